"""Client load for fault tests: many threads sending requests back to back, each request
carrying a unique marker, every answer checked against its own request and tallied."""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson


def slow_request(index: int, iters: int = 0, timeout_us: int | None = None) -> dict[str, Any]:
    """An inference request for tests/support/slow_model.py, marked with ``index``."""
    body: dict[str, Any] = {
        "id": f"req-{index}",
        "inputs": [
            {"name": "IN", "shape": [1, 4], "datatype": "FP32", "data": marker(index)},
            {"name": "ITERS", "shape": [1, 1], "datatype": "INT64", "data": [iters]},
        ],
    }
    if timeout_us is not None:
        body["parameters"] = {"timeout": timeout_us}
    return body


def marker(index: int) -> list[float]:
    """Four floats that identify request ``index`` (exact in FP32 below 2^22)."""
    return [float(index), index + 0.5, -float(index), 7.0]


def answer_matches(index: int, document: Any) -> bool:
    """Whether a 200 body is the slow model's answer to request ``index``."""
    try:
        outputs = {o["name"]: o for o in document["outputs"]}
        return bool(
            document.get("id") == f"req-{index}"
            and outputs["OUT"]["shape"] == [1, 4]
            and outputs["OUT"]["data"] == marker(index)
        )
    except (KeyError, TypeError):
        return False


@dataclass
class Answer:
    index: int
    status: int | None
    """HTTP status; None when no HTTP answer came (connection dropped, client timeout)."""
    correct: bool = False
    """A 200 whose body is the answer to this very request."""
    error: str | None = None
    """The JSON ``error`` of a non-200 answer (or what went wrong)."""
    well_formed: bool = True
    """A non-200 answer has a JSON body with an ``error`` string."""
    retry_after: str | None = None
    latency_s: float = 0.0
    started_s: float = 0.0


def check_response(index: int, response: httpx.Response, started: float) -> Answer:
    answer = Answer(
        index,
        response.status_code,
        retry_after=response.headers.get("retry-after"),
        latency_s=time.monotonic() - started,
        started_s=started,
    )
    try:
        document = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        document = None
    if response.status_code == 200:
        answer.correct = answer_matches(index, document)
    else:
        message = document.get("error") if isinstance(document, dict) else None
        answer.well_formed = isinstance(message, str) and bool(message)
        answer.error = message if answer.well_formed else response.text[:200]
    return answer


@dataclass
class Load:
    """``concurrency`` threads sending requests to ``model`` until ``total`` were sent
    (or :meth:`stop`); ``build(index)`` makes request ``index``'s JSON body."""

    url: str
    model: str
    concurrency: int
    total: int
    build: Any = slow_request
    client_timeout_s: float = 30.0
    headers: dict[str, str] = field(default_factory=dict)
    answers: list[Answer] = field(default_factory=list)
    _indices: Any = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    sent: int = 0

    def start(self) -> Load:
        for n in range(self.concurrency):
            thread = threading.Thread(target=self._run, name=f"load-{n}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        self._stop.set()
        assert not stuck, f"client threads still waiting after {timeout_s} s: {stuck}"

    def _next(self) -> int | None:
        with self._lock:
            if self._stop.is_set() or self.sent >= self.total:
                return None
            self.sent += 1
            return next(self._indices)

    def _run(self) -> None:
        path = f"/v2/models/{self.model}/infer"
        with httpx.Client(
            base_url=self.url, timeout=self.client_timeout_s, headers=self.headers
        ) as client:
            while (index := self._next()) is not None:
                content = orjson.dumps(self.build(index))
                started = time.monotonic()
                try:
                    response = client.post(path, content=content)
                except httpx.HTTPError as exc:
                    answer = Answer(
                        index,
                        None,
                        error=f"{type(exc).__name__}: {exc}",
                        well_formed=False,
                        latency_s=time.monotonic() - started,
                        started_s=started,
                    )
                else:
                    answer = check_response(index, response, started)
                with self._lock:
                    self.answers.append(answer)

    def ok_count(self) -> int:
        return sum(a.correct for a in self.answers)

    def figures(self) -> dict[str, Any]:
        """sent, answered, ok, wrong, errors by status, malformed errors, lost, duplicated."""
        per_index = Counter(a.index for a in self.answers)
        answered = [a for a in self.answers if a.status is not None]
        return {
            "sent": self.sent,
            "answered": len(answered),
            "ok": sum(a.correct for a in answered),
            "wrong_answers": sum(a.status == 200 and not a.correct for a in answered),
            "errors_by_status": dict(
                sorted(Counter(str(a.status) for a in self.answers if a.status != 200).items())
            ),
            "malformed_errors": sum(not a.well_formed for a in answered),
            "lost": self.sent - len(answered),
            "duplicated": sum(n - 1 for n in per_index.values() if n > 1),
            "max_latency_s": round(max((a.latency_s for a in self.answers), default=0.0), 3),
        }


def flood(
    url: str,
    model: str,
    *,
    concurrency: int,
    duration_s: float,
    build: Any,
    client_timeout_s: float,
) -> list[Answer]:
    """``concurrency`` clients sending back to back for ``duration_s``, with no back-off."""
    load = Load(url, model, concurrency, 10**9, build=build, client_timeout_s=client_timeout_s)
    load.start()
    time.sleep(duration_s)
    load.stop()
    load.join(client_timeout_s + 10)
    return load.answers


def tally(answers: list[Answer]) -> dict[str, Any]:
    """Figures of a list of answers (as :meth:`Load.figures`, sent = answers recorded)."""
    load = Load("", "", 0, len(answers), answers=answers)
    load.sent = len(answers)
    return load.figures()
