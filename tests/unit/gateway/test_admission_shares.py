"""A full model queue shared between tenants by weight (sluice.gateway.admission)."""

from __future__ import annotations

from contextlib import ExitStack

import pytest

from sluice.core.errors import Overloaded, ServerBusy
from sluice.core.tenant_limits import TenantLimit, TenantLimits
from sluice.gateway.admission import Admission

MODEL, VERSION, MAX_QUEUE = "m", 1, 4


def hold(admission: Admission, stack: ExitStack, tenant: str, count: int) -> None:
    for _ in range(count):
        stack.enter_context(admission.admit(MODEL, VERSION, MAX_QUEUE, "r", tenant))


def refused(admission: Admission, tenant: str) -> bool:
    try:
        with admission.admit(MODEL, VERSION, MAX_QUEUE, "r1", tenant):
            return False
    except Overloaded as error:
        assert error.message.startswith("[request id: r1] Exceeds maximum queue size")
        assert not isinstance(error, ServerBusy)
        return True


def test_one_tenant_is_refused_once_the_queue_is_full() -> None:
    admission = Admission(100)
    with ExitStack() as stack:
        hold(admission, stack, "anonymous", MAX_QUEUE)
        assert refused(admission, "anonymous")
    assert admission.tenant_queue_full == {"anonymous": 1}
    admission.observe({(MODEL, VERSION): MAX_QUEUE})  # full through other gateways
    assert refused(admission, "anonymous")  # (it holds none here: as before)


def test_a_tenant_under_its_share_joins_a_full_queue() -> None:
    admission = Admission(100)
    with ExitStack() as stack:
        hold(admission, stack, "flood", MAX_QUEUE)
        assert refused(admission, "flood")
        assert not refused(admission, "quiet")  # 0 held, share 2 of 4
        hold(admission, stack, "quiet", 1)
        assert not refused(admission, "quiet")  # 1 held < 2
        hold(admission, stack, "quiet", 1)
        assert refused(admission, "quiet")  # 2 held: its share
        assert refused(admission, "flood")
    admitted, queue_full = admission.take_tenant_counts()
    assert admitted == {"flood": MAX_QUEUE, "quiet": 4}
    assert queue_full == {"flood": 2, "quiet": 1}
    assert admission.per_tenant[(MODEL, VERSION)] == {}


def test_shares_follow_the_weights() -> None:
    limits = TenantLimits({"heavy": TenantLimit(weight=3.0)})
    admission = Admission(100, weight=limits.weight)
    with ExitStack() as stack:
        hold(admission, stack, "light", MAX_QUEUE)
        # heavy's share: 3 / (1 + 3) of 4 = 3, while the queue stays below 8
        hold(admission, stack, "heavy", 2)
        assert not refused(admission, "heavy")
        hold(admission, stack, "heavy", 1)
        assert refused(admission, "heavy")


def test_no_tenant_passes_twice_the_queue_size() -> None:
    admission = Admission(100)
    with ExitStack() as stack:
        hold(admission, stack, "flood", MAX_QUEUE)
        admission.observe({(MODEL, VERSION): 2 * MAX_QUEUE})
        assert refused(admission, "quiet")


def test_the_gateway_limit_comes_first() -> None:
    admission = Admission(1)
    with (
        admission.admit(MODEL, VERSION, MAX_QUEUE, "r", "a"),
        pytest.raises(ServerBusy),
        admission.admit(MODEL, VERSION, MAX_QUEUE, "r", "b"),
    ):
        pass


def test_an_old_reading_of_a_full_queue_does_not_refuse_once_it_drained(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The depth read in the background counts for ``fresh_s``: after a flood the refresh
    slows down (nothing arrives), and its last reading must not refuse the first request
    after the queue drained; this process's own requests always count."""
    now = [1000.0]
    monkeypatch.setattr("sluice.gateway.admission.time.monotonic", lambda: now[0])
    admission = Admission(100, fresh_s=1.0)
    admission.observe({(MODEL, VERSION): MAX_QUEUE})  # full through other gateways
    assert refused(admission, "a")
    now[0] += 0.9
    assert refused(admission, "a")  # still fresh
    now[0] += 0.2
    assert not refused(admission, "a")  # an old reading: only own requests count
    with ExitStack() as stack:
        hold(admission, stack, "a", MAX_QUEUE)
        assert refused(admission, "a")
