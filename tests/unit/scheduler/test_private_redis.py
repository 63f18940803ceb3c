"""The private redis-server of ``sluice up``: a password made per start that every client must
give, kept out of the process list; loopback only; bounded memory that refuses writes
instead of evicting queued entries; the same password after a restart."""

from __future__ import annotations

import logging
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, OutOfMemoryError
from redis.retry import Retry

from sluice.core.settings import ApiKeySettings, UpSettings
from sluice.scheduler.executor.open_listener import is_loopback, warn_if_open_beyond_loopback
from sluice.scheduler.executor.redis_server import RedisServer, new_password
from tests.support import procs

MAXMEMORY = 8 << 20


def refused_client(port: int, password: str | None = None) -> Redis:
    """A client that reports a refusal at once (redis-py retries one three times by default)."""
    return Redis(
        host="127.0.0.1",
        port=port,
        password=password,
        socket_timeout=2,
        retry=Retry(NoBackoff(), 0),
    )


@pytest.fixture
def server() -> Iterator[RedisServer]:
    server = RedisServer(password=new_password(), maxmemory_bytes=MAXMEMORY)
    server.start()
    yield server
    server.stop()


def test_a_client_without_the_password_is_refused(server: RedisServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=2) as raw:
        raw.sendall(b"PING\r\nGET anything\r\n")
        time.sleep(0.2)
        answer = raw.recv(4096)
    assert answer == b"-NOAUTH Authentication required.\r\n" * 2, answer
    with pytest.raises(AuthenticationError):
        refused_client(server.port).ping()
    with pytest.raises(AuthenticationError):
        refused_client(server.port, password="x" * 64).ping()
    assert Redis.from_url(server.url).ping() is True


def test_loopback_only_with_maxmemory_and_noeviction(server: RedisServer) -> None:
    client = Redis.from_url(server.url, decode_responses=True)
    config: dict[str, str] = client.config_get("*")  # type: ignore[assignment]
    assert config["bind"] == "127.0.0.1"
    assert config["protected-mode"] == "yes"
    assert int(config["maxmemory"]) == MAXMEMORY
    assert config["maxmemory-policy"] == "noeviction"
    assert config["save"] == ""
    assert config["appendonly"] == "no"


def test_full_redis_refuses_writes_and_keeps_what_it_holds(server: RedisServer) -> None:
    client = Redis.from_url(server.url)
    chunk = b"x" * (256 << 10)
    written = 0
    with pytest.raises(OutOfMemoryError, match="maxmemory"):
        for index in range(4 * MAXMEMORY // len(chunk)):
            client.set(f"k{index}", chunk)
            written += 1
    assert written > 0
    assert client.dbsize() == written  # nothing evicted
    assert client.get("k0") == chunk


def test_the_password_is_never_an_argument_and_its_file_is_private(server: RedisServer) -> None:
    assert server.process is not None
    assert server.password not in " ".join(procs.cmdline(server.process.pid))
    assert server.password not in repr(server)
    assert server.password not in server.address
    config = server.workdir / "redis.conf"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert stat.S_IMODE(server.workdir.stat().st_mode) == 0o700


def test_passwords_are_long_random_and_differ() -> None:
    passwords = {new_password() for _ in range(20)}
    assert len(passwords) == 20
    assert all(len(p) == 64 and int(p, 16) >= 0 for p in passwords)


def test_a_restarted_server_keeps_its_password(server: RedisServer) -> None:
    assert server.process is not None
    url, port = server.url, server.port
    server.process.kill()
    server.process.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        server.tick()
        if server.restart_at is None and server.process.poll() is None:
            break
        time.sleep(0.05)
    assert (server.url, server.port) == (url, port)
    assert Redis.from_url(server.url).ping() is True
    with pytest.raises(AuthenticationError):
        refused_client(port).ping()


def test_the_servers_of_the_test_suite_keep_no_password(tmp_path: Path) -> None:
    """RedisServer() alone (the suite's fixtures) has neither password nor limit."""
    plain = RedisServer()
    assert plain.url.startswith("redis://127.0.0.1:")


def test_default_maxmemory_is_a_quarter_of_memory_at_most_2_gib(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SLUICE_REDIS_MAXMEMORY", raising=False)
    default = UpSettings().redis_maxmemory
    assert 64 << 20 <= default <= 2 << 30
    monkeypatch.setenv("SLUICE_REDIS_MAXMEMORY", str(300 << 20))
    assert UpSettings().redis_maxmemory == 300 << 20
    monkeypatch.setenv("SLUICE_REDIS_MAXMEMORY", "12")
    with pytest.raises(ValueError, match="redis_maxmemory"):
        UpSettings()


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("192.168.1.10", False),
        ("sluice.example", False),
    ],
)
def test_which_bind_addresses_are_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_a_warning_names_the_setting_when_open_beyond_loopback(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("API_KEYS", "API_KEYS_FILE", "ADMIN_KEYS", "ADMIN_KEYS_FILE"):
        monkeypatch.delenv(f"SLUICE_{name}", raising=False)
    caplog.set_level(logging.WARNING, logger="sluice.up")
    assert warn_if_open_beyond_loopback("0.0.0.0", ApiKeySettings()) is True
    (record,) = caplog.records
    assert "0.0.0.0" in record.getMessage() and "SLUICE_API_KEYS" in record.getMessage()
    caplog.clear()
    assert warn_if_open_beyond_loopback("127.0.0.1", ApiKeySettings()) is False
    assert warn_if_open_beyond_loopback("0.0.0.0", ApiKeySettings(api_keys="a:k")) is False
    assert warn_if_open_beyond_loopback("0.0.0.0", ApiKeySettings(admin_keys="k")) is False
    keys = tmp_path / "keys"
    keys.write_text("team:secret\n")
    assert not warn_if_open_beyond_loopback("::", ApiKeySettings(api_keys_file=str(keys)))
    assert caplog.records == []
