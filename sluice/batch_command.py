"""``sluice batch submit|status|resume|cancel|list``: offline batch jobs from the terminal,
through a gateway's HTTP API, with a progress bar (rows, rate, ETA) on long work.

Closing the terminal or pressing Ctrl-C while watching leaves the job running; ``sluice
batch status ID --watch`` picks it up again.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Annotated, Any

import typer

batch_app = typer.Typer(
    no_args_is_help=True,
    help="Offline batch jobs: a whole data set through a model (through a gateway).",
)

Url = Annotated[str, typer.Option(help="The gateway's URL.")]
Key = Annotated[
    str | None, typer.Option(envvar="SLUICE_API_KEY", help="API key, when keys are set.")
]
Watch = Annotated[bool, typer.Option("--watch/--no-watch", help="Follow its progress.")]
GATEWAY = "http://127.0.0.1:8000"

_POLL_S = 0.5


def _client(url: str, key: str | None) -> Any:
    from sluice.client import Client

    return Client(url, api_key=key)


def _location(value: str) -> str:
    """s3:// URLs as they are; local paths made absolute (the server checks its root)."""
    return value if value.startswith("s3://") else os.path.abspath(value)


def _fail(exc: Exception) -> typer.Exit:
    message = getattr(exc, "message", None) or str(exc)
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(1)


@batch_app.command("submit")
def submit(
    model: Annotated[str, typer.Option(help="The model.")],
    input: Annotated[str, typer.Option(help=".npy/.npz/.parquet/.jsonl path or s3:// URL.")],
    output: Annotated[str, typer.Option(help="Output directory or s3:// prefix.")],
    version: Annotated[int | None, typer.Option(help="Model version (default: newest).")] = None,
    shard_rows: Annotated[int | None, typer.Option(help="Rows per shard.")] = None,
    in_flight: Annotated[int | None, typer.Option(help="Requests in flight per shard.")] = None,
    input_name: Annotated[str | None, typer.Option(help="Model input a .npy feeds.")] = None,
    output_format: Annotated[str | None, typer.Option(help="npy, parquet or jsonl.")] = None,
    watch: Watch = True,
    url: Url = GATEWAY,
    key: Key = None,
) -> None:
    """Submit a batch job, then follow it (Ctrl-C stops following, not the job)."""
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
    client = _client(url, key)
    try:
        status = client.submit_batch(
            model, _location(input), _location(output), version=version, **options
        )
    except Exception as exc:
        raise _fail(exc) from None
    typer.echo(f"batch {status['id']} submitted")
    if watch:
        _follow(client, status["id"])


@batch_app.command("status")
def status(batch_id: str, watch: Watch = False, url: Url = GATEWAY, key: Key = None) -> None:
    """A batch job's status (rows done, rate, ETA, shard errors, manifest)."""
    client = _client(url, key)
    if watch:
        _follow(client, batch_id)
        return
    try:
        _show(client.batch(batch_id))
    except Exception as exc:
        raise _fail(exc) from None


@batch_app.command("resume")
def resume(batch_id: str, watch: Watch = True, url: Url = GATEWAY, key: Key = None) -> None:
    """Run again every shard not committed yet (failed, cancelled or lost)."""
    client = _client(url, key)
    try:
        client.resume_batch(batch_id)
    except Exception as exc:
        raise _fail(exc) from None
    if watch:
        _follow(client, batch_id)


@batch_app.command("cancel")
def cancel(batch_id: str, url: Url = GATEWAY, key: Key = None) -> None:
    """Cancel a batch job: shards stop at their next check, nothing more is committed."""
    try:
        _show(_client(url, key).cancel_batch(batch_id))
    except Exception as exc:
        raise _fail(exc) from None


@batch_app.command("list")
def list_batches(url: Url = GATEWAY, key: Key = None) -> None:
    """The newest batch jobs of this API key."""
    from rich.console import Console
    from rich.table import Table

    try:
        batches = _client(url, key).batches()
    except Exception as exc:
        raise _fail(exc) from None
    table = Table("id", "model", "status", "input", "output")
    for item in batches:
        table.add_row(item["id"], item["model"], item["status"], item["input"], item["output"])
    Console().print(table)


def _show(state: dict[str, Any]) -> None:
    from rich.console import Console

    console = Console()
    console.print(f"[bold]{state['id']}[/] {state['model']}: [bold]{state['status']}[/]")
    total, done = state.get("rows_total", 0), state.get("rows_done", 0)
    line = f"rows {done:,} of {total:,}"
    if "rows_per_s" in state:
        line += f", {state['rows_per_s']:,.0f} rows/s"
    if "eta_s" in state:
        line += f", ETA {state['eta_s']:.0f} s"
    console.print(line)
    for error in state.get("errors", []):
        console.print(f"[red]shard {error['shard']}: {error['error']}[/]")
    if state.get("error"):
        console.print(f"[red]{state['error']}[/]")
    if state.get("manifest"):
        console.print(f"manifest: {state['manifest']}")


def _follow(client: Any, batch_id: str) -> None:
    """A progress bar until the job ends; exit status 1 when it failed."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    finished = ("completed", "failed", "cancelled")
    state: dict[str, Any] = {}
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    try:
        with Progress(*columns, transient=False) as progress:
            task = progress.add_task(batch_id[:8], total=None, rate="")
            while True:
                try:
                    state = client.batch(batch_id)
                except Exception as exc:
                    raise _fail(exc) from None
                rate = state.get("rows_per_s")
                progress.update(
                    task,
                    total=state.get("rows_total") or None,
                    completed=state.get("rows_done", 0),
                    description=f"{batch_id[:8]} {state['status']}",
                    rate=f"{rate:,.0f} rows/s" if rate else "",
                )
                if state["status"] in finished:
                    break
                time.sleep(_POLL_S)
    except KeyboardInterrupt:
        typer.echo(f"\nstopped following; the job goes on: sluice batch status {batch_id} --watch")
        return
    _show(state)
    if state["status"] != "completed":
        raise typer.Exit(1)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(batch_app())
