"""``docker compose up`` for real: compose.yaml + deploy/compose.test.yaml on podman.

scripts/containers.sh sets podman up when it is missing (Debian packages, a debootstrap base
image kept as a cache, the Compose v2 binary). The test then builds the Sluice image from
deploy/Dockerfile and the local stand-ins of deploy/images/ (no registry is needed), starts
podman's Docker-compatible API service, makes the stack's secrets with
scripts/compose-env.sh (compose refuses to start without them), brings the stack up under a
project name of its own with the published ports on free loopback ports, sends an inference
through the gateway with a tenant's key (and is refused without one), checks Redis' password
and memory bound and every container's user, read-only root and capabilities, reads the
metrics port and Prometheus, runs a batch job as from a laptop (the CLI uploads the rows
through the gateway, the batch worker runs them, the CLI downloads the outputs: no shared
folder), and takes everything down again: containers,
networks, volumes, the images it built (the base image stays, as a cache), the API service,
and the host's ip_forward and nftables tables as they were.

Podman 4.3 runs no health check without systemd, and Compose waits on them
(``condition: service_healthy``): a thread runs ``podman healthcheck run`` for the
project's containers that are still starting.

Needs root, and apt-get where podman is missing; fails with the reason otherwise. On a
2-core machine: about 3 minutes cold (no podman, no base image), about 2 minutes warm.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.compose

ROOT = Path(__file__).resolve().parents[2]
SETUP_SCRIPT = ROOT / "scripts" / "containers.sh"
ENV_SCRIPT = ROOT / "scripts" / "compose-env.sh"
BASE_IMAGE = "localhost/debian:bookworm"
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")

SETUP_TIMEOUT_S = 900.0
BUILD_TIMEOUT_S = 1500.0
UP_TIMEOUT_S = 300.0
READY_TIMEOUT_S = 240.0
BATCH_TIMEOUT_S = 300
"""A batch of 3,000 rows in three shards from a laptop, uploaded, run and downloaded (about
10 s on an idle machine)."""

IRIS_REQUEST = {
    "inputs": [
        {
            "name": "input",
            "shape": [2, 4],
            "datatype": "FP32",
            "data": [5.1, 3.5, 1.4, 0.2, 6.7, 3.0, 5.2, 2.3],
        }
    ]
}

_started = time.monotonic()
_live: list[pytest.CaptureFixture[str]] = []
_progress_lock = threading.Lock()


def progress(message: str) -> None:
    """One progress line, shown as the test runs and again in pytest's report on failure."""
    line = f"[compose {time.monotonic() - _started:6.1f} s] {message}"
    with _progress_lock:
        print(line, flush=True)
        if _live:
            with _live[0].disabled():
                print(line, flush=True)


def run(
    command: list[str],
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    check: bool = True,
    what: str = "",
) -> subprocess.CompletedProcess[str]:
    """Run a command; with ``check``, fail the test with its output when it fails."""
    try:
        result = subprocess.run(
            command,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{what or command[0]}: no answer within {timeout:.0f} s: {command}\n{error}")
    if check and result.returncode != 0:
        pytest.fail(
            f"{what or command[0]} failed (exit {result.returncode}): {' '.join(command)}\n"
            f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
        )
    return result


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def http(
    url: str, body: bytes | None = None, timeout: float = 5.0, key: str | None = None
) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"} if body else {}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read()


def wait_for(what: str, probe: Callable[[], object], timeout: float, every: float = 1.0) -> object:
    """Call ``probe`` until it returns something true; fail with ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            result = probe()
        except (OSError, ValueError) as error:
            last_error, result = error, None
        if result:
            return result
        time.sleep(every)
    pytest.fail(f"{what}: not within {timeout:.0f} s (last error: {last_error!r})")


# --------------------------------------------------------------------------- host state


@dataclass
class Snapshot:
    """What existed before the test: only what appears later is removed."""

    containers: set[str]
    images: set[str]
    volumes: set[str]
    networks: set[str]

    @staticmethod
    def take(podman: str) -> Snapshot:
        def ids(*args: str) -> set[str]:
            out = run([podman, *args], timeout=60, what="podman").stdout
            return set(out.split())

        return Snapshot(
            containers=ids("ps", "--all", "--external", "--quiet", "--no-trunc"),
            images=ids("images", "--all", "--quiet", "--no-trunc"),
            volumes=ids("volume", "ls", "--quiet"),
            networks=ids("network", "ls", "--quiet", "--no-trunc"),
        )


def nft_tables() -> set[str]:
    if shutil.which("nft") is None:
        return set()
    out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    return {line.removeprefix("table ").strip() for line in out.splitlines() if line.strip()}


@dataclass
class Cleanup:
    """Everything the test made, undone in reverse order; failures are collected."""

    steps: list[tuple[str, Callable[[], None]]] = field(default_factory=list)

    def add(self, what: str, step: Callable[[], None]) -> None:
        self.steps.append((what, step))

    def run(self) -> list[str]:
        errors = []
        for what, step in reversed(self.steps):
            try:
                step()
            except BaseException as error:  # every step runs, whatever the others did
                errors.append(f"{what}: {error!r}")
        return errors


# --------------------------------------------------------------------------- the stack


class Stack:
    def __init__(self, podman: str, compose: str, workdir: Path) -> None:
        self.podman, self.compose_binary = podman, compose
        self.project = f"sluicetest{uuid.uuid4().hex[:8]}"
        self.socket = workdir / "podman.sock"
        tag = f"{self.project}:latest"
        self.images = {
            "SLUICE_IMAGE": f"localhost/sluice-{tag}",
            "SLUICE_UPLOAD_IMAGE": f"localhost/sluice-upload-{tag}",
            "SLUICE_TEST_REDIS_IMAGE": f"localhost/redis-{tag}",
            "SLUICE_TEST_S3_IMAGE": f"localhost/s3-{tag}",
            "SLUICE_TEST_PROMETHEUS_IMAGE": f"localhost/prometheus-{tag}",
        }
        self.ports = {
            "SLUICE_HTTP_PORT": free_port(),
            "SLUICE_METRICS_PORT": free_port(),
            "SLUICE_GRPC_PORT": free_port(),
            "SLUICE_PROMETHEUS_PORT": free_port(),
            "SLUICE_GRAFANA_PORT": free_port(),
        }
        environment = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("DOCKER_", "COMPOSE_", "SLUICE_", "MINIO_", "GRAFANA_"))
        }
        (workdir / "docker").mkdir()
        environment |= {
            "DOCKER_HOST": f"unix://{self.socket}",
            "DOCKER_CONFIG": str(workdir / "docker"),
            "DOCKER_BUILDKIT": "0",
            "SLUICE_TEST_BASE": BASE_IMAGE,
            **self.images,
            **{key: str(port) for key, port in self.ports.items()},
        }
        self.env = environment
        self.workdir = workdir
        # The stack's secrets, made as a user makes them (never the checkout's own .env).
        self.env_file = workdir / "compose.env"
        run(["sh", str(ENV_SCRIPT), "--output", str(self.env_file), "team-a"], timeout=30)
        self.secrets = dict(
            line.split("=", 1)
            for line in self.env_file.read_text().splitlines()
            if line and not line.startswith("#")
        )
        self.key = self.secrets["SLUICE_API_KEYS"].split(":", 1)[1]

    def url(self, port: str, path: str) -> str:
        return f"http://127.0.0.1:{self.ports[port]}{path}"

    def compose(
        self, *args: str, timeout: float, check: bool = True, env_file: Path | None = None
    ) -> str:
        command = [
            self.compose_binary,
            "--project-name",
            self.project,
            "--env-file",
            str(env_file or self.env_file),
            "--file",
            str(ROOT / "compose.yaml"),
            "--file",
            str(ROOT / "deploy" / "compose.test.yaml"),
            *args,
        ]
        return run(command, timeout=timeout, env=self.env, check=check, what="compose").stdout

    def containers(self, *filters: str) -> list[str]:
        command = [self.podman, "ps", "--all", "--quiet"]
        for item in (f"label=com.docker.compose.project={self.project}", *filters):
            command += ["--filter", item]
        return run(command, timeout=60, what="podman ps").stdout.split()

    def states(self) -> str:
        command = [
            self.podman,
            "ps",
            "--all",
            "--filter",
            f"label=com.docker.compose.project={self.project}",
            "--format",
            "{{.Names}}: {{.Status}}",
        ]
        return ", ".join(run(command, timeout=60, what="podman ps").stdout.splitlines())

    # ----------------------------------------------------------------- podman API service

    def start_service(self) -> subprocess.Popen[bytes]:
        log = (self.workdir / "podman-service.log").open("wb")
        service = subprocess.Popen(
            [self.podman, "system", "service", "--time=0", f"unix://{self.socket}"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

        def answers() -> bool:
            if service.poll() is not None:
                log_text = (self.workdir / "podman-service.log").read_text(errors="replace")
                pytest.fail(f"podman system service exited: {log_text[-2000:]}")
            with socket.socket(socket.AF_UNIX) as client:
                client.settimeout(2)
                client.connect(str(self.socket))
                client.sendall(b"GET /_ping HTTP/1.0\r\nHost: podman\r\n\r\n")
                return client.recv(64).startswith(b"HTTP/1.")

        wait_for("podman's API service answering on its socket", answers, timeout=60, every=0.5)
        return service

    # ----------------------------------------------------------------- images

    def build_images(self) -> None:
        """Build the Sluice image (and its upload target) and the stand-ins, in parallel."""
        base = ["--build-arg", f"BASE={BASE_IMAGE}"]
        dockerfile = str(ROOT / "deploy" / "Dockerfile")
        sluice = [self.podman, "build", "--quiet", *base, "--file", dockerfile]
        images = ROOT / "deploy" / "images"
        chains = {
            "sluice": [
                [*sluice, "--tag", self.images["SLUICE_IMAGE"], str(ROOT)],
                [
                    *sluice,
                    "--target",
                    "models-upload",
                    "--tag",
                    self.images["SLUICE_UPLOAD_IMAGE"],
                    str(ROOT),
                ],
            ],
        }
        for name, variable in (
            ("redis", "SLUICE_TEST_REDIS_IMAGE"),
            ("s3", "SLUICE_TEST_S3_IMAGE"),
            ("prometheus", "SLUICE_TEST_PROMETHEUS_IMAGE"),
        ):
            chains[name] = [
                [
                    self.podman,
                    "build",
                    "--quiet",
                    *base,
                    "--tag",
                    self.images[variable],
                    str(images / name),
                ]
            ]
        failures: dict[str, str] = {}

        def build(name: str, commands: list[list[str]]) -> None:
            started = time.monotonic()
            for command in commands:
                # Twice at most: a build that fetches packages fails with the network (a name
                # that did not resolve for a moment); the second failure is the test's.
                for attempt in (1, 2):
                    try:
                        result = subprocess.run(
                            command,
                            cwd=ROOT,
                            capture_output=True,
                            text=True,
                            timeout=BUILD_TIMEOUT_S,
                            check=False,
                        )
                    except subprocess.TimeoutExpired:
                        failures[name] = f"no end within {BUILD_TIMEOUT_S:.0f} s"
                        return
                    if result.returncode == 0:
                        break
                    if attempt == 1:
                        progress(f"building the {name} image failed; once more:")
                        progress(result.stderr[-1500:])
                        continue
                    failures[name] = f"exit {result.returncode}:\n{result.stderr[-4000:]}"
                    return
            progress(f"built the {name} image in {time.monotonic() - started:.0f} s")

        threads = [
            threading.Thread(target=build, args=(name, commands), daemon=True)
            for name, commands in chains.items()
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            pytest.fail(
                "image builds failed:\n"
                + "\n".join(f"--- {name}: {why}" for name, why in failures.items())
            )

    # ----------------------------------------------------------------- health checks

    def run_health_checks(self, stop: threading.Event) -> None:
        """Stand in for podman's systemd timers: run each container's health check at its
        interval while it is starting or unhealthy (``retries`` failures make it unhealthy,
        as with Docker)."""
        next_run: dict[str, float] = {}
        while not stop.wait(0.5):
            try:
                due = self.containers("health=starting") + self.containers("health=unhealthy")
                for container in due:
                    now = time.monotonic()
                    if next_run.get(container, 0.0) > now:
                        continue
                    next_run[container] = now + self.health_interval(container)
                    subprocess.run(
                        [self.podman, "healthcheck", "run", container],
                        capture_output=True,
                        timeout=30,
                        check=False,
                    )
            except BaseException:  # the test's own checks report what matters
                continue

    def health_interval(self, container: str) -> float:
        inspect = run([self.podman, "inspect", container], timeout=30, what="podman inspect")
        health = json.loads(inspect.stdout)[0]["Config"].get("Healthcheck") or {}
        return max(float(health.get("Interval") or 0) / 1e9, 1.0)

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "60", timeout=120, check=False)


def metric_value(text: str, family: str, labels: dict[str, str]) -> float | None:
    for metric in text_string_to_metric_families(text):
        if metric.name != family:
            continue
        for sample in metric.samples:
            if sample.name in (family, f"{family}_total") and all(
                sample.labels.get(key) == value for key, value in labels.items()
            ):
                return float(sample.value)
    return None


@pytest.fixture
def cleanup(capsys: pytest.CaptureFixture[str]) -> Iterator[Cleanup]:
    global _started
    _started = time.monotonic()
    _live.append(capsys)
    undo = Cleanup()
    yield undo
    progress("cleaning up ...")
    errors = undo.run()
    progress("cleaned up" if not errors else "cleaning up failed")
    _live.clear()
    if errors:
        pytest.fail("cleaning up after the compose test failed:\n" + "\n".join(errors))


@pytest.mark.timeout(SETUP_TIMEOUT_S + BUILD_TIMEOUT_S + UP_TIMEOUT_S + READY_TIMEOUT_S + 600)
def test_compose_up_serves_an_inference_and_its_metrics(cleanup: Cleanup) -> None:
    progress("setting up podman (scripts/containers.sh) ...")
    ip_forward = IP_FORWARD.read_text() if IP_FORWARD.exists() else None

    def restore_ip_forward() -> None:
        if ip_forward is not None and IP_FORWARD.read_text() != ip_forward:
            IP_FORWARD.write_text(ip_forward)

    cleanup.add("restoring net.ipv4.ip_forward", restore_ip_forward)
    setup = run(["bash", str(SETUP_SCRIPT)], timeout=SETUP_TIMEOUT_S, what="scripts/containers.sh")
    compose_binary = setup.stdout.strip().splitlines()[-1]
    podman = shutil.which("podman")
    assert podman, "scripts/containers.sh ran but podman is not on PATH"
    progress(f"podman ready, compose at {compose_binary}")

    tables = nft_tables()

    def delete_new_tables() -> None:
        for table in sorted(nft_tables() - tables):
            subprocess.run(["nft", "delete", "table", *table.split()], check=True)

    cleanup.add("deleting the nftables tables podman made", delete_new_tables)
    before = Snapshot.take(podman)
    cleanup.add("removing what podman made", lambda: remove_new(podman, before))

    workdir = Path(tempfile.mkdtemp(prefix="sluice-compose-"))
    cleanup.add("removing the work folder", lambda: shutil.rmtree(workdir, ignore_errors=True))
    stack = Stack(podman, compose_binary, workdir)
    progress(f"project {stack.project}, ports {stack.ports}")

    service = stack.start_service()

    def stop_service() -> None:
        service.terminate()
        try:
            service.wait(timeout=15)
        except subprocess.TimeoutExpired:
            service.kill()
            service.wait(timeout=15)

    cleanup.add("stopping podman's API service", stop_service)

    # Without the secrets compose refuses to start, and says what to run.
    empty = workdir / "empty.env"
    empty.write_text("")
    refused = run(
        [
            stack.compose_binary,
            "--env-file",
            str(empty),
            "--file",
            str(ROOT / "compose.yaml"),
            "config",
            "--quiet",
        ],
        timeout=60,
        env=stack.env,
        check=False,
    )
    assert refused.returncode != 0
    assert "run scripts/compose-env.sh first" in refused.stderr, refused.stderr
    assert stat.S_IMODE(stack.env_file.stat().st_mode) == 0o600

    progress("building the images (Sluice from deploy/Dockerfile, stand-ins) ...")
    stack.build_images()

    stop_checks = threading.Event()
    checker = threading.Thread(target=stack.run_health_checks, args=(stop_checks,), daemon=True)

    def take_down() -> None:
        stop_checks.set()
        checker.join(timeout=30)
        stack.compose(
            "down", "--volumes", "--timeout", "1", "--remove-orphans", timeout=180, check=True
        )

    cleanup.add("compose down", take_down)
    checker.start()
    progress("compose up -d ...")
    try:
        stack.compose("up", "--detach", "--no-build", "--pull", "never", timeout=UP_TIMEOUT_S)
    except BaseException:
        progress(f"compose up failed; containers: {stack.states()}\n{stack.logs()}")
        raise
    progress(f"compose up returned; containers: {stack.states()}")

    def gateway_ready() -> bool:
        status, _ = http(stack.url("SLUICE_HTTP_PORT", "/v2/health/ready"), timeout=3)
        return status == 200

    deadline = time.monotonic() + READY_TIMEOUT_S
    while not _probe(gateway_ready):
        if time.monotonic() > deadline:
            pytest.fail(
                f"the gateway was not ready within {READY_TIMEOUT_S:.0f} s; "
                f"containers: {stack.states()}\nlogs:\n{stack.logs()}"
            )
        progress(f"waiting for the gateway; containers: {stack.states()}")
        time.sleep(5)
    progress("gateway ready")

    try:
        check_stack(stack)
    except BaseException:
        progress(f"containers: {stack.states()}\nlogs:\n{stack.logs()}")
        raise
    progress("all checks passed; taking the stack down")


def _probe(probe: Callable[[], bool]) -> bool:
    try:
        return probe()
    except OSError:
        return False


def check_stack(stack: Stack) -> None:
    # Without a key: refused; with a tenant's key: an inference through the published port.
    infer_url = stack.url("SLUICE_HTTP_PORT", "/v2/models/iris/infer")
    status, _ = http(infer_url, json.dumps(IRIS_REQUEST).encode())
    assert status == 401, f"an inference without a key: HTTP {status}"
    status, body = http(infer_url, json.dumps(IRIS_REQUEST).encode(), key=stack.key)
    assert status == 200, f"iris inference: HTTP {status}: {body[:500]!r}"
    outputs = {output["name"]: output for output in json.loads(body)["outputs"]}
    assert outputs["label"]["data"] == [0, 2], outputs
    progress("iris answered through the gateway")

    # Triton's counters on the metrics port (which serves /metrics only).
    def success_counted() -> bool:
        status, text = http(stack.url("SLUICE_METRICS_PORT", "/metrics"), key=stack.key)
        assert status == 200, f"GET /metrics on the metrics port: HTTP {status}"
        labels = {"model": "iris", "version": "1"}
        return metric_value(text.decode(), "nv_inference_request_success", labels) == 1.0

    wait_for('nv_inference_request_success{model="iris",version="1"} 1', success_counted, 30)
    status, _ = http(stack.url("SLUICE_METRICS_PORT", "/v2/health/ready"), key=stack.key)
    assert status != 200, "the metrics port serves more than /metrics"
    progress("the metrics port counts the inference")

    # The same inference over gRPC, on Triton's port as compose publishes it.
    with grpcclient.InferenceServerClient(f"127.0.0.1:{stack.ports['SLUICE_GRPC_PORT']}") as rpc:
        features = np.array(IRIS_REQUEST["inputs"][0]["data"], np.float32).reshape(2, 4)
        tensor = grpcclient.InferInput("input", [2, 4], "FP32")
        tensor.set_data_from_numpy(features)
        with pytest.raises(InferenceServerException):
            rpc.infer("iris", [tensor])  # no key
        answer = rpc.infer("iris", [tensor], headers={"authorization": f"Bearer {stack.key}"})
        assert answer.as_numpy("label").tolist() == [[0], [2]]
    progress("iris answered over gRPC")

    # Redis keeps an append-only file.
    (redis,) = stack.containers("label=com.docker.compose.service=redis")
    appendonly = run(
        [stack.podman, "exec", redis, "redis-cli", "config", "get", "appendonly"], timeout=30
    ).stdout.split()
    assert appendonly == ["appendonly", "yes"], appendonly
    # ... needs its password (redis-cli in the container has it in REDISCLI_AUTH) ...
    anonymous = run(
        [stack.podman, "exec", redis, "env", "-u", "REDISCLI_AUTH", "redis-cli", "ping"],
        timeout=30,
        check=False,
    )
    assert "NOAUTH" in anonymous.stdout + anonymous.stderr, anonymous
    # ... and refuses writes once full rather than evicting queued entries.
    for name, value in (("maxmemory", str(1 << 30)), ("maxmemory-policy", "noeviction")):
        got = run(
            [stack.podman, "exec", redis, "redis-cli", "config", "get", name], timeout=30
        ).stdout.split()
        assert got == [name, value], got
    progress("Redis: append-only, password, maxmemory with noeviction")
    check_hardening(stack)

    # The one-shot upload of the example models to the S3 store.
    def upload_finished() -> str | None:
        (container,) = stack.containers("label=com.docker.compose.service=models-upload")
        state = run(
            [
                stack.podman,
                "inspect",
                "--format",
                "{{.State.Status}} {{.State.ExitCode}}",
                container,
            ],
            timeout=30,
        ).stdout.split()
        return container if state == ["exited", "0"] else None

    # The controller leads (no other contends for the lease).
    def controller_leads() -> bool:
        (container,) = stack.containers("label=com.docker.compose.service=controller")
        logs = run([stack.podman, "logs", container], timeout=30).stdout
        return "leads (fencing token" in logs

    wait_for("the controller leading", controller_leads, 60)
    progress("the controller leads")

    # The batch worker is up on the deployment's Redis (Celery).
    def batch_worker_up() -> bool:
        (container,) = stack.containers("label=com.docker.compose.service=batch-worker")
        result = run([stack.podman, "logs", container], timeout=30)
        return "batch worker on queue sluice-sluice-batch" in result.stdout + result.stderr

    wait_for("the batch worker listening", batch_worker_up, 60)
    progress("the batch worker listens")

    uploader = wait_for("models-upload exiting with 0", upload_finished, 120)
    logs = run([stack.podman, "logs", str(uploader)], timeout=30).stdout
    assert "uploaded s3://models/iris/1/model.onnx" in logs, logs[-2000:]
    progress("models-upload put the example models in the S3 store")

    # Prometheus scrapes the gateway's metrics port.
    def scraped() -> bool:
        query = "/api/v1/query?query=nv_inference_request_success"
        status, body = http(stack.url("SLUICE_PROMETHEUS_PORT", query))
        results = json.loads(body)["data"]["result"] if status == 200 else []
        return any(
            result["metric"].get("model") == "iris" and float(result["value"][1]) == 2.0
            for result in results
        )

    # Two: the REST inference and the gRPC one.
    wait_for('Prometheus holding nv_inference_request_success{model="iris"} 2', scraped, 90, 2)
    progress("Prometheus scraped the gateway's metrics port")
    check_batch_from_a_laptop(stack)


def check_batch_from_a_laptop(stack: Stack) -> None:
    """A batch job as a user runs it from a laptop: the CLI on this host, in a folder the
    stack knows nothing of, uploads the rows through the gateway into the batch store
    (MinIO's place), the batch worker runs them, and the CLI downloads the outputs."""
    import onnxruntime as ort

    laptop = Path(tempfile.mkdtemp(prefix="sluice-laptop-"))
    try:
        rows = np.random.default_rng(26).standard_normal((3_000, 16), dtype=np.float32)
        np.save(laptop / "rows.npy", rows)
        env = {
            **os.environ,
            "SLUICE_URL": stack.url("SLUICE_HTTP_PORT", ""),
            "SLUICE_API_KEY": stack.key,
        }
        command = [
            str(ROOT / ".venv" / "bin" / "sluice"),
            "batch",
            "submit",
            "--model",
            "mlp",
            "--input",
            "rows.npy",
            "--output",
            "out",
            "--shard-rows",
            "1000",
        ]
        try:
            submitted = subprocess.run(
                command,
                cwd=laptop,
                env=env,
                capture_output=True,
                text=True,
                timeout=BATCH_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(
                f"`sluice batch submit` did not end within {BATCH_TIMEOUT_S} s\n"
                f"{_batch_diagnosis(stack, exc.stdout, exc.stderr)}"
            ) from None
        assert submitted.returncode == 0, _batch_diagnosis(
            stack, submitted.stdout, submitted.stderr
        )
        session = ort.InferenceSession(str(ROOT / "model_repository" / "mlp" / "1" / "model.onnx"))
        (expected,) = session.run(None, {session.get_inputs()[0].name: rows})
        output = np.load(laptop / "out" / "output.npy")
        np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)
    finally:
        shutil.rmtree(laptop, ignore_errors=True)
    progress("a batch job from a laptop: uploaded, run and downloaded, equal to onnxruntime")


def _batch_diagnosis(stack: Stack, stdout: str | bytes | None, stderr: str | bytes | None) -> str:
    """What a failed batch from a laptop leaves to read, put in the failure message itself
    (a CI log keeps the message whole, but may cut the captured output): the CLI's output,
    the tenant's batches as the API reports them, the containers, the batch worker's log."""

    def text(value: str | bytes | None) -> str:
        return value.decode(errors="replace") if isinstance(value, bytes) else value or ""

    try:
        status, body = http(stack.url("SLUICE_HTTP_PORT", "/v2/batches"), key=stack.key)
        batches = f"HTTP {status} {body.decode(errors='replace')[:2000]}"
    except OSError as exc:
        batches = f"unreachable: {exc}"
    worker_log = stack.compose(
        "logs", "--no-color", "--tail", "80", "batch-worker", timeout=120, check=False
    )
    return (
        f"stdout: {text(stdout)[-2000:]}\nstderr: {text(stderr)[-2000:]}\n"
        f"GET /v2/batches: {batches}\ncontainers: {stack.states()}\n"
        f"batch-worker log (last 80 lines):\n{worker_log[-8000:]}"
    )


def check_hardening(stack: Stack) -> None:
    """Every container of the stack as compose.yaml asks: not root (but the one-shot chown),
    read-only root file system, no capability, no-new-privileges."""
    for container in stack.containers():
        inspect = json.loads(
            run([stack.podman, "inspect", container], timeout=30, what="podman inspect").stdout
        )[0]
        service = inspect["Config"]["Labels"]["com.docker.compose.service"]
        host = inspect["HostConfig"]
        assert host["ReadonlyRootfs"] is True, service
        user = inspect["Config"].get("User") or "root"
        if service == "volumes-init":
            assert set(host.get("CapAdd") or []) <= {"CAP_CHOWN", "CHOWN"}, host.get("CapAdd")
        else:
            assert user.split(":")[0] not in ("", "0", "root"), (service, user)
        assert "no-new-privileges" in " ".join(host.get("SecurityOpt") or []), service
        effective = {c.removeprefix("CAP_") for c in inspect.get("EffectiveCaps") or []}
        assert effective <= {"CHOWN"}, (service, effective)
    progress("every container: not root, read-only, no capability, no-new-privileges")


def remove_new(podman: str, before: Snapshot) -> None:
    """Remove the containers, volumes, networks and images that appeared since ``before``."""
    for _ in range(3):
        now = Snapshot.take(podman)
        new = {
            "containers": now.containers - before.containers,
            "volumes": now.volumes - before.volumes,
            "networks": now.networks - before.networks,
            "images": now.images - before.images,
        }
        if not any(new.values()):
            return
        if new["containers"]:
            subprocess.run([podman, "rm", "--force", *new["containers"]], capture_output=True)
        if new["volumes"]:
            subprocess.run(
                [podman, "volume", "rm", "--force", *new["volumes"]], capture_output=True
            )
        if new["networks"]:
            subprocess.run(
                [podman, "network", "rm", "--force", *new["networks"]], capture_output=True
            )
        if new["images"]:
            subprocess.run([podman, "rmi", "--force", *new["images"]], capture_output=True)
    left = Snapshot.take(podman)
    leftovers = {
        "containers": left.containers - before.containers,
        "volumes": left.volumes - before.volumes,
        "networks": left.networks - before.networks,
        "images": left.images - before.images,
    }
    leftovers = {kind: ids for kind, ids in leftovers.items() if ids}
    if leftovers:
        raise RuntimeError(f"podman objects left behind: {leftovers}")
