"""The controller under faults and hostile input, against a real redis-server with no stack:
the executors' answers are written by the test. An unload racing a rollout, a promotion
whose load fails, a model with no directory, commands a new leader must not carry out twice,
a leader whose start failed, plans the gateway or the repository gets wrong, a repository
where thousands of models change or a copy fails, and versions that come and go."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import orjson
import pytest
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from sluice.core.config import parse_config_text
from sluice.core.control import REPLY_TTL_S, ControlCommand, encode_command, send_reply
from sluice.core.errors import InvalidInput
from sluice.core.keys import Keys
from sluice.core.repository import RepositoryModel
from sluice.core.rollout import PROMOTE, ROLLBACK, START, RolloutPlan, parse_start
from sluice.core.routing import weight_field
from sluice.scheduler.controller.autoscaler import Autoscaler
from sluice.scheduler.controller.fenced_commands import COMMANDS_KEPT, CommandSender
from sluice.scheduler.controller.leadership import Lease
from sluice.scheduler.controller.repository_poller import MAX_MODELS_PER_POLL, RepositoryPoller
from sluice.scheduler.controller.rollouts import RolloutManager
from sluice.scheduler.controller.service import Decisions
from sluice.scheduler.executor.redis_server import RedisServer
from sluice.scheduler.repository.local import LocalSource
from sluice.scheduler.repository.sources import (
    Changes,
    Listing,
    Materialised,
    Model,
    RepositorySource,
    Version,
)

FAST = {"steps": [50], "step_s": 0.1, "min_samples": 1000, "max_inconclusive": 1}


@pytest.fixture
def redis(redis_server: RedisServer) -> Iterator[Redis]:
    client = Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def keys() -> Keys:
    return Keys(f"t{uuid.uuid4().hex[:8]}")


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    for version in ("1", "2"):
        (tmp_path / "m" / version).mkdir(parents=True)
    return tmp_path


def serving(repository: Path, name: str = "m") -> dict[str, tuple[RepositoryModel, list[object]]]:
    return {name: (RepositoryModel(name, repository / name, None, (1,)), [])}


def leader(redis: Redis, keys: Keys, name: str = "controller-a") -> Lease:
    lease = Lease(redis, keys, name, ttl_s=60)
    assert lease.acquire().token is not None
    return lease


def manager(redis: Redis, keys: Keys, repository: Path) -> RolloutManager:
    sender = CommandSender(redis, keys, leader(redis, keys))
    sender.loaded = serving(repository)
    return RolloutManager(redis, keys, sender)


class Executor:
    """Reads the loads the controller sends and answers them, as ``sluice up`` would."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis, self.keys, self.after = redis, keys, "0-0"

    def loads(self) -> list[ControlCommand]:
        from sluice.core.control import read_commands

        commands: list[ControlCommand] = []
        while True:
            stream = self.keys.control_requests
            self.after, read = read_commands(self.redis, stream, self.after, count=1000)
            if not read:
                return commands
            commands += read

    def answer(self, error: str | None = None) -> list[ControlCommand]:
        commands = self.loads()
        for command in commands:
            send_reply(self.redis, self.keys, command.command_id, error, "executor-1")
        return commands


def tick(rollouts: RolloutManager) -> None:
    rollouts._due = 0.0
    rollouts.tick()


def state(redis: Redis, keys: Keys) -> dict[str, Any]:
    return cast(dict[str, Any], orjson.loads(redis.get(keys.rollout("m")) or b"{}"))


def start(rollouts: RolloutManager, **plan: Any) -> str | None:
    body = {"version": 2, **FAST, **plan}
    return rollouts.handle(ControlCommand(START, "m", json.dumps(body)))


def in_canary(rollouts: RolloutManager, executor: Executor) -> None:
    assert start(rollouts) is None
    assert [c.versions for c in executor.answer()] == [(1, 2)]
    tick(rollouts)
    assert rollouts._active["m"].state.phase == "canary"


def test_an_unloaded_model_is_not_loaded_again_by_its_rollout(
    redis: Redis, keys: Keys, repository: Path
) -> None:
    rollouts = manager(redis, keys, repository)
    executor = Executor(redis, keys)
    in_canary(rollouts, executor)
    rollouts.sender.loaded = {}  # an administrator unloads the model mid-canary
    for _ in range(4):  # past the step and its inconclusive checks
        time.sleep(0.12)
        tick(rollouts)
    assert executor.loads() == []  # neither a rollback nor a promotion loads it again
    after = state(redis, keys)
    assert after["phase"] == "rolled_back" and "unloaded" in after["reason"]
    assert redis.hgetall(keys.routing("m")) == {}  # no split left behind


def test_promote_or_rollback_of_an_unloaded_models_rollout_loads_nothing(
    redis: Redis, keys: Keys, repository: Path
) -> None:
    rollouts = manager(redis, keys, repository)
    executor = Executor(redis, keys)
    in_canary(rollouts, executor)
    rollouts.sender.loaded = {}
    error = rollouts.handle(ControlCommand(PROMOTE, "m"))
    assert error is not None and "not loaded" in error
    assert executor.loads() == []
    assert state(redis, keys)["phase"] == "rolled_back"


def test_a_promotion_whose_load_fails_is_rolled_back_not_reported_promoted(
    redis: Redis, keys: Keys, repository: Path
) -> None:
    rollouts = manager(redis, keys, repository)
    executor = Executor(redis, keys)
    in_canary(rollouts, executor)
    assert rollouts.handle(ControlCommand(PROMOTE, "m")) is None
    [promotion] = executor.answer("failed to load 'm', no version 2 in the repository")
    assert promotion.versions == (2,)
    tick(rollouts)
    after = state(redis, keys)
    assert after["phase"] == "rolling_back", after
    assert "promotion failed" in after["reason"]
    # Every request stays with the stable version, which is loaded alone again.
    assert redis.hgetall(keys.routing("m")) == {weight_field(1).encode(): b"100"}
    assert [c.versions for c in executor.answer()] == [(1,)]
    tick(rollouts)
    assert state(redis, keys)["phase"] == "rolled_back"


def test_a_decision_under_way_is_not_taken_twice(
    redis: Redis, keys: Keys, repository: Path
) -> None:
    rollouts = manager(redis, keys, repository)
    executor = Executor(redis, keys)
    in_canary(rollouts, executor)
    assert rollouts.handle(ControlCommand(ROLLBACK, "m")) is None
    for op in (PROMOTE, ROLLBACK):
        error = rollouts.handle(ControlCommand(op, "m"))
        assert error is not None and "rolling back already" in error
    assert [c.versions for c in executor.answer()] == [(1,)]  # one load, not three
    tick(rollouts)
    assert state(redis, keys)["phase"] == "rolled_back"
    assert rollouts._answers == {}


def test_a_model_with_no_directory_is_refused_with_a_reason(
    redis: Redis, keys: Keys, tmp_path: Path
) -> None:
    rollouts = manager(redis, keys, tmp_path)  # (no folder m/: loaded from a request's files)
    error = start(rollouts)
    assert error is not None and "has no version 2" in error


def test_a_remote_repositorys_copy_does_not_refuse_a_version_just_uploaded(
    redis: Redis, keys: Keys, tmp_path: Path
) -> None:
    (tmp_path / "m" / "1").mkdir(parents=True)  # the copy taken before version 2 came
    rollouts = manager(redis, keys, tmp_path)
    rollouts.local_copy = False
    executor = Executor(redis, keys)
    assert start(rollouts) is None
    assert [c.versions for c in executor.loads()] == [(1, 2)]  # the executor's load decides


def rollout_request(redis: Redis, keys: Keys, op: str, body: dict[str, Any] | None = None) -> str:
    command = ControlCommand(op, "m", json.dumps(body) if body is not None else None)
    redis.xadd(keys.controller_requests, encode_command(command))  # type: ignore[arg-type]
    return command.command_id


def reply(redis: Redis, keys: Keys, command_id: str) -> dict[str, Any] | None:
    raw = redis.lpop(keys.control_reply(command_id))
    return None if raw is None else cast(dict[str, Any], orjson.loads(cast(bytes, raw)))


def decisions(redis: Redis, keys: Keys, repository: Path) -> Decisions:
    """A controller reading a local repository (not polling it: no executor sets the mode)."""
    return Decisions(redis, keys, repository, LocalSource(repository), 1.0, announce=False)


def lead_tick(controller: Decisions, lease: Lease) -> None:
    """One tick of the leader, its rollouts checked whatever the time since the last."""
    if controller.leading is not None:
        controller.leading[1]._due = 0.0
    controller.tick(lease)


def catalog(redis: Redis, keys: Keys, repository: Path) -> None:
    from sluice.scheduler.executor.catalog_publisher import publish_catalog

    config = parse_config_text('backend: "python"\n', model_name="m")
    publish_catalog(redis, keys, [RepositoryModel("m", repository / "m", config, (1,))])


def test_a_new_leadership_does_not_carry_out_handled_commands_again(
    redis: Redis, keys: Keys, repository: Path
) -> None:
    """A rollout started, then rolled back; its commands were answered but are still on
    the stream (their gateway gave up, or died). The next leader starts nothing again."""
    catalog(redis, keys, repository)
    executor = Executor(redis, keys)
    first = decisions(redis, keys, repository)
    lease = leader(redis, keys)
    first.on_lead(lease)
    started = rollout_request(redis, keys, START, {"version": 2, **FAST})
    lead_tick(first, lease)
    assert reply(redis, keys, started) == {"error": None, "executor": ""}
    executor.answer()
    lead_tick(first, lease)  # the candidate is loaded: canary
    rolled_back = rollout_request(redis, keys, ROLLBACK)
    lead_tick(first, lease)
    executor.answer()
    lead_tick(first, lease)
    assert reply(redis, keys, rolled_back) == {"error": None, "executor": ""}
    assert state(redis, keys)["phase"] == "rolled_back"
    first.on_lose(lease)
    lease.release()

    second = decisions(redis, keys, repository)
    successor = leader(redis, keys, "controller-b")
    second.on_lead(successor)
    lead_tick(second, successor)
    assert executor.loads() == []
    assert state(redis, keys)["phase"] == "rolled_back"
    assert redis.xlen(keys.controller_requests) == 0


def test_a_command_its_sender_gave_up_on_long_ago_is_not_carried_out(
    redis: Redis, keys: Keys, repository: Path
) -> None:
    catalog(redis, keys, repository)
    seconds, _ = redis.time()
    stale = ControlCommand(START, "m", json.dumps({"version": 2}))
    entry_id = f"{(int(seconds) - REPLY_TTL_S - 60) * 1000}-0"
    redis.xadd(keys.controller_requests, encode_command(stale), id=entry_id)  # type: ignore[arg-type]
    fresh = rollout_request(redis, keys, PROMOTE)
    controller = decisions(redis, keys, repository)
    lease = leader(redis, keys)
    controller.on_lead(lease)
    controller.tick(lease)
    assert reply(redis, keys, stale.command_id) is None
    assert redis.get(keys.rollout("m")) is None
    answered = reply(redis, keys, fresh)
    assert answered is not None and "no rollout" in answered["error"]


def test_a_failing_command_is_answered_and_the_next_still_carried_out(
    redis: Redis, keys: Keys, repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    catalog(redis, keys, repository)
    controller = decisions(redis, keys, repository)
    lease = leader(redis, keys)
    controller.on_lead(lease)
    original = RolloutManager.handle
    calls = []

    def handle(self: RolloutManager, command: ControlCommand) -> str | None:
        calls.append(command.op)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return original(self, command)

    monkeypatch.setattr(RolloutManager, "handle", handle)
    failing = rollout_request(redis, keys, PROMOTE)
    following = rollout_request(redis, keys, START, {"version": 2, **FAST})
    controller.tick(lease)
    answered = reply(redis, keys, failing)
    assert answered is not None and "failed" in answered["error"]
    assert reply(redis, keys, following) == {"error": None, "executor": ""}


def test_a_leader_whose_start_failed_starts_again_on_its_next_tick(
    redis: Redis, keys: Keys, repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    catalog(redis, keys, repository)
    controller = decisions(redis, keys, repository)
    lease = leader(redis, keys)
    original = RolloutManager.recover
    failures = [RedisConnectionError("Redis went away for a moment")]

    def recover(self: RolloutManager) -> None:
        if failures:
            raise failures.pop()
        original(self)

    monkeypatch.setattr(RolloutManager, "recover", recover)
    with pytest.raises(RedisConnectionError):
        controller.on_lead(lease)  # (run_controller logs it and goes on ticking)
    controller.tick(lease)
    assert controller.leading is not None
    started = rollout_request(redis, keys, START, {"version": 2, **FAST})
    controller.tick(lease)
    assert reply(redis, keys, started) == {"error": None, "executor": ""}


def test_a_rollout_of_a_model_whose_folder_is_gone_is_recovered_as_rolled_back(
    redis: Redis, keys: Keys, tmp_path: Path
) -> None:
    from sluice.core.rollout import RolloutState

    current = RolloutState("m", 1, 2, RolloutPlan(), phase="canary", step=0, weight=50)
    redis.set(keys.rollout("m"), orjson.dumps(current.to_json()))
    catalog(redis, keys, tmp_path)  # (no folder m/ in the controller's copy)
    controller = decisions(redis, keys, tmp_path)
    lease = leader(redis, keys)
    controller.on_lead(lease)
    assert controller.leading is not None
    assert state(redis, keys)["phase"] == "rolling_back"


def test_rollout_requests_are_checked_field_by_field() -> None:
    assert parse_start({"version": 4, "steps": [50]}) == (4, RolloutPlan(steps=(50, 100)))
    for body, field in (
        ({"version": 1 << 63}, "'version'"),
        ({"version": "4"}, "'version'"),
        ({"version": 4, "stpes": [10]}, "unknown field 'stpes'"),
        ({"version": 4, "step_s": float("nan")}, "'step_s'"),
        ({"version": 4, "max_error_increase": -0.1}, "'max_error_increase'"),
    ):
        with pytest.raises(InvalidInput, match=field):
            parse_start(body)


class _NoSource(RepositorySource):
    location = "nowhere"

    def list(self) -> Any:
        raise AssertionError

    def served(self) -> Any:
        raise AssertionError

    def materialise(self, listing: Any) -> Any:
        raise AssertionError


def test_a_canary_parameter_out_of_range_is_left_out_not_the_whole_rollout(
    redis: Redis, keys: Keys, repository: Path
) -> None:
    text = 'backend: "python"\n' + "".join(
        f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}\n'
        for key, value in (
            ("sluice.rollout", "canary"),
            ("sluice.rollout_step_s", "0"),
            ("sluice.rollout_steps", "0,200"),
            ("sluice.rollout_min_samples", "5"),
        )
    )
    config = parse_config_text(text, model_name="m")
    sender = CommandSender(redis, keys, leader(redis, keys))
    sender.loaded = {"m": (RepositoryModel("m", repository / "m", config, (1,)), [])}
    poller = RepositoryPoller(_NoSource(), sender, 1.0, redis, keys)
    request = poller._rollout("m", Changes(appeared=(("m", 2),)))
    assert request == {"version": 2, "min_samples": 5}
    parse_start(request)


class _Store(RepositorySource):
    """A repository whose listing and copy failures the test sets."""

    location = "s3://bucket/"

    def __init__(self, root: Path, names: list[str]) -> None:
        self.root = root
        self.listing = Listing({name: Model(versions={1: Version((), "t1")}) for name in names})
        self.failing: dict[str, str] = {}

    def list(self) -> Listing:
        return self.listing

    def served(self) -> Listing:
        return Listing()

    def materialise(self, listing: Listing) -> Materialised:
        return Materialised(self.root, dict(self.failing))


def loads_sent(redis: Redis, keys: Keys) -> list[str]:
    return [c.model for c in Executor(redis, keys).loads()]


def polling(redis: Redis, keys: Keys, store: _Store) -> RepositoryPoller:
    sender = CommandSender(redis, keys, leader(redis, keys))
    poller = RepositoryPoller(store, sender, 1.0, redis, keys)
    poller.acted = Listing()  # (not the first controller: everything listed is new)
    return poller


def test_a_model_whose_copy_failed_is_loaded_once_a_later_poll_copies_it(
    redis: Redis, keys: Keys, tmp_path: Path
) -> None:
    store = _Store(tmp_path, ["a", "b"])
    store.failing = {"a": "the download broke off 3 time(s)"}
    poller = polling(redis, keys, store)
    poller.poll_once()
    assert loads_sent(redis, keys) == ["b"]
    store.failing = {}
    poller.poll_once()  # the same listing: only the failed model is taken now
    assert loads_sent(redis, keys) == ["b", "a"]
    poller.poll_once()
    assert loads_sent(redis, keys) == ["b", "a"]


def test_thousands_of_changed_models_are_loaded_a_share_per_poll(
    redis: Redis, keys: Keys, tmp_path: Path
) -> None:
    """All at once, the control stream (capped near COMMANDS_KEPT) would drop the first
    loads before any executor read them."""
    names = [f"m{index:04d}" for index in range(2 * COMMANDS_KEPT + 50)]
    poller = polling(redis, keys, _Store(tmp_path, names))
    executor = Executor(redis, keys)  # (reads between two polls, seconds apart)
    loaded: list[str] = []
    for _ in range(100):
        poller.poll_once()
        sent = [c.model for c in executor.answer()]
        assert len(sent) <= MAX_MODELS_PER_POLL
        loaded += sent
    assert sorted(loaded) == names
    recorded = orjson.loads(redis.get(keys.polled_repository) or b"{}")
    assert sorted(recorded) == names


def test_the_autoscaler_forgets_versions_no_longer_served(
    redis: Redis, keys: Keys, tmp_path: Path
) -> None:
    text = 'backend: "python"\nparameters { key: "sluice.max_instances" value { %s } }\n'
    sender = CommandSender(redis, keys, leader(redis, keys))
    autoscaler = Autoscaler(redis, keys, sender)
    for version in range(1, 51):  # a new version every poll, the previous one unloaded
        value = f'string_value: "{version % 3 + 2}"'
        config = parse_config_text(text % value, model_name="m")
        sender.loaded = {"m": (RepositoryModel("m", tmp_path / "m", config, (version,)), [])}
        autoscaler._due = 0.0
        autoscaler.tick()
    assert set(autoscaler._scalers) == set(autoscaler._answered) == {("m", 50)}
    assert len(autoscaler._policies) == 1


def test_a_huge_load_error_is_kept_short_in_the_rollouts_state(
    redis: Redis, keys: Keys, repository: Path
) -> None:
    """The error of a candidate's load is the model's own exception text."""
    rollouts = manager(redis, keys, repository)
    assert start(rollouts) is None
    Executor(redis, keys).answer("RuntimeError: " + "x" * 1_000_000)
    tick(rollouts)
    after = state(redis, keys)
    assert after["phase"] == "rolled_back" and "did not load: RuntimeError" in after["reason"]
    assert len(redis.get(keys.rollout("m")) or b"") < 10_000
    assert max(len(e) for e in redis.lrange(keys.controller_decisions, 0, -1)) < 10_000
