"""Two real controller processes, one leading: the standby takes over within 5 s when the
leader is killed (SIGKILL) or frozen (SIGSTOP), and a frozen leader that wakes up
(SIGCONT) applies nothing more: every decision in the log carries a token at least as
new as those before it, and none is there twice.

The controllers have real decisions to make: the catalog serves an autoscaled model, and
a thread keeps filling and emptying its queue (4 s each, so that every empty spell holds
the two quiet checks a scale-down takes), so the leader scales it up and down every few
seconds (no executor runs: the wanted counts are only written)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import orjson
import pytest
from redis import Redis

from sluice.core.config.parse import parse_config_text
from sluice.core.keys import Keys
from sluice.core.repository import RepositoryModel
from sluice.scheduler.executor.catalog_publisher import publish_catalog
from sluice.scheduler.executor.redis_server import RedisServer
from tests.faults.conftest import Report
from tests.support import procs

REPO_ROOT = Path(__file__).resolve().parents[2]
TAKEOVER_S = 5.0
"""The standby leads (applies its first decision) within this long of the leader's death."""


@dataclass
class Controller:
    """A ``sluice controller`` process; its stdout lines with the monotonic
    time they arrived, and its log lines."""

    process: subprocess.Popen[str]
    stdout: list[tuple[float, str]] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)
    readers: list[threading.Thread] = field(default_factory=list)

    @property
    def holder(self) -> str:
        return f"{socket.gethostname()}:{self.process.pid}"

    def tokens(self, since: float = 0.0) -> list[int]:
        """The tokens of the ``Controller <id> leads (fencing token <n>)`` lines printed
        after ``since``."""
        return [
            int(line.rstrip(")").rsplit(" ", 1)[1])
            for at, line in self.stdout
            if at > since and " leads " in line
        ]

    def first_lead_after(self, since: float) -> float | None:
        return next((at for at, line in self.stdout if at > since and " leads " in line), None)

    def logged(self, text: str) -> bool:
        return any(text in line for line in self.stderr)


@pytest.fixture
def namespace() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


POLICY = """
name: "m"
backend: "onnxruntime"
max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
parameters { key: "sluice.min_instances" value { string_value: "0" } }
parameters { key: "sluice.max_instances" value { string_value: "4" } }
parameters { key: "sluice.latency_objective_ms" value { string_value: "400" } }
parameters { key: "sluice.scale_down_window_s" value { string_value: "0" } }
"""


@pytest.fixture
def busy_model(redis_server: RedisServer, namespace: str) -> Iterator[None]:
    """An autoscaled model in the catalog whose queue fills and empties every second."""
    keys = Keys(namespace)
    client = Redis.from_url(redis_server.url)
    config = parse_config_text(POLICY, model_name="m")
    publish_catalog(client, keys, [RepositoryModel("m", Path("m"), config, (1,))])
    stop = threading.Event()

    def churn() -> None:
        stream = keys.request_stream("m", 1)
        while not stop.is_set():
            for _ in range(5):
                client.xadd(stream, {"x": "1"})
            stop.wait(4.0)
            client.delete(stream)
            stop.wait(4.0)

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join(5)
    client.close()


@pytest.fixture
def start_controller(
    redis_server: RedisServer, namespace: str, busy_model: None
) -> Iterator[Callable[[], Controller]]:
    """Factory: start a controller process; every one is killed at the end."""
    started: list[Controller] = []
    env = dict(os.environ, SLUICE_REDIS_URL=redis_server.url, SLUICE_NAMESPACE=namespace)
    env.pop("SLUICE_CONTROLLER_ID", None)

    def start() -> Controller:
        process = subprocess.Popen(
            [sys.executable, "-m", "sluice.cli", "controller"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO_ROOT,
        )
        controller = Controller(process)
        started.append(controller)
        assert process.stdout is not None and process.stderr is not None
        controller.readers = [
            threading.Thread(target=_pump_timed, args=(process.stdout, controller.stdout)),
            threading.Thread(target=_pump, args=(process.stderr, controller.stderr)),
        ]
        for reader in controller.readers:
            reader.start()
        return controller

    try:
        yield start
    finally:
        for controller in started:
            if controller.process.poll() is None:
                controller.process.kill()  # also ends a stopped process
            controller.process.wait(10)
            for reader in controller.readers:
                reader.join(10)
            for stream in (controller.process.stdout, controller.process.stderr):
                if stream is not None:
                    stream.close()


def _pump_timed(stream: IO[str], lines: list[tuple[float, str]]) -> None:
    for line in stream:
        lines.append((time.monotonic(), line.strip()))


def _pump(stream: IO[str], lines: list[str]) -> None:
    for line in stream:
        lines.append(line.rstrip())


@pytest.fixture
def redis(redis_server: RedisServer) -> Iterator[Redis]:
    client = Redis.from_url(redis_server.url)
    yield client
    client.close()


def leader_and_standby(start: Callable[[], Controller]) -> tuple[Controller, Controller]:
    """Start one controller, let it lead, then start a second one that stands by."""
    leader = start()
    assert procs.wait_until(lambda: bool(leader.tokens()), 15, 0.01), leader.stderr
    standby = start()
    assert procs.wait_until(lambda: standby.logged(f"standby: {leader.holder} leads"), 15), (
        standby.stderr
    )
    return leader, standby


def decision_log(redis: Redis, namespace: str) -> list[tuple[int, int]]:
    """(token, count within its leadership) of every decision applied, oldest first."""
    entries = [orjson.loads(e) for e in redis.lrange(Keys(namespace).controller_decisions, 0, -1)]
    return [(int(e["token"]), int(e["n"])) for e in entries]


def assert_fenced(log: list[tuple[int, int]]) -> None:
    tokens = [token for token, _ in log]
    assert tokens == sorted(tokens), f"a decision with an older token came later: {tokens}"
    assert len(set(log)) == len(log), "a decision was applied twice"


def test_the_standby_takes_over_within_5_s_of_a_sigkill(
    start_controller: Callable[[], Controller], redis: Redis, namespace: str, report: Report
) -> None:
    leader, standby = leader_and_standby(start_controller)
    time.sleep(1.5)  # a few renewals and decisions
    killed_at = time.monotonic()
    leader.process.send_signal(signal.SIGKILL)
    assert procs.wait_until(lambda: standby.tokens(), TAKEOVER_S + 2, 0.01), standby.stderr
    took_over_at = standby.first_lead_after(0.0)
    assert took_over_at is not None
    takeover_s = took_over_at - killed_at
    report({"takeover_s": round(takeover_s, 3)})
    assert takeover_s < TAKEOVER_S
    old_token, new_token = leader.tokens()[-1], standby.tokens()[0]
    assert new_token > old_token
    assert standby.logged(f"leading with token {new_token}")
    assert redis.get(Keys(namespace).controller_lease) == standby.holder.encode()
    assert_fenced(decision_log(redis, namespace))


def test_a_frozen_leader_is_replaced_and_applies_nothing_when_it_wakes(
    start_controller: Callable[[], Controller], redis: Redis, namespace: str, report: Report
) -> None:
    old, new = leader_and_standby(start_controller)
    old_token = old.tokens()[-1]
    assert procs.wait_until(lambda: (old_token, 2) in decision_log(redis, namespace), 20), (
        "the leader decided nothing"
    )
    stopped_at = time.monotonic()
    old.process.send_signal(signal.SIGSTOP)
    assert procs.wait_until(lambda: new.tokens(), TAKEOVER_S + 2, 0.01), new.stderr
    took_over_at = new.first_lead_after(0.0)
    assert took_over_at is not None
    new_token = new.tokens()[0]
    assert new_token > old_token
    assert procs.wait_until(lambda: (new_token, 1) in decision_log(redis, namespace), 20), (
        "the new leader decided nothing"
    )

    continued_at = time.monotonic()
    old.process.send_signal(signal.SIGCONT)
    # It steps down: its lease lapsed by its own clock, or a renewal or write was refused.
    assert procs.wait_until(lambda: old.logged(f"standby: {new.holder} leads"), 10), old.stderr
    assert old.logged(f"lost the lease (token {old_token})")
    time.sleep(1.5)  # would it still decide, it would have by now

    takeover_s = took_over_at - stopped_at
    refused = [line for line in old.stderr if "refused" in line]
    report({"takeover_s": round(takeover_s, 3), "old_leader_refused_writes": len(refused)})
    assert takeover_s < TAKEOVER_S
    assert old.tokens(since=continued_at) == []
    log = decision_log(redis, namespace)
    assert_fenced(log)
    first_new = log.index((new_token, 1))
    assert all(token != old_token for token, _ in log[first_new:])
    assert redis.get(Keys(namespace).controller_lease) == new.holder.encode()
    assert old.process.poll() is None  # a former leader stands by; it does not exit
