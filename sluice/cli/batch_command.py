"""``sluice batch submit|status|download|resume|cancel|delete|list|upload|uploads``: offline
batch jobs from the terminal, through a gateway's HTTP API, from any machine that reaches it.

``submit`` with a local input file uploads it (progress in bytes), runs the job, follows it
(rows, rate, ETA) and downloads the outputs into a local folder; ``s3://`` locations and
``server:/path`` (a location on the server's side, which its operator must allow) are
passed to the server as they are. Progress goes to stderr; stdout says what happened.

Closing the terminal or pressing Ctrl-C while watching leaves the job running; ``sluice
batch status ID --watch`` picks it up again, ``sluice batch download ID --output DIR``
fetches its outputs (of a job that failed or was cancelled, the parts it committed; the exit
status says it did not complete).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

    from sluice.client import Client

batch_app = typer.Typer(
    no_args_is_help=True,
    help="Offline batch jobs: a whole data set through a model (through a gateway).",
)

GATEWAY = "http://127.0.0.1:8000"
Url = Annotated[str, typer.Option(envvar="SLUICE_URL", help="The gateway's URL.")]
Key = Annotated[
    str | None, typer.Option(envvar="SLUICE_API_KEY", help="API key, when keys are set.")
]
Watch = Annotated[bool, typer.Option("--watch/--no-watch", help="Follow its progress.")]

S3_PREFIX = "s3://"
SERVER_PREFIX = "server:"
UPLOAD_PREFIX = "upload:"
_POLL_S = 0.5
_FINISHED = ("completed", "failed", "cancelled")


def _client(url: str, key: str | None) -> Client:
    from sluice.client import Client

    return Client(url, api_key=key)


def _fail(exc: BaseException, hint: str | None = None) -> NoReturn:
    """Exit 1 with the error's message (the server's, or the local file's problem), and
    what to do about it when there is something to say."""
    message = getattr(exc, "message", None) or str(exc)
    typer.echo(f"error: {message}", err=True)
    if hint:
        typer.echo(hint, err=True)
    raise typer.Exit(1)


def _stderr() -> Console:
    from rich.console import Console

    return Console(stderr=True)


def _remote(value: str) -> str | None:
    """The location to hand the server as it is, or None for a local path."""
    if value.startswith(S3_PREFIX) or value.startswith(UPLOAD_PREFIX):
        return value
    if value.startswith(SERVER_PREFIX):
        return value[len(SERVER_PREFIX) :]
    return None


@batch_app.command("submit")
def submit(
    model: Annotated[str, typer.Option(help="The model.")],
    input: Annotated[
        str,
        typer.Option(
            help="A local .npy/.npz/.parquet/.jsonl file (uploaded), upload:ID (uploaded "
            "before), s3://bucket/key, or server:/path (on the server, where allowed)."
        ),
    ],
    output: Annotated[
        str | None,
        typer.Option(
            help="A local folder (outputs downloaded into it), s3://bucket/prefix/ or "
            "server:/path; none: outputs stay on the server (sluice batch download)."
        ),
    ] = None,
    version: Annotated[int | None, typer.Option(help="Model version (default: newest).")] = None,
    shard_rows: Annotated[int | None, typer.Option(help="Rows per shard.")] = None,
    in_flight: Annotated[int | None, typer.Option(help="Requests in flight per shard.")] = None,
    input_name: Annotated[str | None, typer.Option(help="Model input a .npy feeds.")] = None,
    output_format: Annotated[str | None, typer.Option(help="npy, parquet or jsonl.")] = None,
    watch: Watch = True,
    download: Annotated[
        bool,
        typer.Option(
            "--download/--no-download",
            help="Download the outputs into the local --output folder once done.",
        ),
    ] = True,
    url: Url = GATEWAY,
    key: Key = None,
) -> None:
    """Submit a batch job, follow it (Ctrl-C stops following, not the job) and download
    its outputs."""
    from sluice.client import transfers

    options = {
        name: value
        for name, value in (
            ("shard_rows", shard_rows),
            ("in_flight", in_flight),
            ("input_name", input_name),
            ("output_format", output_format),
        )
        if value is not None
    }
    # Every local path is checked before anything is sent.
    source = _remote(input)
    local_input: Path | None = None
    server_output = None if output is None else _remote(output)
    local_output: Path | None = None
    try:
        if source is None:
            local_input = transfers.input_file(input)
        if output is not None and server_output is None:
            local_output = transfers.output_directory(output)
    except OSError as exc:
        _fail(exc)
    with _client(url, key) as client:
        if local_input is not None:
            source = UPLOAD_PREFIX + _upload(client, local_input)["id"]
        assert source is not None
        try:
            status = client.submit_batch(model, source, server_output, version=version, **options)
        except Exception as exc:
            _fail(exc)
        _after_submit(client, status["id"], local_output, server_output, watch, download)


def _after_submit(
    client: Client,
    batch_id: str,
    local_output: Path | None,
    server_output: str | None,
    watch: bool,
    download: bool,
) -> None:
    typer.echo(f"batch {batch_id} submitted")
    if not watch:
        typer.echo(f"follow it: sluice batch status {batch_id} --watch")
        _hint_download(batch_id, local_output, server_output)
        return
    state = _follow(client, batch_id)
    if state is None:
        _hint_download(batch_id, local_output, server_output)
        raise typer.Exit(130)
    _show(state)
    if state["status"] != "completed":
        where = local_output if local_output is not None else "DIR"
        if server_output is None:
            typer.echo(
                f"what it committed: sluice batch download {batch_id} --output {where}; "
                f"the rest: sluice batch resume {batch_id}"
            )
        raise typer.Exit(1)
    if local_output is not None and download:
        _download(client, batch_id, local_output)
    else:
        _hint_download(batch_id, local_output, server_output)


def _hint_download(batch_id: str, folder: Path | None, server_output: str | None) -> None:
    if server_output is not None:
        typer.echo(f"outputs: {server_output} (under the batch's id)")
        return
    where = folder if folder is not None else "DIR"
    typer.echo(f"outputs stay on the server: sluice batch download {batch_id} --output {where}")


@batch_app.command("download")
def download(
    batch_id: str,
    output: Annotated[str, typer.Option(help="Local folder for the output files (created).")],
    url: Url = GATEWAY,
    key: Key = None,
) -> None:
    """Download a batch job's output files (kept on the server) into a folder: all of a
    completed job's; of one that failed or was cancelled, the parts of the shards it
    committed (exit status 1: it did not complete)."""
    from sluice.client import transfers

    try:
        folder = transfers.output_directory(output)
    except OSError as exc:
        _fail(exc)
    with _client(url, key) as client:
        state = _poll(client, batch_id)
        partial = state["status"] in _FINISHED and state["status"] != "completed"
        if partial:
            _show(state)  # (why it did not complete, first)
        _download(client, batch_id, folder)
    if partial:
        ended = "was cancelled" if state["status"] == "cancelled" else state["status"]
        typer.echo(
            f"batch {batch_id} {ended}: only the parts of the shards it committed were "
            f"downloaded; sluice batch resume {batch_id} runs the rest"
        )
        raise typer.Exit(1)


@batch_app.command("status")
def status(batch_id: str, watch: Watch = False, url: Url = GATEWAY, key: Key = None) -> None:
    """A batch job's status (rows done, rate, ETA, shard errors, manifest)."""
    with _client(url, key) as client:
        if not watch:
            try:
                _show(client.batch(batch_id))
            except Exception as exc:
                _fail(exc)
            return
        state = _follow(client, batch_id)
    if state is not None:
        _show(state)
        if state["status"] != "completed":
            raise typer.Exit(1)


@batch_app.command("resume")
def resume(batch_id: str, watch: Watch = True, url: Url = GATEWAY, key: Key = None) -> None:
    """Run again every shard not committed yet (failed, cancelled or lost)."""
    with _client(url, key) as client:
        try:
            client.resume_batch(batch_id)
        except Exception as exc:
            _fail(exc)
        state = _follow(client, batch_id) if watch else None
    if state is not None:
        _show(state)
        if state["status"] != "completed":
            raise typer.Exit(1)


@batch_app.command("cancel")
def cancel(batch_id: str, url: Url = GATEWAY, key: Key = None) -> None:
    """Cancel a batch job: shards stop at their next check, nothing more is committed."""
    try:
        with _client(url, key) as client:
            _show(client.cancel_batch(batch_id))
    except Exception as exc:
        _fail(exc)


@batch_app.command("delete")
def delete(batch_id: str, url: Url = GATEWAY, key: Key = None) -> None:
    """Delete a batch job that has ended, with its outputs kept on the server (their bytes
    go back to the tenant's quota); a job still running must be cancelled first."""
    from sluice.client import Conflict, NotFound

    try:
        with _client(url, key) as client:
            client.delete_batch(batch_id)
    except Conflict as exc:
        _fail(exc, f"(sluice batch cancel {batch_id} stops it; delete it once it has ended)")
    except NotFound as exc:
        _fail(exc, "(unknown, deleted already or expired, or not this API key's tenant's)")
    except Exception as exc:
        _fail(exc)
    typer.echo(f"batch {batch_id} deleted, with its outputs on the server")


@batch_app.command("list")
def list_batches(url: Url = GATEWAY, key: Key = None) -> None:
    """The newest batch jobs of this API key's tenant."""
    from rich.console import Console
    from rich.table import Table

    try:
        with _client(url, key) as client:
            batches = client.batches()
    except Exception as exc:
        _fail(exc)
    table = Table("id", "model", "status", "input", "output")
    for item in batches:
        table.add_row(
            *(str(item.get(field, "")) for field in ("id", "model", "status", "input", "output"))
        )
    Console().print(table)


@batch_app.command("upload")
def upload(
    file: Annotated[str, typer.Argument(help="A local .npy/.npz/.parquet/.jsonl file.")],
    url: Url = GATEWAY,
    key: Key = None,
) -> None:
    """Upload a file for later batch jobs; prints upload:ID, for --input."""
    from sluice.client import transfers

    try:
        path = transfers.input_file(file)
    except OSError as exc:
        _fail(exc)
    with _client(url, key) as client:
        record = _upload(client, path)
    typer.echo(f"{UPLOAD_PREFIX}{record['id']}")


@batch_app.command("uploads")
def list_uploads(url: Url = GATEWAY, key: Key = None) -> None:
    """This API key's tenant's uploads (they expire unless a batch job uses them)."""
    from rich.console import Console
    from rich.table import Table

    try:
        with _client(url, key) as client:
            uploads = client.uploads()
    except Exception as exc:
        _fail(exc)
    table = Table("id", "name", "bytes", "expires")
    for item in uploads:
        expires = item.get("expires")
        when = (
            time.strftime("%Y-%m-%d %H:%M", time.localtime(expires))
            if isinstance(expires, int | float)
            else ""
        )
        table.add_row(str(item.get("id", "")), str(item.get("name", "")), _size(item), when)
    Console().print(table)


def _size(item: dict[str, Any]) -> str:
    size = item.get("bytes")
    return f"{size:,}" if isinstance(size, int) else ""


# ------------------------------------------------------------------------- transfers


def _byte_progress(console: Console) -> Progress:
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
    )


def _upload(client: Client, path: Path) -> dict[str, Any]:
    """Upload ``path`` with bars for its two passes (sha256 first, then the bytes)."""
    console = _stderr()
    try:
        with _byte_progress(console) as progress:
            hashing = progress.add_task(f"sha256 {path.name}", total=None)
            sending = progress.add_task(f"upload {path.name}", total=None, visible=False)

            def hashed(done: int, total: int | None) -> None:
                progress.update(hashing, completed=done, total=total)

            def sent(done: int, total: int | None) -> None:
                progress.update(sending, completed=done, total=total, visible=True)

            record = client.upload(path, progress=sent, hashing_progress=hashed)
    except Exception as exc:
        _fail(exc)
    console.print(f"uploaded {path} as {UPLOAD_PREFIX}{record['id']}", highlight=False)
    return record


def _download(client: Client, batch_id: str, folder: Path) -> None:
    """Every output file of the batch into ``folder``, with one bar for all the bytes."""
    console = _stderr()
    try:
        with _byte_progress(console) as progress:
            task = progress.add_task(f"download {batch_id[:8]}", total=None)

            def received(done: int, total: int | None) -> None:
                progress.update(task, completed=done, total=total)

            saved = client.download_batch_outputs(batch_id, folder, progress=received)
    except KeyboardInterrupt:
        typer.echo(
            f"\ndownload stopped; again: sluice batch download {batch_id} --output {folder}",
            err=True,
        )
        raise typer.Exit(130) from None
    except Exception as exc:
        _fail(exc)
    total = sum(path.stat().st_size for path in saved)
    typer.echo(f"downloaded {len(saved)} files ({total:,} bytes) to {folder}")


# ---------------------------------------------------------------------------- status


def _show(state: dict[str, Any]) -> None:
    """The job's status: why it failed first, rows only once it has any."""
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False)
    console.print(
        f"[bold]{escape(str(state['id']))}[/] {escape(str(state.get('model', '')))}: "
        f"[bold]{escape(str(state['status']))}[/]"
    )
    if state.get("error"):
        console.print(f"[red]{escape(str(state['error']))}[/]")
    if isinstance(state.get("place"), int):  # (a job waiting for one of its tenant's turns)
        console.print(f"waiting for a turn: {state['place']:,} in line (1: next)")
    for error in state.get("errors", []):
        console.print(f"[red]shard {error.get('shard')}: {escape(str(error.get('error')))}[/]")
    if state.get("rows_failed"):  # (JSON Lines rows that failed alone; the job went on)
        console.print(f"[red]{state['rows_failed']:,} row(s) failed[/]")
        for failed in state.get("row_errors", []):
            console.print(f"[red]line {failed.get('line')}: {escape(str(failed.get('reason')))}[/]")
    total, done = state.get("rows_total") or 0, state.get("rows_done") or 0
    if total:
        line = f"rows {done:,} of {total:,}"
        if state.get("rows_per_s"):
            line += f", {state['rows_per_s']:,.0f} rows/s"
        if state.get("eta_s") is not None and state["status"] not in _FINISHED:
            line += f", ETA {state['eta_s']:.0f} s"
        console.print(line)
    if state.get("manifest"):
        console.print(f"manifest: {escape(str(state['manifest']))}")


def _follow(client: Client, batch_id: str) -> dict[str, Any] | None:
    """Poll until the job ends, on stderr: a spinner while it has no rows yet (queued,
    reading its input), then a bar of rows. Its last status; None after Ctrl-C."""
    console = _stderr()
    try:
        state = _wait_for_rows(client, batch_id, console)
        if state["status"] not in _FINISHED:
            state = _rows_bar(client, batch_id, console, state)
    except KeyboardInterrupt:
        typer.echo(
            f"\nstopped following; the job goes on: sluice batch status {batch_id} --watch",
            err=True,
        )
        return None
    return state


def _poll(client: Client, batch_id: str) -> dict[str, Any]:
    try:
        return client.batch(batch_id)
    except Exception as exc:
        _fail(exc)


def _wait_for_rows(client: Client, batch_id: str, console: Console) -> dict[str, Any]:
    state = _poll(client, batch_id)
    with console.status(f"{batch_id[:8]} {state['status']}") as spinner:
        while state["status"] not in _FINISHED and not state.get("rows_total"):
            time.sleep(_POLL_S)
            state = _poll(client, batch_id)
            spinner.update(f"{batch_id[:8]} {state['status']}")
    return state


def _rows_bar(
    client: Client, batch_id: str, console: Console, state: dict[str, Any]
) -> dict[str, Any]:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task(batch_id[:8], total=state["rows_total"], rate="")
        while True:
            rate = state.get("rows_per_s")
            progress.update(
                task,
                total=state.get("rows_total") or None,
                completed=state.get("rows_done") or 0,
                description=f"{batch_id[:8]} {state['status']}",
                rate=f"{rate:,.0f} rows/s" if rate else "",
            )
            if state["status"] in _FINISHED:
                return state
            time.sleep(_POLL_S)
            state = _poll(client, batch_id)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(batch_app())
