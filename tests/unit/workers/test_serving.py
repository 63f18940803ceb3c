"""Whose a Python model's calls are: the tenant of the batch its worker computes on that
thread; a batch that mixes tenants makes shared calls (the anonymous tenant's, never
answered from nor kept in the response cache, whose answers are each one tenant's)."""

from __future__ import annotations

import threading

import numpy as np

from sluice.core.config.parse import parse_config_text
from sluice.workers.backends import python_backend
from sluice.workers.backends import triton_python_backend_utils as pb
from sluice.workers.model_calls import CallContext, cached
from sluice.workers.serving import serving, serving_tenant


def test_one_tenant_s_batch_makes_that_tenant_s_calls() -> None:
    assert serving_tenant() == ("", False)
    with serving(["team-a", "team-a"]):
        assert serving_tenant() == ("team-a", False)
    assert serving_tenant() == ("", False)


def test_a_batch_of_several_tenants_makes_shared_calls() -> None:
    with serving(["team-a", "team-b"]):
        assert serving_tenant() == ("", True)
        with serving(["team-b"]):  # (nested: the inner batch, then the outer again)
            assert serving_tenant() == ("team-b", False)
        assert serving_tenant() == ("", True)


def test_each_thread_has_its_own_batch() -> None:
    seen: list[tuple[str, bool]] = []
    with serving(["team-a"]):
        thread = threading.Thread(target=lambda: seen.append(serving_tenant()))
        thread.start()
        thread.join()
    assert seen == [("", False)]


def test_a_python_model_s_call_carries_the_batch_s_tenant() -> None:
    """Sluice's own Python models (``context.infer``) as Triton's (``pb_utils``)."""
    x = np.ones((1, 2), np.float32)
    for tenants, expected in ((["team-a"], ("team-a", False)), (["a", "b"], ("", True))):
        with serving(tenants):
            context = python_backend._call_args({"X": x}, [], None)[2]
            assert (context.tenant, context.shared) == expected
            request = pb.InferenceRequest(
                model_name="m", requested_output_names=[], inputs=[pb.Tensor("X", x)]
            )
            context = request._call_args()[4]
            assert (context.tenant, context.shared) == expected


def test_a_shared_call_bypasses_the_response_cache() -> None:
    config = parse_config_text(
        'name: "m"\nbackend: "onnxruntime"\nmax_batch_size: 8\nresponse_cache { enable: true }\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]\n',
        model_name="m",
    )
    assert cached(config, CallContext(tenant="team-a"))
    assert cached(config, CallContext())
    assert not cached(config, CallContext(shared=True))
