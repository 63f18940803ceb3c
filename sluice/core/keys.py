"""The whole Redis layout of a deployment, in one place.

Every key starts with the deployment's namespace. Each name below says what
the key holds and who writes it.

Keys carry Redis Cluster hash tags (the part in braces decides the slot), so that every
multi-key command or script touches one slot:

- ``{<namespace>}:…``: the control plane (catalog, routing, rollouts, controller, gateways).
  Small and rarely written, so one slot is enough.
- ``<namespace>:<kind>:{<model>}:…``: everything of one model (its request streams of every
  version and priority, statistics, live workers, sequences, jobs), so a worker's answer,
  acknowledgement, statistics and checkpoint go in one transaction on one shard.
- ``<namespace>:reply:{<gateway>}``: one gateway's answers; ``<namespace>:batch:{<id>}…``
  one offline batch.
- ``<namespace>:cache…:{<namespace>-cache-<shard>}…``: one shard of the response cache
  (its answers, their sizes and order of use, updated together by one script).

A model name containing ``}`` still maps all its keys to one slot: the tag is always what
lies between the first ``{`` (right after the fixed prefix) and the next ``}``.
"""

from __future__ import annotations

from dataclasses import dataclass

WORKER_GROUP = "workers"
"""Consumer group of every request stream: each entry goes to one worker of the model version."""


@dataclass(frozen=True, slots=True)
class Keys:
    """Every key of one deployment, named from its namespace (SLUICE_NAMESPACE)."""

    namespace: str = "sluice"

    def request_stream(self, model: str, version: int, priority: int = 0, tenant: str = "") -> str:
        """Requests for one model version and priority level (gateway XADDs, workers
        XREADGROUP); level 0 is the only stream of models without priority levels.
        Workers delete entries once answered, so the length is the queue depth.
        A named ``tenant`` has a stream of its own in each level (listed in
        :meth:`tenant_streams`), so the workers can share the level between tenants;
        the anonymous tenant ("") and requests from inside the deployment use the level's
        base stream."""
        suffix = f":p{priority}" if priority else ""
        return tenant_stream(f"{self.namespace}:req:{{{model}}}:{version}{suffix}", tenant)

    def request_streams(self, model: str, version: int, priority_levels: int) -> list[str]:
        """Every stream of a model version, highest priority (level 1) first."""
        if priority_levels <= 0:
            return [self.request_stream(model, version)]
        return [self.request_stream(model, version, p) for p in range(1, priority_levels + 1)]

    def sequence_stream(self, model: str, version: int, slot: int) -> str:
        """Requests of the sequences routed to one instance (slot) of a sequence model:
        that instance alone reads it, so a sequence's requests are computed in order."""
        return f"{self.namespace}:req:{{{model}}}:{version}:s{slot}"

    def sequence_owner(self, model: str, version: int, slot: int) -> str:
        """Which worker reads a slot's stream now: a lease (worker, expiring unless renewed)
        among the workers of every host started for that slot (:mod:`sluice.workers.slot_lease`)."""
        return f"{self.namespace}:seq-owner:{{{model}}}:{version}:s{slot}"

    def sequence_state(self, model: str, version: int, sequence: str) -> str:
        """A sequence's checkpoint (its implicit state), written with each answer and
        expiring when the sequence has been idle for the model's idle time."""
        return f"{self.namespace}:seq:{{{model}}}:{version}:{sequence}"

    def background_stream(self, model: str, version: int, tenant: str = "") -> str:
        """Requests below every online priority level (asynchronous jobs, batch jobs): the
        workers of the model version take them only when no online request waits. A named
        ``tenant`` has its own, as in :meth:`request_stream`."""
        return tenant_stream(f"{self.namespace}:req:{{{model}}}:{version}:bg", tenant)

    def tenant_streams(self, model: str, version: int) -> str:
        """Set of the tenant request streams of a model version (``request_stream`` with a
        tenant): a gateway adds one before its first entry, its workers read them all."""
        return f"{self.namespace}:req-tenants:{{{model}}}:{version}"

    def rate_limit_resource(self, name: str, host: str = "", device: int | None = None) -> str:
        """Hash of one rate limiter resource (:mod:`sluice.workers.rate_limiter`): a global
        one (no host), or one device's on one host. Every resource shares one Redis Cluster
        slot, so that an instance takes all of its resources in one script."""
        if device is None:
            return f"{self.namespace}:{{rate-limiter}}:global:{name}"
        return f"{self.namespace}:{{rate-limiter}}:{host}:{device}:{name}"

    def cancellations(self, model: str) -> str:
        """Stream of the model's requests whose callers went away (client disconnected, call
        cancelled, job cancelled), by request key: workers drop them before computing, and
        an ensemble or BLS call stops its children (:mod:`sluice.core.cancellation`)."""
        return f"{self.namespace}:cancel:{{{model}}}"

    def job(self, model: str, job_id: str) -> str:
        """Hash of one asynchronous job (:mod:`sluice.core.jobs`): its status, and its answer once
        a worker wrote it there. A request whose reply address is such a key is a job. It
        lives in its model's slot, with the stream and statistics its scripts touch."""
        return f"{self.namespace}:job:{{{model}}}:{job_id}"

    def job_model(self, job_id: str) -> str:
        """The model a job id belongs to (what finds :meth:`job` from the id alone); it
        expires with the job."""
        return f"{self.namespace}:job-model:{job_id}"

    def is_job(self, reply_to: str) -> bool:
        """Whether a request's reply address is a job's hash (:meth:`job`) rather than a
        gateway's reply stream."""
        return reply_to.startswith(f"{self.namespace}:job:")

    def job_by_key(self, model: str, tenant: str, key: str) -> str:
        """The job id (and a digest of its request) that a tenant's ``Idempotency-Key`` (or
        request id) named for a model, while the job lives. Another tenant's equal key is
        another key."""
        return f"{self.namespace}:job-key:{{{model}}}:{tenant}:{key}"

    def queued_jobs(self, model: str) -> str:
        """Sorted set job id -> when its wait ends (unix s) of a model's jobs that no worker
        has started yet: how the job scripts find the ones that expired while queued, so
        that :meth:`job_room` does not keep counting them (:mod:`sluice.core.jobs`)."""
        return f"{self.namespace}:queued-jobs:{{{model}}}"

    def cached_answer(self, digest: str, shard: int = 0) -> str:
        """One answer of the response cache (expires once unused for
        ``SLUICE_RESPONSE_CACHE_TTL_S``), in one of its shards: each shard's keys share a
        slot of their own (``SLUICE_RESPONSE_CACHE_SHARDS``)."""
        return f"{self.namespace}:cache:{{{self._cache_tag(shard)}}}:{digest}"

    def cache_index(self, shard: int = 0) -> str:
        """A shard of the response cache: its answers by last use (zset) and their sizes
        (hash ``:sizes``, with the total under ``:total``)."""
        return f"{self.namespace}:cache-index:{{{self._cache_tag(shard)}}}"

    def _cache_tag(self, shard: int) -> str:
        return f"{self.namespace}-cache" + (f"-{shard}" if shard else "")

    def job_room(self, model: str) -> str:
        """Hash of what each tenant's queued jobs of a model hold: ``n:<tenant>`` (jobs),
        ``b:<tenant>`` (bytes of their entries) and, per queued job, ``<job id>`` ->
        ``"<bytes> <tenant>"``. Written by the job scripts only, so it is exact; the bounds
        SLUICE_TENANT_MAX_QUEUED_JOBS and SLUICE_TENANT_MAX_QUEUED_JOB_BYTES are checked
        against it. One key per model (not per tenant), so that a worker can name it."""
        return f"{self.namespace}:job-room:{{{model}}}"

    def job_results(self, model: str) -> str:
        """Hash of what each tenant's finished jobs of a model hold until their retention
        ends: ``r:<tenant>`` (bytes of their answers) and, per finished job, ``<job id>`` ->
        ``"<bytes> <tenant>"``; SLUICE_TENANT_MAX_JOB_RESULT_BYTES is checked against it.
        Written by the job scripts only (:mod:`sluice.core.jobs`)."""
        return f"{self.namespace}:job-results:{{{model}}}"

    def finished_jobs(self, model: str) -> str:
        """Sorted set job id -> when its record expires (unix s) of a model's finished jobs
        that hold an answer: how the next submission finds the ones gone, so that
        :meth:`job_results` stops counting them."""
        return f"{self.namespace}:finished-jobs:{{{model}}}"

    def batch(self, batch_id: str) -> str:
        """Hash of one offline batch job (:mod:`sluice.core.batch_jobs.batches`)."""
        return f"{self.namespace}:batch:{{{batch_id}}}"

    def batch_shards(self, batch_id: str) -> str:
        """Hash shard index -> its state (JSON): attempt, rows, part, error."""
        return f"{self.namespace}:batch:{{{batch_id}}}:shards"

    def batch_attempts(self, batch_id: str) -> str:
        """Hash shard index -> its newest attempt (only that one may commit)."""
        return f"{self.namespace}:batch:{{{batch_id}}}:attempts"

    def batch_progress(self, batch_id: str) -> str:
        """Hash shard index -> rows answered by its current attempt (all once committed)."""
        return f"{self.namespace}:batch:{{{batch_id}}}:progress"

    def batch_leases(self, batch_id: str) -> str:
        """Hash shard index -> when its running attempt's lease ends (unix s): the attempt
        renews it every second; past it, the shard is given to another worker."""
        return f"{self.namespace}:batch:{{{batch_id}}}:leases"

    def batch_in_flight(self, batch_id: str) -> str:
        """Hash shard index -> when it was last sent (unix s): the shards of a running job
        queued or running now, at most ``SLUICE_BATCH_SHARDS_IN_FLIGHT`` (its window)."""
        return f"{self.namespace}:batch:{{{batch_id}}}:in-flight"

    @property
    def running_batches(self) -> str:
        """Set of the batch ids running now (what the batch workers' reapers look at)."""
        return f"{{{self.namespace}}}:batches:running"

    def batches(self, tenant: str) -> str:
        """Sorted set batch id -> creation time (unix s) of one tenant's batches, for its
        listing (no tenant sees, or is crowded out by, another's); at most
        SLUICE_TENANT_MAX_BATCHES."""
        return f"{{{self.namespace}}}:batches:{tenant}"

    def tenant_running_batches(self, tenant: str) -> str:
        """Sorted set batch id -> when it got its turn (unix s) of one tenant's jobs that
        hold one of its SLUICE_TENANT_MAX_RUNNING_BATCHES turns (planning or running; see
        :mod:`sluice.core.batch_jobs.turns`)."""
        return f"{{{self.namespace}}}:batch-turns:{tenant}"

    def tenant_queued_batches(self, tenant: str) -> str:
        """Sorted set batch id -> its number in line of one tenant's jobs waiting for a turn
        (status ``queued``), first in line first."""
        return f"{{{self.namespace}}}:batch-line:{tenant}"

    def tenant_admitting_batches(self, tenant: str) -> str:
        """Sorted set batch id -> when (unix s) a gateway began to admit it, of one tenant's
        jobs on their way into its turns or line (written before the job is ``queued``, so
        that the periodic round finds one whose gateway stopped between the two)."""
        return f"{{{self.namespace}}}:batch-admitting:{tenant}"

    @property
    def batch_turn_tenants(self) -> str:
        """Set of the tenants with jobs holding or waiting for a turn (what the batch
        workers' periodic round looks at)."""
        return f"{{{self.namespace}}}:batch-turn-tenants"

    def upload(self, tenant: str, upload_id: str) -> str:
        """Hash of one upload (:mod:`sluice.core.batch_jobs.uploads`): its name, size, digest,
        expiry, and how many batch jobs use it; the file itself is in the batch store. Made
        when the upload begins, marked ``partial`` until its file is whole."""
        return f"{{{self.namespace}}}:upload:{tenant}:{upload_id}"

    def uploads(self, tenant: str) -> str:
        """Sorted set upload id -> creation time (unix s) of one tenant's uploads (arriving
        ones included), at most SLUICE_TENANT_MAX_UPLOADS."""
        return f"{{{self.namespace}}}:uploads:{tenant}"

    def stored_bytes(self, tenant: str) -> str:
        """Bytes one tenant keeps in the batch store (uploads and outputs; reserved while an
        upload arrives), within SLUICE_TENANT_MAX_STORED_BYTES."""
        return f"{{{self.namespace}}}:stored-bytes:{tenant}"

    def batch_stored(self, tenant: str) -> str:
        """Hash batch id -> bytes that batch's files keep in the batch store (its outputs,
        and what a shard still writing reserved), the part of :meth:`stored_bytes` each
        batch gives back when it is removed (:mod:`sluice.core.batch_jobs.output_quota`)."""
        return f"{{{self.namespace}}}:batch-stored:{tenant}"

    @property
    def store_expiry(self) -> str:
        """Sorted set ``upload:<tenant>:<id>`` / ``batch:<tenant>:<id>`` -> when it expires
        (unix s; +inf while in use): what the store sweepers (batch workers, gateways) remove,
        files and all."""
        return f"{{{self.namespace}}}:store-expiry"

    def batch_reply_stream(self, batch_id: str, shard: int, attempt: int) -> str:
        """Answers to one attempt of one shard (the shard task reads them itself); it expires
        once the attempt is over, or with its batch job."""
        return f"{self.namespace}:reply:{{batch-{batch_id}-{shard}-{attempt}}}"

    @property
    def celery_prefix(self) -> str:
        """Prefix of the Celery broker's keys (queues, unacknowledged messages)."""
        return f"{self.namespace}:celery:"

    def dead_letters(self, model: str, version: int) -> str:
        """Requests that were delivered too often (each killed its worker), kept for a look."""
        return f"{self.namespace}:dead:{{{model}}}:{version}"

    def reply_stream(self, gateway_id: str) -> str:
        """Answers for one gateway process (workers XADD, the gateway's reader XREADs): an
        entry holds one answer, or a batch's answers to that process
        (:func:`sluice.core.wire.encode_replies`)."""
        return f"{self.namespace}:reply:{{{gateway_id}}}"

    @property
    def catalog(self) -> str:
        """Hash model name -> catalog entry (msgpack), written by the controller."""
        return f"{{{self.namespace}}}:catalog"

    @property
    def catalog_revision(self) -> str:
        """Counter bumped on every catalog change, so readers reload only when needed."""
        return f"{{{self.namespace}}}:catalog:rev"

    @property
    def load_errors(self) -> str:
        """Hash "model:version" -> reason a worker could not load that version."""
        return f"{{{self.namespace}}}:load-errors"

    def live_workers(self, model: str, version: int) -> str:
        """Sorted set worker id -> heartbeat expiry (unix seconds)."""
        return f"{self.namespace}:live:{{{model}}}:{version}"

    def worker_hosts(self, model: str, version: int) -> str:
        """Hash worker id -> host id (:mod:`sluice.core.hosts`), written with each heartbeat:
        whether a gateway may hand this version's workers shared memory."""
        return f"{self.namespace}:hosts:{{{model}}}:{version}"

    @property
    def control_requests(self) -> str:
        """Stream of model control commands (load, unload) to every executor (``sluice
        up``), from gateways and from the controller; each executor reads it with a cursor
        of its own."""
        return f"{{{self.namespace}}}:control:requests"

    @property
    def loaded_as(self) -> str:
        """Hash model name -> the load command (msgpack) that the executors carried out for
        it, where it named a configuration, files or versions of its own: an executor that
        joins later loads the model the same way (:mod:`sluice.scheduler.executor.loaded_as`)."""
        return f"{{{self.namespace}}}:control:loaded-as"

    @property
    def torchserve_workflows(self) -> str:
        """Hash workflow name -> the workflow registered through TorchServe's ``POST /workflows``
        (JSON, :class:`sluice.core.torchserve.workflows.Workflow`): its nodes, each served as a
        model of its own, and who feeds whom; ``registering <until> <models>`` while a
        gateway process registers or unregisters its nodes (a claim that lapses at
        ``until``, Unix seconds, naming the models it registers)."""
        return f"{{{self.namespace}}}:torchserve:workflows"

    @property
    def executors(self) -> str:
        """Sorted set executor id -> until when it is alive (the deployment's clock): the
        executors (``sluice up``) that carry out each model control command, whose answers
        a sender waits for (:mod:`sluice.core.control`)."""
        return f"{{{self.namespace}}}:control:executors"

    @property
    def custom_metrics(self) -> str:
        """Hash worker id -> the metrics its model defines itself (JSON,
        :mod:`sluice.core.observability.custom_metrics`), written with a heartbeat when they
        changed."""
        return f"{{{self.namespace}}}:custom-metrics"

    @property
    def custom_metrics_expiry(self) -> str:
        """Sorted set worker id -> when its report in :attr:`custom_metrics` expires (unix
        seconds, on the deployment clock): a report counts while its expiry is ahead, and a
        scrape removes the others (and any report without one)."""
        return f"{{{self.namespace}}}:custom-metrics:expiry"

    @property
    def demand_requests(self) -> str:
        """Stream of wake-ups to the executors: a gateway queued a request for an on-demand
        model version that no worker serves (:mod:`sluice.core.on_demand`)."""
        return f"{{{self.namespace}}}:demand:requests"

    @property
    def on_demand_states(self) -> str:
        """Hash "<host>/<model>/<version>" -> that host's state of an on-demand model version
        (JSON with its expiry), written by each executor, read by the gateways."""
        return f"{{{self.namespace}}}:demand:states"

    @property
    def host_memory(self) -> str:
        """Hash host -> its memory budget and use by device (JSON with its expiry), written
        by each executor that loads models on demand."""
        return f"{{{self.namespace}}}:demand:memory"

    @property
    def model_memory(self) -> str:
        """Hash "<model>:<version>" -> the memory one instance of it held when last measured
        (JSON, bytes by device): every host's estimate before it loads the version."""
        return f"{{{self.namespace}}}:demand:footprints"

    def on_demand_lock(self, model: str, version: int) -> str:
        """The one host that loads or holds an on-demand version: taken with SET NX,
        renewed while it holds it, expiring when it no longer does (a host that died)."""
        return f"{{{self.namespace}}}:demand:lock:{model}:{version}"

    @property
    def controller_requests(self) -> str:
        """Stream of rollout commands (start, promote, rollback) from gateways to the
        leading controller."""
        return f"{{{self.namespace}}}:controller:requests"

    def control_reply(self, command_id: str) -> str:
        """List where the answer to one control command is pushed (the gateway polls it)."""
        return f"{{{self.namespace}}}:control:reply:{command_id}"

    def rollout(self, model: str) -> str:
        """A model's rollout state (JSON, :mod:`sluice.core.rollout`), written by the controller."""
        return f"{{{self.namespace}}}:rollout:{model}"

    @property
    def control_mode(self) -> str:
        """Triton's model control mode in force (``none``, ``explicit``), set by ``sluice up``."""
        return f"{{{self.namespace}}}:control:mode"

    def routing(self, model: str) -> str:
        """Hash of a model's version labels ("label:<name>" -> version) and split weights
        ("weight:<version>" -> weight), written by the gateway's routing endpoints."""
        return f"{{{self.namespace}}}:routing:{model}"

    @property
    def gateways(self) -> str:
        """Sorted set gateway id -> expiry (unix seconds) of its last report."""
        return f"{{{self.namespace}}}:gateways"

    def gateway_report(self, gateway_id: str) -> str:
        """Hash of one gateway process's gauges (in flight, Redis round trip), expiring."""
        return f"{{{self.namespace}}}:gateway:{gateway_id}"

    @property
    def gateway_counters(self) -> str:
        """Hash of counters every gateway adds to that belong to no model."""
        return f"{{{self.namespace}}}:gateway-counters"

    def client_regions(self, host: str, kind: str) -> str:
        """Hash region name -> record (JSON) of the client shared memory regions of one
        host (``kind``: ``system`` or ``cuda``), registered through any gateway process of
        that host; every one of them reads it. Expires unless a live gateway of the host
        renews it (:mod:`sluice.gateway.shm.store`)."""
        return f"{{{self.namespace}}}:shm-regions:{host}:{kind}"

    def client_regions_revision(self, host: str) -> str:
        """Counter of the changes to one host's client regions (:meth:`client_regions`):
        a gateway process reloads the records when it moved."""
        return f"{{{self.namespace}}}:shm-regions:{host}:rev"

    def client_regions_draining(self, host: str) -> str:
        """Hash region name -> kind of one host's client regions that were unregistered
        while requests used them: listed until the last of those requests ends."""
        return f"{{{self.namespace}}}:shm-regions:{host}:draining"

    def client_region_users(self, host: str, name: str) -> str:
        """Sorted set of the requests in flight that use one client region of a host: lease
        id, scored by the time (ms) it expires, its request's deadline. ``name`` "" gives
        the prefix of every region's set (the scripts of :mod:`sluice.gateway.shm.store`
        add the name)."""
        return f"{{{self.namespace}}}:shm-regions:{host}:users:{name}"

    @property
    def tenant_weights(self) -> str:
        """Hash tenant -> weight (``*``: every tenant not named) of the tenant limits in
        force, written by the gateways that read the limits, read by the workers that share
        each priority level between tenants by these weights."""
        return f"{{{self.namespace}}}:tenant-weights"

    @property
    def log_settings(self) -> str:
        """Hash of the log settings changed through Triton's logging extension (``rev``:
        their revision); every gateway process applies them at its catalog refresh."""
        return f"{{{self.namespace}}}:log-settings"

    def stats(self, model: str, version: int) -> str:
        """Hash of Triton statistics counters for one model version (workers HINCRBY)."""
        return f"{self.namespace}:stats:{{{model}}}:{version}"

    def batch_stats(self, model: str, version: int) -> str:
        """Hash "<batch size>:<counter>" -> value, Triton's batch_stats."""
        return f"{self.namespace}:batch-stats:{{{model}}}:{version}"

    def instance_stats(self, model: str, version: int) -> str:
        """Hash worker id -> executions, to show that every instance serves."""
        return f"{self.namespace}:instance-stats:{{{model}}}:{version}"

    @property
    def controller_lease(self) -> str:
        """Id of the controller that leads, expiring unless it renews (SET NX PX)."""
        return f"{{{self.namespace}}}:controller:lease"

    @property
    def controller_fencing(self) -> str:
        """Fencing token of the current leader, bumped (INCR) each time a controller
        takes the lease; decisions carrying an older token are refused."""
        return f"{{{self.namespace}}}:controller:fencing"

    @property
    def controller_decisions(self) -> str:
        """List of the controller's applied decisions, oldest first, each tagged with the
        fencing token of the leader that applied it."""
        return f"{{{self.namespace}}}:controller:decisions"

    @property
    def desired_instances(self) -> str:
        """Hash "model:version" -> instances the controller's autoscaler wants; executors
        start or retire workers to match."""
        return f"{{{self.namespace}}}:controller:instances"

    @property
    def polled_repository(self) -> str:
        """The repository listing (version tokens, JSON) the controller last acted upon in
        poll mode, so that a new leader sees what changed since."""
        return f"{{{self.namespace}}}:controller:polled"


TENANT_MARK = ":t:"
"""What separates a level's base stream from the tenant in a tenant's stream name."""


def tenant_stream(base: str, tenant: str) -> str:
    """The stream of ``tenant`` in the level whose base stream is ``base`` (the base
    stream itself for the anonymous tenant, "")."""
    return f"{base}{TENANT_MARK}{tenant}" if tenant else base


def base_stream(stream: str) -> str:
    """The level's base stream of a tenant's stream (a base stream: itself). Tenant names
    cannot hold ``:`` or ``}`` (:data:`sluice.core.tenants.TENANT_NAME`), so only the last
    mark can be one, and only if what follows is such a name."""
    base, mark, tenant = stream.rpartition(TENANT_MARK)
    if not mark or not tenant or ":" in tenant or "}" in tenant:
        return stream
    return base


def load_error_field(model: str, version: int) -> str:
    """The field of :attr:`Keys.load_errors` that holds why a model version failed to load."""
    return f"{model}:{version}"
