"""What the batch tasks do: plan a job into shards, run one attempt of a shard, and finish
the job once its last shard is in (see :mod:`sluice.core.batch_jobs.batches` for the record
and the rules).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import orjson
from redis.exceptions import RedisError

from sluice.batch.feeder import Cancelled, Feeder, RequestFailed, ShardFailed
from sluice.batch.formats import (
    InputLimits,
    InputReader,
    JsonLinesReader,
    open_input,
    output_row_bytes,
    safe_name,
    shard_rows,
    write_part,
)
from sluice.batch.jsonl import answer_line, error_line, request_arrays
from sluice.batch.storage import Storage
from sluice.batch.stored import OverQuota, Reservation, StoredBytes
from sluice.core.batch_jobs import batches as b
from sluice.core.batch_jobs import turns
from sluice.core.batch_jobs import uploads as u
from sluice.core.batch_jobs.store import Tree
from sluice.core.batch_jobs.turns import SendPlan, Turns
from sluice.core.catalog import decode_entry
from sluice.core.clock import CLOCK
from sluice.core.config import ModelConfig
from sluice.core.errors import InvalidInput, SluiceError
from sluice.core.keys import Keys
from sluice.core.observability import statistics as st
from sluice.core.on_demand import wake_blocking
from sluice.core.redis_client.connect import connect
from sluice.core.settings import BatchSettings
from sluice.core.tenants import ANONYMOUS
from sluice.core.wire import MalformedEntry

log = logging.getLogger("batch")

SendShard = Callable[[str, int], None]

_FORGET_LEASE = """
-- KEYS: leases, in flight; ARGV: shard, its lease's end, now (unix s)
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then
    redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
  end
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""
"""The lease of a shard whose worker is gone is forgotten as the shard is sent again; in
the job's window, the shard counts as sent now (see :data:`b.DISPATCH`)."""

_PASSED_AT_ONCE = 1024
"""Most shards one :data:`b.DISPATCH` passes over (after a resume, the cursor walks over
the committed ones): Redis is never held long by one call."""


class Runner:
    def __init__(
        self, settings: BatchSettings, send_shard: SendShard, send_plan: SendPlan | None = None
    ) -> None:
        """``send_plan`` queues a job's plan task (resuming it): how the job next in its
        tenant's line starts as one ends; without it, a job that ends gives its turn back
        and another batch worker's periodic round starts the next."""
        self.settings = settings
        self.keys = Keys(settings.namespace)
        self.redis = connect(settings.redis_url, socket_timeout=10, socket_connect_timeout=5)
        self.storage = Storage(settings)
        self.send_shard = send_shard
        self.turns = Turns(self.redis, self.keys, settings.tenant_max_running_batches, send_plan)
        self._readers: dict[str, InputReader] = {}

    def close(self) -> None:
        self.storage.close()
        self.redis.close()

    # -- the record ----------------------------------------------------------------------

    def record(self, batch_id: str) -> dict[str, str]:
        raw = cast(dict[bytes, bytes], self.redis.hgetall(self.keys.batch(batch_id)))
        return {k.decode(): v.decode(errors="replace") for k, v in raw.items()}

    def give_up(self, batch_id: str, error: str) -> None:
        """End the job as failed after its planning task failed for good (best effort:
        Redis may be what failed)."""
        try:
            self._fail(batch_id, error[:4000])
        except RedisError as exc:
            log.error("batch %s: cannot record that it failed (%s): %s", batch_id, error, exc)

    def _fail(self, batch_id: str, error: str) -> None:
        log.warning("batch %s failed: %s", batch_id, error)
        self._end(batch_id, {b.F_STATUS: b.FAILED, b.F_ERROR: error})

    def _end(self, batch_id: str, fields: dict[str, str]) -> None:
        """The job's final status (and what goes with it); no longer running, and expiring
        ``SLUICE_BATCH_RETENTION_S`` from now. Its turn goes to its tenant's next job in
        line, which starts."""
        now = time.time()
        fields[b.F_FINISHED] = f"{now:.6f}"
        tenant = self._tenant(self.record(batch_id))
        member = u.expiry_member(u.BATCH, tenant, batch_id)
        values = [item for pair in fields.items() for item in pair]
        if not self.redis.eval(b.END, 1, self.keys.batch(batch_id), *values):
            log.info("batch %s: it ended already (cancelled, or stopped); it stays so", batch_id)
            return
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.srem(self.keys.running_batches, batch_id)
            pipe.delete(self.keys.batch_in_flight(batch_id))  # (a resume makes it anew)
            pipe.zadd(self.keys.store_expiry, {member: now + self.settings.batch_retention_s})
            pipe.execute()
        try:
            self.turns.leave(tenant, batch_id)
        except Exception as exc:
            log.warning(
                "batch %s: giving its turn on failed (the periodic round gives it): %s",
                batch_id,
                exc,
            )

    @staticmethod
    def _tenant(record: dict[str, str]) -> str:
        return record.get(b.F_OWNER) or ANONYMOUS

    @classmethod
    def _queue_tenant(cls, record: dict[str, str]) -> str:
        """Whose stream the requests go to ("": the anonymous tenant's, the base stream)."""
        tenant = cls._tenant(record)
        return "" if tenant == ANONYMOUS else tenant

    def _outputs(self, batch_id: str, record: dict[str, str]) -> Tree:
        return self.storage.output_tree(self._tenant(record), batch_id, record[b.F_OUTPUT])

    def _stored(self, batch_id: str, record: dict[str, str]) -> StoredBytes:
        """This batch's files counted against its tenant's stored bytes (those at a location
        of the client's own are not)."""
        return StoredBytes(
            self.redis,
            self.keys,
            self._tenant(record),
            batch_id,
            self.settings.tenant_max_stored_bytes,
            counted=not record[b.F_OUTPUT],
        )

    def _put(
        self,
        batch_id: str,
        record: dict[str, str],
        tree: Tree,
        name: str,
        source: Path,
        held: Reservation | None = None,
    ) -> int:
        """Put a finished scratch file in this batch's output tree as ``name``; its size.
        Counted against the tenant before it is put (``held``: what was counted while it
        was written), so that the stored bytes never pass the quota (nor two shards
        finishing together): OverQuota past it. A file that is not put is removed from the
        scratch folder and gives back what it counted."""
        stored = self._stored(batch_id, record)
        held = held or stored.reservation()
        try:
            replaced = (tree.size(name) or 0) if stored.counted else 0
            size = source.stat().st_size
            held.settle(size - replaced)
            tree.put_file(name, source)
        except BaseException:
            held.release()
            source.unlink(missing_ok=True)
            raise
        held.hand_over()
        if not stored.exists():  # removed as it was put: its files went before this one
            tree.delete(name)
            raise Cancelled(f"batch {batch_id} was removed")
        return size

    def _model(self, record: dict[str, str]) -> tuple[ModelConfig, int]:
        name = record[b.F_MODEL]
        raw = self.redis.hget(self.keys.catalog, name)
        if raw is None:
            raise InvalidInput(f"'model': no model '{name}' is served")
        try:
            entry = decode_entry(cast(bytes, raw))
        except MalformedEntry as exc:
            raise InvalidInput(f"'model': {exc}") from None
        if not entry.available or entry.config is None:
            raise InvalidInput(f"'model': model '{name}' is unavailable: {entry.error}")
        if entry.config.max_batch_size < 1:
            raise InvalidInput(f"'model': model '{name}' does not batch (max_batch_size 0)")
        version = int(record.get(b.F_VERSION) or 0) or max(entry.versions)
        if version not in entry.versions:
            raise InvalidInput(f"'version': model '{name}' does not serve version {version}")
        if entry.on_demand:  # (its rows wait in its stream while an executor loads it)
            wake_blocking(self.redis, self.keys, name, version)
        return entry.config, version

    def _reader(self, batch_id: str, record: dict[str, str], config: ModelConfig) -> InputReader:
        reader = self._readers.get(batch_id)
        if reader is None:
            options = b.BatchOptions(**json.loads(record[b.F_OPTIONS]))
            path = self.storage.input_file(
                self._tenant(record), record[b.F_INPUT], f"{batch_id}.{options.input_format}"
            )
            reader = open_input(
                path,
                options.input_format,
                config,
                options.input_name,
                InputLimits.of(self.settings),
            )
            self._readers = {batch_id: reader}  # one job's input at a time per worker
        return reader

    # -- planning ------------------------------------------------------------------------

    def plan(self, batch_id: str, resume: bool) -> None:
        """The job's plan task: plan it (``resume``: or resume it, when it was planned).
        From the moment it is taken until the job runs, listed among the running jobs
        with its window sent (or has ended), the record says so (:data:`turns.PLAN_TAKEN`):
        a batch worker killed in between leaves the mark, and the periodic round sends the
        plan task again once it is old (:data:`turns.RESEND`). A task that raises keeps the
        mark too (it is retried, or the job ends failed)."""
        key = self.keys.batch(batch_id)
        # A resume from now on queues a plan of its own: this one reads the job after.
        taken = f"{CLOCK.now():.3f}"
        marked = self.redis.eval(turns.PLAN_TAKEN, 1, key, taken, int(resume))
        self._plan(batch_id, resume)
        if marked:
            self.redis.eval(turns.PLAN_DONE, 1, key, taken)

    def _plan(self, batch_id: str, resume: bool) -> None:
        record = self.record(batch_id)
        if not record:
            return
        if resume:
            self._resume(batch_id, record)
            return
        if record.get(b.F_STATUS) != b.PLANNING:
            return  # planned already (a redelivered plan task)
        options = b.BatchOptions(**json.loads(record[b.F_OPTIONS]))
        try:
            config, version = self._model(record)
            self._outputs(batch_id, record)  # allowed, and a store when there is none
            _check_output_format(config, options.output_format)
            reader = self._reader(batch_id, record, config)
        except SluiceError as exc:
            self._fail(batch_id, exc.message)
            return
        # A shard's rows, inputs and outputs, are held in a batch worker's memory at once:
        # fewer rows than asked where they would be too many bytes (SLUICE_BATCH_MAX_SHARD_BYTES).
        bounded = shard_rows(
            options.shard_rows,
            reader.row_bytes + (output_row_bytes(config) if reader.row_bytes else 0),
            self.settings.batch_max_shard_bytes,
        )
        rows_per_shard = max(bounded, math.ceil(reader.rows / b.MAX_SHARDS) or 1)
        shards = math.ceil(reader.rows / rows_per_shard)
        planned: dict[str, str | int | bytes] = {
            b.F_STATUS: b.RUNNING,
            b.F_VERSION: version,
            b.F_ROWS_TOTAL: reader.rows,
            b.F_SHARDS: shards,
            b.F_SHARDS_DONE: 0,
            b.F_SHARDS_FAILED: 0,
            b.F_STARTED: f"{time.time():.6f}",
            b.F_NEXT_SHARD: 0,
            b.F_OPTIONS: orjson.dumps({**options.to_json(), "shard_rows": rows_per_shard}),
        }
        fields = [item for pair in planned.items() for item in pair]
        if not self.redis.eval(b.START, 1, self.keys.batch(batch_id), *fields):
            log.info("batch %s: cancelled while it was planned", batch_id)
            return
        # A cancel between the two leaves a stale member, which the reaper removes.
        self.redis.sadd(self.keys.running_batches, batch_id)
        log.info(
            "batch %s: %d rows in %d shard(s) of %d", batch_id, reader.rows, shards, rows_per_shard
        )
        if shards == 0:
            self._finish(batch_id)
            return
        self._top_up(batch_id, "as it was planned")

    def _resume(self, batch_id: str, record: dict[str, str]) -> None:
        """Queue again, within the job's window, every shard not committed yet that no
        worker holds (the gateway set the status to running); the others follow as shards
        end. A shard whose lease is live is being computed: it commits, or its lease runs
        out and the reaper queues it again."""
        if record.get(b.F_STATUS) != b.RUNNING or not record.get(b.F_SHARDS):
            if record.get(b.F_STATUS) == b.PLANNING:
                self._plan(batch_id, resume=False)
            return
        states = cast(dict[bytes, bytes], self.redis.hgetall(self.keys.batch_shards(batch_id)))
        committed = {int(k) for k, v in states.items() if b'"committed"' in v}
        failed = [k for k, v in states.items() if b'"error"' in v]
        if failed:
            self.redis.hdel(self.keys.batch_shards(batch_id), *failed)
            self.redis.hset(self.keys.batch(batch_id), b.F_SHARDS_FAILED, 0)
        left = [i for i in range(int(record[b.F_SHARDS])) if i not in committed]
        if not left:  # (cancelled while its outputs were written up: they are all there)
            log.info("batch %s resumed: every shard is committed", batch_id)
            self._finish(batch_id)
            return
        keys = self.keys
        CLOCK.sync_blocking(self.redis)  # (leases are written by batch workers on other hosts)
        rewound = self.redis.eval(
            b.REWIND,
            4,
            keys.batch(batch_id),
            keys.batch_shards(batch_id),
            keys.batch_leases(batch_id),
            keys.batch_in_flight(batch_id),
            min(left),
            f"{CLOCK.now():.3f}",
        )
        if not rewound:
            log.info("batch %s: stopped again before it was resumed", batch_id)
            return
        self.redis.sadd(keys.running_batches, batch_id)  # (resumed from its tenant's line)
        log.info("batch %s resumed: %d shard(s) not committed", batch_id, len(left))
        self._top_up(batch_id, "as it was resumed")

    def send_next(self, batch_id: str) -> int:
        """Fill the job's window (:data:`b.DISPATCH`): the shards that ended leave it, the
        next ones are sent, and so is one whose message was lost; how many were sent. Run
        as a shard ends, and for every running job by the batch workers' periodic round
        (:class:`Reaper`), which tops up a window a worker killed at the wrong moment left
        short."""
        keys = self.keys
        CLOCK.sync_blocking(self.redis)  # (the window is read by batch workers on other hosts)
        count, more = 0, True
        while more:
            reply = cast(
                list[int],
                self.redis.eval(
                    b.DISPATCH,
                    4,
                    keys.batch(batch_id),
                    keys.batch_shards(batch_id),
                    keys.batch_leases(batch_id),
                    keys.batch_in_flight(batch_id),
                    self.settings.batch_shards_in_flight,
                    f"{CLOCK.now():.3f}",
                    self.settings.batch_visibility_timeout_s,
                    _PASSED_AT_ONCE,
                ),
            )
            more = bool(reply[0])
            self._send(batch_id, [int(index) for index in reply[1:]])
            count += len(reply) - 1
        return count

    def _send(self, batch_id: str, shards: list[int]) -> None:
        """Queue ``shards``, now in the window. Those not queued when the broker refuses
        one count as sent long ago, so that the next round sends them again at once."""
        for number, index in enumerate(shards):
            try:
                self.send_shard(batch_id, index)
            except Exception:
                unsent = shards[number:]
                try:
                    self.redis.hset(
                        self.keys.batch_in_flight(batch_id),
                        items=[item for shard in unsent for item in (shard, 0)],
                    )
                except RedisError as exc:
                    log.warning("batch %s: %d shard(s) not sent: %s", batch_id, len(unsent), exc)
                raise

    def _top_up(self, batch_id: str, when: str) -> None:
        """:meth:`send_next`, best effort: the job is running, and a window left short (Redis
        or the broker out of reach for a moment) is topped up by the periodic round, so
        this task neither fails nor is retried for it."""
        try:
            self.send_next(batch_id)
        except Exception as exc:
            log.warning(
                "batch %s: sending shards %s failed (the periodic round sends them): %s",
                batch_id,
                when,
                exc,
            )

    # -- one shard -----------------------------------------------------------------------

    def shard(self, batch_id: str, index: int, transient_tries_left: bool) -> None:
        """Run one attempt of shard ``index``. A transient failure (Redis, storage) raises
        for Celery to retry; a permanent one marks the shard failed."""
        record = self.record(batch_id)
        if record.get(b.F_STATUS) != b.RUNNING:
            return
        options = b.BatchOptions(**json.loads(record[b.F_OPTIONS]))
        attempt = self._take(batch_id, index)
        if attempt <= 0:
            return  # a live attempt holds it, or it is done, or the batch stopped
        lease = LeaseKeeper(self, batch_id, index, attempt)
        try:
            self._attempt(batch_id, index, attempt, record, options, transient_tries_left, lease)
        finally:
            lease.stop()
            self._let_go(batch_id, index, attempt)

    def _let_go(self, batch_id: str, index: int, attempt: int) -> None:
        """Give up the lease of an attempt that stopped with its batch (cancelled), so that
        a resume sends the shard again at once (best effort: the lease runs out anyway)."""
        try:
            self._shard_script(b.LET_GO, batch_id, index, attempt)
        except RedisError as exc:
            log.warning("batch %s shard %d: giving up its lease failed: %s", batch_id, index, exc)

    def _take(self, batch_id: str, index: int) -> int:
        CLOCK.sync_blocking(self.redis)  # (its lease is read by batch workers on other hosts)
        now = f"{CLOCK.now():.3f}"
        return self._shard_script(b.TAKE, batch_id, index, now, self.settings.batch_shard_lease_s)

    def _attempt(
        self,
        batch_id: str,
        index: int,
        attempt: int,
        record: dict[str, str],
        options: b.BatchOptions,
        transient_tries_left: bool,
        lease: LeaseKeeper,
    ) -> None:
        try:
            config, version = self._model(record)
            if attempt > 1:
                self.redis.hincrby(self.keys.stats(config.name, version), st.BATCH_SHARD_RETRIES, 1)
            if attempt > options.max_retries + 1:
                raise InvalidInput(f"shard {index} was tried {attempt - 1} times; giving up")
            files, sizes, failed = self._run(
                batch_id, index, attempt, record, options, config, version, lease
            )
        except OverQuota as exc:
            self._shard_failed(batch_id, index, attempt, exc.message)
            self._stop(batch_id, f"shard {index}: {exc.message}")
            return
        except (ShardFailed, InvalidInput) as exc:
            self._shard_failed(batch_id, index, attempt, exc.message)
            return
        except Cancelled:
            log.info("batch %s shard %d: cancelled", batch_id, index)
            return
        except (OSError, SluiceError) as exc:
            if transient_tries_left:
                raise
            self._shard_failed(batch_id, index, attempt, str(getattr(exc, "message", exc)))
            return
        start = index * options.shard_rows
        end = min(start + options.shard_rows, int(record[b.F_ROWS_TOTAL]))
        state = orjson.dumps(
            {
                "committed": True,
                "attempt": attempt,
                "rows": [start, end],
                "files": files,
                "sizes": sizes,
                "rows_failed": failed.rows,
                "row_errors": failed.first,
            }
        )
        outcome = self._shard_script(b.COMMIT, batch_id, index, attempt, state)
        if outcome < 0:
            log.info(
                "batch %s shard %d attempt %d not committed (%d)", batch_id, index, attempt, outcome
            )
            self._withdraw(batch_id, record, sizes)
            return
        self.redis.hset(self.keys.batch_progress(batch_id), str(index), end - start)
        if outcome == 1:
            self._finish(batch_id)
        else:
            self._top_up(batch_id, f"after shard {index}")

    def _shard_script(self, script: str, batch_id: str, index: int, *args: Any) -> int:
        """One of :mod:`sluice.core.batch_jobs.batches`' shard scripts (KEYS: the batch, its shard
        states, attempts and leases; ARGV: the shard, then ``args``)."""
        keys = self.keys
        return int(
            cast(
                int,
                self.redis.eval(
                    script,
                    4,
                    keys.batch(batch_id),
                    keys.batch_shards(batch_id),
                    keys.batch_attempts(batch_id),
                    keys.batch_leases(batch_id),
                    str(index),
                    *args,
                ),
            )
        )

    def _withdraw(self, batch_id: str, record: dict[str, str], sizes: dict[str, int]) -> None:
        """Remove parts this attempt put in the output tree that will not be committed,
        giving back what they counted."""
        tree = self._outputs(batch_id, record)
        stored = self._stored(batch_id, record)
        for name, size in sizes.items():
            tree.delete(name)
            stored.charge(-size)

    def _stop(self, batch_id: str, error: str) -> None:
        """End the whole job as failed now (the tenant's quota is full): its other shards
        stop at their next check instead of computing what could not be written, and the
        shards it committed stay, readable and counted; resume runs the others."""
        self._fail(batch_id, error)

    def _shard_failed(self, batch_id: str, index: int, attempt: int, error: str) -> None:
        log.warning("batch %s shard %d failed: %s", batch_id, index, error)
        state = orjson.dumps({"error": error, "attempt": attempt})
        outcome = self._shard_script(b.FAIL_SHARD, batch_id, index, attempt, state)
        if outcome == 1:
            self._finish(batch_id)
        elif outcome == 0:
            self._top_up(batch_id, f"after shard {index}")

    def _run(
        self,
        batch_id: str,
        index: int,
        attempt: int,
        record: dict[str, str],
        options: b.BatchOptions,
        config: ModelConfig,
        version: int,
        lease: LeaseKeeper,
    ) -> tuple[dict[str, str], dict[str, int], RowErrors]:
        """Run the shard's rows; its files in the output tree (by output name: ``""`` for
        one file holding them all), their sizes, and the rows that failed on their own."""
        reader = self._reader(batch_id, record, config)
        start = index * options.shard_rows
        end = min(start + options.shard_rows, reader.rows)
        progress_key, field = self.keys.batch_progress(batch_id), str(index)
        stats = self.keys.stats(config.name, version)
        self.redis.hset(progress_key, field, 0)

        def progress(rows: int) -> None:
            with self.redis.pipeline(transaction=False) as pipe:
                pipe.hincrby(progress_key, field, rows)
                pipe.hincrby(stats, st.BATCH_ROWS, rows)
                pipe.execute()

        def cancelled() -> bool:
            if lease.superseded:
                return True
            return self.redis.hget(self.keys.batch(batch_id), b.F_STATUS) != b.RUNNING.encode()

        feeder = Feeder(
            self.redis,
            self.keys,
            config,
            version,
            self.keys.batch_reply_stream(batch_id, index, attempt),
            options.rows_per_request or config.max_batch_size,
            options.in_flight,
            options.request_timeout_s,
            f"batch-{batch_id[:8]}-{index}-{attempt}",
            progress,
            cancelled,
            tenant=self._queue_tenant(record),
        )
        scratch = f"{batch_id}-{index:06d}-a{attempt}"
        made: list[Path] = []

        def scratch_file(suffix: str) -> Path:
            path = self.storage.scratch_file(f"{scratch}.{suffix}")
            made.append(path)
            return path

        failed = RowErrors()
        held = self._stored(batch_id, record).reservation()
        files: dict[str, str] = {}
        sizes: dict[str, int] = {}
        try:
            try:
                if isinstance(reader, JsonLinesReader):
                    path = scratch_file("jsonl")
                    feeder.progress = lambda rows: None  # (a line is a row of the job)
                    with path.open("wb") as stream:  # (each answer written as it comes)
                        for number, request in reader.requests(start, end):
                            line = _answer(feeder, config, version, number, request, failed)
                            held.cover(stream.tell() + len(line) + 1)  # (counted first)
                            stream.write(line + b"\n")
                            progress(1)
                    written = {"": path}
                else:
                    outputs = feeder.run(reader.read(start, end))
                    if options.output_format == "npy":
                        for name, array in outputs.items():
                            if array.dtype == object:
                                raise InvalidInput(_NPY_BYTES.format(name=name))
                    written = write_part(options.output_format, outputs, scratch_file)
            finally:
                feeder.close()
            if cancelled():  # (stopped as its rows were computed: nothing more is put)
                raise Cancelled(f"batch {batch_id} stopped")
            tree = self._outputs(batch_id, record)
            for name, written_path in written.items():
                suffix = written_path.name.split(".", 1)[1]
                part = f"part-{index:06d}-a{attempt}.{suffix}"
                sizes[part] = self._put(
                    batch_id, record, tree, part, written_path, held if name == "" else None
                )
                files[name] = part
        except BaseException:
            # Nothing of a shard that stopped stays: not its scratch files, not the parts
            # it put, not what they counted.
            held.release()
            for path in made:
                path.unlink(missing_ok=True)
            if sizes:
                self._withdraw(batch_id, record, sizes)
            raise
        return files, sizes, failed

    # -- the end -------------------------------------------------------------------------

    def _finish(self, batch_id: str) -> None:
        record = self.record(batch_id)
        if int(record.get(b.F_SHARDS_FAILED) or 0):
            states = cast(dict[bytes, bytes], self.redis.hgetall(self.keys.batch_shards(batch_id)))
            errors = [
                f"shard {k.decode()}: {orjson.loads(v)['error']}"
                for k, v in sorted(states.items(), key=lambda kv: int(kv[0]))
                if b'"error"' in v
            ]
            self._fail(batch_id, "; ".join(errors)[:4000] or "a shard failed")
            return
        try:
            manifest, files = self._manifest(batch_id, record)
        except Cancelled:
            log.info("batch %s: stopped or removed while its outputs were written up", batch_id)
            return
        except (OSError, ValueError, SluiceError) as exc:
            self._fail(batch_id, f"writing the outputs failed: {getattr(exc, 'message', exc)}")
            return
        self._end(
            batch_id,
            {
                b.F_STATUS: b.COMPLETED,
                b.F_MANIFEST: manifest,
                b.F_FILES: orjson.dumps(files).decode(),
            },
        )
        log.info("batch %s completed: %s", batch_id, manifest)

    def _manifest(self, batch_id: str, record: dict[str, str]) -> tuple[str, list[dict[str, Any]]]:
        """Write the manifest (and for ``.npy`` output, the joined outputs); how the
        client names the manifest, and every file of the batch with its size. File names in
        the manifest are relative to the folder it is in."""
        states = cast(dict[bytes, bytes], self.redis.hgetall(self.keys.batch_shards(batch_id)))
        parts = [orjson.loads(states[k]) for k in sorted(states, key=int)]
        options = json.loads(record[b.F_OPTIONS])
        tree = self._outputs(batch_id, record)
        body: dict[str, Any] = {
            "batch": batch_id,
            "model": record[b.F_MODEL],
            "version": int(record[b.F_VERSION]),
            "input": record[b.F_INPUT],
            "rows": int(record[b.F_ROWS_TOTAL]),
            "format": options["output_format"],
            "rows_failed": sum(int(p.get("rows_failed", 0)) for p in parts),
            "parts": [{"rows": p["rows"], "files": p["files"]} for p in parts],
        }
        files = [
            {"name": name, "bytes": size}
            for p in parts
            for name, size in sorted(p.get("sizes", {}).items())
        ]
        if options["output_format"] == "npy" and parts:
            joined = self._join(batch_id, record, tree, parts, int(record[b.F_ROWS_TOTAL]))
            body["outputs"] = {name: file for name, (file, _) in joined.items()}
            files += [{"name": file, "bytes": size} for file, size in joined.values()]
        path = self.storage.scratch_file(f"{batch_id}-{b.MANIFEST}")
        path.write_bytes(orjson.dumps(body, option=orjson.OPT_INDENT_2))
        size = self._put(batch_id, record, tree, b.MANIFEST, path)
        return tree.join(b.MANIFEST), [{"name": b.MANIFEST, "bytes": size}, *files]

    def _join(
        self,
        batch_id: str,
        record: dict[str, str],
        tree: Tree,
        parts: list[dict[str, Any]],
        rows: int,
    ) -> dict[str, tuple[str, int]]:
        """Every output's parts joined, in input order, into ``<name>.npy`` of the output
        tree: output name -> (file, size). Parts on S3 are downloaded into the scratch
        folder first, one at a time. Never with pickle: a part file is read as plain
        numbers or refused (anyone who may write the output location could have replaced
        it)."""
        joined: dict[str, tuple[str, int]] = {}
        limit = self.settings.tenant_max_stored_bytes

        def path_of(key: str) -> Path:
            target = self.storage.scratch_file(f"part-{batch_id}-{safe_name(key)}")
            return tree.fetch(key, target, limit, "output")

        for name in parts[0]["files"]:
            first = np.load(path_of(parts[0]["files"][name]), mmap_mode="r")
            if first.dtype == object:
                raise InvalidInput(_NPY_BYTES.format(name=name))
            scratch = self.storage.scratch_file(f"join-{batch_id}-{safe_name(name)}.npy")
            shape = (rows, *first.shape[1:])
            held = self._stored(batch_id, record).reservation()
            try:
                # Counted before its scratch file is written (it is as large as the parts).
                held.cover(_NPY_HEADER_BYTES + math.prod(shape) * first.dtype.itemsize)
                target = np.lib.format.open_memmap(
                    scratch, mode="w+", dtype=first.dtype, shape=shape
                )
                for part in parts:
                    start, end = part["rows"]
                    source = path_of(part["files"][name])
                    target[start:end] = np.load(source, mmap_mode="r")
                    if not tree.is_local:
                        source.unlink(missing_ok=True)
                target.flush()
                del target
            except BaseException:
                held.release()
                Path(scratch).unlink(missing_ok=True)
                raise
            file = f"{safe_name(name)}.npy"
            joined[name] = (file, self._put(batch_id, record, tree, file, Path(scratch), held))
        return joined


_NPY_HEADER_BYTES = 4096
"""At least the header of a ``.npy`` file (numpy writes 64 to a few hundred bytes)."""

ROW_ERRORS_KEPT = 20
"""Failed rows a shard keeps the reasons of (the count covers them all)."""


@dataclass
class RowErrors:
    """The rows of a shard that failed on their own (JSON Lines: a line that is no request
    the model takes, or one the model answered with an error): their answers are errors
    in the output, the shard goes on, and the job reports them."""

    rows: int = 0
    first: list[dict[str, Any]] = field(default_factory=list)
    """``{"line", "reason"}`` of the first :data:`ROW_ERRORS_KEPT` (not ``error``: that
    key marks a failed shard's state)."""

    def add(self, line: int, error: str) -> None:
        self.rows += 1
        if len(self.first) < ROW_ERRORS_KEPT:
            self.first.append({"line": line, "reason": error[:1000]})


def _answer(
    feeder: Feeder,
    config: ModelConfig,
    version: int,
    line: int,
    request: Any,
    failed: RowErrors,
) -> bytes:
    """One JSON Lines row's answer: the v2 response, or the v2 error response when the line
    is no request the model takes or the model answered it with an error (that row alone
    fails). A request never answered, a cancel or Redis out of reach still stop the shard."""
    try:
        if isinstance(request, InvalidInput):
            raise request
        inputs = request_arrays(request, config, f"'input' line {line}")
        feeder.rows_per_request = max(len(next(iter(inputs.values()))), 1)
        return answer_line(request, config.name, version, feeder.run(inputs))
    except RequestFailed as exc:
        error = f"'input' line {line}: {exc.error}"
    except InvalidInput as exc:
        error = exc.message
    failed.add(line, error)
    return error_line(request, config.name, version, error)


_NPY_BYTES = (
    "output '{name}' is BYTES, which .npy holds only with pickle (never used here): "
    "choose 'options.output_format' parquet (or send JSON Lines)"
)


def _check_output_format(config: ModelConfig, output_format: str) -> None:
    """Refuse ``.npy`` output for a model with a BYTES output before any row runs."""
    if output_format != "npy":
        return
    for spec in config.outputs:
        if spec.datatype == "BYTES":
            raise InvalidInput(_NPY_BYTES.format(name=spec.name))


class LeaseKeeper:
    """Renews a shard attempt's lease every second on a thread of its own, so that a long
    read, write or upload does not lose it; notes when a newer attempt took over."""

    def __init__(self, runner: Runner, batch_id: str, index: int, attempt: int) -> None:
        self.runner, self.batch_id, self.index, self.attempt = runner, batch_id, index, attempt
        self.superseded = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shard-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        keys, lease_s = self.runner.keys, self.runner.settings.batch_shard_lease_s
        while not self._stop.wait(1.0):
            try:
                renewed = self.runner.redis.eval(
                    b.RENEW,
                    2,
                    keys.batch_attempts(self.batch_id),
                    keys.batch_leases(self.batch_id),
                    str(self.index),
                    self.attempt,
                    f"{CLOCK.now() + lease_s:.3f}",
                )
            except RedisError as exc:
                log.warning("renewing the lease of shard %d failed: %s", self.index, exc)
                continue
            if not renewed:
                self.superseded = True
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class Reaper:
    """Gives the shards of dead workers to live ones: every few seconds (:attr:`every_s`), a
    shard of a running batch whose lease ran out is queued again (once per attempt,
    whichever worker sees it first). The broker would redeliver it too, but only after its
    visibility timeout. The same round tops up every running batch's window
    (:meth:`Runner.send_next`): a worker killed between a shard's commit and sending the
    next leaves it short, and nothing else would send that next shard; and it moves the
    tenants' turns (:meth:`Turns.sweep`): a job that ended without giving its turn on (its
    worker killed then) gives it now, a job given a turn that did not start starts, one a
    gateway left out of its tenant's turns and line goes in, and one whose plan task's
    worker was killed before it ran gets its plan task again."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    @property
    def every_s(self) -> float:
        return max(1.0, self.runner.settings.batch_shard_lease_s / 3)

    def sweep(self) -> None:
        try:
            self._leases()
        finally:
            self.runner.turns.sweep()

    def _leases(self) -> None:
        runner, keys = self.runner, self.runner.keys
        redis = runner.redis
        CLOCK.sync_blocking(redis)  # (leases are written by batch workers on other hosts)
        now = CLOCK.now()
        ttl = int(runner.settings.batch_shard_lease_s * 10)
        for raw in cast(set[bytes], redis.smembers(keys.running_batches)):
            batch_id = raw.decode()
            if redis.hget(keys.batch(batch_id), b.F_STATUS) != b.RUNNING.encode():
                redis.srem(keys.running_batches, batch_id)
                continue
            leases = cast(dict[bytes, bytes], redis.hgetall(keys.batch_leases(batch_id)))
            for shard, until in leases.items():
                if float(until) > now:
                    continue
                raw_attempt = cast(bytes | None, redis.hget(keys.batch_attempts(batch_id), shard))
                attempt = (raw_attempt or b"0").decode()
                marker = f"{keys.batch(batch_id)}:resent:{shard.decode()}:{attempt}"
                if redis.set(marker, 1, nx=True, ex=ttl):
                    # The lease is forgotten (unless the shard was taken meanwhile): the
                    # shard waits in the queue, and its next attempt takes a lease of its own.
                    redis.eval(
                        _FORGET_LEASE,
                        2,
                        keys.batch_leases(batch_id),
                        keys.batch_in_flight(batch_id),
                        shard,
                        until,
                        f"{now:.3f}",
                    )
                    log.warning(
                        "batch %s shard %s: its worker is gone; queued again",
                        batch_id,
                        shard.decode(),
                    )
                    runner.send_shard(batch_id, int(shard))
            runner.send_next(batch_id)
