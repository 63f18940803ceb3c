"""TorchServe's explanations: ``POST /explanations/{model}[/{version}]`` (and KServe v1's
``/v1/models/{model}:explain``) run the model's handler as a prediction does, with the
request marked for explanation. The handler reads the mark as TorchServe's frontend sets it,
the request header ``explain`` (``"True"``, else ``"False"``), through its context:
``BaseHandler.handle`` then calls ``explain_handle`` instead of ``inference``.

The gateway's route puts the mark on the request as a parameter (:data:`EXPLAIN`) that the
worker hands to the TorchServe backend. Its name is in Triton's reserved ``triton_`` space,
which clients cannot use (a request parameter or a forwarded header of that name is
refused) and which models never see as their own parameters: a request is marked only by
the route it came through.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

EXPLAIN = "triton_torchserve_explain"
"""The request parameter that marks a request for explanation (True; absent otherwise)."""

HEADER = "explain"
"""The request header TorchServe's handlers read the mark from."""


def is_explanation(parameters: Mapping[str, Any]) -> bool:
    """Whether a request's parameters mark it for explanation."""
    return parameters.get(EXPLAIN) is True


def header_value(explain: bool) -> str:
    """The ``explain`` header's value, as TorchServe's frontend writes it."""
    return "True" if explain else "False"
