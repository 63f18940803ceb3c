"""Cutting a batch into its requests and joining their answers again, for backends that
handle each request of a batch on its own (an ensemble runs its graph per request)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from sluice.core.errors import InferenceFailed, SluiceError
from sluice.workers.backends.base import PartialOutputs


def split_requests(
    inputs: Mapping[str, np.ndarray], sizes: Sequence[int], batching: bool
) -> list[dict[str, np.ndarray]]:
    """Each request's inputs: rows of dim 0 in order when ``batching``; else one request."""
    if not batching or len(sizes) <= 1:
        return [dict(inputs)]
    parts: list[dict[str, np.ndarray]] = []
    start = 0
    for size in sizes:
        parts.append({name: array[start : start + size] for name, array in inputs.items()})
        start += size
    return parts


def join_requests(
    answers: Sequence[Mapping[str, np.ndarray]],
    sizes: Sequence[int],
    outputs: Sequence[str],
    failures: Mapping[int, SluiceError],
) -> dict[str, np.ndarray] | None:
    """Whole-batch outputs from each request's answer (rows of failed requests hold
    zeros, as :class:`sluice.workers.backends.base.RequestsFailed` expects, and so do rows of
    requests answered without an output, named by :class:`PartialOutputs`); None when every
    request failed. Raises :class:`InferenceFailed` when the answers' item shapes differ."""
    good = [i for i in range(len(answers)) if i not in failures]
    if not good:
        return None
    joined: dict[str, np.ndarray] = {}
    absent: dict[int, set[str]] = {}
    for name in outputs:
        sample = next((answers[i][name] for i in good if name in answers[i]), None)
        if sample is None:
            continue  # no request has it
        rows: list[np.ndarray] = []
        for index, size in enumerate(sizes):
            if index in failures or name not in answers[index]:
                if index not in failures:
                    absent.setdefault(index, set()).add(name)
                filler = np.zeros((size, *sample.shape[1:]), dtype=sample.dtype)
                if sample.dtype == np.object_:
                    filler.fill(b"")
                rows.append(filler)
            else:
                rows.append(answers[index][name])
        try:
            joined[name] = np.concatenate(rows, axis=0)
        except ValueError as exc:
            raise InferenceFailed(
                f"output '{name}': the batch's requests answered different shapes ({exc})"
            ) from None
    if absent:
        return PartialOutputs(joined, {i: frozenset(names) for i, names in absent.items()})
    return joined
