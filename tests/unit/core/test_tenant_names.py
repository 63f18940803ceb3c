"""Tenant names: what goes into Redis keys and storage paths, refused at start otherwise."""

from __future__ import annotations

import pytest

from sluice.core.keys import Keys
from sluice.core.tenants import RESERVED_TENANT_NAMES, is_tenant_name, parse_key_entry


def test_a_tenant_named_as_the_running_batches_set_is_refused_by_name() -> None:
    """``Keys.batches("running")`` would be the deployment's running batches."""
    keys = Keys("t")
    assert keys.batches("running") == keys.running_batches
    assert "running" in RESERVED_TENANT_NAMES
    with pytest.raises(ValueError, match=r"'running' is not a tenant name .*not 'running'"):
        parse_key_entry("running:secret")
    assert not is_tenant_name("running")
    assert parse_key_entry("runner:secret").tenant == "runner"


@pytest.mark.parametrize("name", ["team-a", "a.b_c", "0", "x" * 64])
def test_names_of_letters_digits_and_marks_are_taken(name: str) -> None:
    assert parse_key_entry(f"{name}:k").tenant == name


@pytest.mark.parametrize("name", ["", "-a", "a b", "a/b", "x" * 65, "é"])
def test_other_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="is not a tenant name"):
        parse_key_entry(f"{name}:k")
