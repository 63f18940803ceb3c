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
from typer.core import TyperGroup

from sluice.cli.batch_command import batch_app
from sluice.cli.infer_command import infer as infer_command
from sluice.core.errors import StartupFailed


class _Commands(TyperGroup):
    """The one place a fatal start-up error (:class:`StartupFailed`, raised by any service
    that cannot start, and a bad ``SLUICE_*`` setting) is handled: one line on stderr, and
    its exit status."""

    def invoke(self, ctx: Any) -> Any:  # typer's click Context (vendored by typer)
        try:
            return super().invoke(ctx)
        except StartupFailed as exc:
            print(f"error: {exc.message}", file=sys.stderr)
            ctx.exit(exc.exit_status)
        except Exception as exc:
            from pydantic import ValidationError  # (imported already when one was raised)

            if not isinstance(exc, ValidationError):
                raise
            from sluice.core.settings import settings_problems

            print(f"error: {settings_problems(exc)}", file=sys.stderr)
            ctx.exit(2)


app = typer.Typer(
    cls=_Commands, add_completion=False, no_args_is_help=True, help="Sluice inference server."
)

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
    """Log lines as SLUICE_LOG_* say (sluice.core.observability.logs); their role is the name of the
    command function calling this (``up``, ``gateway``, ``worker``)."""
    from sluice.core.observability.logs import configure_logging
    from sluice.core.settings import CommonSettings

    caller = sys._getframe(1).f_code.co_name
    configure_logging(caller, CommonSettings(), verbose=verbose, stream=sys.stderr)


def _gateway_processes(value: str | None) -> str | None:
    """``--gateway-processes``: ``auto`` or a number from 1 to 64, else refused here."""
    if value is None:
        return None
    text = value.strip().lower()
    if text == "auto" or (text.isdigit() and 1 <= int(text) <= 64):
        return text
    raise typer.BadParameter(
        f"{value!r}: 'auto' or a number from 1 to 64", param_hint="'--gateway-processes'"
    )


def _overrides(**values: Any) -> dict[str, Any]:
    return {key: value for key, value in values.items() if value is not None}


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def up(
    ctx: typer.Context,
    model_repository: Annotated[
        list[str] | None,
        typer.Option(
            "--model-repository",
            "--model-store",
            help="Triton-layout model repository: a local directory, or s3://bucket/prefix "
            "(copied into SLUICE_REPOSITORY_CACHE_DIR at start). Give it more than once to "
            "serve several together, as Triton does: a model name found in two or more is "
            "unavailable (unless --model-namespacing=true). Default: model_repository.",
            show_default=False,
        ),
    ] = None,
    http_port: Annotated[int | None, typer.Option(help="HTTP port (default 8000).")] = None,
    http_host: Annotated[
        str | None,
        typer.Option(
            "--http-host", "--http-address", help="HTTP bind address (default 127.0.0.1)."
        ),
    ] = None,
    redis_url: Annotated[
        str | None, typer.Option(help="Use this Redis instead of starting a private one.")
    ] = None,
    gateway_processes: Annotated[
        str | None,
        typer.Option(
            help="Gateway processes sharing the HTTP and gRPC ports: auto (the default: one "
            "per two CPUs this process may run on, 1 to 16) or a number from 1 to 64.",
            callback=_gateway_processes,
            metavar="auto|N",
        ),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(help="Port serving only GET /metrics, as Triton's (default 8002; 0: none)."),
    ] = None,
    grpc_port: Annotated[
        int | None,
        typer.Option(help="Port of the Triton gRPC API, as Triton's (default 8001; 0: none)."),
    ] = None,
    model_control_mode: Annotated[
        str | None,
        typer.Option(
            help="Triton's model control mode: none (serve the whole repository, the "
            "default), explicit (load and unload on request) or poll (load again what changes "
            "in the repository, every SLUICE_REPOSITORY_POLL_S seconds); or Sluice's demand "
            "(load each model when a request for it comes, unload the least recently used "
            "within SLUICE_MEMORY_BUDGET)."
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
    controller: Annotated[
        bool,
        typer.Option(
            "--controller/--no-controller",
            help="--no-controller: run no controller here (autoscaling, rollouts, poll "
            "mode); one started elsewhere (sluice controller) decides for these workers.",
        ),
    ] = True,
    torchserve: Annotated[
        bool,
        typer.Option(
            "--torchserve",
            help="Also serve TorchServe's APIs on its ports: inference 8080, management "
            "8081, metrics 8082 (SLUICE_TORCHSERVE_PORTS sets others).",
        ),
    ] = False,
    torchserve_ports: Annotated[
        str | None,
        typer.Option(
            help="TorchServe's inference, management and metrics ports, e.g. 8080,8081,8082 "
            "(each may be host:port; 0 leaves one out).",
            metavar="I,M,X",
        ),
    ] = None,
    ts_config: Annotated[
        Path | None,
        typer.Option(
            help="TorchServe's config.properties: its inference_address, management_address "
            "and metrics_address say where TorchServe's APIs are served.",
            exists=True,
            dir_okay=False,
        ),
    ] = None,
    verbose: Verbose = False,
) -> None:
    """Start Redis (unless given), the gateway and one worker per model instance.

    Also takes tritonserver's flags, spelled as Triton spells them (--repository-poll-secs=2,
    --strict-readiness false, ...): each is mapped to a Sluice setting, ignored with a
    warning, or refused with what to do instead, as the section "Triton's flags" of the
    command line reference (docs/reference/cli.md) lists."""
    from sluice.cli import triton_flags
    from sluice.core.settings import ApiKeySettings, UpSettings
    from sluice.scheduler.executor.up import up as run_up

    try:
        own = [name for param in ctx.command.params for name in param.opts + param.secondary_opts]
        triton = triton_flags.parse(ctx.args, sluice_options=own)
    except typer.BadParameter as exc:
        exc.ctx = ctx
        raise
    # Before anything reads settings: this process and every child it starts see them.
    os.environ.update(triton.environment)
    given = redis_url is not None or "SLUICE_REDIS_URL" in os.environ
    options = _overrides(
        model_repository=model_repository,
        http_port=http_port,
        http_host=http_host,
        redis_url=redis_url,
        gateway_processes=gateway_processes,
        metrics_port=metrics_port,
        grpc_port=grpc_port,
        gateway=gateway,
        controller=controller,
        model_control_mode=model_control_mode.lower() if model_control_mode else None,
        load_model=load_model,
        torchserve_ports=_torchserve_ports(torchserve, torchserve_ports, ts_config),
    )
    # Triton's --allow-grpc=false / --allow-metrics=false close their port whatever
    # --grpc-port / --metrics-port say, as in Triton: the flags' overrides come last.
    settings = UpSettings(**{**options, **triton.overrides})
    try:
        triton.check_addresses(settings.http_host)
    except typer.BadParameter as exc:
        exc.ctx = ctx
        raise
    _logging(verbose)
    for line in triton.warnings:
        print(line, file=sys.stderr, flush=True)
    raise typer.Exit(run_up(settings, redis_url_given=given, keys=ApiKeySettings()))


def _torchserve_ports(enabled: bool, ports: str | None, config: Path | None) -> str | None:
    """SLUICE_TORCHSERVE_PORTS from ``--torchserve-ports``, else ``--ts-config``'s addresses,
    else TorchServe's own ports with ``--torchserve`` (None: the settings decide)."""
    from sluice.cli.mar_import import parse_properties
    from sluice.core.torchserve.ports import TORCHSERVE_DEFAULT, from_properties, parse_ports

    if ports is not None:
        try:
            parse_ports(ports)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="'--torchserve-ports'") from None
        return ports
    if config is not None:
        try:
            found = from_properties(parse_properties(config.read_text(errors="replace")))
        except (OSError, ValueError) as exc:
            raise typer.BadParameter(str(exc), param_hint="'--ts-config'") from None
        return found or TORCHSERVE_DEFAULT
    return TORCHSERVE_DEFAULT if enabled else None


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
    grpc_port: Annotated[
        int | None,
        typer.Option(help="Port of the Triton gRPC API (default 8001; 0: none)."),
    ] = None,
    verbose: Verbose = False,
) -> None:
    """Run one gateway process (settings from SLUICE_* variables and these options)."""
    from sluice.core.settings import GatewaySettings
    from sluice.gateway.__main__ import serve

    _logging(verbose)
    serve(
        GatewaySettings(
            **_overrides(
                http_port=http_port,
                http_host=http_host,
                redis_url=redis_url,
                metrics_port=metrics_port,
                grpc_port=grpc_port,
            )
        )
    )


@app.command()
def controller(
    model_repository: Annotated[
        list[str] | None,
        typer.Option(
            help="The repository the workers serve (a local directory or s3://bucket/prefix): "
            "read for rollouts, and listed for changes in poll mode. Give each one the "
            "workers serve, in the same order."
        ),
    ] = None,
    redis_url: Annotated[
        str | None, typer.Option(help="Redis to use (default: SLUICE_REDIS_URL).")
    ] = None,
    verbose: Verbose = False,
) -> None:
    """Run a controller: it leads (autoscaling, rollouts, poll mode) or stands by for the
    one that does, through a lease in Redis."""
    import signal
    import threading

    from sluice.core.settings import ControllerSettings
    from sluice.scheduler.controller.service import run as run_controller
    from sluice.scheduler.executor.kubernetes import start_executor

    _logging(verbose)
    settings = ControllerSettings(
        **_overrides(model_repository=model_repository, redis_url=redis_url)
    )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    print(f"Controller {settings.controller_id} started", flush=True)
    run_controller(settings, stop, start_executor=start_executor)
    print("Controller stopped.", flush=True)


@app.command("batch-worker")
def batch_worker(verbose: Verbose = False) -> None:
    """Run a batch worker: Celery on the deployment's Redis, running batch jobs' shards."""
    from sluice.batch.app import run_worker
    from sluice.core.settings import BatchSettings

    _logging(verbose)
    raise typer.Exit(run_worker(BatchSettings()))


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
    from sluice.core.placement import Placement
    from sluice.core.settings import WorkerSettings
    from sluice.workers.__main__ import run_worker

    _logging(verbose)
    settings = WorkerSettings()
    placement = Placement(kind=kind, gpu=gpu, threads=settings.threads or threads or 1)
    raise typer.Exit(run_worker(settings, model_repository, model, version, placement))


app.add_typer(batch_app, name="batch")
app.command("infer")(infer_command)


@app.command("import-mar")
def import_mar(
    sources: Annotated[
        list[Path],
        typer.Argument(help="TorchServe archives (.mar, .tar.gz, model folders), or model stores."),
    ],
    model_repository: Annotated[
        Path, typer.Option(help="Triton-layout repository to write the models into.")
    ] = Path("model_repository"),
    config_properties: Annotated[
        Path | None,
        typer.Option(help="TorchServe's config.properties: batching, workers, queue, timeout."),
    ] = None,
    force: Annotated[bool, typer.Option(help="Replace models that exist already.")] = False,
) -> None:
    """Lay out a TorchServe model store as a repository Sluice serves (backend torchserve)."""
    from sluice.cli.mar_import import import_archives, read_store_settings
    from sluice.core.errors import SluiceError

    try:
        settings = read_store_settings(config_properties)
        names = import_archives(sources, model_repository, settings, force=force)
    except SluiceError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(2) from None
    for key in settings.ignored:
        typer.echo(f"config.properties: {key} has no Sluice equivalent; ignored", err=True)
    for name in names:
        typer.echo(f"model '{name}' -> {model_repository / name}")


routing = typer.Typer(
    no_args_is_help=True,
    help="Version labels and traffic split of a model, through a gateway's HTTP API.",
)
app.add_typer(routing, name="routing")

Url = Annotated[str, typer.Option(envvar="SLUICE_URL", help="The gateway's URL.")]
Key = Annotated[
    str | None, typer.Option(envvar="SLUICE_API_KEY", help="Admin API key, when keys are set.")
]


def _routing_call(url: str, key: str | None, method: str, path: str, body: Any = None) -> None:
    """Call ``/v2/repository/models/...`` and print the model's routing (or the error)."""
    import json
    import urllib.error
    import urllib.parse
    import urllib.request

    quoted = "/".join(urllib.parse.quote(part, safe="") for part in path.split("/"))
    request = urllib.request.Request(
        f"{url.rstrip('/')}/v2/repository/models/{quoted}",
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={"Content-Type": "application/json"},
    )
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            print(json.dumps(json.load(response), indent=2))
    except urllib.error.HTTPError as exc:
        print(f"error {exc.code}: {exc.read().decode(errors='replace')}", file=sys.stderr)
        raise typer.Exit(1) from None
    except urllib.error.URLError as exc:
        print(f"cannot reach {url}: {exc.reason}", file=sys.stderr)
        raise typer.Exit(1) from None


@routing.command("show")
def routing_show(model: str, url: Url = "http://127.0.0.1:8000", key: Key = None) -> None:
    """Print the model's labels and split weights."""
    _routing_call(url, key, "GET", f"{model}/routing")


@routing.command("set-label")
def routing_set_label(
    model: str, label: str, version: int, url: Url = "http://127.0.0.1:8000", key: Key = None
) -> None:
    """Point LABEL at VERSION (the version must be served)."""
    _routing_call(url, key, "PUT", f"{model}/routing/labels/{label}", {"version": version})


@routing.command("remove-label")
def routing_remove_label(
    model: str, label: str, url: Url = "http://127.0.0.1:8000", key: Key = None
) -> None:
    """Remove LABEL from the model."""
    _routing_call(url, key, "DELETE", f"{model}/routing/labels/{label}")


@routing.command("set-weights")
def routing_set_weights(
    model: str,
    weights: Annotated[
        list[str] | None, typer.Argument(help="VERSION=WEIGHT pairs (0-1000); none: no split.")
    ] = None,
    url: Url = "http://127.0.0.1:8000",
    key: Key = None,
) -> None:
    """Split the requests that name no version between versions, by weight."""
    split: dict[str, int] = {}
    for pair in weights or []:
        version, _, weight = pair.partition("=")
        if not weight.strip().isdigit():
            raise typer.BadParameter(f"{pair!r} is not VERSION=WEIGHT", param_hint="WEIGHTS")
        split[version.strip()] = int(weight)
    _routing_call(url, key, "PUT", f"{model}/routing", {"weights": split})


@routing.command("clear")
def routing_clear(model: str, url: Url = "http://127.0.0.1:8000", key: Key = None) -> None:
    """Remove every label and the split of the model."""
    _routing_call(url, key, "DELETE", f"{model}/routing")


rollout = typer.Typer(
    no_args_is_help=True,
    help="Canary rollouts of a new model version, with automatic rollback (through a gateway).",
)
app.add_typer(rollout, name="rollout")


@rollout.command("start")
def rollout_start(
    model: str,
    version: Annotated[int, typer.Option(help="The candidate version.")],
    steps: Annotated[
        str | None, typer.Option(help="Its traffic shares in percent, e.g. 10,25,50.")
    ] = None,
    step_s: Annotated[float | None, typer.Option(help="Seconds per step at least.")] = None,
    min_samples: Annotated[
        int | None, typer.Option(help="Answers a step needs to be judged.")
    ] = None,
    shadow_s: Annotated[
        float | None,
        typer.Option(
            help="First mirror requests to it for this long (answers discarded, compared) "
            "before it answers any client."
        ),
    ] = None,
    shadow_percent: Annotated[
        int | None, typer.Option(help="Share of the requests mirrored (default 100).")
    ] = None,
    url: Url = "http://127.0.0.1:8000",
    key: Key = None,
) -> None:
    """Load VERSION beside the serving one, give it traffic step by step, promote it, or
    roll it back by itself when it errs or is slower."""
    body: dict[str, Any] = {"version": version}
    if steps:
        try:
            body["steps"] = [int(step) for step in steps.split(",")]
        except ValueError:
            raise typer.BadParameter("steps: percentages separated by commas") from None
    if step_s is not None:
        body["step_s"] = step_s
    if min_samples is not None:
        body["min_samples"] = min_samples
    if shadow_s is not None:
        body["shadow_s"] = shadow_s
    if shadow_percent is not None:
        body["shadow_percent"] = shadow_percent
    _routing_call(url, key, "POST", f"{model}/rollout", body)


@rollout.command("status")
def rollout_status(model: str, url: Url = "http://127.0.0.1:8000", key: Key = None) -> None:
    """The rollout's phase, the candidate's share, and every decision with its numbers."""
    _routing_call(url, key, "GET", f"{model}/rollout")


@rollout.command("promote")
def rollout_promote(model: str, url: Url = "http://127.0.0.1:8000", key: Key = None) -> None:
    """Give the candidate all the traffic now and stop the old version."""
    _routing_call(url, key, "POST", f"{model}/rollout/promote")


@rollout.command("rollback")
def rollout_rollback(model: str, url: Url = "http://127.0.0.1:8000", key: Key = None) -> None:
    """Give the old version all the traffic now and stop the candidate."""
    _routing_call(url, key, "POST", f"{model}/rollout/rollback")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
