"""``sluice up``: Redis, the catalog, a gateway and every worker on one machine."""

from __future__ import annotations

import logging
import os
import signal
import socket
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from redis import Redis
from redis.exceptions import RedisError

from scheduler.catalog_publisher import publish_catalog
from scheduler.placement import placements, visible_gpus
from scheduler.redis_server import RedisNotInstalled, RedisServer
from scheduler.supervisor import ChildSpec, Supervisor
from sluice.errors import InvalidConfig
from sluice.keys import Keys
from sluice.repository import RepositoryModel, scan_repository
from sluice.settings import GatewaySettings, UpSettings
from sluice.shm import SEGMENT_GRACE_S, sweep_orphans

log = logging.getLogger("sluice.up")

EXIT_LOAD_FAILED = 3
_GATEWAY_START_ATTEMPTS = 3


class CatalogKeeper:
    """Republishes the catalog when Redis lost it (a restart without persistence)."""

    def __init__(self, client: Redis, keys: Keys, models: list[RepositoryModel]) -> None:
        self.client, self.keys, self.models = client, keys, models
        self.reachable = True

    def tick(self) -> None:
        try:
            if not self.client.exists(self.keys.catalog_revision):
                log.warning(
                    "the model catalog is gone from Redis (restarted?); publishing it again"
                )
                publish_catalog(self.client, self.keys, self.models)
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


def _worker_specs(
    models: list[RepositoryModel], repository: Path, env: dict[str, str]
) -> list[ChildSpec]:
    usable = [m for m in models if m.config is not None and m.error is None]
    total = sum(m.config.total_instances * len(m.versions) for m in usable if m.config) or 1
    threads = max(1, (os.cpu_count() or 1) // total)
    specs: list[ChildSpec] = []
    for model in usable:
        assert model.config is not None
        where = placements(model.config.instance_groups, visible_gpus())
        for version in model.versions:
            for index, (kind, device) in enumerate(where):
                argv = [
                    sys.executable,
                    "-m",
                    "workers",
                    "--model-repository",
                    str(repository),
                    "--model",
                    model.name,
                    "--version",
                    str(version),
                    "--kind",
                    kind,
                    "--threads",
                    str(threads),
                ]
                if device is not None:
                    argv += ["--gpu", str(device)]
                specs.append(
                    ChildSpec(
                        f"worker {model.name}:{version}#{index}",
                        argv,
                        env,
                        frozenset({EXIT_LOAD_FAILED}),
                    )
                )
    return specs


def _listen(host: str, port: int) -> socket.socket:
    """One listening socket shared by every gateway process: the kernel spreads connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(2048)
    listener.set_inheritable(True)
    return listener


def _ready(url: str) -> bool:
    # The probe talks to our own gateway on loopback: its certificate may be self-signed.
    context = ssl._create_unverified_context() if url.startswith("https") else None
    try:
        with urllib.request.urlopen(
            f"{url}/v2/health/ready", timeout=1, context=context
        ) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _report(models: list[RepositoryModel]) -> None:
    for model in models:
        if model.error:
            log.error("model '%s' is unavailable: %s", model.name, model.error)
        else:
            log.info("model '%s' versions %s", model.name, ", ".join(map(str, model.versions)))


def up(settings: UpSettings, *, redis_url_given: bool) -> int:
    repository = Path(settings.model_repository).resolve()
    try:
        models = scan_repository(repository)
    except InvalidConfig as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    _report(models)

    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())

    redis_server: RedisServer | None = None
    redis_url = settings.redis_url
    if not redis_url_given:
        redis_server = RedisServer()
        try:
            redis_server.start()
        except RedisNotInstalled as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        redis_url = redis_server.url
        log.info("started a private redis-server at %s", redis_url)

    supervisor: Supervisor | None = None
    sweeper = SegmentSweeper(settings.namespace, models)
    keys = Keys(settings.namespace)
    client = Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
    try:
        try:
            client.delete(keys.load_errors)
            publish_catalog(client, keys, models)
        except RedisError as exc:
            print(f"error: cannot reach Redis at {redis_url}: {exc}", file=sys.stderr)
            return 2

        env = dict(os.environ, SLUICE_REDIS_URL=redis_url, SLUICE_NAMESPACE=settings.namespace)
        try:
            listener = _listen(settings.http_host, settings.http_port)
        except OSError as exc:
            where = f"{settings.http_host}:{settings.http_port}"
            print(f"error: cannot listen on {where}: {exc.strerror}", file=sys.stderr)
            return 2
        gateway_env = dict(
            env,
            SLUICE_HTTP_HOST=settings.http_host,
            SLUICE_HTTP_PORT=str(settings.http_port),
            SLUICE_HTTP_FD=str(listener.fileno()),
            SLUICE_GATEWAY_PROCESSES=str(settings.gateway_processes),
            SLUICE_SHM_SAME_HOST=str(settings.shm_same_host).lower(),
        )
        gateways = [
            ChildSpec(
                f"gateway#{index}",
                [sys.executable, "-m", "gateway"],
                gateway_env,
                pass_fds=(listener.fileno(),),
            )
            for index in range(settings.gateway_processes)
        ]
        supervisor = Supervisor([*gateways, *_worker_specs(models, repository, env)])
        supervisor.start()
        listener.close()

        scheme = "https" if settings.ssl_certfile else "http"
        url = f"{scheme}://{settings.http_host}:{settings.http_port}"
        deadline = time.monotonic() + settings.ready_timeout_s
        gateway_child = supervisor.children[0]
        while not stop.is_set() and not _ready(url):
            supervisor.tick()
            if len(gateway_child.exit_codes) >= _GATEWAY_START_ATTEMPTS:
                print("error: the gateway failed to start (see its log above)", file=sys.stderr)
                return 1
            if time.monotonic() > deadline:
                print(
                    f"error: Sluice did not become ready within {settings.ready_timeout_s:.0f} s",
                    file=sys.stderr,
                )
                return 1
            stop.wait(0.2)
        if stop.is_set():
            return 0
        print(f"Sluice ready at {url}", flush=True)
        catalog = CatalogKeeper(client, keys, models)
        while not stop.wait(0.5):
            supervisor.tick()
            catalog.tick()
            sweeper.tick()
        return 0
    finally:
        client.close()
        if supervisor is not None:
            supervisor.stop()
        sweeper.tick(final=True)  # every child is gone: nobody will read what is left
        if redis_server is not None:
            redis_server.stop()
