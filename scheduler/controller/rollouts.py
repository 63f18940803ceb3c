"""Canary rollouts with automatic rollback, decided by the leading controller.

A rollout starts the candidate version beside the stable one (model control: a load naming
both versions, so the stable version's workers go on serving) and gives it traffic only once
its workers are warm and ready. Then, step by step, the candidate gets the plan's share of
the requests that name no version (the model's traffic split, applied by every gateway). On
every check (each second) the candidate is compared with the stable version over the same
window, from the counters the workers keep in Redis: error rate, deadline misses and p99
latency (from the latency histogram). Too few answers make a step inconclusive (its weight
is held), not failed; a regression rolls back at once; a step that passes its duration moves
on; the last one promotes. Promotion and rollback are loads too: the version left behind
answers what waits in its stream before its workers stop, so no client request fails.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, cast

import orjson
from redis import Redis

from sluice.core.control import Answers, ControlCommand, live_executors
from sluice.core.errors import InvalidConfig, InvalidInput, SluiceError
from sluice.core.keys import Keys
from sluice.core.observability import histograms as hist
from sluice.core.observability import statistics as st
from sluice.core.repository import RepositoryModel, available_versions
from sluice.core.rollout import (
    FINISHED,
    MAX_DECISIONS,
    PROMOTE,
    ROLLBACK,
    START,
    RolloutState,
    parse_start,
)
from sluice.core.routing import shadow_field, weight_field
from sluice.scheduler.controller.fenced_commands import CommandSender, Served
from sluice.scheduler.controller.leadership import Write

log = logging.getLogger("sluice.up")

CHECK_S = 1.0
MAX_ERROR_CHARS = 1000
"""Of a load's error kept in a decision: a model's own exception text (a repository's model
file raises what it likes) must not make each of the state's decisions megabytes."""
LOAD_ANSWER_S = 300.0
"""A load the executors have not answered in this long (none runs, or it restarted and
dropped the command) counts as failed: the rollout does not wait forever."""


@dataclass
class _Numbers:
    answered: int = 0
    failed: int = 0
    missed: int = 0
    buckets: list[float] = field(default_factory=list)

    @property
    def error_rate(self) -> float:
        return (self.failed + self.missed) / self.answered if self.answered else 0.0

    def p99_s(self) -> float | None:
        total = self.buckets[-1] if self.buckets else 0
        if not total:
            return None
        bounds = (*hist.REQUEST.bounds, float("inf"))
        return next(
            b for b, count in zip(bounds, self.buckets, strict=True) if count >= 0.99 * total
        )

    def minus(self, earlier: _Numbers) -> _Numbers:
        return _Numbers(
            self.answered - earlier.answered,
            self.failed - earlier.failed,
            self.missed - earlier.missed,
            [
                a - b
                for a, b in zip(
                    self.buckets, earlier.buckets or [0] * len(self.buckets), strict=True
                )
            ],
        )


@dataclass
class _Active:
    state: RolloutState
    load_id: str = ""
    """The model control command being waited for (load of the candidate, promotion,
    rollback)."""
    waiting_since: float = 0.0
    """When the rollout began waiting for ``load_id``'s answer (0: not yet seen waiting)."""
    window_start: float = 0.0
    base: dict[int, _Numbers] = field(default_factory=dict)
    inconclusive: int = 0


@dataclass
class RolloutManager:
    client: Redis
    keys: Keys
    sender: CommandSender
    """Every write and load goes through it, fenced by the controller's lease."""
    local_copy: bool = True
    """Whether the models' directories are the repository itself (a local directory), so
    that a version missing there is missing. The copy of a remote repository may lag behind
    the store (the executors bring theirs up to date before each load): there the loads
    decide."""
    _active: dict[str, _Active] = field(default_factory=dict)
    _due: float = 0.0
    _answers: dict[str, Answers] = field(default_factory=dict)
    """The answers so far to each load a rollout waits for."""

    @property
    def fleet(self) -> Served:
        return self.sender.loaded

    def recover(self) -> None:
        """Take up the rollouts an earlier leader (or an earlier run of ``sluice up``) left
        under way: their state is in Redis, their workers may be gone. The versions they
        need are loaded again (a load of what runs already changes nothing) and each goes on
        from where it was: a canary from the start of its step, a promotion or a rollback to
        its end. One whose candidate has left the repository is rolled back."""
        for name, (model, _) in self.fleet.items():
            raw = self.client.get(self.keys.rollout(name))
            if raw is None:
                continue
            try:
                state = RolloutState.from_json(orjson.loads(cast(bytes, raw)))
            except (ValueError, KeyError, TypeError):
                log.error("dropping the unreadable rollout state of '%s'", name)
                self.sender.apply(
                    [Write("DEL", self.keys.rollout(name))], {"op": "drop_rollout", "model": name}
                )
                continue
            if state.phase in FINISHED:
                continue
            active = _Active(state)
            self._active[name] = active
            on_disk = self._on_disk(model, (state.stable, state.candidate))
            if state.phase == "promoting" and state.candidate in on_disk:
                self._decide(active, "resume", "promoting again after a restart")
                active.load_id = self._load(name, (state.candidate,))
            elif state.phase != "rolling_back" and {state.stable, state.candidate} <= on_disk:
                step = max(state.step, 0)
                state.phase, state.step, state.weight = "loading", max(-1, state.step - 1), 0
                self._set_weights(state, {state.stable: 100})
                self._decide(active, "resume", f"after a restart, from step {step}")
                active.load_id = self._load(name, (state.stable, state.candidate))
            else:
                resumed = state.phase == "rolling_back"
                state.phase, state.weight = "rolling_back", 0
                if not resumed:
                    gone = ", ".join(map(str, sorted({state.stable, state.candidate} - on_disk)))
                    state.reason = f"version {gone} left the repository during the rollout"
                self._set_weights(state, {state.stable: 100})
                if resumed:
                    self._decide(active, "resume", "rolling back again after a restart")
                else:
                    self._decide(active, "rollback", state.reason)
                active.load_id = self._load(name, (state.stable,))

    def handle(self, command: ControlCommand) -> str | None:
        """Carry out a rollout command; the error text, or None."""
        try:
            if command.op == START:
                self._start(command)
            else:
                active = self._active.get(command.model)
                if active is None or active.state.phase in FINISHED:
                    raise InvalidInput(f"no rollout of model '{command.model}' is under way")
                if command.model not in self.fleet:
                    self._abandon(active)
                    raise InvalidInput(f"model '{command.model}' is not loaded; its rollout ended")
                phase = active.state.phase
                if phase == "loading":
                    raise InvalidInput("the candidate is still loading; roll back or wait")
                if phase in ("promoting", "rolling_back"):
                    raise InvalidInput(
                        f"the rollout is {phase.replace('_', ' ')} already; wait for its end"
                    )
                if command.op == PROMOTE:
                    self._promote(active, "promoted on request")
                elif command.op == ROLLBACK:
                    self._roll_back(active, "rolled back on request")
        except SluiceError as exc:
            return exc.message
        return None

    def _start(self, command: ControlCommand) -> None:
        name = command.model
        try:
            body = json.loads(command.config or "{}")
        except ValueError:
            raise InvalidInput("the rollout request must be a JSON object") from None
        if not isinstance(body, dict):
            raise InvalidInput("the rollout request must be a JSON object")
        candidate, plan = parse_start(body)
        current = self._active.get(name)
        if current is not None and current.state.phase not in FINISHED:
            raise InvalidInput(f"a rollout of model '{name}' is under way already")
        loaded = self.fleet.get(name)
        if loaded is None:
            raise InvalidInput(f"model '{name}' is not loaded")
        model = loaded[0]
        if len(model.versions) != 1:
            raise InvalidInput(
                f"model '{name}' serves versions {list(model.versions)}; a rollout starts from "
                "one stable version"
            )
        stable = model.versions[0]
        if candidate == stable:
            raise InvalidInput(f"version {candidate} of model '{name}' is the one serving")
        if candidate not in self._on_disk(model, (candidate,)):
            raise InvalidInput(f"model '{name}' has no version {candidate} in its repository")
        state = RolloutState(name, stable, candidate, plan)
        active = _Active(state)
        self._active[name] = active
        # Every request naming no version stays with the stable version until the candidate
        # is warm and its first step (or shadow phase) begins: without a split, the
        # highest ready version (the candidate, once loaded) would take them all.
        self._set_weights(state, {stable: 100})
        self._decide(active, "start", f"loading version {candidate} beside version {stable}")
        active.load_id = self._load(name, (stable, candidate))

    def _on_disk(self, model: RepositoryModel, versions: tuple[int, ...]) -> set[int]:
        """Which of ``versions`` the repository holds, as far as the controller can tell
        (see :attr:`local_copy`); none when the model has no directory there (loaded from
        a request's files)."""
        if not self.local_copy:
            return set(versions)
        try:
            return set(available_versions(model.path)) & set(versions)
        except InvalidConfig:
            return set()

    def _load(self, model: str, versions: tuple[int, ...]) -> str:
        """Have every executor load ``versions``; the command's id, whose answers the
        rollout waits for (each executor alive now, :class:`~sluice.core.control.Answers`)."""
        command = ControlCommand("load", model, versions=versions)
        self._answers[command.command_id] = Answers(live_executors(self.client, self.keys))
        self.sender.submit(command)
        return command.command_id

    def _answered(self, load_id: str, now: float, since: float) -> tuple[bool, str | None]:
        """Whether the load ``load_id`` is answered (by each executor expected, still
        alive) or timed out, and its error if any."""
        answers = self._answers.setdefault(load_id, Answers(frozenset()))
        while (raw := self.client.lpop(self.keys.control_reply(load_id))) is not None:
            answers.add(cast(bytes, raw))
        done = answers.answered and (
            not answers.waiting_for_others
            or answers.complete(live_executors(self.client, self.keys))
        )
        if done:
            return True, answers.error
        if now - since > LOAD_ANSWER_S:
            whom = "every executor" if answers.answered else "any executor"
            return (
                True,
                answers.error or f"{whom} did not answer the load within {LOAD_ANSWER_S:.0f} s",
            )
        return False, None

    def tick(self) -> None:
        now = time.monotonic()
        if now < self._due:
            return
        self._due = now + CHECK_S
        for active in list(self._active.values()):
            state = active.state
            if state.phase in FINISHED:
                continue
            if not active.load_id and state.model not in self.fleet:
                self._abandon(active)
            elif active.load_id:
                active.waiting_since = active.waiting_since or now
                done, error = self._answered(active.load_id, now, active.waiting_since)
                if not done:
                    continue
                self._answers.pop(active.load_id, None)
                active.load_id, active.waiting_since = "", 0.0
                if error is not None and len(error) > MAX_ERROR_CHARS:
                    error = error[:MAX_ERROR_CHARS] + " ..."
                self._loaded(active, error, now)
            elif state.phase in ("canary", "shadow"):
                self._check(active, now)

    def _loaded(self, active: _Active, error: str | None, now: float) -> None:
        state = active.state
        if state.phase == "loading":
            if error:
                self._end(active, "rolled_back", f"the candidate did not load: {error}")
                return
            if state.plan.shadow_s > 0 and not state.shadowed:
                self._shadow(active, now)
            else:
                state.phase = "canary"
                self._next_step(active, now)
        elif state.phase == "promoting":
            if error:  # what served goes on serving: back to the stable version alone
                self._roll_back(active, f"the promotion failed: {error}")
                return
            self._clear_weights(state)
            self._end(active, "promoted", state.reason)
        elif state.phase == "rolling_back":
            if error:  # both versions may still run: the split keeps requests on the stable one
                log.error("rollout of '%s': %s", state.model, error)
                self._end(active, "rolled_back", f"{state.reason}; its load failed: {error}")
                return
            self._clear_weights(state)
            self._end(active, "rolled_back", state.reason)

    def _shadow(self, active: _Active, now: float) -> None:
        """Mirror a share of the traffic to the candidate, which answers nobody; judged as
        a step is, over ``shadow_s``."""
        state = active.state
        state.phase = "shadow"
        percent = state.plan.shadow_percent
        write = Write(
            "HSET", self.keys.routing(state.model), (shadow_field(state.candidate), percent)
        )
        self.sender.apply([write], {"op": "shadow", "model": state.model, "percent": percent})
        active.window_start = now
        active.base = self._numbers(state)
        active.inconclusive = 0
        self._decide(
            active,
            "shadow",
            f"{percent} % of the requests mirrored to the candidate, answers discarded",
        )

    def _next_step(self, active: _Active, now: float) -> None:
        state = active.state
        state.step += 1
        if state.step >= len(state.plan.steps):
            self._promote(active, "every step passed")
            return
        state.weight = state.plan.steps[state.step]
        if state.weight >= 100:
            self._promote(active, "every step passed")
            return
        self._set_weights(state, {state.stable: 100 - state.weight, state.candidate: state.weight})
        active.window_start = now
        active.base = self._numbers(state)
        active.inconclusive = 0
        self._decide(active, "step", f"the candidate takes {state.weight} % of the traffic")

    def _check(self, active: _Active, now: float) -> None:
        state, plan = active.state, active.state.plan
        numbers = self._numbers(state)
        stable = numbers[state.stable].minus(active.base[state.stable])
        candidate = numbers[state.candidate].minus(active.base[state.candidate])
        figures = {
            "candidate_answers": candidate.answered,
            "stable_answers": stable.answered,
            "candidate_error_rate": round(candidate.error_rate, 4),
            "stable_error_rate": round(stable.error_rate, 4),
            "candidate_p99_s": candidate.p99_s(),
            "stable_p99_s": stable.p99_s(),
        }
        if candidate.answered >= plan.min_samples:
            if candidate.error_rate - stable.error_rate > plan.max_error_increase:
                self._roll_back(
                    active,
                    f"error rate {candidate.error_rate:.1%} against {stable.error_rate:.1%}",
                    figures,
                )
                return
            c99, s99 = candidate.p99_s(), stable.p99_s()
            if (
                c99 is not None
                and s99 is not None
                and stable.answered >= plan.min_samples
                and c99 > s99 * plan.max_p99_ratio
                and c99 > s99 + plan.min_p99_increase_s
            ):
                self._roll_back(active, f"p99 latency {c99:.3f} s against {s99:.3f} s", figures)
                return
        duration = plan.shadow_s if state.phase == "shadow" else plan.step_s
        if now - active.window_start < duration:
            return
        if candidate.answered < plan.min_samples:
            active.inconclusive += 1
            if active.inconclusive > plan.max_inconclusive:
                self._roll_back(active, "too few answers to judge the candidate", figures)
            elif active.inconclusive == 1:
                self._decide(
                    active,
                    "inconclusive",
                    f"{candidate.answered} answers, {plan.min_samples} needed: weight held",
                    figures,
                )
            return
        if state.phase == "shadow":
            state.phase, state.shadowed = "canary", True
            self._clear_weights(state)
            self._decide(active, "passed", "the shadow phase passed", figures)
        else:
            self._decide(active, "passed", f"step at {state.weight} % passed", figures)
        self._next_step(active, now)

    def _promote(self, active: _Active, reason: str, figures: dict[str, Any] | None = None) -> None:
        state = active.state
        state.phase, state.reason = "promoting", reason
        self._set_weights(state, {state.candidate: 100})
        state.weight = 100
        self._decide(active, "promote", reason, figures)
        active.load_id = self._load(state.model, (state.candidate,))

    def _roll_back(
        self, active: _Active, reason: str, figures: dict[str, Any] | None = None
    ) -> None:
        state = active.state
        state.phase, state.reason, state.weight = "rolling_back", reason, 0
        self._set_weights(state, {state.stable: 100})
        self._decide(active, "rollback", reason, figures)
        active.load_id = self._load(state.model, (state.stable,))

    def _abandon(self, active: _Active) -> None:
        """End the rollout of a model unloaded meanwhile, with no load (a load would serve
        the model again) and no split left behind."""
        state = active.state
        state.weight = 0
        self._clear_weights(state)
        self._end(active, "rolled_back", f"model '{state.model}' was unloaded during the rollout")

    def _end(self, active: _Active, phase: str, reason: str) -> None:
        active.state.phase, active.state.reason = phase, reason
        self._decide(active, phase, reason)

    def _decide(
        self, active: _Active, decision: str, reason: str, figures: dict[str, Any] | None = None
    ) -> None:
        state = active.state
        entry = {"time": time.time(), "decision": decision, "reason": reason, **(figures or {})}
        state.decisions = [*state.decisions, entry][-MAX_DECISIONS:]
        log.info(
            "rollout of '%s' %d -> %d: %s: %s",
            state.model,
            state.stable,
            state.candidate,
            decision,
            reason,
        )
        writes = [
            Write("SET", self.keys.rollout(state.model), (orjson.dumps(state.to_json()),)),
            Write(
                "HINCRBY",
                self.keys.stats(state.model, state.candidate),
                (st.rollout_decision_field(decision), 1),
            ),
        ]
        self.sender.apply(
            writes, {"op": f"rollout_{decision}", "model": state.model, "reason": reason}
        )

    def _set_weights(self, state: RolloutState, weights: dict[int, int]) -> None:
        key = self.keys.routing(state.model)
        pairs = tuple(x for v, w in weights.items() for x in (weight_field(v), w))
        writes = [Write("HDEL", key, _routing_fields(state)), Write("HSET", key, pairs)]
        self.sender.apply(writes, {"op": "traffic_split", "model": state.model, **_named(weights)})

    def _clear_weights(self, state: RolloutState) -> None:
        key = self.keys.routing(state.model)
        self.sender.apply(
            [Write("HDEL", key, _routing_fields(state))],
            {"op": "traffic_split", "model": state.model},
        )

    def _numbers(self, state: RolloutState) -> dict[int, _Numbers]:
        numbers: dict[int, _Numbers] = {}
        with self.client.pipeline(transaction=False) as pipe:
            for version in (state.stable, state.candidate):
                pipe.hgetall(self.keys.stats(state.model, version))
            results = cast(list[dict[bytes, bytes]], pipe.execute())
        for version, raw in zip((state.stable, state.candidate), results, strict=True):
            counters = {k.decode(): int(v) for k, v in raw.items() if v.lstrip(b"-").isdigit()}
            buckets, _ = hist.REQUEST.read(counters)
            numbers[version] = _Numbers(
                answered=counters.get(st.count_field("success"), 0)
                + counters.get(st.count_field("fail"), 0),
                failed=counters.get(st.count_field("fail"), 0),
                missed=counters.get(st.deadline_miss_field("gateway"), 0),
                buckets=[count for _, count in buckets],
            )
        return numbers


def _routing_fields(state: RolloutState) -> tuple[str, ...]:
    """The routing fields a rollout sets: both versions' weights, the candidate's shadow."""
    return (
        weight_field(state.stable),
        weight_field(state.candidate),
        shadow_field(state.candidate),
    )


def _named(weights: dict[int, int]) -> dict[str, int]:
    return {f"weight_{version}": weight for version, weight in weights.items()}
