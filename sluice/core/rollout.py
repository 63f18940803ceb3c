"""A rollout of a new model version: its plan, as a client asks for it, and its state, as
the controller keeps it in Redis (``Keys.rollout``) for every gateway to show.

Phases: ``loading`` (the candidate version is started beside the stable one and warmed up
before it gets any traffic), ``shadow`` when the plan asks for it (a share of the requests
that name no version is mirrored to the candidate, which answers nobody, and judged as a
step would be), ``canary`` (it gets the plan's shares of the requests that name no version,
one step after another), then ``promoted`` or ``rolled_back``. Every decision is kept with
the numbers it was taken on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from sluice.core.errors import InvalidInput
from sluice.core.fields import integers, numbers

START, PROMOTE, ROLLBACK = "rollout_start", "rollout_promote", "rollout_rollback"
OPS = (START, PROMOTE, ROLLBACK)
FINISHED = ("promoted", "rolled_back")
MAX_DECISIONS = 200
MAX_VERSION = 1 << 63
"""Versions are below it (int64, as a control command carries them)."""


@dataclass(frozen=True)
class RolloutPlan:
    steps: tuple[int, ...] = (10, 25, 50, 100)
    """The candidate's share of traffic at each step, in percent; the last one promotes."""
    step_s: float = 10.0
    """How long each step lasts at least (more while its samples are too few)."""
    min_samples: int = 20
    """Answers of the candidate in a step below which the step is inconclusive (held)."""
    max_error_increase: float = 0.02
    """Rollback when the candidate's error rate exceeds the stable one's by more than this."""
    max_p99_ratio: float = 1.5
    """Rollback when the candidate's p99 latency exceeds the stable one's times this ..."""
    min_p99_increase_s: float = 0.01
    """... and by more than this (histogram buckets are coarse: 2.5 ms against 1 ms is no
    regression worth a rollback)."""
    max_inconclusive: int = 30
    """Consecutive inconclusive checks after which the rollout gives up (rolls back)."""
    shadow_s: float = 0.0
    """How long the candidate gets mirrored requests before its first step (0: no shadow
    phase); judged like a step, it must also gather ``min_samples`` answers."""
    shadow_percent: int = 100
    """The share of the requests naming no version that is mirrored, in percent."""

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> RolloutPlan:
        """The plan a client sent (every field optional), checked field by field; a field
        the plan does not have is refused (a misspelt one would silently take its default)."""
        plan = cls()
        known = {f.name for f in fields(cls)}
        unknown = sorted(name for name in body if name not in known)
        if unknown:
            raise InvalidInput(
                f"unknown field {repr(unknown[0])[:40]}; a rollout request has 'version' and "
                f"{', '.join(repr(name) for name in sorted(known))}"
            )
        values: dict[str, Any] = {}
        if "steps" in body:
            steps = body["steps"]
            if (
                not isinstance(steps, list)
                or not 1 <= len(steps) <= 20
                or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
                or not all(1 <= s <= 100 for s in steps)
                or steps != sorted(set(steps))
            ):
                raise InvalidInput("'steps' must be 1 to 20 increasing percentages in 1..100")
            values["steps"] = tuple(steps) if steps[-1] == 100 else (*steps, 100)
        values.update(
            numbers(
                body,
                (
                    ("step_s", 0.1, 3600.0),
                    ("max_error_increase", 0.0, 1.0),
                    ("max_p99_ratio", 1.0, 100.0),
                    ("min_p99_increase_s", 0.0, 60.0),
                    ("shadow_s", 0.0, 3600.0),
                ),
            )
        )
        values.update(
            integers(
                body,
                (
                    ("min_samples", 1, 1_000_000),
                    ("max_inconclusive", 1, 10_000),
                    ("shadow_percent", 1, 100),
                ),
            )
        )
        return RolloutPlan(**{**asdict(plan), **values})


def parse_start(body: dict[str, Any]) -> tuple[int, RolloutPlan]:
    """The candidate version and the plan of a rollout request (``{"version": 4, ...}``),
    checked alike by the gateway that takes it and the controller that carries it out."""
    candidate = body.get("version")
    if (
        isinstance(candidate, bool)
        or not isinstance(candidate, int)
        or not 0 < candidate < MAX_VERSION
    ):
        raise InvalidInput("'version' must be the candidate version, a positive integer")
    return candidate, RolloutPlan.from_json({k: v for k, v in body.items() if k != "version"})


@dataclass
class RolloutState:
    model: str
    stable: int
    candidate: int
    plan: RolloutPlan
    phase: str = "loading"
    step: int = -1
    """Index of the plan's step in force (-1: no traffic yet)."""
    weight: int = 0
    """The candidate's share of traffic now, in percent."""
    reason: str = ""
    decisions: list[dict[str, Any]] = field(default_factory=list)
    shadowed: bool = False
    """The shadow phase (if the plan has one) passed."""

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        body["plan"]["steps"] = list(self.plan.steps)
        return body

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> RolloutState:
        plan = body["plan"]
        return cls(
            model=str(body["model"]),
            stable=int(body["stable"]),
            candidate=int(body["candidate"]),
            plan=RolloutPlan(**{**plan, "steps": tuple(plan["steps"])}),
            phase=str(body["phase"]),
            step=int(body["step"]),
            weight=int(body["weight"]),
            reason=str(body.get("reason", "")),
            decisions=list(body.get("decisions", [])),
            shadowed=bool(body.get("shadowed", False)),
        )
