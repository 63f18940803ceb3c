"""Model namespacing's names (Triton's --model-namespacing): the internal name of each copy
of a name several repositories hold, how a step resolves from a repository, Triton's
texts, and the view's record read back (and refused when it is not one)."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from sluice.core.catalog import CatalogEntry, decode_entry, encode_entry
from sluice.core.errors import InvalidConfig
from sluice.core.repository_namespaces import (
    NAMESPACES_FILE,
    Namespaces,
    ambiguity,
    identifier,
    internal_names,
    link_record,
    read_namespaces,
    unresolved_steps,
)


def test_each_copy_is_named_after_its_repository_and_never_as_a_real_model() -> None:
    holders = {"comp": [2, 0], "pipe": [0, 1]}
    names = internal_names(holders, ["comp", "pipe", "comp@1", "other"])
    assert names == {
        ("comp", 0): "comp@1@",  # a real model is named comp@1 already
        ("comp", 2): "comp@3",
        ("pipe", 0): "pipe@1",
        ("pipe", 1): "pipe@2",
    }
    assert internal_names(holders, ["comp", "pipe", "comp@1", "other"]) == names
    long_name = "m" * 250
    [(_, internal)] = internal_names({long_name: [0]}, []).items()
    assert len(internal.encode()) <= 255 and internal.endswith("@1")


def test_a_step_resolves_to_its_own_repository_first_then_to_the_one_model() -> None:
    namespaces = Namespaces(
        ("/a", "/b", "/c"),
        {
            "comp@1": ("comp", 0),
            "comp@2": ("comp", 1),
            "alone": ("alone", 2),
            "pipe": ("pipe", 2),
        },
    )
    assert namespaces.resolve("comp", 0) == "comp@1"
    assert namespaces.resolve("comp", 1) == "comp@2"
    assert namespaces.resolve("comp", 2) is None  # held by two others: ambiguous
    assert namespaces.resolve("alone", 0) == "alone"  # one model of that name, anywhere
    assert namespaces.resolve("missing", 0) == "missing"  # (its load says it is missing)
    assert namespaces.ambiguous() == {"comp": ("comp@1", "comp@2")}
    assert namespaces.copies("comp") == ("comp@1", "comp@2")
    assert namespaces.copies("alone") == ()
    assert namespaces.is_internal("comp@2") and not namespaces.is_internal("alone")
    assert namespaces.name_of("comp@2") == "comp" and namespaces.name_of("x") == "x"
    assert namespaces.index_of("comp@2") == 1 and namespaces.index_of("x") is None


def test_tritons_texts() -> None:
    assert ambiguity("comp", 2) == (
        "There are 2 identifiers of model 'comp' in global map, model namespace must be "
        "provided to resolve ambiguity."
    )
    assert unresolved_steps("/c", "pipe", ["comp", "other"]) == (
        "ensemble /c::pipe contains models that are not available or ambiguous: comp, other"
    )


def test_the_record_is_read_back_and_anything_else_refused(tmp_path: Path) -> None:
    namespaces = Namespaces(("/a", "/b"), {"comp@1": ("comp", 0), "comp@2": ("comp", 1)})
    assert read_namespaces(tmp_path) is None
    (tmp_path / NAMESPACES_FILE).write_bytes(namespaces.encode())
    assert read_namespaces(tmp_path) == namespaces
    staged = tmp_path / "staged"
    staged.mkdir()
    link_record(tmp_path, staged)
    assert read_namespaces(staged) == namespaces
    for bad in (
        b"[]",
        b"{",
        b'{"repositories": ["/a"], "models": {"x": ["x", 1]}}',  # no such repository
        b'{"repositories": ["/a"], "models": {"x": ["x", true]}}',
        b'{"repositories": "/a", "models": {}}',
    ):
        (tmp_path / NAMESPACES_FILE).write_bytes(bad)
        with pytest.raises(InvalidConfig, match="not a record of the repositories' models"):
            read_namespaces(tmp_path)


def test_the_catalog_carries_a_copys_name_and_an_ambiguous_name() -> None:
    """Entries of deployments without namespacing are written as before (no new keys)."""
    plain = CatalogEntry("alone", (1,), None, "broken")
    assert set(msgpack.unpackb(encode_entry(plain))) == {
        "v",
        "name",
        "versions",
        "config",
        "error",
        "on_demand",
    }
    assert decode_entry(encode_entry(plain)) == plain
    copy = CatalogEntry("comp@2", (1,), None, "broken", listed_as="comp")
    ambiguous = CatalogEntry("comp", (), None, ambiguity("comp", 2), ambiguous=True)
    assert decode_entry(encode_entry(copy)) == copy
    assert decode_entry(encode_entry(ambiguous)) == ambiguous


def test_the_catalog_carries_a_models_repository_and_whether_it_was_loaded_once() -> None:
    spaced = CatalogEntry("alone", (1,), None, namespace="/models/a")
    unloaded = CatalogEntry("idle", (), None, "unloaded", namespace="/models/a", once_loaded=True)
    assert decode_entry(encode_entry(spaced)) == spaced
    assert decode_entry(encode_entry(unloaded)) == unloaded
    assert msgpack.unpackb(encode_entry(spaced))["namespace"] == "/models/a"


def test_a_model_is_named_by_its_repository_as_triton_names_it() -> None:
    record = Namespaces(("first", "/models/b"), {"alone": ("alone", 0), "comp@2": ("comp", 1)})
    assert record.repository_of("alone") == "first"
    assert record.repository_of("comp@2") == "/models/b"
    assert record.repository_of("other") == ""
    assert identifier("/models/b", "comp") == "/models/b::comp"
    assert identifier("", "comp") == "comp"
