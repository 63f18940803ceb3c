"""The benchmark's CPU accounting tells the server's roles apart by command line."""

from __future__ import annotations

import pytest

from bench.cpu import classify


@pytest.mark.parametrize(
    ("command", "role"),
    [
        ("/venv/bin/python -m sluice.gateway", "gateway"),
        ("/venv/bin/python -m sluice.workers --model mlp --version 1", "worker"),
        ("/venv/bin/sluice worker --model mlp", "worker"),
        ("/venv/bin/sluice gateway", "gateway"),
        ("/usr/bin/redis-server 127.0.0.1:6379", "redis"),
        ("/venv/bin/python -m sluice.cli up --model-repository /srv/gateway/models", "other"),
        ("/venv/bin/python -m sluice.batch", "other"),
        ("", "other"),
    ],
)
def test_each_process_counts_for_its_role(command: str, role: str) -> None:
    assert classify(command) == role
