"""Whose requests a model computes now, for the calls it makes meanwhile.

A Python model calls other models (Triton's BLS) from ``execute``, while its worker computes
one batch on that thread. A call is made on behalf of the batch's tenant, as a client's
request is (its queue, its limits, its answers in the response cache); when the batch mixes
tenants' requests, the call serves them all and is no one tenant's
(:attr:`sluice.workers.model_calls.CallContext.shared`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator

_SERVING = threading.local()


@contextlib.contextmanager
def serving(tenants: Iterable[str]) -> Iterator[None]:
    """Say whose requests the batch a model computes now on this thread holds, for the calls
    it makes meanwhile (:func:`serving_tenant`)."""
    previous = getattr(_SERVING, "tenants", None)
    _SERVING.tenants = frozenset(tenants)
    try:
        yield
    finally:
        _SERVING.tenants = previous


def serving_tenant() -> tuple[str, bool]:
    """Whose a call made now on this thread is: the one tenant of the batch being computed
    ("": the anonymous one, or no batch), and whether the batch mixes tenants (the call is
    :attr:`~sluice.workers.model_calls.CallContext.shared`)."""
    tenants: frozenset[str] | None = getattr(_SERVING, "tenants", None)
    if not tenants:
        return "", False
    if len(tenants) == 1:
        return next(iter(tenants)), False
    return "", True
