"""The ``type`` of TorchServe's error body (``{"code", "type", "message"}``): the name of the
exception class TorchServe's frontend answers with, for each of Sluice's errors.

TorchServe names its frontend's exceptions (``ModelNotFoundException``,
``BadRequestException``, ...); an error its worker reports (a handler that raised, or a
``PredictionException``) is an ``InternalServerException`` whatever its code.
"""

from __future__ import annotations

from sluice.core.errors import (
    Conflict,
    Forbidden,
    HandlerFailed,
    InvalidConfig,
    InvalidInput,
    NotFound,
    Overloaded,
    SluiceError,
    Unavailable,
)


class ModelVersionNotFound(NotFound):
    """TorchServe's ``ModelVersionNotFoundException``: the model has no such version."""


class WorkflowNotFound(NotFound):
    """TorchServe's ``WorkflowNotFoundException``: no workflow of that name."""


_TYPES: tuple[tuple[type[SluiceError], str], ...] = (
    (HandlerFailed, "InternalServerException"),
    (ModelVersionNotFound, "ModelVersionNotFoundException"),
    (WorkflowNotFound, "WorkflowNotFoundException"),
    (NotFound, "ModelNotFoundException"),
    (InvalidInput, "BadRequestException"),
    (InvalidConfig, "BadRequestException"),
    (Conflict, "ConflictStatusException"),
    (Forbidden, "InvalidModelVersionException"),
    (Overloaded, "ServiceUnavailableException"),
    (Unavailable, "ServiceUnavailableException"),
)
"""The first class an error is an instance of names its type (subclasses first)."""


def exception_type(error: SluiceError) -> str:
    """TorchServe's name for ``error``: its client errors' by kind, else
    ``BadRequestException`` (4xx) or ``InternalServerException`` (5xx)."""
    for kind, name in _TYPES:
        if isinstance(error, kind):
            return name
    return "BadRequestException" if error.status < 500 else "InternalServerException"
