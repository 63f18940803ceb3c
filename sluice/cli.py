"""The ``sluice`` command.

This module is the composition root: it is the one place in :mod:`sluice` that
reaches into the services, and it does so lazily inside each command so that
importing :mod:`sluice` never imports a service.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Sluice inference server.")

Verbose = Annotated[bool, typer.Option(help="Log debug messages too.")]


def _print_version(value: bool) -> None:
    if value:
        from sluice import __version__

        print(f"sluice {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option(
            "--version", help="Print the version and exit.", is_eager=True, callback=_print_version
        ),
    ] = False,
) -> None:
    """Options that come before the command."""


def _logging(verbose: bool) -> None:
    """Log lines as SLUICE_LOG_* say (sluice.logs); their role is the name of the command
    function calling this (``up``, ``gateway``, ``worker``)."""
    from sluice.logs import configure_logging
    from sluice.settings import CommonSettings

    caller = sys._getframe(1).f_code.co_name
    configure_logging(caller, CommonSettings(), verbose=verbose, stream=sys.stderr)


def _overrides(**values: Any) -> dict[str, Any]:
    return {key: value for key, value in values.items() if value is not None}


@app.command()
def up(
    model_repository: Annotated[
        str,
        typer.Option(
            help="Triton-layout model repository: a local directory, or s3://bucket/prefix "
            "(copied into SLUICE_REPOSITORY_CACHE_DIR at start)."
        ),
    ] = "model_repository",
    http_port: Annotated[int | None, typer.Option(help="HTTP port (default 8000).")] = None,
    http_host: Annotated[
        str | None, typer.Option(help="HTTP bind address (default 127.0.0.1).")
    ] = None,
    redis_url: Annotated[
        str | None, typer.Option(help="Use this Redis instead of starting a private one.")
    ] = None,
    gateway_processes: Annotated[
        int | None, typer.Option(help="Gateway processes sharing the port (default 1).")
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(help="Port serving only GET /metrics, as Triton's (default 8002; 0: none)."),
    ] = None,
    model_control_mode: Annotated[
        str | None,
        typer.Option(
            help="Triton's model control mode: none (serve the whole repository, the "
            "default) or explicit (load and unload on request)."
        ),
    ] = None,
    load_model: Annotated[
        list[str] | None,
        typer.Option(
            help="With explicit model control: a model to load at start (repeat; *: all)."
        ),
    ] = None,
    gateway: Annotated[
        bool,
        typer.Option(
            "--gateway/--no-gateway",
            help="--no-gateway: publish the catalog and run the workers only; gateways "
            "started elsewhere (sluice gateway) reach them through the same Redis.",
        ),
    ] = True,
    verbose: Verbose = False,
) -> None:
    """Start Redis (unless given), the gateway and one worker per model instance."""
    from scheduler.up import up as run_up
    from sluice.settings import ApiKeySettings, UpSettings

    _logging(verbose)
    given = redis_url is not None or "SLUICE_REDIS_URL" in os.environ
    settings = UpSettings(
        **_overrides(
            model_repository=model_repository,
            http_port=http_port,
            http_host=http_host,
            redis_url=redis_url,
            gateway_processes=gateway_processes,
            metrics_port=metrics_port,
            gateway=gateway,
            model_control_mode=model_control_mode,
            load_model=load_model,
        )
    )
    raise typer.Exit(run_up(settings, redis_url_given=given, keys=ApiKeySettings()))


@app.command()
def gateway(
    http_port: Annotated[int | None, typer.Option(help="HTTP port (default 8000).")] = None,
    http_host: Annotated[
        str | None, typer.Option(help="HTTP bind address (default 127.0.0.1).")
    ] = None,
    redis_url: Annotated[
        str | None, typer.Option(help="Redis to use (default: SLUICE_REDIS_URL).")
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(help="Also serve GET /metrics alone on this port, as Triton's 8002."),
    ] = None,
    verbose: Verbose = False,
) -> None:
    """Run one gateway process (settings from SLUICE_* variables and these options)."""
    from gateway.__main__ import serve
    from sluice.settings import GatewaySettings

    _logging(verbose)
    serve(
        GatewaySettings(
            **_overrides(
                http_port=http_port,
                http_host=http_host,
                redis_url=redis_url,
                metrics_port=metrics_port,
            )
        )
    )


@app.command()
def worker(
    model: Annotated[str, typer.Option(help="Model name.")],
    model_repository: Annotated[Path, typer.Option(help="Triton-layout model repository.")] = Path(
        "model_repository"
    ),
    version: Annotated[int | None, typer.Option(help="Version (default: newest served).")] = None,
    kind: Annotated[str, typer.Option(help="KIND_CPU or KIND_GPU.")] = "KIND_CPU",
    gpu: Annotated[int | None, typer.Option(help="GPU index for KIND_GPU.")] = None,
    threads: Annotated[int, typer.Option(help="Compute threads (0: from settings or 1).")] = 0,
    verbose: Verbose = False,
) -> None:
    """Run one instance of one model version, pulling from its Redis stream."""
    from sluice.settings import WorkerSettings
    from workers.__main__ import run_worker
    from workers.backends.base import Placement

    _logging(verbose)
    settings = WorkerSettings()
    placement = Placement(kind=kind, gpu=gpu, threads=settings.threads or threads or 1)
    raise typer.Exit(run_worker(settings, model_repository, model, version, placement))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
