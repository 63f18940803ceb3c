"""Log lines (sluice.core.observability.logs), request ids
(sluice.gateway.inference.request_id), the ``/v2/logging`` checks and the request id in the
stream entry."""

from __future__ import annotations

import contextvars
import io
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from sluice.core.errors import InvalidInput, Unsupported
from sluice.core.observability import logs
from sluice.core.observability.logs import REQUEST_ID, TRACE_ID, configure_logging, control
from sluice.core.settings import CommonSettings
from sluice.core.wire import HEADER_FIELD, RequestMessage, decode_request, encode_request
from sluice.gateway.http.logging_routes import parse_log_settings
from sluice.gateway.inference import request_id

log = logging.getLogger("tests.unit.test_logs")
UTC_TIME = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"


@pytest.fixture(autouse=True)
def restore_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test configures logging afresh, whatever SLUICE_LOG_* the environment has; the
    root logger is put back afterwards."""
    for name in list(os.environ):
        if name.startswith("SLUICE_LOG_"):
            monkeypatch.delenv(name)
    root = logging.getLogger()
    handlers, level, saved = list(root.handlers), root.level, logs._control
    logs._control = None
    yield
    if logs._control is not None:
        root.removeHandler(logs._control.handler)
        logs._control.handler.close()
    root.handlers[:] = handlers
    root.setLevel(level)
    logs._control = saved


def configured(role: str = "gateway", **settings: Any) -> io.StringIO:
    stream = io.StringIO()
    configure_logging(role, CommonSettings(**settings), stream=stream)
    return stream


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_json_lines_carry_time_level_logger_message_role_pid_and_ids() -> None:
    stream = configured("worker", log_format="json")
    log.warning("request failed: %s", "boom", extra={"request_id": "r-1", "trace_id": "t" * 32})
    [line] = lines(stream)
    document = json.loads(line)
    assert document == {
        "time": document["time"],
        "level": "WARNING",
        "logger": "tests.unit.test_logs",
        "message": "request failed: boom",
        "role": "worker",
        "pid": os.getpid(),
        "request_id": "r-1",
        "trace_id": "t" * 32,
    }
    assert re.fullmatch(UTC_TIME, document["time"])


def test_the_gateway_ids_come_from_the_tasks_context() -> None:
    stream = configured(log_format="json")

    def in_a_request() -> None:
        REQUEST_ID.set("abc")
        TRACE_ID.set("0af7651916cd43dd8448eb211c80319c")
        log.info("inside")

    contextvars.copy_context().run(in_a_request)
    log.info("outside")
    inside, outside = (json.loads(line) for line in lines(stream))
    assert inside["request_id"] == "abc" and inside["trace_id"].startswith("0af7")
    assert "request_id" not in outside and "trace_id" not in outside


def test_batch_lines_list_their_request_ids_and_exceptions_stay_on_one_line() -> None:
    stream = configured(log_format="json")
    log.debug("not shown at verbose level 0")
    log.info("batch", extra={"request_ids": ["a", "b"]})
    try:
        raise RuntimeError("bad\nthing")
    except RuntimeError:
        log.exception("failed")
    batch, failed = (json.loads(line) for line in lines(stream))
    assert batch["request_ids"] == ["a", "b"]
    assert "RuntimeError: bad\nthing" in failed["exception"]


def test_text_lines_and_triton_s_iso8601_format() -> None:
    stream = configured("up")
    contextvars.copy_context().run(lambda: (REQUEST_ID.set("r-9"), log.info("hello %d", 1)))
    log.info("plain", extra={"request_ids": ["a", "b"]})
    first, second = lines(stream)
    timestamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
    assert re.fullmatch(
        rf"{timestamp} up tests\.unit\.test_logs INFO hello 1 \[request_id=r-9\]", first
    )
    assert second.endswith("INFO plain [request_ids=a,b]")
    control().update(format="ISO8601")
    log.info("later")
    assert re.fullmatch(rf"{UTC_TIME} up tests\.unit\.test_logs INFO later", lines(stream)[-1])


def test_a_clients_text_in_a_message_cannot_forge_text_lines() -> None:
    """A model name from a URL (``%0A`` decodes to a newline) goes into a message as it
    came: in text lines its control characters are escaped, so that it cannot start a line
    that reads as another record, nor drive a terminal; a traceback keeps its lines."""
    stream = configured("gateway", log_format="text")
    forged = "x'\n2030-01-01 00:00:00,000 gateway sluice.up ERROR forged\r\x1b[2J\u2028"
    log.warning("inference request failed: 404 unknown model '%s'", forged)
    try:
        raise RuntimeError("bad\nthing")
    except RuntimeError:
        log.exception("failed")
    line, *traceback = lines(stream)
    assert line.endswith(
        "WARNING inference request failed: 404 unknown model 'x'\\n2030-01-01 00:00:00,000 "
        "gateway sluice.up ERROR forged\\r\\x1b[2J\\u2028'"
    )
    assert traceback[0].endswith("ERROR failed") and traceback[-2:] == [
        "RuntimeError: bad",
        "thing",
    ]


def test_tritons_switches_and_verbose_level() -> None:
    stream = configured(log_info=False)
    log.info("dropped")
    log.warning("kept")
    assert control().options.as_triton() == {
        "log_file": "",
        "log_info": False,
        "log_warning": True,
        "log_error": True,
        "log_verbose_level": 0,
        "log_format": "default",
    }
    control().update(info=True, warning=False, verbose_level=2)
    log.debug("debug shown")
    log.warning("warning dropped")
    log.error("error kept")
    assert logging.getLogger().level == logging.DEBUG
    control().update(verbose_level=0, error=False)
    log.debug("debug dropped")
    log.error("error dropped")
    messages = [line.split(" ", 5)[-1] for line in lines(stream)]
    assert messages == ["kept", "debug shown", "error kept"]
    with pytest.raises(ValueError, match="unknown log format"):
        control().update(format="xml")


def test_the_log_file_and_a_log_file_that_cannot_be_opened(tmp_path: Path) -> None:
    path = tmp_path / "sluice.log"
    configure_logging("worker", CommonSettings(log_file=str(path), log_format="auto"))
    log.info("to the file")
    assert control().options.file == str(path)
    assert control().options.format == "json"  # auto: a file is no terminal
    assert json.loads(path.read_text())["message"] == "to the file"

    stream = io.StringIO()
    missing = tmp_path / "no" / "such" / "dir" / "x.log"
    configure_logging("worker", CommonSettings(log_file=str(missing)), stream=stream)
    assert control().options.file == ""
    assert f"cannot open {missing}" in stream.getvalue()


def test_auto_is_text_on_a_terminal_and_configuring_again_replaces_the_handler() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    root = logging.getLogger()
    before = len(root.handlers)
    configure_logging("gateway", CommonSettings(log_format="auto"), stream=Terminal())
    assert control().options.format == "default"
    configure_logging("gateway", CommonSettings(log_format="auto"), stream=io.StringIO())
    assert control().options.format == "json"
    assert len(root.handlers) == before + 1


def test_the_cli_tags_lines_with_the_command_and_verbose_adds_debug() -> None:
    from sluice.cli import _logging

    def worker() -> None:  # named as the CLI's command functions are
        _logging(True)

    worker()
    assert control().role == "worker"
    assert control().options.verbose_level == 1


def test_request_ids_kserve_id_then_header_then_made_up() -> None:
    def choose(kserve_id: str, header: str | None) -> str:
        def run() -> str:
            request_id.from_header(header)
            return request_id.settle(kserve_id)

        return contextvars.copy_context().run(run)

    assert choose("k-1", "h-1") == "k-1"
    assert choose("", "h-1") == "h-1"
    assert choose("bad\nid", "h-1") == "h-1"
    assert choose("", " padded") != " padded"
    made_up = {choose("", None) for _ in range(100)}
    assert len(made_up) == 100 and all(request_id.usable(rid) for rid in made_up)


@pytest.mark.parametrize(
    ("value", "usable"),
    [
        ("abc-123", True),
        ("with inner space", True),
        ("x" * 256, True),
        ("x" * 257, False),
        ("", False),
        (" lead", False),
        ("trail ", False),
        ("tab\there", False),
        ("caf\u00e9", False),
    ],
)
def test_which_ids_are_usable(value: str, usable: bool) -> None:
    assert request_id.usable(value) is usable


def test_the_request_id_travels_in_the_entry_and_old_entries_still_decode() -> None:
    message = RequestMessage("1", "r", [], ["y"], client_id="c", request_id="req-1")
    decoded, _ = decode_request(encode_request(message, b""))
    assert decoded.request_id == "req-1" and decoded.client_id == "c"
    old = encode_request(RequestMessage("1", "r", [], ["y"], client_id="c"), b"")
    header = msgpack.unpackb(old[HEADER_FIELD])
    assert "ri" not in header  # nothing added when there is no id
    assert decode_request(old)[0].request_id == ""


def test_log_settings_checks() -> None:
    assert parse_log_settings(b'{"log_info": null, "other": 1, "log_verbose_level": 3}') == {
        "verbose_level": 3
    }
    assert parse_log_settings(b'{"log_verbose_level": 4294967295}') == {
        "verbose_level": (1 << 32) - 1
    }
    with pytest.raises(InvalidInput, match=r"^log_verbose_level must be at most 4294967295"):
        parse_log_settings(b'{"log_verbose_level": 18446744073709551615}')  # (a uint32)
    with pytest.raises(InvalidInput, match="non-unsigned-integer"):
        parse_log_settings(b'{"log_verbose_level": 18446744073709551616}')
    with pytest.raises(Unsupported, match="can not be updated through network protocol"):
        parse_log_settings(b'{"log_file": "x", "log_info": 3}')  # Triton checks log_file first
    with pytest.raises(InvalidInput, match=r"^failed to parse the request JSON buffer: "):
        parse_log_settings(b"{'single': 'quotes'}")
    assert parse_log_settings(b'{"log_format": "json"}') == {"format": "json"}
