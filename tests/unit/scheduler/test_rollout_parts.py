"""Rollout pieces without a stack: the plan a client sends, the state kept in Redis, the
p99 read from histogram counts, and a restart that ends a rollout under way."""

from __future__ import annotations

import uuid
from pathlib import Path

import orjson
import pytest
from redis import Redis

from sluice.core.control import ControlCommand, read_commands
from sluice.core.errors import InvalidInput
from sluice.core.keys import Keys
from sluice.core.repository import RepositoryModel
from sluice.core.rollout import RolloutPlan, RolloutState
from sluice.core.routing import weight_field
from sluice.scheduler.controller.fenced_commands import CommandSender
from sluice.scheduler.controller.leadership import Lease, Write
from sluice.scheduler.controller.rollouts import RolloutManager, _Numbers
from sluice.scheduler.executor.redis_server import RedisServer


def test_plans_are_checked_field_by_field() -> None:
    plan = RolloutPlan.from_json({"steps": [10, 50], "step_s": 2, "min_samples": 5})
    assert plan.steps == (10, 50, 100) and plan.step_s == 2.0 and plan.min_samples == 5
    for body, field in (
        ({"steps": [50, 10]}, "'steps'"),
        ({"steps": [0]}, "'steps'"),
        ({"steps": "10"}, "'steps'"),
        ({"step_s": True}, "'step_s'"),
        ({"step_s": 1e9}, "'step_s'"),
        ({"min_samples": 1.5}, "'min_samples'"),
        ({"max_p99_ratio": 0.5}, "'max_p99_ratio'"),
        ({"shadow_s": -1}, "'shadow_s'"),
        ({"shadow_s": "soon"}, "'shadow_s'"),
        ({"shadow_percent": 0}, "'shadow_percent'"),
        ({"shadow_percent": 101}, "'shadow_percent'"),
        ({"shadow_percent": 50.5}, "'shadow_percent'"),
    ):
        with pytest.raises(InvalidInput, match=field):
            RolloutPlan.from_json(body)


def test_state_round_trips_through_json() -> None:
    state = RolloutState("m", 1, 2, RolloutPlan(), phase="canary", step=1, weight=25)
    state.decisions.append({"decision": "step", "reason": "x"})
    assert RolloutState.from_json(orjson.loads(orjson.dumps(state.to_json()))) == state


def test_p99_is_the_bound_of_the_bucket_holding_it() -> None:
    counts: list[float] = [0] * 17
    for index in range(17):
        counts[index] = 99 if index >= 2 else 0  # 99 answers within 2.5 ms ...
    counts[-1] = 100  # ... and one past every bound
    assert _Numbers(100, 0, 0, counts).p99_s() == 0.0025
    assert _Numbers(0, 0, 0, [0] * 17).p99_s() is None


def test_a_restart_takes_a_rollout_up_again(redis_server: RedisServer, tmp_path: Path) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    for version in ("1", "2"):
        (tmp_path / "m" / version).mkdir(parents=True)
    client = Redis.from_url(redis_server.url)
    try:
        state = RolloutState("m", 1, 2, RolloutPlan(), phase="canary", step=1, weight=25)
        client.set(keys.rollout("m"), orjson.dumps(state.to_json()))
        client.hset(keys.routing("m"), mapping={weight_field(1): 75, weight_field(2): 25})
        lease = Lease(client, keys, "controller-a")
        token = lease.acquire().token
        sender = CommandSender(client, keys, lease)
        sender.loaded = {"m": (RepositoryModel("m", tmp_path / "m", None, (1,)), [])}
        RolloutManager(client, keys, sender).recover()
        after = orjson.loads(client.get(keys.rollout("m")) or b"{}")
        assert after["decisions"][-1]["decision"] == "resume"
        _, (load,) = read_commands(client, keys.control_requests, "0-0")
        assert (load.op, load.model, load.versions, load.token) == ("load", "m", (1, 2), token)
        # The candidate gets no traffic until it is loaded again.
        assert client.hgetall(keys.routing("m")) == {weight_field(1).encode(): b"100"}
        logged = [orjson.loads(e) for e in client.lrange(keys.controller_decisions, 0, -1)]
        assert {e["token"] for e in logged} == {token}
        assert "load" in [e["op"] for e in logged]
    finally:
        client.close()


def test_a_deposed_leader_decides_nothing(redis_server: RedisServer, tmp_path: Path) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    client = Redis.from_url(redis_server.url)
    try:
        old = Lease(client, keys, "controller-a", ttl_s=0.3, margin_s=0.0)
        assert old.acquire().token is not None
        sender = CommandSender(client, keys, old)
        client.delete(keys.controller_lease)  # as if it had expired while a pause lasted
        new = Lease(client, keys, "controller-b")
        assert new.acquire().token is not None
        assert not sender.submit(ControlCommand("load", "m"))
        assert not sender.apply([Write("SET", keys.rollout("m"), ("x",))], {"op": "test"})
        assert client.xlen(keys.control_requests) == 0
        assert client.get(keys.rollout("m")) is None
        assert client.llen(keys.controller_decisions) == 0
    finally:
        client.close()
