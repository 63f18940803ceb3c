"""A workflow archive that ``POST /workflows?url=`` cannot find is TorchServe's
``WorkflowNotFoundException`` (404), whatever made it missing: TorchServe's workflow
archive raises no other exception for any of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.gateway.torchserve.archives import find_workflow
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
