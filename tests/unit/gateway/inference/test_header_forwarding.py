"""Triton's header forwarding (:mod:`sluice.gateway.inference.header_forwarding`): which names a
pattern takes, Triton's case rule, and what may never be forwarded."""

from __future__ import annotations

import pytest

from sluice.core.errors import InvalidInput
from sluice.core.request_parameters import PatternError, forward_pattern
from sluice.gateway.inference.header_forwarding import add_forwarded, matching

HEADERS = [
    ("my_header_1", "one"),
    ("My_Header_2", 'a "quoted" value\\'),
    ("header_3", "three"),
    ("my_header_1", "repeated"),
    ("Authorization", "Bearer secret"),
]


def test_a_pattern_matches_anywhere_in_the_name_ignoring_case() -> None:
    pattern = forward_pattern("MY_HEADER.*")
    assert pattern is not None
    assert matching(pattern, HEADERS) == (
        ("my_header_1", "one"),
        ("My_Header_2", 'a "quoted" value\\'),
    )
    anywhere = forward_pattern("header_3")
    assert anywhere is not None and matching(anywhere, HEADERS) == (("header_3", "three"),)


def test_a_leading_case_sensitive_flag_keeps_case_and_authorization_never_goes() -> None:
    pattern = forward_pattern("(?-i)my_.*")
    assert pattern is not None and [n for n, _ in matching(pattern, HEADERS)] == ["my_header_1"]
    everything = forward_pattern(".*")
    assert everything is not None
    assert "Authorization" not in dict(matching(everything, HEADERS))
    assert forward_pattern("") is None


@pytest.mark.parametrize("name", ["priority", "Timeout", "sequence_id", "triton_anything"])
def test_a_reserved_name_is_refused(name: str) -> None:
    with pytest.raises(InvalidInput, match="reserved for Triton usage"):
        add_forwarded({}, ((name, "1"),))


def test_a_forwarded_header_replaces_a_request_parameter_of_its_name() -> None:
    parameters: dict[str, object] = {"my_header_1": 5, "other": True}
    add_forwarded(parameters, (("my_header_1", "one"),))
    assert parameters == {"my_header_1": "one", "other": True}


def test_patterns_are_re2s_so_a_hostile_name_cannot_make_them_backtrack() -> None:
    # (a|aa)*$ takes Python's backtracking engine exponential time on a long run of a's
    # ending in a character that fails; RE2 answers in one pass over the name.
    pattern = forward_pattern("^(a|aa)*$")
    assert pattern is not None
    hostile = ("a" * 4096 + "!", "x")
    assert matching(pattern, [hostile, ("aaaa", "y")]) == (("aaaa", "y"),)


def test_re2_syntax_is_taken_and_python_only_syntax_is_refused_as_triton_refuses_it() -> None:
    # RE2 turns case back on anywhere in the pattern, as Triton reads it.
    pattern = forward_pattern("x-(?-i)Tenant")
    assert pattern is not None
    assert [n for n, _ in matching(pattern, [("X-Tenant", "1"), ("x-tenant", "2")])] == ["X-Tenant"]
    for python_only in ("(?=my)", "(a)\\1", "(?<!x)y"):
        with pytest.raises(PatternError):
            forward_pattern(python_only)
