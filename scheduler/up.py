"""``sluice up``: Redis, the catalog, a gateway and every worker on one machine."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import ssl
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from redis import Redis
from redis.exceptions import RedisError

from sluice.core.catalog import UNLOADED
from sluice.core.celery_config import broker_url
from sluice.core.errors import InvalidConfig
from sluice.core.exits import EXIT_LOAD_FAILED
from sluice.core.keys import Keys
from sluice.core.redis_connect import connect
from sluice.core.repository import RepositoryModel, scan_repository
from sluice.core.settings import (
    ApiKeySettings,
    ControllerSettings,
    GatewaySettings,
    RepositorySourceSettings,
    UpSettings,
)
from sluice.core.shm import SEGMENT_GRACE_S, sweep_orphans
from sluice.scheduler import controller
from sluice.scheduler.catalog_publisher import publish_catalog
from sluice.scheduler.instances import Fleet, InstanceReconciler, InstanceSpec
from sluice.scheduler.model_control import ModelControl
from sluice.scheduler.open_listener import warn_if_open_beyond_loopback
from sluice.scheduler.placement import placements, threads_per_instance, visible_gpus
from sluice.scheduler.redis_server import RedisNotInstalled, RedisServer, new_password
from sluice.scheduler.sources import (
    LocalSource,
    SourceError,
    carry_over,
    open_source,
    snapshot_repository,
)
from sluice.scheduler.supervisor import ChildSpec, Supervisor

log = logging.getLogger("sluice.up")

_GATEWAY_START_ATTEMPTS = 3


class CatalogKeeper:
    """Republishes the catalog when Redis lost it (a restart without persistence), with
    the load errors workers reported: those workers exited and will not report again."""

    def __init__(
        self, client: Redis, keys: Keys, models: Callable[[], list[RepositoryModel]], mode: str
    ) -> None:
        self.client, self.keys, self.models, self.mode = client, keys, models, mode
        self.reachable = True
        self.load_errors: dict[Any, bytes] = {}

    def publish(self) -> None:
        """The catalog of the models served now, and the model control mode in force."""
        self.client.set(self.keys.control_mode, self.mode)
        publish_catalog(self.client, self.keys, self.models())

    def tick(self) -> None:
        try:
            if self.client.exists(self.keys.catalog_revision):
                errors = self.client.hgetall(self.keys.load_errors)
                self.load_errors = cast(dict[Any, bytes], errors)
            else:
                log.warning(
                    "the model catalog is gone from Redis (restarted?); publishing it again"
                )
                if self.load_errors:
                    self.client.hset(self.keys.load_errors, mapping=self.load_errors)
                self.publish()
            if not self.reachable:
                log.info("Redis is reachable again")
            self.reachable = True
        except RedisError as exc:
            if self.reachable:
                log.warning("Redis is unreachable: %s", exc)
            self.reachable = False


class SegmentSweeper:
    """Removes the shared memory segments that killed children left in /dev/shm."""

    EVERY_S = 10.0

    def __init__(self, namespace: str, models: list[RepositoryModel]) -> None:
        self.namespace = namespace
        longest = GatewaySettings().default_timeout_s
        for model in models:
            dynamic = model.config.dynamic_batching if model.config is not None else None
            if dynamic is not None:
                longest = max(longest, dynamic.default_timeout_us / 1e6)
        self.max_age_s = 2 * longest  # an answer unread this long has no reader left
        self.due = 0.0

    def tick(self, *, final: bool = False) -> None:
        if final or time.monotonic() >= self.due:
            try:
                grace_s = 0.0 if final else SEGMENT_GRACE_S
                sweep_orphans(self.namespace, self.max_age_s, grace_s=grace_s)
            except OSError as exc:
                log.warning("sweeping shared memory segments failed: %s", exc)
            self.due = time.monotonic() + self.EVERY_S


def _initially_loaded(settings: UpSettings, models: list[RepositoryModel]) -> list[RepositoryModel]:
    """Explicit model control: the models named by --load-model (``*``: all)."""
    wanted = set(settings.load_model)
    return [m for m in models if "*" in wanted or m.name in wanted]


def _instance_spec(env: dict[str, str]) -> InstanceSpec:
    """One more worker of a model version (autoscaling), like those it started with."""

    def spec(model: RepositoryModel, version: int, threads: int) -> ChildSpec:
        specs = _worker_specs([model], model.path.parent, env, threads)
        return next(s for s in specs if s.version == version)

    return spec


def _refresher(settings: UpSettings) -> Callable[[], None] | None:
    """For a remote repository: bring the local copy up to date before a load."""
    source = open_source(settings.model_repository, settings)
    if isinstance(source, LocalSource):
        return None

    def refresh() -> None:
        result = source.materialise(carry_over(source.served(), source.list()))
        for name, reason in result.problems.items():
            log.warning("model '%s' not taken from %s: %s", name, source.location, reason)

    return refresh


def _start_controller(
    settings: UpSettings, redis_url: str
) -> tuple[threading.Thread, threading.Event]:
    """The controller as a thread of ``sluice up``: it contends for the lease like any
    other, so a ``sluice controller`` elsewhere may lead instead, or stand by."""
    fields = {name: getattr(settings, name) for name in RepositorySourceSettings.model_fields}
    controller_settings = ControllerSettings(
        **fields,
        redis_url=redis_url,
        namespace=settings.namespace,
        model_repository=settings.model_repository,
    )
    stop = threading.Event()

    def run() -> None:
        try:
            controller.run(controller_settings, stop, announce=False)
        except SourceError as exc:
            log.error("the controller cannot read the repository: %s", exc.message)

    thread = threading.Thread(target=run, name="controller", daemon=True)
    thread.start()
    return thread, stop


def _worker_specs(
    models: list[RepositoryModel],
    repository: Path,
    env: dict[str, str],
    threads: int | None = None,
) -> list[ChildSpec]:
    """One child per instance of each served version of each usable model."""
    usable = [m for m in models if m.config is not None and m.error is None]
    specs: list[ChildSpec] = []
    for model in usable:
        assert model.config is not None
        model_threads = threads or threads_per_instance(model.config.total_instances)
        where = placements(model.config.instance_groups, visible_gpus())
        for version in model.versions:
            for index, (kind, device) in enumerate(where):
                argv = [
                    sys.executable,
                    "-m",
                    "sluice.workers",
                    "--model-repository",
                    str(repository),
                    "--model",
                    model.name,
                    "--version",
                    str(version),
                    "--kind",
                    kind,
                    "--threads",
                    str(model_threads),
                    "--slot",
                    str(index),
                ]
                if device is not None:
                    argv += ["--gpu", str(device)]
                specs.append(
                    ChildSpec(
                        f"worker {model.name}:{version}#{index}",
                        argv,
                        env,
                        frozenset({EXIT_LOAD_FAILED}),
                        version=version,
                    )
                )
    return specs


class ListenError(Exception):
    """A port ``sluice up`` cannot listen on (in use, or not allowed)."""


def _listeners(settings: UpSettings) -> list[socket.socket]:
    """The HTTP listener, then the metrics listener when there is a metrics port. They stay
    open here for as long as we run: a restarted gateway serves on them again, and
    connections arriving meanwhile wait in their backlog."""
    listeners: list[socket.socket] = []
    ports = [settings.http_port] + ([settings.metrics_port] if settings.metrics_port else [])
    for port in ports:
        try:
            listeners.append(_listen(settings.http_host, port))
        except OSError as exc:
            for listener in listeners:
                listener.close()
            where = f"{settings.http_host}:{port}"
            raise ListenError(f"cannot listen on {where}: {exc.strerror}") from None
    return listeners


def _reserve_grpc_port(settings: UpSettings) -> socket.socket | None:
    """Hold the gRPC port for our gateways, which bind it with SO_REUSEPORT (grpcio cannot
    serve on an inherited socket): bound, never listening, so no connection lands here.
    Checked first without SO_REUSEPORT, so that a port another server holds (another Sluice
    included) is refused instead of shared."""
    if not settings.grpc_port:
        return None
    family = socket.AF_INET6 if ":" in settings.http_host else socket.AF_INET
    where = f"{settings.http_host}:{settings.grpc_port}"
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((settings.http_host, settings.grpc_port))
        reserved = socket.socket(family, socket.SOCK_STREAM)
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        reserved.bind((settings.http_host, settings.grpc_port))
    except OSError as exc:
        raise ListenError(f"cannot listen on {where} (gRPC port): {exc.strerror}") from None
    return reserved


def _batch_data_env(settings: UpSettings, repository: Path) -> dict[str, str]:
    """What the gateways and batch workers learn of batch data: the store (a data directory
    of its own by default, never the directory ``sluice up`` started in) and the model
    repository, where no batch job may read or write."""
    store = settings.batch_store
    if store and not store.startswith("s3://"):
        store = os.path.abspath(store)
    source = settings.model_repository
    return {
        "SLUICE_BATCH_STORE": store,
        "SLUICE_MODEL_REPOSITORY": source if source.startswith("s3://") else str(repository),
    }


def _batch_worker_specs(settings: UpSettings, env: dict[str, str]) -> list[ChildSpec]:
    """The batch workers (Celery), when the batch extra is installed."""
    if not settings.batch_workers:
        return []
    if importlib.util.find_spec("celery") is None:
        log.info("no batch workers: batch jobs need Celery (pip install 'sluice[batch]')")
        return []
    try:
        broker_url(settings.redis_url, settings.batch_broker_url)
    except ValueError as exc:
        log.warning("no batch workers: %s", exc)
        return []
    return [
        ChildSpec(f"batch-worker#{index}", [sys.executable, "-m", "sluice.batch"], env)
        for index in range(settings.batch_workers)
    ]


def _gateway_specs(
    settings: UpSettings, env: dict[str, str], listeners: list[socket.socket]
) -> list[ChildSpec]:
    gateway_env = dict(
        env,
        SLUICE_HTTP_HOST=settings.http_host,
        SLUICE_HTTP_PORT=str(settings.http_port),
        SLUICE_HTTP_FD=str(listeners[0].fileno()),
        SLUICE_GATEWAY_PROCESSES=str(settings.gateway_processes),
        SLUICE_GRPC_PORT=str(settings.grpc_port),
        SLUICE_GRPC_REUSE_PORT="true",
        SLUICE_SHM_SAME_HOST=str(settings.shm_same_host).lower(),
    )
    if len(listeners) > 1:
        gateway_env.update(
            SLUICE_METRICS_PORT=str(settings.metrics_port),
            SLUICE_METRICS_FD=str(listeners[1].fileno()),
        )
    else:
        gateway_env.update(SLUICE_METRICS_PORT="0", SLUICE_METRICS_FD="-1")
    return [
        ChildSpec(
            f"gateway#{index}",
            [sys.executable, "-m", "sluice.gateway"],
            gateway_env,
            pass_fds=tuple(listener.fileno() for listener in listeners),
        )
        for index in range(settings.gateway_processes)
    ]


def _wait_ready(
    settings: UpSettings,
    probe: str | None,
    models: list[RepositoryModel],
    supervisor: Supervisor,
    redis_server: RedisServer | None,
    stop: threading.Event,
) -> bool:
    """Announces each model as it becomes ready, then Sluice; False when it cannot start."""
    scheme = "https" if settings.ssl_certfile else "http"
    url = f"{scheme}://{settings.http_host}:{settings.http_port}"
    announcer = Announcer(url, probe, {m.name for m in models}, _instances(models))
    deadline = time.monotonic() + settings.ready_timeout_s
    gateway_child = supervisor.children[0]
    while not stop.is_set() and not announcer.settled():
        supervisor.tick()
        if redis_server is not None:
            redis_server.tick()
        if len(gateway_child.exit_codes) >= _GATEWAY_START_ATTEMPTS:
            print("error: the gateway failed to start (see its log above)", file=sys.stderr)
            return False
        if time.monotonic() > deadline:
            waiting = f": still loading {', '.join(announcer.loading)}"
            print(
                f"error: Sluice did not become ready within {settings.ready_timeout_s:.0f} s"
                + (waiting if announcer.loading else ""),
                file=sys.stderr,
            )
            return False
        stop.wait(0.2)
    if not stop.is_set():
        if settings.metrics_port:
            print(
                f"Metrics at {scheme}://{settings.http_host}:{settings.metrics_port}/metrics",
                flush=True,
            )
        if settings.grpc_port and settings.gateway:
            print(f"gRPC at {settings.http_host}:{settings.grpc_port}", flush=True)
        print(f"Sluice ready at {url}", flush=True)
    return True


def _redacted(url: str) -> str:
    """A Redis URL without its password, for printing."""
    scheme, sep, rest = url.partition("://")
    _credentials, at, host = rest.rpartition("@")
    return f"{scheme}{sep}{'***@' if at else ''}{host}" if sep else url


def _listen(host: str, port: int) -> socket.socket:
    """One listening socket shared by every gateway process: the kernel spreads connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(2048)
    listener.set_inheritable(True)
    return listener


PROBE_TENANT = "sluice-up"
"""Tenant of the admin key ``sluice up`` makes for its own readiness probe."""


def _probe_key(keys: ApiKeySettings | None) -> str | None:
    """A key for the readiness probe, which reads the repository index (a management
    route): made for this start and given to the gateways as one more admin key, so that
    the probe works however the operator's keys are written, and with inference keys
    alone. None without keys (everything is open)."""
    if keys is None or not (
        keys.api_keys or keys.api_keys_file or keys.admin_keys or keys.admin_keys_file
    ):
        return None
    return secrets.token_urlsafe(32)


def _with_probe_key(env: dict[str, str], probe: str | None) -> dict[str, str]:
    if probe is None:
        return env
    admin = env.get("SLUICE_ADMIN_KEYS", "")
    entry = f"{PROBE_TENANT}:{probe}"
    return {**env, "SLUICE_ADMIN_KEYS": f"{admin},{entry}" if admin.strip() else entry}


def _repository_index(url: str, token: str | None) -> list[dict[str, Any]] | None:
    """The gateway's ``POST /v2/repository/index``; None while it cannot answer."""
    request = urllib.request.Request(f"{url}/v2/repository/index", data=b"{}", method="POST")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    # The probe talks to our own gateway on loopback: its certificate may be self-signed.
    context = ssl._create_unverified_context() if url.startswith("https") else None
    try:
        with urllib.request.urlopen(request, timeout=2, context=context) as response:
            rows = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return rows if isinstance(rows, list) else None


@dataclass
class Announcer:
    """Prints a line for each model version once it is ready or unavailable, as the
    gateway's repository index says (not ``/v2/health/ready``, which stays false while
    any model is unavailable)."""

    url: str
    token: str | None
    expected: set[str]
    """The repository's models: the gateway knows the catalog once it lists them all."""
    instances: dict[str, int]
    announced: set[tuple[str, str]] = field(default_factory=set)
    loading: list[str] = field(default_factory=list)

    def settled(self) -> bool:
        """Whether every model version is ready or unavailable (announcing what is new)."""
        rows = _repository_index(self.url, self.token)
        if rows is None or not self.expected <= {row.get("name") for row in rows}:
            return False
        self.loading = []
        for row in rows:
            name, version, state = str(row.get("name")), row.get("version", ""), row.get("state")
            what = f"model '{name}'" + (f" version {version}" if version else "")
            if row.get("reason") == UNLOADED:
                continue  # explicit model control: not asked for
            if state not in ("READY", "UNAVAILABLE"):
                self.loading.append(what)
            elif (name, version) not in self.announced:
                self.announced.add((name, version))
                if state == "READY":
                    count = self.instances.get(name, 1)
                    print(f"{what} ready ({count} instance{'s' * (count != 1)})", flush=True)
                else:
                    reason = row.get("reason") or "no reason given"
                    print(f"{what} unavailable: {reason}", flush=True)
        return not self.loading


def _instances(models: list[RepositoryModel]) -> dict[str, int]:
    """Worker processes per version of each model (what _worker_specs starts)."""
    return {
        m.name: len(placements(m.config.instance_groups, visible_gpus()))
        for m in models
        if m.config is not None and m.error is None
    }


def up(settings: UpSettings, *, redis_url_given: bool, keys: ApiKeySettings | None = None) -> int:
    """Run everything until SIGINT/SIGTERM; the exit status. ``keys``: the gateway's API
    keys, so that the readiness probe may read the repository index."""
    try:  # an s3:// repository is copied into the local cache first
        repository = snapshot_repository(settings.model_repository, settings)
        models = scan_repository(repository)
    except (InvalidConfig, SourceError) as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    if not models:
        print(
            f"warning: the model repository {repository} has no models; serving none "
            "(a model is a directory <model>/ with config.pbtxt and <version>/<model file>)",
            file=sys.stderr,
            flush=True,
        )

    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())

    redis_server: RedisServer | None = None
    redis_url = settings.redis_url
    if not redis_url_given:
        redis_server = RedisServer(
            password=new_password(), maxmemory_bytes=settings.redis_maxmemory
        )
        try:
            redis_server.start()
        except RedisNotInstalled as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        redis_url = redis_server.url
        log.info(
            "started a private redis-server at %s (password made for this start, "
            "maxmemory %d MiB, SLUICE_REDIS_MAXMEMORY)",
            redis_server.address,
            settings.redis_maxmemory >> 20,
        )
    if settings.gateway:
        warn_if_open_beyond_loopback(settings.http_host, keys)

    supervisor: Supervisor | None = None
    listeners: list[socket.socket] = []
    held: list[socket.socket] = []
    """Sockets that only keep a port ours (the gRPC one)."""
    sweeper = SegmentSweeper(settings.namespace, models)
    namespace = Keys(settings.namespace)
    client = connect(redis_url, socket_timeout=2, socket_connect_timeout=2)
    control: ModelControl | None = None
    decider: tuple[threading.Thread, threading.Event] | None = None
    staging: Path | None = None
    try:
        env = dict(
            os.environ,
            SLUICE_REDIS_URL=redis_url,
            SLUICE_NAMESPACE=settings.namespace,
            **_batch_data_env(settings, repository),
        )
        probe = _probe_key(keys)
        explicit = settings.model_control_mode == "explicit"
        loaded = _initially_loaded(settings, models) if explicit else models
        served = list(loaded)
        catalog = CatalogKeeper(
            client,
            namespace,
            (lambda: control.catalog() if control is not None else served),
            settings.model_control_mode,
        )
        try:
            client.delete(namespace.load_errors)
            catalog.publish()
        except RedisError as exc:
            print(f"error: cannot reach Redis at {_redacted(redis_url)}: {exc}", file=sys.stderr)
            return 2

        if not settings.gateway:
            supervisor = Supervisor([])
        else:
            try:
                listeners = _listeners(settings)
                grpc_reservation = _reserve_grpc_port(settings)
                if grpc_reservation is not None:
                    held.append(grpc_reservation)
            except ListenError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            supervisor = Supervisor(
                _gateway_specs(settings, _with_probe_key(env, probe), listeners)
            )
        supervisor.start()
        supervisor.add(_batch_worker_specs(settings, env))
        children = {
            model.name: supervisor.add(_worker_specs([model], repository, env)) for model in loaded
        }
        fleet: Fleet = {m.name: (m, children[m.name]) for m in loaded}
        instances = InstanceReconciler(client, namespace, supervisor, fleet, _instance_spec(env))
        # Model control runs in every mode: load / unload requests only in explicit mode
        # (the gateways check), the controller's loads (poll mode, rollouts) in all.
        staging = Path(tempfile.mkdtemp(prefix="sluice-staged-"))
        control = ModelControl(
            client,
            namespace,
            repository,
            staging,
            supervisor,
            lambda model, root, env: _worker_specs([model], root, env),
            env,
            settings.model_control_timeout_s,
            fleet,
            catalog.publish,
        )
        control.refresh = _refresher(settings)
        control.start()
        catalog.publish()
        if settings.controller:
            decider = _start_controller(settings, redis_url)
        if not settings.gateway:
            count = sum(len(c) for c in children.values())
            print(
                f"Sluice workers started for {count} model instance(s), without a "
                f"gateway; gateways reach them through {_redacted(redis_url)}",
                flush=True,
            )
        elif not _wait_ready(settings, probe, loaded, supervisor, redis_server, stop):
            return 1
        while not stop.wait(0.1):
            supervisor.tick()
            if redis_server is not None:
                redis_server.tick()
            catalog.tick()
            sweeper.tick()
            control.tick()
            _guarded_tick(instances.tick)
        return 0
    finally:
        if stop.is_set():
            print("Stopping Sluice ...", flush=True)
        if decider is not None:
            decider[1].set()
            decider[0].join(10)
        client.close()
        if supervisor is not None:
            supervisor.stop()
        for listener in [*listeners, *held]:
            listener.close()
        sweeper.tick(final=True)  # every child is gone: nobody will read what is left
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if redis_server is not None:
            redis_server.stop()
        if stop.is_set():
            print("Sluice stopped.", flush=True)


def _guarded_tick(tick: Callable[[], None]) -> None:
    try:
        tick()
    except RedisError as exc:
        log.warning("Redis: %s", exc)
