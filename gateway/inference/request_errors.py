"""Triton's texts for the requests it refuses (core ``src/infer_request.cc``,
``src/model.cc``; server ``src/http_server.cc``), including its ``[request id: <id>]``
prefix, so that clients matching on them keep working; Sluice's own detail follows after
``"; "``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from sluice.gateway.inference.pending_input import PendingInput

if TYPE_CHECKING:
    from sluice.core.config import ModelConfig


def log_request(request_id: str) -> str:
    """Triton's prefix of the errors its core raises about a request (``LogRequest()``)."""
    return f"[request id: {request_id or '<id_unknown>'}] "


def names_list(names: Sequence[str]) -> str:
    """A name list as Triton writes it: ``['a','b']``."""
    return "[" + ",".join(f"'{name}'" for name in names) + "]"


def input_count_message(
    config: ModelConfig, pending: list[PendingInput], missing: list[str], request_id: str
) -> str:
    """Triton's text (``ValidateRequestInputs``), with ``[]`` where Triton prints ``]``
    when nothing is missing."""
    total = len(config.inputs)
    required = total - sum(s.optional for s in config.inputs)
    expected = (
        f"expected {total} inputs"
        if required == total
        else f"expected number of inputs between {required} and {total}"
    )
    return (
        f"{log_request(request_id)}{expected} but got {len(pending)} inputs for model "
        f"'{config.name}'. "
        f"Got input(s) {names_list([e.name for e in pending])}, but missing required input(s) "
        f"{names_list(missing)}. Please provide all required input(s)."
    )


def byte_size_message(
    entry: PendingInput, expected: int, got: int, config: ModelConfig, request_id: str
) -> str:
    return (
        f"{log_request(request_id)}input byte size mismatch for input '{entry.name}' for model "
        f"'{config.name}'. Expected {expected}, got {got}"
    )


def string_count_message(
    entry: PendingInput, found: int, config: ModelConfig, request_id: str, detail: str = ""
) -> str:
    """Triton's texts (``ValidateBytesInputs``): too few elements, or too many (where
    Triton stops counting at one past the expected count; the real count follows)."""
    where = f"for inference input '{entry.name}' for model '{config.name}'"
    if found < entry.count:
        message = (
            f"{log_request(request_id)}expected {entry.count} string elements {where}, got {found}"
        )
    else:
        message = (
            f"{log_request(request_id)}unexpected number of string elements "
            f"{entry.count + 1} {where}, expecting {entry.count}"
        )
        detail = detail or f"the data holds {found}"
    return f"{message}; {detail}" if detail else message
