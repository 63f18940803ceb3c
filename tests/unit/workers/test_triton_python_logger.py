"""``pb_utils.Logger`` of Triton's Python backend, onto the worker's log."""

from __future__ import annotations

import pytest

from sluice.workers.backends import triton_python_backend_utils as pb_utils


def test_the_logger_logs_at_the_level_asked(caplog: pytest.LogCaptureFixture) -> None:
    """``pb_utils.Logger.log(message, level)`` (Triton's levels; INFO when none or unknown),
    beside ``log_info`` and friends, onto the worker's log."""
    logger = pb_utils.Logger
    with caplog.at_level("DEBUG", logger="model.py"):
        logger.log("plain")
        logger.log("careful", logger.WARNING)
        logger.log("broken", logger.ERROR)
        logger.log("chatty", logger.VERBOSE)
        logger.log("odd", 12345)
    assert [(r.levelname, r.message) for r in caplog.records] == [
        ("INFO", "plain"),
        ("WARNING", "careful"),
        ("ERROR", "broken"),
        ("DEBUG", "chatty"),
        ("INFO", "odd"),
    ]
