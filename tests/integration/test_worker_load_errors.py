"""A worker whose model fails to load reports why in Redis, where the repository index
and every load's answer read it: a model's exception may carry any amount of text, so
what is kept is bounded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from redis import Redis

from sluice.core.keys import Keys
from sluice.scheduler.executor.redis_server import RedisServer
from sluice.workers.worker import MAX_LOAD_ERROR_CHARS

CONFIG = """name: "loud"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""
MODEL = """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("x" * 10_000_000)
"""


def test_a_huge_load_error_is_kept_short(tmp_path: Path, redis_server: RedisServer) -> None:
    (tmp_path / "loud" / "1").mkdir(parents=True)
    (tmp_path / "loud" / "config.pbtxt").write_text(CONFIG)
    (tmp_path / "loud" / "1" / "model.py").write_text(MODEL)
    namespace = f"loud{os.getpid()}"
    env = dict(os.environ, SLUICE_REDIS_URL=redis_server.url, SLUICE_NAMESPACE=namespace)
    argv = ["--model-repository", str(tmp_path), "--model", "loud", "--version", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "sluice.workers", *argv, "--kind", "KIND_CPU", "--threads", "1"],
        env=env,
        timeout=120,
        capture_output=True,
    )
    assert done.returncode != 0
    client = Redis.from_url(redis_server.url)
    try:
        errors = client.hgetall(Keys(namespace).load_errors)
    finally:
        client.close()
    (reason,) = errors.values()
    assert b"xxxx" in reason and reason.endswith(b" ... (cut)")
    assert len(reason) < MAX_LOAD_ERROR_CHARS + 100
