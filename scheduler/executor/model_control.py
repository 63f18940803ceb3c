"""Model control in the executor (``sluice up``): load and unload while serving.

Gateways put each ``POST /v2/repository/models/{m}/load`` or ``/unload`` on a Redis stream,
and so does the leading controller for what it decides (poll mode, rollouts); each sender
waits for the answers on a list of the command's own. Every executor of the deployment (one
per host) reads every command and carries it out on its host, and keeps its place among the
live executors, whose answers a sender waits for (:mod:`sluice.core.control`). ``sluice up``
carries commands out one at a time, from its main loop, without blocking it:

- a command from a controller carries its fencing token; one older than a token already seen
  was sent by a controller that has been replaced since, and is refused;
- for a remote repository (S3), a load first brings the local copy up to date (on a thread),
  so that whichever controller decided the load, the executor loads what it decided on;

- **load**: start the model's workers (from its directory, or a staged copy with the
  request's overrides), wait until each has announced itself, then publish the model in
  the catalog and retire the workers of what it replaces. A load that changes only the
  instances of a loaded model updates it instead (:mod:`.instance_update`): only the
  missing workers start, and those beyond the new count are retired. A worker that exits
  while loading is started again as often as ``--model-load-retry-count`` allows (the
  supervisor does it); a load that fails after that (the
  configuration, the model file, a failing warm-up, a timeout) kills the new workers at
  once and leaves what was serving as it was; the answer says why. The new workers report a load
  failure to a hash of the command's own, so the serving version is never marked
  unavailable by its failed successor. A model that was not serving is then listed as
  Triton lists it (:meth:`ModelControl._set_failed`): ``UNAVAILABLE`` with the reason, until
  a load succeeds or an unload clears it.
- **unload**: take the model out of the catalog, wait until every live gateway reports that
  it holds the new catalog (then none admits the model's requests any more,
  :mod:`sluice.core.catalog_applied`), then until its streams are empty (every request
  admitted is answered), then stop its workers (each answers what it holds first; one
  still running ``SLUICE_WORKER_STOP_GRACE_S`` later is killed, :mod:`.leaving`). The
  workers of versions a load no longer serves are stopped the same way.

An ensemble's load also loads the models it calls, and its unload with
``unload_dependents`` unloads them (:mod:`.dependencies`). With model namespacing, a load or
unload naming a name several repositories hold applies to each copy
(:mod:`.namespaced_commands`).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

from redis import Redis
from redis.exceptions import RedisError

from sluice.core.catalog import UNLOADED
from sluice.core.catalog_applied import CATCH_UP_S, lagging_gateways, published_revision
from sluice.core.clock import CLOCK
from sluice.core.control import (
    EXECUTOR_TTL_S,
    REGISTER_EXECUTOR,
    ControlCommand,
    newest_command,
    read_commands,
    send_reply,
    trim_commands,
)
from sluice.core.errors import InvalidConfig, SluiceError
from sluice.core.keys import Keys, load_error_field
from sluice.core.queue_streams import base_streams, tenant_members_sync, with_tenants
from sluice.core.repository import (
    DUPLICATE_REASON,
    RepositoryModel,
    ambiguous_models,
    available_versions,
    duplicate_names,
    read_model,
)
from sluice.core.repository_namespaces import Namespaces, link_record, read_namespaces
from sluice.core.settings import DEFAULT_MAX_BATCH_SIZE
from sluice.scheduler.executor.dependencies import Groups, loads_first, unloads_after
from sluice.scheduler.executor.instance_update import (
    Fingerprint,
    fingerprint,
    instances_only,
    plan,
)
from sluice.scheduler.executor.loaded_as import forget_load, remember_load
from sluice.scheduler.executor.namespaced_commands import internal_named, on_each_copy
from sluice.scheduler.executor.snapshot import Snapshots
from sluice.scheduler.executor.supervisor import Child, ChildSpec, Supervisor
from sluice.scheduler.repository.staging import check_model_name, stage

log = logging.getLogger("sluice.up")

_DRAIN_TIMEOUT_S = 60.0
"""After unpublishing a model, retire its workers this long later even if its streams
still hold requests."""
_APPEND_GRACE_S = 0.5
"""Once every live gateway has applied the change, wait this long more before judging the
streams: a request a gateway matched to the model before its refresh may still be on its
way into a stream (an append takes milliseconds; this allows a busy event loop)."""

WorkerSpecs = Callable[[RepositoryModel, Path, dict[str, str]], list[ChildSpec]]


@dataclass
class _Unpublished:
    """A catalog change that took a model, or some of its versions, away: a gateway that
    has not applied it yet may still admit their requests, so their streams are judged
    empty only once every live gateway reports its revision (or a later one)."""

    since: float
    """When it was published (``time.monotonic()``)."""
    revision: int | None = None
    """The catalog's revision once the change was published, read at the first look (it
    may be a later one: the revision only grows); None: no catalog in Redis, nothing to
    wait for."""
    read: bool = False
    applied_at: float | None = None
    """When every live gateway had reported it (or :data:`CATCH_UP_S` passed)."""


@dataclass
class _InProgress:
    command: ControlCommand
    deadline: float
    children: list[Child]
    model: RepositoryModel | None = None
    phase: str = "starting"
    """``fetching`` (a remote repository), ``starting``, ``draining``, ``stopping``."""
    unpublished: _Unpublished | None = None
    """An unload's change of the catalog (phase ``draining``)."""
    errors_key: str = ""
    kept: list[Child] = field(default_factory=list)
    """Workers of the model already serving that go on serving it (versions unchanged)."""
    fetch: threading.Thread | None = None
    fetch_error: str | None = None
    files: Fingerprint = frozenset()
    """The files the new workers load (:func:`.instance_update.fingerprint`)."""


@dataclass
class ModelControl:
    client: Redis
    keys: Keys
    repository: Path
    staging_root: Path
    supervisor: Supervisor
    worker_specs: WorkerSpecs
    env: dict[str, str]
    timeout_s: float
    loaded: dict[str, tuple[RepositoryModel, list[Child]]]
    on_change: Callable[[], None]
    """Called after the set of loaded models changed (publishes the catalog)."""
    refresh: Callable[[], None] | None = None
    """Brings the local copy of a remote repository up to date (raises SourceError)."""
    config_name: str = ""
    """The deployment's custom configuration name
    (:func:`~sluice.core.repository.config_source`)."""
    default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    """What autocomplete gives a model that can batch (SLUICE_DEFAULT_MAX_BATCH_SIZE)."""
    snapshots: Snapshots | None = None
    """Where the loaded models are kept for the next start (SLUICE_SNAPSHOT_DIR)."""
    executor_id: str = field(
        default_factory=lambda: f"{socket.gethostname()}-{uuid.uuid4().hex[:12]}"
    )
    """This executor among the live ones (``Keys.executors``)."""
    _last_id: str = "0-0"
    _present_due: float = 0.0
    _trim_due: float = 0.0
    _newest_token: int = 0
    """The newest fencing token seen on a controller's command."""
    _queue: list[ControlCommand] = field(default_factory=list)
    _current: _InProgress | None = None
    _draining: list[tuple[RepositoryModel, list[Child], _Unpublished]] = field(default_factory=list)
    """Versions no longer served, with their workers, until their streams are empty."""
    _files: dict[str, Fingerprint] = field(default_factory=dict)
    """The files each loaded model's workers loaded, to tell an update from a reload."""
    _groups: Groups = field(default_factory=Groups)
    """Commands of this executor's own that carry out one client's together
    (:mod:`.dependencies`: an ensemble and the models it calls)."""
    known: set[str] = field(default_factory=set)
    """The models unloaded, or whose load failed: Triton keeps their names known
    (:attr:`sluice.core.catalog.CatalogEntry.once_loaded`). Those since this executor
    started, and those the live executors' catalog listed so when it joined them
    (:func:`~sluice.scheduler.executor.start_loads.known_to_others`)."""
    _failed: dict[str, tuple[RepositoryModel, dict[int, str]]] = field(default_factory=dict)
    """The models of the repository not serving whose last load failed, as the catalog lists
    them, each with why each version it tried is unavailable (in ``Keys.load_errors``; none:
    the model's ``error`` says why)."""

    def start(self) -> None:
        """Join the live executors, reading the commands sent from now on (those sent
        before were answered by the others, or given up)."""
        self._last_id = newest_command(self.client, self.keys.control_requests)
        self._files = {name: fingerprint(model.path) for name, (model, _) in self.loaded.items()}
        self._present(time.monotonic())

    def leave(self) -> None:
        """No longer among the live executors (senders stop waiting for this one)."""
        with contextlib.suppress(RedisError):
            self.client.zrem(self.keys.executors, self.executor_id)

    def _present(self, now: float) -> None:
        """Renew this executor's place among the live ones; now and then, drop the
        commands every sender has given up on."""
        if now < self._present_due:
            return
        self._present_due = now + EXECUTOR_TTL_S / 3
        self.client.eval(
            REGISTER_EXECUTOR, 1, self.keys.executors, self.executor_id, EXECUTOR_TTL_S
        )
        reasons = _fields(self._failed)
        if reasons:  # (again: an executor that starts clears them, as does a Redis restart)
            self.client.hset(self.keys.load_errors, mapping=reasons)  # type: ignore[arg-type]
        if now >= self._trim_due:
            self._trim_due = now + 60.0
            trim_commands(self.client, self.keys.control_requests)

    @property
    def busy(self) -> bool:
        """A command is queued or under way, or a version drains: tick often until done."""
        return bool(self._current is not None or self._queue or self._draining)

    def catalog(self) -> list[RepositoryModel]:
        """The loaded models, every other model of the repository as unloaded (or as its
        last load failed, when it did); in a
        view joining several repositories, a name two or more of them hold as unavailable
        with Triton's reason (as Triton's index shows it in every mode), or with model
        namespacing, as ambiguous (its copies listed each under its internal name)."""
        models = {name: model for name, (model, _) in self.loaded.items()}
        if self.repository.is_dir():
            namespaces = self._namespaces()
            for path in self.repository.iterdir():
                if path.is_dir() and not path.name.startswith(".") and path.name not in models:
                    own = path.name if namespaces is None else namespaces.name_of(path.name)
                    listed_as = own if own != path.name else ""
                    namespace = "" if namespaces is None else namespaces.repository_of(path.name)
                    failed = self._failed.get(path.name)
                    models[path.name] = (
                        replace(
                            failed[0], listed_as=listed_as, namespace=namespace, once_loaded=True
                        )
                        if failed is not None
                        else RepositoryModel(
                            path.name,
                            path,
                            None,
                            (),
                            UNLOADED,
                            listed_as,
                            namespace=namespace,
                            once_loaded=path.name in self.known,
                        )
                    )
            try:
                duplicates = duplicate_names(self.repository)
            except InvalidConfig as exc:
                log.warning("model control: %s", exc.message)
                duplicates = []
            for name in duplicates:
                if name not in models:
                    path = self.repository / name
                    models[name] = RepositoryModel(name, path, None, (), DUPLICATE_REASON)
            for model in ambiguous_models(self.repository, namespaces, set(models)):
                models[model.name] = model
        return [models[name] for name in sorted(models)]

    def _namespaces(self) -> Namespaces | None:
        """The repository's record of namespaces (model namespacing), None without."""
        try:
            return read_namespaces(self.repository)
        except InvalidConfig as exc:
            log.warning("model control: %s", exc.message)
            return None

    def tick(self) -> None:
        try:
            self._present(time.monotonic())
            self._retire_drained()
            self._read()
            if self._current is None and self._queue:
                self._begin(self._queue.pop(0))
            if self._current is not None:
                self._progress(self._current)
        except RedisError as exc:
            log.warning("model control: Redis: %s", exc)

    # -- commands ------------------------------------------------------------------------

    def _read(self) -> None:
        self._last_id, commands = read_commands(
            self.client, self.keys.control_requests, self._last_id
        )
        self._queue += commands

    def _reply(self, command: ControlCommand, error: str | None) -> None:
        if error is None:
            log.info("model control: %s of '%s' done", command.op, command.model)
        else:
            log.warning("model control: %s of '%s' failed: %s", command.op, command.model, error)
        if self._groups.owns(command):
            settled = self._groups.settle(command, error, self._queue)
            if settled is None:
                return
            whole, whole_error = settled
            if whole_error is not None and whole.op == "load" and whole.model != command.model:
                # An ensemble not begun: a model it calls failed to load (said why).
                self._fail_model(whole.model, error or whole_error)
            command, error = whole, whole_error
        send_reply(self.client, self.keys, command.command_id, error, self.executor_id)

    # -- failed loads --------------------------------------------------------------------

    def _fail_model(self, name: str, reason: str) -> None:
        """A load of ``name`` failed before any of its workers started (its configuration
        or files as read, its versions, its copy from a remote repository, a model it calls):
        listed ``UNAVAILABLE`` with ``reason``, as a model whose configuration cannot be read
        is listed from the start."""
        self._set_failed(RepositoryModel(name, self.repository / name, None, (), reason), {})

    def _set_failed(self, model: RepositoryModel, reasons: dict[int, str]) -> None:
        """The load of ``model`` failed: unless one of its versions serves (a failed reload
        keeps what serves, as in Triton) or it is no model of the repository, the catalog
        lists it so from now on, as Triton's repository index does (``UNAVAILABLE``, each
        version tried with its reason: ``reasons``, kept where the workers report theirs,
        ``Keys.load_errors``), and the gateways answer it with Triton's texts for a model
        whose load failed. Until a load succeeds, or an unload clears it."""
        name = model.name
        if name in self.loaded or not (self.repository / name).is_dir():
            return
        before = list(_fields({name: self._failed[name]})) if name in self._failed else []
        fields = _fields({name: (model, reasons)})
        with self.client.pipeline(transaction=False) as pipe:
            if before:
                pipe.hdel(self.keys.load_errors, *before)
            if fields:
                pipe.hset(self.keys.load_errors, mapping=fields)  # type: ignore[arg-type]
            pipe.execute()
        self._failed[name] = (replace(model, path=self.repository / name), reasons)
        self.known.add(name)
        self.on_change()

    def _clear_failed(self, name: str) -> bool:
        """``name`` no longer failed (loaded, or unloaded): whether it had."""
        before = self._failed.pop(name, None)
        fields = _fields({name: before}) if before is not None else {}
        if fields:
            self.client.hdel(self.keys.load_errors, *fields)
        return before is not None

    def _in_group(self, command: ControlCommand, parts: list[ControlCommand]) -> None:
        """Carry ``command`` out as ``parts``, from the next tick on."""
        self._groups.add(command, parts)
        self._queue[0:0] = parts
        log.info(
            "model control: %s of '%s' with %s",
            command.op,
            command.model,
            ", ".join(f"'{part.model}'" for part in parts if part.model != command.model),
        )

    def _repository_model(self, name: str) -> RepositoryModel | None:
        folder = self.repository / name
        if not folder.is_dir():
            return None
        return read_model(
            folder, self.config_name, default_max_batch_size=self.default_max_batch_size
        )

    def _begin(self, command: ControlCommand) -> None:
        deadline = time.monotonic() + self.timeout_s
        if command.token:
            if command.token < self._newest_token:
                self._reply(
                    command,
                    f"refused: sent by a controller that no longer leads (token "
                    f"{command.token}, newest {self._newest_token})",
                )
                return
            self._newest_token = command.token
        try:
            check_model_name(command.model)
            if self._internal_named(command):
                missing = f"failed to load '{command.model}', failed to poll from model repository"
                self._reply(command, missing if command.op == "load" else None)
            elif command.op == "unload":
                self._begin_unload(command, deadline)
            elif command.op != "load":
                self._reply(command, f"'{command.op}' is the controller's to carry out")
            elif self.refresh is not None and not self._groups.owns(command):
                self._begin_fetch(command, deadline)  # (a group's parts: fetched already)
            else:
                self._begin_load(command, deadline)
        except SluiceError as exc:
            self._reply(command, exc.message)

    def _begin_fetch(self, command: ControlCommand, deadline: float) -> None:
        work = _InProgress(command, deadline, [], phase="fetching")
        refresh = self.refresh
        assert refresh is not None

        def fetch() -> None:
            try:
                refresh()
            except Exception as exc:  # reported as the load's failure
                work.fetch_error = str(getattr(exc, "message", exc))

        work.fetch = threading.Thread(target=fetch, name="repository-fetch", daemon=True)
        work.fetch.start()
        self._current = work

    def _internal_named(self, command: ControlCommand) -> bool:
        """Whether a client's load or unload names a copy of a name several repositories
        hold by Sluice's own name for it (model namespacing)."""
        if command.op not in ("load", "unload") or self._groups.owns(command):
            return False
        return internal_named(command, self._namespaces())

    def _on_each_copy(self, command: ControlCommand) -> bool:
        """Carry a client's load or unload of a name several repositories hold out on each
        copy (model namespacing); False for any other command (a controller's name the
        view's models as they are)."""
        if self._groups.owns(command) or command.token:
            return False
        loaded = {name: model for name, (model, _) in self.loaded.items()}
        parts = on_each_copy(command, self._namespaces(), loaded, self._repository_model)
        if parts:
            self._in_group(command, parts)
        return bool(parts)

    def _begin_load(self, command: ControlCommand, deadline: float) -> None:
        if self._on_each_copy(command):
            return
        name = command.model
        source = self.repository / name
        current = self.loaded.get(name)
        if not source.is_dir() and current is not None and current[0].path.is_dir():
            # Loaded from a request's files, not from the repository: a new configuration
            # applies to the files it was loaded from.
            source = current[0].path
        if not command.files and not source.is_dir():
            self._reply(command, f"failed to load '{name}', failed to poll from model repository")
            return
        model_dir = stage(
            source,
            self.staging_root / command.command_id,
            command.config,
            command.files,
            keep=command.keep_files,
        )
        if model_dir != source:
            link_record(self.repository, model_dir.parent)
        model = read_model(
            model_dir, self.config_name, default_max_batch_size=self.default_max_batch_size
        )
        if model.error is not None or model.config is None:
            self._unstage(command)
            self._fail_model(name, model.error or "its configuration cannot be read")
            self._reply(command, f"failed to load '{name}', {model.error}")
            return
        if not self._groups.owns(command):
            parts = loads_first(command, model, self.loaded, self._repository_model)
            if parts:
                self._unstage(command)  # (staged again in its turn)
                self._in_group(command, parts)
                return
        if model_dir != source and model.config.ensemble_steps:
            self._link_beside(model_dir.parent, name)
        if command.versions:
            missing = sorted(set(command.versions) - set(available_versions(model_dir)))
            if missing:
                listed = ", ".join(map(str, missing))
                self._unstage(command)
                self._fail_model(name, f"no version {listed} in the repository")
                self._reply(
                    command, f"failed to load '{name}', no version {listed} in the repository"
                )
                return
            model = replace(model, versions=command.versions)
        if not model.versions:
            self._unstage(command)
            self._fail_model(name, "no version is available")
            self._reply(command, f"failed to load '{name}', no version is available")
            return
        errors_key = f"{self.keys.namespace}:control:load-errors:{command.command_id}"
        env = dict(self.env, SLUICE_LOAD_ERRORS_KEY=errors_key)
        specs = self.worker_specs(model, model_dir.parent, env)
        files = fingerprint(model_dir)
        kept: list[Child] = []
        if command.versions and current is not None and _same_model(current[0], model):
            # A load naming its versions (a rollout) changes only which versions run: the
            # versions already running keep their workers. A plain load reloads them all.
            kept = [c for c in current[1] if c.spec.version in model.versions]
            running = {c.spec.version for c in kept}
            specs = [spec for spec in specs if spec.version not in running]
        elif (
            current is not None
            and not command.versions
            and instances_only(current[0], model)
            and self._files.get(name) == files
        ):
            kept, specs = plan(current[1], specs)
            log.info(
                "model control: updating the instances of '%s' (%d kept, %d to start)",
                name,
                len(kept),
                len(specs),
            )
        children = self.supervisor.add(specs)
        log.info("model control: loading '%s' (%d worker(s))", name, len(children))
        self._current = _InProgress(
            command, deadline, children, model, errors_key=errors_key, kept=kept, files=files
        )

    def _begin_unload(self, command: ControlCommand, deadline: float) -> None:
        if self._on_each_copy(command):
            return
        if not self._groups.owns(command):
            parts = unloads_after(command, {n: m for n, (m, _) in self.loaded.items()})
            if parts:
                self._in_group(command, parts)
                return
        loaded = self.loaded.pop(command.model, None)
        self._files.pop(command.model, None)
        if loaded is None:
            if self._clear_failed(command.model):  # (listed as unloaded from now on)
                self.known.add(command.model)
                self.on_change()
            self._reply(command, None)  # as Triton: unloading what is not loaded succeeds
            return
        self.known.add(command.model)
        self.on_change()
        model, children = loaded
        self._current = _InProgress(
            command,
            deadline,
            children,
            model,
            phase="draining",
            unpublished=self._unpublished(),
        )

    # -- progress ------------------------------------------------------------------------

    def _progress(self, work: _InProgress) -> None:
        if work.phase == "fetching":
            if work.fetch is not None and work.fetch.is_alive():
                return
            self._current = None
            if work.fetch_error is not None:
                name = work.command.model
                self._fail_model(name, work.fetch_error)
                self._reply(work.command, f"failed to load '{name}', {work.fetch_error}")
                return
            try:
                self._begin_load(work.command, work.deadline)
            except SluiceError as exc:
                self._reply(work.command, exc.message)
        elif work.phase == "starting":
            self._progress_load(work)
        elif work.phase == "draining":
            now = time.monotonic()
            unpublished = work.unpublished
            assert unpublished is not None
            if not self._gateways_applied(unpublished, work.command.model, now):
                return
            drained = self._streams_empty(work.model)
            if drained or now > unpublished.since + _DRAIN_TIMEOUT_S:
                if not drained:
                    log.warning("model control: '%s' still had queued requests", work.command.model)
                self.supervisor.retire(work.children)
                work.phase = "stopping"
        elif work.phase == "stopping" and not any(c.running for c in work.children):
            self._finish(work, None)

    def _progress_load(self, work: _InProgress) -> None:
        name = work.command.model
        retries = self.supervisor.load_retries
        failed = [c for c in work.children if c.failed or len(c.exit_codes) > retries]
        if failed:
            reason = self._load_error(work) or "its worker exited while loading"
            self._abandon(work, reason, {c.spec.version for c in failed})
        elif self._announced(work.children):
            replaced = self.loaded.get(name)
            assert work.model is not None
            self._clear_failed(name)
            self.loaded[name] = (work.model, [*work.kept, *work.children])
            self._files[name] = work.files
            self.on_change()
            if replaced is not None:
                old = [c for c in replaced[1] if c not in work.kept]
                gone = tuple(v for v in replaced[0].versions if v not in work.model.versions)
                same_versions = [c for c in old if c.spec.version not in gone]
                # Workers of a version still served hand over to the new ones at once (they
                # share its stream); those of a version no longer served first answer what
                # waits in its stream.
                self.supervisor.retire(same_versions)
                leaving = [c for c in old if c not in same_versions]
                if leaving:
                    self._draining.append(
                        (replace(replaced[0], versions=gone), leaving, self._unpublished())
                    )
            self._finish(work, None)
        elif time.monotonic() > work.deadline:
            self._abandon(work, f"not ready within {self.timeout_s:.0f} s", self._waiting(work))

    def _abandon(self, work: _InProgress, reason: str, culprits: set[int | None]) -> None:
        """Give the load up for ``reason``, which concerns the versions ``culprits``."""
        # No grace: its workers hold no request yet, and one stuck in its model's loading
        # does not end on SIGTERM (:mod:`.leaving`).
        self.supervisor.retire(work.children, grace_s=0.0)
        self._unstage(work.command)
        if work.model is not None:
            # As Triton's versions: each with why it failed; one that loaded, "unloaded" (it
            # goes with the others).
            reasons = {
                version: self._version_error(work, version)
                or (reason if version in culprits or not culprits else UNLOADED)
                for version in work.model.versions
            }
            self._set_failed(replace(work.model, error=None), reasons)
        self._finish(work, f"failed to load '{work.command.model}', {reason}")

    def _waiting(self, work: _InProgress) -> set[int | None]:
        """The versions of the load some of whose workers have not announced themselves."""
        assert work.model is not None
        return {
            version
            for version in work.model.versions
            if not announced(
                self.client,
                self.keys,
                work.model.name,
                (version,),
                [c for c in work.children if c.spec.version == version],
            )
        }

    def _link_beside(self, staged_root: Path, name: str) -> None:
        """An ensemble loaded from a request's configuration or files is staged alone, yet
        reads its steps' models beside it (as Triton loads such an ensemble): link there every
        other model as it is served (a loaded one from the folder it was loaded from, with its
        own overrides) or else as the repository holds it."""
        names = set(self.loaded)
        if self.repository.is_dir():
            names.update(p.name for p in self.repository.iterdir() if not p.name.startswith("."))
        names.discard(name)
        for other in sorted(names):
            loaded = self.loaded.get(other)
            target = loaded[0].path if loaded is not None else self.repository / other
            link = staged_root / other
            if target.is_dir() and not link.exists():
                try:
                    link.symlink_to(target.resolve())
                except OSError as exc:
                    log.warning("model control: cannot link %s beside %s: %s", other, name, exc)

    def _unstage(self, command: ControlCommand) -> None:
        """Remove what ``command`` staged (a load's overrides), which no model serves from:
        its load failed, or waits for the models it calls. A staged copy that serves stays
        until ``sluice up`` stops: a later load with a new configuration links to its files."""
        shutil.rmtree(self.staging_root / command.command_id, ignore_errors=True)

    def _finish(self, work: _InProgress, error: str | None) -> None:
        if work.errors_key:
            self.client.delete(work.errors_key)
        self._current = None
        if error is None:
            self._remember(work.command)
        self._reply(work.command, error)

    def _remember(self, command: ControlCommand) -> None:
        """How the model is now loaded, for the executors that join later (and for this
        one's next start, with a snapshot folder)."""
        if command.op not in ("load", "unload"):
            return
        outside = not (self.repository / command.model).is_dir()
        if self.snapshots is not None:
            try:
                self.snapshots.save(self.loaded, command, files_of_previous=outside)
            except OSError as exc:
                log.warning("cannot write the model snapshot: %s", exc)
        try:
            if command.op == "unload":
                forget_load(self.client, self.keys, command.model)
            else:
                remember_load(self.client, self.keys, command, files_of_previous=outside)
        except RedisError as exc:
            log.warning("cannot record how '%s' is loaded: %s", command.model, exc)

    def _load_error(self, work: _InProgress) -> str | None:
        assert work.model is not None
        for version in work.model.versions:
            reason = self._version_error(work, version)
            if reason:
                return reason
        return None

    def _version_error(self, work: _InProgress, version: int) -> str | None:
        """Why a worker of the load could not load ``version``, as it reported."""
        assert work.model is not None
        reason = self.client.hget(work.errors_key, load_error_field(work.model.name, version))
        return cast(bytes, reason).decode() if reason else None

    def _announced(self, children: list[Child]) -> bool:
        """Whether every worker started for the load has sent its first heartbeat."""
        model = self._current.model if self._current is not None else None
        if model is None:
            return False
        return announced(self.client, self.keys, model.name, model.versions, children)

    def _retire_drained(self) -> None:
        """Stop the workers of versions no longer served once their streams are empty."""
        now = time.monotonic()
        waiting = []
        for model, children, unpublished in self._draining:
            applied = self._gateways_applied(unpublished, model.name, now)
            if applied and (
                self._streams_empty(model) or now > unpublished.since + _DRAIN_TIMEOUT_S
            ):
                self.supervisor.retire(children)
            else:
                waiting.append((model, children, unpublished))
        self._draining = waiting

    def _unpublished(self) -> _Unpublished:
        """The catalog change just published (:attr:`on_change`), to wait for."""
        return _Unpublished(time.monotonic())

    def _gateways_applied(self, unpublished: _Unpublished, model: str, now: float) -> bool:
        """Whether every live gateway has applied the catalog change: from then on none
        admits a request for what it took away, and the model's streams may be judged.
        With no live gateway, at once; after :data:`CATCH_UP_S`, whatever they report
        (naming those behind)."""
        if not unpublished.read:
            unpublished.revision = published_revision(self.client, self.keys)
            unpublished.read = True
        if unpublished.applied_at is not None:
            return now >= unpublished.applied_at + _APPEND_GRACE_S
        if unpublished.revision is None:
            return True
        lagging = lagging_gateways(self.client, self.keys, unpublished.revision)
        if lagging and now < unpublished.since + CATCH_UP_S:
            return False
        if lagging:
            log.warning(
                "model control: gateway(s) %s did not report catalog revision %d within "
                "%.0f s; judging the queues of '%s' without them",
                ", ".join(lagging),
                unpublished.revision,
                CATCH_UP_S,
                model,
            )
        unpublished.applied_at = now
        return False  # (the appends already on their way land meanwhile)

    def _streams_empty(self, model: RepositoryModel | None) -> bool:
        if model is None or model.config is None:
            return True
        levels = (
            model.config.dynamic_batching.priority_levels if model.config.dynamic_batching else 0
        )
        versions = [(model.name, version) for version in model.versions]
        members = tenant_members_sync(self.client, self.keys, versions)
        with self.client.pipeline(transaction=False) as pipe:
            for version in model.versions:
                bases = base_streams(self.keys, model.name, version, levels)
                for stream in with_tenants(bases, members[(model.name, version)]):
                    pipe.xlen(stream)
            lengths = pipe.execute()
        return not any(lengths)


def announced(
    client: Redis, keys: Keys, model: str, versions: tuple[int, ...], children: list[Child]
) -> bool:
    """Whether each of ``children`` (workers of ``model``'s ``versions`` on this host) has
    sent its first heartbeat."""
    CLOCK.sync_blocking(client)  # (heartbeats are on the deployment's clock)
    now = CLOCK.now()
    live: set[str] = set()
    for version in versions:
        members = client.zrangebyscore(keys.live_workers(model, version), now, "+inf")
        live |= {m.decode() if isinstance(m, bytes) else str(m) for m in members}
    host = socket.gethostname()
    for child in children:
        if child.process is None:
            return False
        prefix = f"{host}-{child.process.pid}-"
        if not any(member.startswith(prefix) for member in live):
            return False
    return True


def _fields(failed: dict[str, tuple[RepositoryModel, dict[int, str]]]) -> dict[str, str]:
    """The ``Keys.load_errors`` fields of the failed loads ``failed``."""
    return {
        load_error_field(name, version): reason
        for name, (_, reasons) in failed.items()
        for version, reason in reasons.items()
    }


def _same_model(old: RepositoryModel, new: RepositoryModel) -> bool:
    """Whether ``new`` differs from ``old`` in its versions only (same files, same config)."""
    return old.path == new.path and old.config == new.config
