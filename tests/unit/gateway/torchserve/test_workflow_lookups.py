"""A workflow archive that ``POST /workflows?url=`` cannot find is TorchServe's
``WorkflowNotFoundException`` (404), whatever made it missing (an empty ``url`` too, in
TorchServe's words): TorchServe's workflow archive raises no other exception for any of
them."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.core.errors import NotFound
from sluice.gateway.torchserve.archives import find_archive, find_workflow
from sluice.gateway.torchserve.exception_types import WorkflowNotFound, exception_type


@pytest.mark.parametrize(
    ("url", "store", "message"),
    [
        ("nowhere.war", "store", "Workflow not found in workflow store: nowhere.war"),
        ("folder", "store", "Workflow not found at: folder"),
        ("../up.war", "store", "Relative path is not allowed in url: ../up.war"),
        ("https://elsewhere.example/w.war", "store", "does not match any allowed URL"),
        ("w.war", None, "Workflow store has not been configured"),
    ],
)
async def test_a_workflow_not_found_is_torchserve_s_workflow_not_found(
    tmp_path: Path, url: str, store: str | None, message: str
) -> None:
    (tmp_path / "store" / "folder").mkdir(parents=True)
    with pytest.raises(WorkflowNotFound) as missing:
        await find_workflow(url, tmp_path / store if store else None, "")
    assert message in missing.value.message
    assert missing.value.status == 404
    assert exception_type(missing.value) == "WorkflowNotFoundException"


async def test_an_empty_url_is_answered_as_torchserve_answers_it(tmp_path: Path) -> None:
    """TorchServe's workflow archive has no check of an empty ``url`` (its model archive
    has: ``empty url``): the empty name is the store's folder itself, no archive."""
    with pytest.raises(WorkflowNotFound) as missing:
        await find_workflow("", tmp_path, "")
    assert (missing.value.status, missing.value.message) == (404, "Workflow not found at: ")
    assert exception_type(missing.value) == "WorkflowNotFoundException"
    with pytest.raises(WorkflowNotFound, match=r"^Workflow store has not been configured"):
        await find_workflow("", None, "")
    with pytest.raises(NotFound) as model:
        await find_archive("", tmp_path, "")
    assert (model.value.message, exception_type(model.value)) == (
        "empty url",
        "ModelNotFoundException",
    )
    with pytest.raises(NotFound, match=r"^Model store has not been configured"):
        await find_archive("", None, "")
