"""The requests a model makes on a tenant's behalf are that tenant's: an ensemble's steps
and a Triton Python model's BLS calls go to the called model's stream of that tenant (so the
called model shares its time between tenants, as it does for their own requests), not to
the anonymous tenant's."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import orjson
from redis import Redis

from sluice.core.keys import Keys, tenant_stream
from sluice.core.queue_streams import WAKE_FIELD
from sluice.core.wire import decode_request
from sluice.scheduler.executor.redis_server import RedisServer
from tests.support.gate_model import BLOCKER_ITERS, open_gate, write_gate, write_wrapper
from tests.support.load import slow_request
from tests.support.procs import wait_until
from tests.support.stack import Stack

CALLER = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            call = pb_utils.InferenceRequest(
                model_name="slow",
                requested_output_names=["OUT"],
                inputs=[
                    pb_utils.get_input_tensor_by_name(request, "IN"),
                    pb_utils.get_input_tensor_by_name(request, "ITERS"),
                ],
            )
            answer = call.exec()
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            out = pb_utils.get_output_tensor_by_name(answer, "OUT")
            responses.append(pb_utils.InferenceResponse([out]))
        return responses
"""

CALLER_CONFIG = """name: "caller"
backend: "python"
max_batch_size: 1
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] },
        { name: "ITERS" data_type: TYPE_INT64 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def test_ensemble_steps_and_bls_calls_are_their_tenants(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    repository, gate = tmp_path / "repository", tmp_path / "gate"
    gate.mkdir()
    write_gate(repository, "slow")
    write_wrapper(repository, "wrapped", "slow")
    (repository / "caller" / "1").mkdir(parents=True)
    (repository / "caller" / "1" / "model.py").write_text(CALLER)
    (repository / "caller" / "config.pbtxt").write_text(CALLER_CONFIG)
    stack = Stack(
        repository,
        redis_server.url,
        grpc_port=0,
        env={"SLUICE_API_KEYS": "team-a:key-a,team-b:key-b", "SLUICE_TEST_GATE": str(gate)},
    )
    stack.start()
    client = Redis.from_url(redis_server.url)
    keys = Keys(stack.namespace)
    base = keys.request_stream("slow", 1)
    answers: list[Any] = []

    def send(model: str, key: str, iters: int) -> threading.Thread:
        def post() -> None:
            with httpx.Client(base_url=stack.url, timeout=120) as http:
                response = http.post(
                    f"/v2/models/{model}/infer",
                    content=orjson.dumps(slow_request(1, iters)),
                    headers={"authorization": f"Bearer {key}"},
                )
            answers.append((model, response.status_code, response.text))

        thread = threading.Thread(target=post, daemon=True)
        thread.start()
        return thread

    def tenants_queued(stream: str) -> list[str]:
        entries = client.xrange(stream)
        return [decode_request(f)[0].tenant for _, f in entries if WAKE_FIELD not in f]

    try:
        # team-b holds the only instance; team-a's calls wait in team-a's stream.
        threads = [send("slow", "key-b", BLOCKER_ITERS)]
        assert wait_until(lambda: tenants_queued(tenant_stream(base, "team-b")) == ["team-b"], 60)
        threads += [send("wrapped", "key-a", 1), send("caller", "key-a", 1)]
        team_a = tenant_stream(base, "team-a")
        assert wait_until(lambda: len(tenants_queued(team_a)) == 2, 60), tenants_queued(base)
        assert tenants_queued(team_a) == ["team-a", "team-a"]
        assert tenants_queued(base) == []  # nothing went as the anonymous tenant's
        assert team_a.encode() in client.smembers(keys.tenant_streams("slow", 1))
        open_gate(gate, "slow")
        for thread in threads:
            thread.join(120)
        assert sorted(status for _, status, _ in answers) == [200, 200, 200], answers
    finally:
        open_gate(gate, "slow")
        client.close()
        stack.stop()
