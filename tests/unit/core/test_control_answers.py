"""The answers a model control command's sender waits for (:class:`Answers`): one from each
executor alive when it was sent and still alive; the first failure is the command's."""

from __future__ import annotations

import orjson

from sluice.core.control import Answers


def _answer(executor: str, error: str | None = None) -> bytes:
    return orjson.dumps({"error": error, "executor": executor})


def test_every_expected_executor_still_alive_must_answer() -> None:
    answers = Answers(frozenset({"a", "b"}))
    assert not answers.complete({"a", "b"})
    answers.add(_answer("a"))
    assert answers.waiting_for_others and not answers.complete({"a", "b"})
    assert answers.complete({"a"})  # b died without answering
    answers.add(_answer("b", "failed to load 'm', no room"))
    assert not answers.waiting_for_others and answers.complete({"a", "b"})
    assert answers.error == "failed to load 'm', no room"


def test_without_registered_executors_the_first_answer_settles_it() -> None:
    answers = Answers(frozenset())
    answers.add(_answer(""))
    assert not answers.waiting_for_others and answers.complete(set()) and answers.error is None


def test_the_first_failure_is_kept_and_a_malformed_answer_fails() -> None:
    answers = Answers(frozenset({"a", "b", "c"}))
    answers.add(b"not json")
    answers.add(_answer("b", "second"))
    assert answers.error == "a malformed answer"
