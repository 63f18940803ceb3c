"""A decoupled ensemble's request: the steps after a decoupled model run again for each of
its responses, and the ensemble answers each time its requested outputs are complete.

Each ensemble tensor value has a key: the request's own inputs have the key ``()``; a
step that answers once gives its outputs the key of the inputs it read; the ``r``-th
response of a decoupled step run at key ``k`` gives its outputs the key ``k + (r,)``. A
step runs once for each key at which every tensor it reads has a value, and the ensemble
answers once for each key at which every requested output has one (the load made sure no
step reads the responses of different decoupled models together:
:func:`sluice.workers.backends.ensemble_check.composing_configs`). This is Triton's
ensemble scheduler, whose tensors count the responses instead; the key also keeps apart
the responses of two branches that finish out of order.

The ensemble's responses go out in the order of their keys, that is, in the order the
decoupled models sent the responses they come from, even when later steps finish out of
order: a response waits while a step runs at an earlier key that could still answer
(Triton sends them as they finish). The last one is the final response; when the last
step to finish answers nothing (a decoupled model's empty final response), the final
response has no outputs.

Tensor values are dropped once every step that reads them has started and the response
that carries them is made, so a long stream holds only what is still to be used.

A decoupled model faster than the steps after it is held back, as Triton's
``max_inflight_requests`` holds it (the ensemble's ``in_flight``, per step and instance): it
takes its next response only once every step its last one started has been let in by its
step's bound, and while no more than ``in_flight`` responses wait for an earlier one to be
sent. Meanwhile its responses wait in its call's bounded queue
(:data:`sluice.core.dispatch.STREAM_BACKLOG`; past it the request fails, not the worker's
memory). It waits only while a step of the request that is let in and not itself waiting so
still runs: one whose end makes room. When none does (a decoupled step further on holds the
only place, or the steps ahead are another request's), they all go on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from sluice.core.config import EnsembleStep, ModelConfig
from sluice.core.errors import SluiceError
from sluice.workers.backends.base import RequestContext
from sluice.workers.backends.ensemble_graph import Carried

Key = tuple[int, ...]
Answer = dict[str, np.ndarray]


class StepBound:
    """The places of one step's model for one ensemble instance (``max_inflight_requests``):
    an ``async with`` takes one, waiting while none is free."""

    def __init__(self, places: int) -> None:
        self.places = places
        self.held = 0
        self._semaphore = asyncio.Semaphore(places)

    @property
    def free(self) -> bool:
        """Whether a place is free (one just given back counts as free until its next
        holder goes in)."""
        return self.held < self.places

    async def __aenter__(self) -> None:
        await self._semaphore.acquire()
        self.held += 1

    async def __aexit__(self, *exc_info: object) -> None:
        self.held -= 1
        self._semaphore.release()


class Steps(Protocol):
    """What a stream needs of its ensemble (:class:`~sluice.workers.backends.
    ensemble_backend.EnsembleBackend`)."""

    config: ModelConfig
    steps: tuple[EnsembleStep, ...]
    step_configs: list[ModelConfig]
    in_flight: int
    """Requests one instance has in flight to each step's model."""

    def live(self, outputs: Sequence[str]) -> frozenset[int]: ...

    def where(self, index: int) -> str: ...

    def inputs_of(
        self, index: int, carried: Mapping[str, Carried], context: RequestContext
    ) -> tuple[dict[str, np.ndarray], int]: ...

    def limit(self, index: int) -> StepBound: ...

    async def submit(
        self, index: int, reads: dict[str, np.ndarray], context: RequestContext
    ) -> Answer: ...

    def submit_stream(
        self, index: int, reads: dict[str, np.ndarray], context: RequestContext
    ) -> Any: ...

    def answer(self, outputs: Sequence[str], made: Sequence[Carried]) -> Answer: ...


class EnsembleStream:
    """One request through a decoupled ensemble. ``partial`` is handed each response but
    the final one, as soon as it may go; :meth:`run` returns the final one (None: a final
    response without outputs)."""

    def __init__(
        self,
        ensemble: Steps,
        outputs: Sequence[str],
        context: RequestContext,
        partial: Callable[[Answer], None],
    ) -> None:
        self._ensemble = ensemble
        self._outputs = list(outputs)
        self._context = context
        self._partial = partial
        self._live = sorted(ensemble.live(outputs))
        self._values: dict[str, dict[Key, Carried]] = {}
        self._readers: Counter[str] = Counter()
        """Who uses each tensor: the live steps that read it, and the answer."""
        for index in self._live:
            for tensor in set(ensemble.steps[index].input_map.values()):
                self._readers[tensor] += 1
        for name in self._outputs:
            self._readers[name] += 1
        self._used: Counter[tuple[str, Key]] = Counter()
        self._started: set[tuple[int, Key]] = set()
        self._answered: set[Key] = set()
        self._tasks: dict[asyncio.Task[None], Key] = {}
        """The steps running, and the key each runs at."""
        self._step_of: dict[asyncio.Task[None], int] = {}
        """The step each of them runs."""
        self._finished: asyncio.Queue[asyncio.Task[None]] = asyncio.Queue()
        self._ready: dict[Key, Answer] = {}
        """Responses made and not yet sent (an earlier one may still come)."""
        self._held: Answer | None = None
        """The response that is the final one, unless another comes after all."""
        self._working: set[asyncio.Task[Any]] = set()
        """Steps let in by their step's bound and not yet finished."""
        self._holding: set[asyncio.Task[Any]] = set()
        """Decoupled steps that wait before taking their next response."""
        self._room = asyncio.Event()
        """Set whenever what holds a decoupled step back may have changed."""

    async def run(self, inputs: Mapping[str, np.ndarray], batch: int) -> Answer | None:
        for spec in self._ensemble.config.inputs:  # an optional input not given: no tensor
            self._record(spec.name, (), Carried(inputs.get(spec.name), batch))
        for name, array in inputs.items():
            if () not in self._values.get(name, {}):
                self._record(name, (), Carried(array, batch))
        self._advance(())
        try:
            while self._tasks:
                task = await self._finished.get()
                del self._tasks[task]
                del self._step_of[task]
                self._room.set()
                error = task.exception()
                if error is not None:
                    raise error
                self._send(None, last=True)
            self._send(None, last=True)
            return self._held
        finally:
            for task in self._tasks:
                task.cancel()

    # -- tensors and steps -----------------------------------------------------------------

    def _record(self, tensor: str, key: Key, carried: Carried) -> None:
        if self._readers[tensor]:
            self._values.setdefault(tensor, {})[key] = carried

    def _take(self, tensor: str, key: Key) -> Carried:
        """The value of ``tensor`` at ``key`` for one of its users (the last one drops it)."""
        values = self._values[tensor]
        carried = values[key]
        self._used[tensor, key] += 1
        if self._used[tensor, key] >= self._readers[tensor]:
            del values[key]
            del self._used[tensor, key]
        return carried

    def _has(self, tensor: str, key: Key) -> bool:
        return key in self._values.get(tensor, {})

    def _advance(self, key: Key) -> None:
        """Start the steps that can run at ``key`` now, and make its response if complete."""
        steps = self._ensemble.steps
        for index in self._live:
            if (index, key) in self._started:
                continue
            tensors = set(steps[index].input_map.values())
            if all(self._has(tensor, key) for tensor in tensors):
                self._started.add((index, key))
                carried = {tensor: self._take(tensor, key) for tensor in tensors}
                task = asyncio.create_task(self._step(index, key, carried))
                task.add_done_callback(self._finished.put_nowait)
                self._tasks[task] = key
                self._step_of[task] = index
        if key not in self._answered and all(self._has(name, key) for name in self._outputs):
            self._answered.add(key)
            made = [self._take(name, key) for name in self._outputs]
            self._ready[key] = self._ensemble.answer(self._outputs, made)

    async def _step(self, index: int, key: Key, carried: Mapping[str, Carried]) -> None:
        ensemble, context = self._ensemble, self._context
        reads, batch = ensemble.inputs_of(index, carried, context)
        try:
            async with self._admitted(ensemble.limit(index)):
                if not ensemble.step_configs[index].decoupled:
                    answer = await ensemble.submit(index, reads, context)
                    self._made(index, key, answer, batch, last=True)
                    return
                sent = 0
                responses = ensemble.submit_stream(index, reads, context)
                async for answer, final in responses:
                    if answer:  # (a final response may carry nothing: no values then)
                        self._made(index, (*key, sent), answer, batch, last=final)
                        sent += 1
                    elif final:
                        self._send(asyncio.current_task(), last=True)
                    if not final:
                        await self._hold_back()
        except SluiceError as exc:
            raise type(exc)(f"{ensemble.where(index)}: {exc.message}") from None

    def _made(self, index: int, key: Key, answer: Answer, batch: int, *, last: bool) -> None:
        for name, tensor in self._ensemble.steps[index].output_map.items():
            self._record(tensor, key, Carried(answer.get(name), batch))
        self._advance(key)
        self._send(asyncio.current_task(), last=last)

    @contextlib.asynccontextmanager
    async def _admitted(self, bound: StepBound) -> AsyncIterator[None]:
        """``bound`` held, the step counted as working meanwhile."""
        me = asyncio.current_task()
        assert me is not None
        async with bound:
            self._working.add(me)
            try:
                yield
            finally:
                self._working.discard(me)
                self._room.set()

    async def _hold_back(self) -> None:
        """Wait (a decoupled step, before its next response) while the steps its responses
        started queue at their bounds or too many responses wait to be sent, as long as a
        step that is let in and not waiting so still runs."""
        me = asyncio.current_task()
        assert me is not None
        self._holding.add(me)
        self._room.set()  # (the others may now all be waiting)
        try:
            while self._crowded():
                self._room.clear()
                await self._room.wait()
        finally:
            self._holding.discard(me)

    def _crowded(self) -> bool:
        queued = [t for t in self._tasks if not t.done() and t not in self._working]
        if not queued and len(self._ready) <= self._ensemble.in_flight:
            return False
        if any(t not in self._holding for t in self._working):
            return True  # (its end makes room)
        limit = self._ensemble.limit
        return any(limit(self._step_of[t]).free for t in queued)  # (it goes in)

    # -- responses -------------------------------------------------------------------------

    def _send(self, current: asyncio.Task[Any] | None, *, last: bool) -> None:
        """Send the responses that may go now, in key order. The last of them is held as
        the final one when nothing else can follow: no step runs but ``current`` (the one
        that just made it, if any), and that one has made its ``last``."""
        done = current if last else None  # (it answers nothing more)
        while self._ready:
            key = min(self._ready)
            if self._waits_for_earlier(key, done):
                return
            response = self._ready.pop(key)
            self._room.set()
            if self._held is not None:
                self._partial(self._held)
                self._held = None
            running = [t for t in self._tasks if t is not current and not t.done()]
            if not self._ready and not running and last:
                self._held = response
            else:
                self._partial(response)

    def _waits_for_earlier(self, key: Key, done: asyncio.Task[Any] | None) -> bool:
        """Whether a step still runs at a key before ``key`` that could answer before it
        (a decoupled step whose responses lead to ``key`` itself answers later ones only;
        ``done`` has made all it makes)."""
        for task, running_at in self._tasks.items():
            if task is done or task.done() or running_at >= key:
                continue
            if key[: len(running_at)] != running_at:
                return True
        return False
