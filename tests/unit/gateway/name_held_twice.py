"""A gateway's view with model namespacing on and ``comp`` held by two repositories: its
copies ``comp@1`` and ``comp@2`` served (ready), ``comp`` itself ambiguous."""

from __future__ import annotations

from sluice.core.catalog import CatalogEntry
from sluice.core.config import parse_config_text
from sluice.core.repository_namespaces import ambiguity
from sluice.gateway.http.fast_path import InferFastPath
from tests.support.onnx_models import identity_config

AMBIGUOUS = (
    "There are 2 identifiers of model 'comp' in global map, model namespace must be provided "
    "to resolve ambiguity."
)
"""Triton's answer to a request naming ``comp``, in its words."""


def hold_comp_twice(app: InferFastPath) -> None:
    view = app.app.state.sluice.view
    view.namespacing = True
    for copy in ("comp@1", "comp@2"):
        config = parse_config_text(identity_config(copy, ["FP32"], [-1], 8), model_name=copy)
        view.models[copy] = CatalogEntry(copy, (1,), config, listed_as="comp")
        view.ready[copy] = frozenset((1,))
    view.models["comp"] = CatalogEntry("comp", (), None, ambiguity("comp", 2), ambiguous=True)
