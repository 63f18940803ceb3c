"""The tenant limits at start and their reload (sluice.gateway.tenants.limits_source): a bad
value stops the start; a bad file on reload is logged and counted, the previous limits stay."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from sluice.core.errors import InvalidConfig
from sluice.core.settings import GatewaySettings
from sluice.gateway.tenants import limits_source
from sluice.gateway.tenants.limits_source import LimitsSource, load_at_start

KEYS = "team-a:key-a,team-b:key-b"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def settings(**values: str) -> GatewaySettings:
    return GatewaySettings(api_keys=KEYS, **values)  # type: ignore[arg-type]


def write(path: Path, text: str, mtime_ns: int) -> None:
    path.write_text(text)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def test_inline_limits_at_start() -> None:
    source = load_at_start(settings(tenant_limits="[tenants.team-a]\nrate = 5"))
    assert source.loaded.of("team-a").rate == 5
    assert source.loaded.of("team-b").rate is None
    assert source.tenants == {"team-a", "team-b"}
    assert source.changed_limits() is None  # nothing to follow


def test_without_keys_the_one_tenant_is_anonymous() -> None:
    source = load_at_start(GatewaySettings(tenant_limits="[tenants.anonymous]\nweight = 2"))
    assert source.loaded.weight("anonymous") == 2


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"tenant_limits": "[tenants.team-a]\nrate = 'x'"}, "[tenants.team-a] rate: must be"),
        ({"tenant_limits": "[tenants.nobody]\nrate = 1"}, "unknown tenant 'nobody'"),
        ({"tenant_limits_file": "/nonexistent/limits.toml"}, "cannot be read"),
    ],
)
def test_a_bad_value_stops_the_start(values: dict[str, str], expected: str) -> None:
    with pytest.raises(InvalidConfig, match=expected.replace("[", r"\[").replace("]", r"\]")):
        load_at_start(settings(**values))


def test_the_file_wins_over_the_inline_limits(tmp_path: Path) -> None:
    path = tmp_path / "limits.toml"
    path.write_text("[tenants.team-b]\nweight = 4")
    source = load_at_start(
        settings(tenant_limits_file=str(path), tenant_limits="[tenants.team-a]\nweight = 2")
    )
    assert source.loaded.weights() == {"*": "1", "team-b": "4"}


def test_a_changed_file_is_read_again_at_most_once_a_second(tmp_path: Path) -> None:
    path = tmp_path / "limits.toml"
    write(path, "[tenants.team-a]\nrate = 5", 1_000_000_000)
    clock = FakeClock()
    source = load_at_start(settings(tenant_limits_file=str(path)))
    source.clock, source.checked_at = clock, 0.0
    write(path, "[tenants.team-a]\nrate = 7", 2_000_000_000)
    clock.now = 0.5
    assert source.changed_limits() is None  # not yet looked at
    clock.now = 1.0
    limits = source.changed_limits()
    assert limits is not None and limits.of("team-a").rate == 7
    clock.now = 2.0
    assert source.changed_limits() is None  # unchanged since


def test_a_bad_file_keeps_the_previous_limits_and_is_counted_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "limits.toml"
    write(path, "[tenants.team-a]\nrate = 5", 1_000_000_000)
    clock = FakeClock()
    source = LimitsSource(str(path), frozenset({"team-a"}), clock=clock)
    assert source.changed_limits() is not None
    write(path, "[tenants.team-a]\nrate = -1", 2_000_000_000)
    with caplog.at_level(logging.ERROR):
        for step in range(1, 4):
            clock.now = step * 1.0
            assert source.changed_limits() is None
    assert source.loaded.of("team-a").rate == 5
    assert source.take_reload_errors() == 1
    assert "[tenants.team-a] rate: must be a number > 0, got -1" in caplog.text
    assert "previous tenant limits stay in force" in caplog.text
    path.unlink()  # unreadable: one more error
    clock.now = 10.0
    assert source.changed_limits() is None
    assert source.take_reload_errors() == 1
    write(path, "[tenants.team-a]\nrate = 9", 3_000_000_000)
    clock.now = 11.0
    limits = source.changed_limits()
    assert limits is not None and limits.of("team-a").rate == 9
    assert source.take_reload_errors() == 0


def test_a_fifo_in_place_of_the_file_is_refused_without_waiting_for_a_writer(
    tmp_path: Path,
) -> None:
    """Opening a FIFO for reading waits for a writer: the gateway's whole process stopped."""
    path = tmp_path / "limits.toml"
    write(path, "[tenants.team-a]\nrate = 5", 1_000_000_000)
    clock = FakeClock()
    source = LimitsSource(str(path), frozenset({"team-a"}), clock=clock)
    assert source.changed_limits() is not None
    path.unlink()
    os.mkfifo(path)
    clock.now = 1.0
    assert source.changed_limits() is None  # (and does not block)
    assert source.take_reload_errors() == 1
    assert "not a regular file (a FIFO)" in source.last_error
    assert source.loaded.of("team-a").rate == 5
    with pytest.raises(InvalidConfig, match=r"not a regular file \(a FIFO\)"):
        load_at_start(settings(tenant_limits_file=str(path)))


def test_a_link_to_a_device_or_a_huge_file_is_refused_and_the_limits_stay(
    tmp_path: Path,
) -> None:
    """A link to a regular file is read (as Kubernetes mounts a ConfigMap); one to
    /dev/zero, or a file past the size a limits file may have, is not read into memory."""
    target = tmp_path / "real.toml"
    write(target, "[tenants.team-a]\nrate = 5", 1_000_000_000)
    path = tmp_path / "limits.toml"
    path.symlink_to(target)
    clock = FakeClock()
    source = LimitsSource(str(path), frozenset({"team-a"}), clock=clock)
    assert source.changed_limits() is not None
    path.unlink()
    path.symlink_to("/dev/zero")
    clock.now = 1.0
    assert source.changed_limits() is None
    assert "not a regular file (a character device)" in source.last_error
    path.unlink()
    with path.open("wb") as file:
        file.truncate(limits_source.MAX_FILE_BYTES + 1)
    clock.now = 2.0
    assert source.changed_limits() is None
    assert f"more than the {limits_source.MAX_FILE_BYTES} a limits" in source.last_error
    assert source.take_reload_errors() == 2
    assert source.loaded.of("team-a").rate == 5
