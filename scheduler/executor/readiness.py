"""How ``sluice up`` waits until it is ready: the gateway's repository index, read with a
key made for this start, announces each model version."""

from __future__ import annotations

import json
import secrets
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sluice.core.catalog import UNLOADED
from sluice.core.errors import StartupFailed
from sluice.core.placement import placements, visible_gpus
from sluice.core.repository import RepositoryModel
from sluice.core.restricted_api import parse_restrictions
from sluice.core.settings import ApiKeySettings, UpSettings
from sluice.scheduler.executor.redis_server import RedisServer
from sluice.scheduler.executor.supervisor import Supervisor

GATEWAY_START_ATTEMPTS = 3


PROBE_TENANT = "sluice-up"
"""Tenant of the admin key ``sluice up`` makes for its own readiness probe."""


def probe_key(keys: ApiKeySettings | None) -> str | None:
    """A key for the readiness probe, which reads the repository index (a management
    route): made for this start and given to the gateways as one more admin key, so that
    the probe works however the operator's keys are written, and with inference keys
    alone. None without keys (everything is open)."""
    if keys is None or not (
        keys.api_keys or keys.api_keys_file or keys.admin_keys or keys.admin_keys_file
    ):
        return None
    return secrets.token_urlsafe(32)


def with_probe_key(env: dict[str, str], probe: str | None) -> dict[str, str]:
    if probe is None:
        return env
    admin = env.get("SLUICE_ADMIN_KEYS", "")
    entry = f"{PROBE_TENANT}:{probe}"
    return {**env, "SLUICE_ADMIN_KEYS": f"{admin},{entry}" if admin.strip() else entry}


def _repository_index(
    url: str, token: str | None, headers: Mapping[str, str]
) -> list[dict[str, Any]] | None:
    """The gateway's ``POST /v2/repository/index``; None while it cannot answer."""
    request = urllib.request.Request(f"{url}/v2/repository/index", data=b"{}", method="POST")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    for name, value in headers.items():
        request.add_header(name, value)
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
    headers: Mapping[str, str] = field(default_factory=dict)
    """What else the probe sends: Triton's restricted-API header of the repository index."""
    announced: set[tuple[str, str]] = field(default_factory=set)
    loading: list[str] = field(default_factory=list)
    unavailable: list[str] = field(default_factory=list)
    """What is unavailable, with the reason, as announced."""

    def settled(self) -> bool:
        """Whether every model version is ready or unavailable (announcing what is new)."""
        rows = _repository_index(self.url, self.token, self.headers)
        if rows is None or not self.expected <= {row.get("name") for row in rows}:
            return False
        self.loading = []
        for row in rows:
            name, version, state = str(row.get("name")), row.get("version", ""), row.get("state")
            what = f"model '{name}'" + (f" version {version}" if version else "")
            if row.get("reason") == UNLOADED or "state" not in row:
                continue  # explicit model control: not asked for (never loaded: a name alone)
            if name not in self.expected:  # loaded on demand: ready for requests as it is
                if (name, version) not in self.announced:
                    self.announced.add((name, version))
                    print(f"{what} loads on demand", flush=True)
                continue
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
                    self.unavailable.append(f"{what}: {reason}")
        return not self.loading


def instances_per_version(models: list[RepositoryModel]) -> dict[str, int]:
    """Worker processes per version of each model (what worker_specs starts)."""
    return {
        m.name: len(placements(m.config.instance_groups, visible_gpus()))
        for m in models
        if m.config is not None and m.error is None
    }


def wait_ready(
    settings: UpSettings,
    probe: str | None,
    models: list[RepositoryModel],
    supervisor: Supervisor,
    redis_server: RedisServer | None,
    stop: threading.Event,
) -> None:
    """Announces each model as it becomes ready, then Sluice. Raises :class:`StartupFailed`
    (exit status 1) when the gateway cannot start or the models do not become ready, or
    when one failed to load and ``exit_on_error`` is set."""
    scheme = "https" if settings.ssl_certfile else "http"
    url = f"{scheme}://{settings.http_host}:{settings.http_port}"
    restricted = parse_restrictions(settings.http_restricted_api).get("model-repository")
    headers = {restricted.header: restricted.value} if restricted is not None else {}
    # The index lists each model by the name clients know it by (model namespacing: a
    # copy of a name several repositories hold under that name, the name itself not).
    expected = {m.listed_as or m.name for m in models if not m.ambiguous}
    announcer = Announcer(url, probe, expected, instances_per_version(models), headers)
    deadline = time.monotonic() + settings.ready_timeout_s
    gateway_child = supervisor.children[0]
    while not stop.is_set() and not announcer.settled():
        supervisor.tick()
        if redis_server is not None:
            redis_server.tick()
        if len(gateway_child.exit_codes) >= GATEWAY_START_ATTEMPTS:
            raise StartupFailed("the gateway failed to start (see its log above)", 1)
        if time.monotonic() > deadline:
            waiting = f": still loading {', '.join(announcer.loading)}"
            raise StartupFailed(
                f"Sluice did not become ready within {settings.ready_timeout_s:.0f} s"
                + (waiting if announcer.loading else ""),
                1,
            )
        stop.wait(0.2)
    if settings.exit_on_error and announcer.unavailable and not stop.is_set():
        raise StartupFailed(
            "exit_on_error (--exit-on-error) is set and model(s) failed to load: "
            + "; ".join(announcer.unavailable),
            1,
        )
    if not stop.is_set():
        if settings.metrics_port:
            print(
                f"Metrics at {scheme}://{settings.http_host}:{settings.metrics_port}/metrics",
                flush=True,
            )
        if settings.grpc_port and settings.gateway:
            print(f"gRPC at {settings.http_host}:{settings.grpc_port}", flush=True)
        print(f"Sluice ready at {url}", flush=True)
