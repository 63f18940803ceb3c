"""``sluice infer``: send one inference request (or job) to a running server and show its
outputs.

Registered in :mod:`sluice.cli`; numpy, httpx and the client are imported only when the
command runs, so ``sluice --help`` stays quick.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

if TYPE_CHECKING:
    import numpy as np
    from rich.console import Console

    from sluice.client import Client

SMALL = 64
"""Outputs of at most this many elements are printed whole; larger ones summarized."""
_UNSAFE_FILE_CHARACTERS = re.compile(r"[^A-Za-z0-9._-]")


def infer(
    model: Annotated[str, typer.Argument(help="The model's name.")],
    inputs: Annotated[
        list[str] | None,
        typer.Option("--input", "-i", help="An input as NAME=path.npy (repeat for each input)."),
    ] = None,
    request: Annotated[
        Path | None,
        typer.Option(
            "--json",
            help="A whole KServe v2 JSON request, sent as it is (instead of --input).",
        ),
    ] = None,
    version: Annotated[
        int | None, typer.Option(help="The model version (default: as the server routes).")
    ] = None,
    outputs: Annotated[
        list[str] | None,
        typer.Option("--output", "-o", help="Ask for this output only (repeat; default: all)."),
    ] = None,
    save_dir: Annotated[
        Path | None, typer.Option(help="Also write each output to DIR/<output>.npy.")
    ] = None,
    url: Annotated[
        str, typer.Option(envvar="SLUICE_URL", help="The gateway's URL.")
    ] = "http://127.0.0.1:8000",
    key: Annotated[
        str | None, typer.Option(envvar="SLUICE_API_KEY", help="API key, when keys are set.")
    ] = None,
    as_job: Annotated[
        bool,
        typer.Option("--async", help="Submit an asynchronous job and wait for its result."),
    ] = False,
    timeout_s: Annotated[
        float, typer.Option("--timeout", help="Seconds to wait for the answer (or the job).")
    ] = 60.0,
    verbose: Annotated[bool, typer.Option(help="Log debug messages (HTTP calls) too.")] = False,
) -> None:
    """Send one inference request to MODEL and print its outputs."""
    from rich.console import Console

    from sluice.client import Client, SluiceError

    if verbose:
        from sluice.core.observability.logs import configure_logging

        configure_logging("infer", verbose=True, stream=sys.stderr)
    if request is not None and (inputs or outputs):
        _usage(
            "--json sends the request as it is: name inputs and outputs in it, not with "
            "--input or --output"
        )
    if request is None and not inputs:
        _usage("give the inputs: --input NAME=path.npy (repeat), or a request with --json")
    document = _read_request(request) if request is not None else None
    arrays = _read_inputs(inputs or []) if document is None else {}

    out, err = Console(highlight=False), Console(stderr=True, highlight=False)
    try:
        with Client(url, api_key=key, timeout_s=timeout_s) as client:
            if as_job:
                results = _run_job(client, err, model, version, document, arrays, outputs)
            elif document is not None:
                results = client.infer_json(model, document, version=version)
            else:
                results = client.infer(model, arrays, outputs=outputs, version=version)
    except SluiceError as exc:
        _fail(exc.message)
    for name, array in results.items():
        _show(out, name, array)
    if save_dir is not None:
        _save(out, save_dir, results)


def _run_job(
    client: Client,
    err: Console,
    model: str,
    version: int | None,
    document: dict[str, Any] | None,
    arrays: dict[str, np.ndarray],
    outputs: list[str] | None,
) -> dict[str, np.ndarray]:
    if document is not None:
        job = client.submit_job_json(model, document, version=version)
    else:
        job = client.submit_job(model, arrays, outputs=outputs, version=version)
    from rich.text import Text

    err.print(f"submitted job {job.id}", markup=False)
    waiting = Text(f"waiting for job {job.id} ({job.status.get('status', 'queued')})")
    try:
        with err.status(waiting):
            results = client.wait_job(job, timeout_s=client.timeout_s)
    except KeyboardInterrupt:
        err.print(f"stopped waiting; the job goes on: {job.url}", markup=False)
        raise typer.Exit(130) from None
    err.print(f"job {job.id} completed", markup=False)
    return results


def _usage(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(2)


def _fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(1)


def _read_inputs(values: list[str]) -> dict[str, np.ndarray]:
    """``NAME=path.npy`` arguments -> arrays; a bad argument or file exits 2, naming it."""
    import numpy as np

    from sluice.core.datatypes import from_numpy_dtype

    arrays: dict[str, np.ndarray] = {}
    for value in values:
        name, separator, path = value.partition("=")
        name, path = name.strip(), path.strip()
        if not separator or not name or not path:
            _usage(f"--input {value!r}: expected NAME=path.npy")
        if name in arrays:
            _usage(f"--input {value!r}: input '{name}' is given twice")
        try:
            loaded = np.load(path, allow_pickle=False)
        except FileNotFoundError:
            _usage(f"--input {value!r}: no file {path}")
        except (ValueError, EOFError) as exc:  # EOFError: an empty file
            _usage(f"--input {value!r}: {path} {_unreadable(exc)}")
        except OSError as exc:
            _usage(f"--input {value!r}: cannot read {path}: {exc.strerror or exc}")
        if not isinstance(loaded, np.ndarray):
            loaded.close()
            _usage(f"--input {value!r}: {path} is an .npz archive; give one .npy per input")
        try:
            from_numpy_dtype(loaded.dtype)
        except ValueError as exc:
            _usage(f"--input {value!r}: {exc}")
        arrays[name] = loaded
    return arrays


def _unreadable(exc: Exception) -> str:
    """Why numpy could not load a file, as a user would say it."""
    text = str(exc)
    if "Object arrays" in text:
        return (
            "holds an object array, refused (it would take pickle to load): save BYTES "
            "inputs as str or bytes arrays"
        )
    if "pickle" in text:
        return "is not a .npy file (numpy would have to unpickle it)"
    return f"is not a readable .npy file: {text or 'it is empty'}"


def _read_request(path: Path) -> dict[str, Any]:
    try:
        document = json.loads(path.read_bytes())
    except OSError as exc:
        _usage(f"--json {path}: cannot read it: {exc.strerror or exc}")
    except ValueError as exc:
        _usage(f"--json {path}: not valid JSON: {exc}")
    if not isinstance(document, dict):
        _usage(f"--json {path}: a KServe v2 request is a JSON object")
    return document


def _show(console: Console, name: str, array: np.ndarray) -> None:
    """The output's name, datatype and shape; its values when small, a summary otherwise."""
    import numpy as np

    from sluice.core.datatypes import from_numpy_dtype

    heading = f"{name}  {from_numpy_dtype(array.dtype)}  {list(array.shape)}"
    console.print(heading, style="bold", markup=False)
    if array.size <= SMALL:
        console.print(np.array2string(array, threshold=SMALL), markup=False)
        return
    console.print(_summary(array), markup=False)
    console.print(np.array2string(array, threshold=0, edgeitems=3), markup=False)


def _summary(array: np.ndarray) -> str:
    import numpy as np

    count = f"{array.size} elements"
    if array.dtype.kind == "b":
        return f"{count}, {int(np.count_nonzero(array))} true"
    if array.dtype.kind in "iuf":
        wide = array.astype(np.float64)
        finite = wide[np.isfinite(wide)]
        if finite.size == 0:
            return f"{count}, none finite"
        return f"{count}: min {finite.min():.6g}, max {finite.max():.6g}, mean {finite.mean():.6g}"
    return count


def _save(console: Console, directory: Path, results: dict[str, np.ndarray]) -> None:
    """Each output to ``<directory>/<output>.npy``, never with pickle. BYTES outputs are
    saved as a bytes array (usable as an --input again) when no element ends in a NUL
    byte, which numpy's fixed-width bytes would drop; otherwise as ``<output>.json``, the
    shape and each element in base64."""
    import base64

    import numpy as np
    import orjson

    try:
        directory.mkdir(parents=True, exist_ok=True)
        for name, array in results.items():
            stem = directory / _UNSAFE_FILE_CHARACTERS.sub("_", name)
            path = stem.with_suffix(".npy")
            if array.dtype.kind == "O":
                elements = [bytes(element) for element in array.reshape(-1)]
                if any(element.endswith(b"\0") for element in elements):
                    path = stem.with_suffix(".json")
                    document = {
                        "shape": list(array.shape),
                        "base64": [base64.b64encode(e).decode() for e in elements],
                    }
                    path.write_bytes(orjson.dumps(document))
                    console.print(f"saved {name} to {path}", markup=False)
                    continue
                array = array.astype(np.bytes_)
            np.save(path, array, allow_pickle=False)
            console.print(f"saved {name} to {path}", markup=False)
    except OSError as exc:
        _fail(f"--save-dir {directory}: {exc.strerror or exc}")
