"""``sluice up``: Redis, the catalog, a gateway and every worker on one machine.

:func:`up` composes the pieces on one :class:`contextlib.ExitStack`: each is started, then
its teardown is pushed, so that whatever fails at start leaves nothing behind, and a stop
tears down in the reverse order (the controller, the children, the ports, their shared
memory, the staging folder, the private Redis). Then one guarded tick loop keeps it all
running (:mod:`.ticks`), woken at once by what needs it (a child's exit, a command) rather
than polling for it. A start that cannot go on raises :class:`StartupFailed`."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from redis import Redis
from redis.exceptions import RedisError

from sluice.core.control import live_executors
from sluice.core.errors import InvalidConfig, StartupFailed
from sluice.core.keys import Keys
from sluice.core.redis_client.connect import connect
from sluice.core.repository import RepositoryModel, scan_repository
from sluice.core.settings import ApiKeySettings, UpSettings
from sluice.scheduler.executor.catalog_keeper import CatalogKeeper
from sluice.scheduler.executor.children import (
    batch_data_env,
    batch_worker_specs,
    gateway_specs,
    instance_spec,
    worker_specs,
)
from sluice.scheduler.executor.controller_thread import start_controller
from sluice.scheduler.executor.instances import Fleet, InstanceReconciler
from sluice.scheduler.executor.listeners import ListenError, open_listeners, reserve_grpc_port
from sluice.scheduler.executor.model_control import ModelControl
from sluice.scheduler.executor.on_demand_start import (
    split_on_demand,
    start_on_demand,
    with_on_demand,
)
from sluice.scheduler.executor.open_listener import warn_if_open_beyond_loopback
from sluice.scheduler.executor.readiness import probe_key, wait_ready, with_probe_key
from sluice.scheduler.executor.redis_server import RedisNotInstalled, RedisServer, new_password
from sluice.scheduler.executor.segment_sweeper import SegmentSweeper
from sluice.scheduler.executor.snapshot import Snapshots
from sluice.scheduler.executor.start_loads import StartLoads, known_to_others
from sluice.scheduler.executor.supervisor import Supervisor, gateway_stop_s
from sluice.scheduler.executor.ticks import CommandWatch, Tick, Wakeup, run_ticks
from sluice.scheduler.repository.local import LocalSource
from sluice.scheduler.repository.locations import open_source, snapshot_repository
from sluice.scheduler.repository.sources import SourceError, carry_over

log = logging.getLogger("sluice.up")


def up(settings: UpSettings, *, redis_url_given: bool, keys: ApiKeySettings | None = None) -> int:
    """Run everything until SIGINT/SIGTERM; the exit status. ``keys``: the gateway's API
    keys, so that the readiness probe may read the repository index."""
    repository, models = _read_repository(settings)
    stop = threading.Event()
    # Ends the tick loop's wait: a stop, a child's exit, a command. (Its pipe lives as long
    # as the process: the command watcher's thread may still set it while this returns.)
    wake = Wakeup()

    def stopping(*_: object) -> None:
        stop.set()
        wake.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stopping)
    with ExitStack() as stack:
        previous = signal.signal(signal.SIGCHLD, lambda *_: wake.set())
        stack.callback(signal.signal, signal.SIGCHLD, previous)
        stack.callback(_say_if_stopped, stop, "Sluice stopped.")
        try:
            redis_server = _private_redis(settings, redis_url_given, stack)
            redis_url = redis_server.url if redis_server is not None else settings.redis_url
            if settings.gateway:
                warn_if_open_beyond_loopback(settings.http_host, keys)
            sweeper = SegmentSweeper(settings.namespace, models)
            stack.callback(sweeper.tick, final=True)  # after the children: nobody reads more
            staging = Path(tempfile.mkdtemp(prefix="sluice-staged-"))
            stack.callback(shutil.rmtree, staging, ignore_errors=True)
            client = connect(redis_url, socket_timeout=2, socket_connect_timeout=2)
            stack.callback(client.close)
            namespace = Keys(settings.namespace)
            env = dict(
                os.environ,
                SLUICE_REDIS_URL=redis_url,
                SLUICE_NAMESPACE=settings.namespace,
                # What the supervisor times its children's stops by: a gateway drains for
                # as long as it is given, a worker left behind when this process is killed
                # exits after the grace.
                SLUICE_SHUTDOWN_TIMEOUT_S=str(settings.shutdown_timeout_s),
                SLUICE_WORKER_STOP_GRACE_S=str(settings.worker_stop_grace_s),
                **batch_data_env(settings),
            )
            explicit = settings.model_control_mode == "explicit"
            models, demanded = split_on_demand(models, settings.model_control_mode)
            snapshots = Snapshots(settings.snapshot_dir) if settings.snapshot_dir else None
            if explicit:
                loaded = StartLoads(client, namespace, settings, repository, staging).choose(
                    models, snapshots
                )
            else:
                loaded = models
            loaded = [m for m in loaded if m.name not in demanded]
            known = _known_to_others(client, namespace)
            control: ModelControl | None = None
            catalog = CatalogKeeper(
                client,
                namespace,
                lambda: with_on_demand(
                    control.catalog() if control is not None else list(loaded), demanded, models
                ),
                settings.model_control_mode,
                lambda: demanded,
            )
            _first_publish(client, namespace, catalog, redis_url)

            probe = probe_key(keys)
            supervisor = _supervisor(settings, with_probe_key(env, probe), stack)
            supervisor.add(batch_worker_specs(settings, env))
            children = {
                m.name: supervisor.add(worker_specs([m], m.path.parent, env)) for m in loaded
            }
            fleet: Fleet = {m.name: (m, children[m.name]) for m in loaded}
            instances = InstanceReconciler(client, namespace, supervisor, fleet, instance_spec(env))
            # Model control runs in every mode: load / unload requests only in explicit mode
            # (the gateways check), the controller's loads (poll mode, rollouts) in all.
            control = ModelControl(
                client,
                namespace,
                repository,
                staging,
                supervisor,
                lambda model, root, env: worker_specs([model], root, env),
                env,
                settings.model_control_timeout_s,
                fleet,
                catalog.publish,
                config_name=settings.model_config_name,
                default_max_batch_size=settings.default_max_batch_size,
                snapshots=snapshots if explicit else None,
                known=known,
            )
            control.refresh = _refresher(settings)
            control.start()
            stack.callback(control.leave)
            on_demand = start_on_demand(
                settings, client, namespace, supervisor, demanded, models, repository, env, wake.set
            )
            if on_demand is not None:
                stack.callback(on_demand.stop)
                # The children stop first, those the fork server forked with the others,
                # while it still reaps them; then the fork server (ExitStack: last in first).
                stack.callback(supervisor.stop)
            CommandWatch(
                lambda timeout_s: connect(redis_url, socket_timeout=timeout_s),
                [namespace.control_requests, namespace.demand_requests],
                wake,
                stop,
            ).start()
            catalog.publish()
            if settings.controller:
                stack.callback(start_controller(settings, redis_url))
            if not settings.gateway:
                count = sum(len(c) for c in children.values())
                print(
                    f"Sluice workers started for {count} model instance(s), without a "
                    f"gateway; gateways reach them through {_redacted(redis_url)}",
                    flush=True,
                )
            else:
                wait_ready(settings, probe, loaded, supervisor, redis_server, stop)
            ticks: list[Tick] = [supervisor.tick]
            if redis_server is not None:
                ticks.append(redis_server.tick)
            ticks += [catalog.tick, sweeper.tick, control.tick, instances.tick]
            if on_demand is not None:
                ticks.append(on_demand.tick)

            def busy() -> bool:
                restarting = redis_server is not None and redis_server.restart_at is not None
                loading = on_demand is not None and on_demand.busy
                return control.busy or supervisor.busy or restarting or loading

            run_ticks(ticks, stop, wake=wake, busy=busy)
            return 0
        finally:
            _say_if_stopped(stop, "Stopping Sluice ...")


def _read_repository(settings: UpSettings) -> tuple[Path, list[RepositoryModel]]:
    """The local directory to serve (an s3:// repository is copied into the local cache
    first) and its models; warns when there are none."""
    try:
        repository = snapshot_repository(settings.model_repository, settings)
        models = scan_repository(
            repository,
            settings.model_config_name,
            default_max_batch_size=settings.default_max_batch_size,
        )
    except (InvalidConfig, SourceError) as exc:
        raise StartupFailed(exc.message) from None
    if not models:
        print(
            f"warning: the model repository {repository} has no models; serving none "
            "(a model is a directory <model>/ with config.pbtxt and <version>/<model file>)",
            file=sys.stderr,
            flush=True,
        )
    return repository, models


def _private_redis(
    settings: UpSettings, redis_url_given: bool, stack: ExitStack
) -> RedisServer | None:
    """A redis-server of our own, unless a Redis URL was given; stopped last."""
    if redis_url_given:
        return None
    server = RedisServer(password=new_password(), maxmemory_bytes=settings.redis_maxmemory)
    try:
        server.start()
    except RedisNotInstalled as exc:
        raise StartupFailed(str(exc)) from None
    stack.callback(server.stop)
    log.info(
        "started a private redis-server at %s (password made for this start, "
        "maxmemory %d MiB, SLUICE_REDIS_MAXMEMORY)",
        server.address,
        settings.redis_maxmemory >> 20,
    )
    return server


def _known_to_others(client: Redis, namespace: Keys) -> set[str]:
    """The models the live executors know though not loaded, read before this one publishes
    its catalog (:func:`known_to_others`)."""
    try:
        return known_to_others(client, namespace)
    except RedisError as exc:
        log.warning("cannot read from Redis which models the other executors know: %s", exc)
        return set()


def _first_publish(client: Redis, namespace: Keys, catalog: CatalogKeeper, redis_url: str) -> None:
    """The catalog, published before any child starts: load errors of a previous run go,
    unless other executors are live (an executor joining them keeps theirs: the failed
    loads they list, the on-demand versions their budget refused)."""
    try:
        if not live_executors(client, namespace):
            client.delete(namespace.load_errors)
        catalog.publish()
    except RedisError as exc:
        raise StartupFailed(f"cannot reach Redis at {_redacted(redis_url)}: {exc}") from None


def _supervisor(settings: UpSettings, gateway_env: dict[str, str], stack: ExitStack) -> Supervisor:
    """The supervisor, started with the gateways (none with ``--no-gateway``) on the ports
    held here for as long as we run: a restarted gateway serves on them again, and
    connections arriving meanwhile wait in their backlog. Stopped before the ports close:
    a gateway then has its drain (``SLUICE_SHUTDOWN_TIMEOUT_S``) and a margin to exit."""
    retries, grace_s = settings.model_load_retry_count, settings.worker_stop_grace_s
    others_s = gateway_stop_s(settings.shutdown_timeout_s)
    if not settings.gateway:
        supervisor = Supervisor(
            [], load_retries=retries, stop_grace_s=grace_s, others_stop_s=others_s
        )
    else:
        try:
            listeners = open_listeners(settings)
            for listener in listeners.all():
                stack.callback(listener.close)
            grpc_reservation = reserve_grpc_port(settings)
            if grpc_reservation is not None:
                stack.callback(grpc_reservation.close)
        except ListenError as exc:
            raise StartupFailed(str(exc)) from None
        supervisor = Supervisor(
            gateway_specs(settings, gateway_env, listeners),
            load_retries=retries,
            stop_grace_s=grace_s,
            others_stop_s=others_s,
        )
    stack.callback(supervisor.stop)
    supervisor.start()
    return supervisor


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


def _redacted(url: str) -> str:
    """A Redis URL without its password, for printing."""
    scheme, sep, rest = url.partition("://")
    _credentials, at, host = rest.rpartition("@")
    return f"{scheme}{sep}{'***@' if at else ''}{host}" if sep else url


def _say_if_stopped(stop: threading.Event, line: str) -> None:
    if stop.is_set():
        print(line, flush=True)
