"""One Sluice stack shared by the integration tests, over a repository the tests build."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.onnx_models import ALL_DATATYPES, write_identity
from tests.support.stack import Stack

ROOT = Path(__file__).resolve().parents[2]
BODY_LIMIT = 1 << 20


def load_examples_builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "example_builder", ROOT / "model_repository" / "build.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repository")
    # The ONNX examples only: the other backends have their own stack (test_backends.py).
    load_examples_builder().build_all(root, models=("iris", "mlp", "cnn"))
    write_identity(
        root,
        "identity",
        [dt for dt in ALL_DATATYPES if dt != "BF16"],
        # Triton's fixed window (adaptive batching off): tests rely on every batch waiting
        # 20 ms for company (test_adaptive_batching.py covers the adaptive default).
        extra="dynamic_batching { max_queue_delay_microseconds: 20000 }\n"
        'parameters { key: "adaptive_batching" value: { string_value: "false" } }',
    )
    write_identity(root, "identity_bf16", ["BF16"])
    write_identity(root, "nobatch", ["FP32"], dims=(2, 3), max_batch_size=0)
    broken = root / "broken_config"
    (broken / "1").mkdir(parents=True)
    (broken / "config.pbtxt").write_text('name: "broken_config"\nmax_batch_size: eight\n')
    corrupt = write_identity(root, "corrupt_model", ["FP32"])
    (corrupt / "1" / "model.onnx").write_bytes(b"this is not an onnx file")
    (corrupt / "config.pbtxt").write_text(
        (corrupt / "config.pbtxt").read_text()  # keeps inputs/outputs so only loading fails
    )
    return root


@pytest.fixture(scope="session")
def stack(repository: Path, redis_server: RedisServer) -> Iterator[Stack]:
    stack = Stack(repository, redis_server.url, env={"SLUICE_MAX_BODY_BYTES": str(BODY_LIMIT)})
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server, a real HTTP server on a free loopback port, for one test module."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()
