"""Cancellation notices: what names a request, and entries that are not notices."""

from __future__ import annotations

from sluice.core.cancellation import notice_fields, parse_notice


def test_a_notice_names_its_request() -> None:
    assert parse_notice(notice_fields("sluice:reply:{g}", "42")) == ("sluice:reply:{g}", "42")


def test_an_entry_that_is_not_a_notice_is_ignored() -> None:
    assert parse_notice({b"x": b"1"}) is None
    assert parse_notice({b"r": b"\xff", b"k": b"1"}) is None
