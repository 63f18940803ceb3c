"""Restart policy of ``sluice up``'s children and of its private redis-server, and what
it publishes again when Redis lost everything."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

from redis import Redis

from sluice.core.keys import Keys
from sluice.core.repository import RepositoryModel
from sluice.scheduler.executor.catalog_keeper import CatalogKeeper
from sluice.scheduler.executor.catalog_publisher import publish_catalog
from sluice.scheduler.executor.redis_server import RedisServer
from sluice.scheduler.executor.supervisor import COULD_NOT_START, Backoff, ChildSpec, Supervisor
from tests.support import procs


def test_backoff_grows_while_crashing_and_starts_over_after_a_healthy_run() -> None:
    backoff = Backoff(healthy_after_s=10)
    assert [backoff.delay_after(0.1) for _ in range(9)] == [0, 0.5, 1, 2, 4, 8, 16, 30, 30]
    assert backoff.delay_after(10.0) == 0  # it ran fine for a while: restart at once
    assert backoff.delay_after(0.1) == 0.5


def _exits(supervisor: Supervisor) -> int:
    child = supervisor.children[0]
    assert procs.wait_until(lambda: child.process is not None and not child.running, 10, 0.01)
    supervisor.tick()
    return len(child.exit_codes)


def test_a_child_that_ran_healthily_is_restarted_at_once_a_crash_loop_backs_off() -> None:
    healthy = Supervisor(
        [ChildSpec("healthy", ["sh", "-c", "sleep 0.3; exit 1"], dict(os.environ))],
        healthy_after_s=0.2,
    )
    crashing = Supervisor(
        [ChildSpec("crashing", ["sh", "-c", "exit 1"], dict(os.environ))], healthy_after_s=0.2
    )
    try:
        healthy.start()
        crashing.start()
        for count in (1, 2):
            assert _exits(healthy) == count
            assert healthy.children[0].running, "not restarted at once after a healthy run"
        assert _exits(crashing) == 1
        assert crashing.children[0].process is not None  # the first restart is immediate
        assert _exits(crashing) == 2
        child = crashing.children[0]
        assert child.process is None and child.restart_at - time.monotonic() > 0.3
    finally:
        healthy.stop()
        crashing.stop()


def test_a_child_that_cannot_load_is_started_again_as_often_as_retries_allow(
    tmp_path: Path,
) -> None:
    """--model-load-retry-count: exit status 3 (cannot load) twice, then a start that
    stays up; with one retry the child has failed, with two it runs."""
    tries = tmp_path / "tries"
    script = f"echo x >> {tries}; [ $(wc -l < {tries}) -gt 2 ] || exit 3; sleep 30"

    def supervisor(retries: int) -> Supervisor:
        tries.unlink(missing_ok=True)
        spec = ChildSpec("loader", ["sh", "-c", script], dict(os.environ), frozenset({3}))
        return Supervisor([spec], load_retries=retries)

    once = supervisor(1)
    try:
        once.start()
        assert _exits(once) == 1 and once.children[0].process is not None  # retried at once
        assert _exits(once) == 2
        assert once.children[0].failed and once.children[0].process is None
    finally:
        once.stop()
    twice = supervisor(2)
    try:
        twice.start()
        assert _exits(twice) == 1 and _exits(twice) == 2
        assert not twice.children[0].failed
        assert procs.wait_until(lambda: tries.read_text().count("x") == 3, 10, 0.01)
        time.sleep(0.2)
        assert twice.children[0].running
    finally:
        twice.stop()


def test_private_redis_server_restarts_on_its_port() -> None:
    server = RedisServer()
    server.start()
    client = Redis.from_url(server.url, socket_timeout=1)
    try:
        assert server.process is not None
        first, port = server.process, server.port
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        server.tick()
        assert server.process is not first and server.port == port
        assert client.ping()
    finally:
        client.close()
        server.stop()


def test_catalog_and_load_errors_are_published_again_after_redis_lost_them(
    redis_server: RedisServer,
) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    model = RepositoryModel("m", Path("m"), None, (1,), "broken config")
    client = Redis.from_url(redis_server.url)
    try:
        publish_catalog(client, keys, [model])
        client.hset(keys.load_errors, "other:1", "cannot load")  # a worker said so, then exited
        keeper = CatalogKeeper(client, keys, lambda: [model], "explicit")
        keeper.tick()
        client.delete(keys.catalog, keys.catalog_revision, keys.load_errors)  # Redis restarted
        keeper.tick()
        assert client.exists(keys.catalog_revision)
        assert client.hkeys(keys.catalog) == [b"m"]
        assert client.hgetall(keys.load_errors) == {b"other:1": b"cannot load"}
        assert client.get(keys.control_mode) == b"explicit"  # the gateways' load / unload
    finally:
        client.close()


def test_a_child_that_cannot_be_started_is_tried_again_with_back_off(tmp_path: Path) -> None:
    """``exec`` fails (here: its program is missing; out of processes or memory alike): the
    start counts as an exit, the caller (the tick loop) goes on, and a later tick tries
    again, which starts it once it can."""
    program = tmp_path / "program"
    supervisor = Supervisor([ChildSpec("missing", [str(program)], dict(os.environ))])
    try:
        supervisor.start()
        child = supervisor.children[0]
        assert child.process is None and child.exit_codes == [COULD_NOT_START]
        assert child.restart_at > time.monotonic() and supervisor.busy
        supervisor.tick()
        assert child.process is None  # (not again at once)
        program.write_text("#!/bin/sh\nexec sleep 30\n")
        program.chmod(0o755)

        def started() -> bool:
            supervisor.tick()
            return child.running

        assert procs.wait_until(started, 10, 0.05), "not started once it could be"
    finally:
        supervisor.stop()
