"""Hosts cut off by the network, on test hosts joined by veth links (issue 17).

Redis alone on one host, the gateway on another (a front link for clients, a back link to
Redis), and two worker hosts, each running ``sluice up --no-gateway --no-controller`` on the
back network: the "Several hosts" layout (docs/operations/several-hosts.md), every setting
at its default. A cut link drops what crosses it without a word to either side
(:mod:`tests.support.netns`), so each side learns of it from its own timeouts, as across a
failed switch.

- A worker host cut off mid-load: the requests it held are answered by the other host's
  worker once its heartbeat stops, none is lost, none answered twice or wrongly, no client
  sees an error; when the link returns, the host serves again (it alone serves while the
  other host is cut in its turn).
- The gateway cut off from Redis: clients get 503 quickly rather than waiting for their
  deadlines, and answers again once the link returns, without a restart.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from typing import cast

import pytest

from sluice.core.keys import WORKER_GROUP
from sluice.core.redis_client.types import StreamEntry
from sluice.core.settings import GatewaySettings
from sluice.core.wire import decode_request
from tests.faults.conftest import Report
from tests.support.load import Answer, Load, slow_request
from tests.support.multihost import Deployment
from tests.support.netns import Host, HostNetwork, unavailable_reason
from tests.support.slow_model import write_slow

MODEL = "slow"
CLIENTS = 8
REDIS_TIMEOUT_S = GatewaySettings().redis_timeout_s
GATEWAY_CUT_S = 8.0
NOTICED_S = 2 * REDIS_TIMEOUT_S + 1.0
"""By then the gateway knows: a refresh (every 0.5 s) timed out, with its one retry."""


def _request(index: int) -> dict[str, object]:
    return slow_request(index, iters=20)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.fail(f"the partition tests need test hosts: {reason}")
    base = tmp_path_factory.mktemp("hosts")
    repository = base / "repository"
    repository.mkdir()
    write_slow(repository, MODEL, extra="dynamic_batching { max_queue_delay_microseconds: 1000 }")
    with HostNetwork() as network:
        deployment = Deployment(network, repository, base / "logs", gateways=1, worker_hosts=2)
        try:
            deployment.start()
            deployment.wait_for_workers(MODEL, 1)
            yield deployment
        finally:
            deployment.stop()


def _held_requests(deployment: Deployment, host: Host) -> set[str]:
    """Client ids of the requests the workers of ``host`` hold (read, not answered)."""
    redis = deployment.redis
    assert redis is not None
    stream = deployment.keys.request_stream(MODEL, 1)
    ids: set[str] = set()
    for worker in deployment.workers_by_host(MODEL).get(host.name, set()):
        rows = redis.xpending_range(
            stream, WORKER_GROUP, min="-", max="+", count=10_000, consumername=worker
        )
        for row in rows:
            entries = cast(
                list[StreamEntry], redis.xrange(stream, row["message_id"], row["message_id"])
            )
            ids |= {decode_request(fields)[0].client_id for _, fields in entries}
    return ids


def _cut_while_busy(deployment: Deployment, host: Host, timeout_s: float = 10.0) -> set[str]:
    """Cut ``host``'s back link while its worker holds requests; their client ids. Once cut,
    the host can neither take nor answer anything, so what it holds is read after the cut."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _held_requests(deployment, host):
            deployment.network.cut(host, "back")
            held = _held_requests(deployment, host)
            if held:
                return held
            deployment.network.restore(host, "back")  # it answered them just before the cut
        time.sleep(0.01)
    raise AssertionError(f"{host.name} held no request within {timeout_s} s")


def _wait(predicate: Callable[[], bool], timeout_s: float) -> float | None:
    """Seconds until ``predicate()`` held, or None if it did not within ``timeout_s``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.05)
    return None


def _since(start: float, predicate: Callable[[], bool], timeout_s: float = 20.0) -> float | None:
    """Seconds from ``start`` until ``predicate()`` held (None: not within ``timeout_s``)."""
    waited = _wait(predicate, timeout_s)
    return None if waited is None else time.monotonic() - start


def _answered_ok(load: Load, ids: set[str]) -> bool:
    return ids <= {f"req-{a.index}" for a in list(load.answers) if a.correct}


def _finished_between(answers: list[Answer], start: float, end: float) -> list[Answer]:
    return [a for a in answers if start <= a.started_s + a.latency_s <= end]


@pytest.mark.timeout(150)
def test_a_worker_host_cut_off_mid_load_loses_nothing(
    deployment: Deployment, report: Report
) -> None:
    first, second = deployment.worker_host_list
    network = deployment.network
    load = Load(deployment.gateway_url(), MODEL, CLIENTS, 10**9, build=_request).start()
    try:
        time.sleep(1.5)
        held = _cut_while_busy(deployment, first)
        cut_at = time.monotonic()
        declared_dead_s = _since(
            cut_at, lambda: first.name not in deployment.workers_by_host(MODEL)
        )
        taken_over_s = _since(cut_at, lambda: _answered_ok(load, held))
        time.sleep(max(0.0, 5 - (time.monotonic() - cut_at)))

        network.restore(first, "back")
        restored_at = time.monotonic()
        back_s = _wait(lambda: first.name in deployment.workers_by_host(MODEL), 30)
        assert back_s is not None, "the cut host's worker did not beat again:\n" + deployment.logs()

        # The first host alone now: the second is cut in its turn.
        network.cut(second, "back")
        second_cut_at = time.monotonic()
        time.sleep(4)
        network.restore(second, "back")
        second_restored_at = time.monotonic()
        time.sleep(1)
    finally:
        load.stop()
        network.restore(first, "back")
        network.restore(second, "back")
    load.join(60)

    answers = list(load.answers)
    # While the second host is cut, its answers cannot reach Redis: what finishes then
    # (past the first second, when answers it sent before the cut may still arrive) comes
    # from the first host.
    alone = _finished_between(answers, second_cut_at + 1, second_restored_at)
    figures = load.figures()
    figures.update(
        held_by_cut_host=len(held),
        held_answered_after_s=round(taken_over_s, 2) if taken_over_s is not None else None,
        cut_host_declared_dead_after_s=(
            round(declared_dead_s, 2) if declared_dead_s is not None else None
        ),
        cut_host_beating_again_after_s=round(back_s, 2),
        answered_by_the_returned_host_alone=sum(a.correct for a in alone),
        restored_after_s=round(restored_at - cut_at, 2),
    )
    report(figures)

    assert taken_over_s is not None, (
        f"requests held by the cut host were not answered: {held}\n" + deployment.logs()
    )
    assert figures["lost"] == 0
    assert figures["duplicated"] == 0
    assert figures["wrong_answers"] == 0
    assert figures["errors_by_status"] == {}, [a.error for a in answers if a.status != 200][:5]
    assert figures["ok"] == figures["sent"]
    assert figures["answered_by_the_returned_host_alone"] >= 10, deployment.logs()


@pytest.mark.timeout(120)
def test_a_gateway_cut_off_from_redis_answers_503_quickly(
    deployment: Deployment, report: Report
) -> None:
    gateway = deployment.gateway_hosts[0]
    network = deployment.network
    deployment.wait_for_workers(MODEL, 1)
    load = Load(deployment.gateway_url(), MODEL, CLIENTS, 10**9, build=_request).start()
    try:
        time.sleep(1.5)
        network.cut(gateway, "back")
        cut_at = time.monotonic()
        time.sleep(GATEWAY_CUT_S)
        network.restore(gateway, "back")
        restored_at = time.monotonic()
        serving_again_s = _wait(
            lambda: any(a.correct and a.started_s > restored_at for a in list(load.answers)), 15
        )
        time.sleep(1)
    finally:
        load.stop()
        network.restore(gateway, "back")
    load.join(60)

    answers = list(load.answers)
    during = [a for a in answers if cut_at <= a.started_s <= restored_at]
    after_detection = [a for a in during if cut_at + NOTICED_S <= a.started_s <= restored_at - 0.5]
    failed = [a for a in answers if a.status != 200]
    figures = load.figures()
    figures.update(
        sent_while_cut=len(during),
        answered_503_while_cut=sum(a.status == 503 for a in during),
        slowest_answer_while_cut_s=round(max((a.latency_s for a in during), default=0.0), 2),
        slowest_answer_once_noticed_s=round(
            max((a.latency_s for a in after_detection), default=0.0), 3
        ),
        serving_again_after_s=round(serving_again_s, 2) if serving_again_s is not None else None,
    )
    report(figures)

    assert figures["lost"] == 0, "a client got no answer at all"
    assert {a.status for a in failed} <= {503}, [(a.status, a.error) for a in failed][:5]
    assert all(a.well_formed for a in failed)
    assert figures["wrong_answers"] == 0
    assert figures["answered_503_while_cut"] > 0
    # No one waits for a deadline (60 s): at most a command's timeout and its one retry.
    assert figures["slowest_answer_while_cut_s"] <= 2 * REDIS_TIMEOUT_S + 1.5
    # Once the gateway knows, it answers at once, without touching Redis: none waits a
    # command's timeout (a busy machine's client may stall an answer by a second), and
    # most are answered within milliseconds.
    assert after_detection and figures["slowest_answer_once_noticed_s"] < REDIS_TIMEOUT_S
    assert statistics.median(a.latency_s for a in after_detection) < 0.25
    assert serving_again_s is not None and serving_again_s < 5, deployment.logs()
