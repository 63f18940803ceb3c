"""The log lines of every Sluice process: human-readable text or one JSON object per line.

:func:`configure_logging` is called once at the start of each process role (``sluice up``,
gateway, worker). JSON lines carry ``time`` (UTC, ISO 8601), ``level``, ``logger``,
``message``, ``role``, ``pid``, and ``request_id`` / ``trace_id`` when known: in the
gateway from :data:`REQUEST_ID` / :data:`TRACE_ID` (context variables, so each request's
task sees its own), elsewhere from the record (``extra={"request_id": ...}``, or
``"request_ids"`` for a whole batch). Text lines add the same ids in brackets.

The settings Triton's logging extension reads and changes at run time (``/v2/logging``)
live in the process's :class:`LogControl` (see :func:`control`).
"""

from __future__ import annotations

import logging
import re
import sys
import time
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any, TextIO

import orjson

from sluice.core.settings import CommonSettings

REQUEST_ID: ContextVar[str | None] = ContextVar("sluice_request_id", default=None)
"""The id of the request the current task serves (gateway)."""

TRACE_ID: ContextVar[str | None] = ContextVar("sluice_trace_id", default=None)
"""The W3C trace id of the request the current task serves (gateway), when it has one."""

TEXT = "default"
ISO8601 = "ISO8601"
JSON = "json"
FORMATS = (TEXT, ISO8601, JSON)
"""``default`` and ``ISO8601`` as Triton's ``--log-format`` (text with local or UTC ISO 8601
times); ``json``: one JSON object per line."""

_SETTING_FORMATS = {"text": TEXT, "iso8601": ISO8601, "json": JSON}

_TEXT_LAYOUT = "%(asctime)s %(role)s %(name)s %(levelname)s %(message)s"


@dataclass(frozen=True)
class LogOptions:
    """What Triton's ``/v2/logging`` reports, and all but ``file`` what it may change."""

    file: str = ""
    info: bool = True
    warning: bool = True
    error: bool = True
    verbose_level: int = 0
    format: str = TEXT

    def as_triton(self) -> dict[str, Any]:
        """The settings under Triton's names (``GET /v2/logging``)."""
        return {
            "log_file": self.file,
            "log_info": self.info,
            "log_warning": self.warning,
            "log_error": self.error,
            "log_verbose_level": self.verbose_level,
            "log_format": self.format,
        }


def _utc_iso(record: logging.LogRecord) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


def _ids(record: logging.LogRecord) -> tuple[Any, Any, Any]:
    """(request_id, request_ids, trace_id) of a record: given with it, else the task's."""
    fields = record.__dict__
    request_id = fields.get("request_id") or REQUEST_ID.get()
    trace_id = fields.get("trace_id") or TRACE_ID.get()
    return request_id, fields.get("request_ids"), trace_id


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line. Messages are the code's own texts: request
    ids and error texts, never tensor data."""

    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "time": _utc_iso(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "role": self.role,
            "pid": record.process,
        }
        request_id, request_ids, trace_id = _ids(record)
        if request_id:
            document["request_id"] = request_id
        if request_ids:
            document["request_ids"] = request_ids
        if trace_id:
            document["trace_id"] = trace_id
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            document["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(document, default=str).decode()


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
"""What may end a line or drive a terminal (what ``str.splitlines`` splits at included)."""


def _one_line(text: str) -> str:
    """``text`` with its control characters escaped (``\\n``, ``\\x1b``): messages carry
    clients' text (a model name from a URL, where ``%0A`` decodes to a newline), which must
    not start a text line that reads as another record."""
    return _CONTROL.sub(lambda found: found.group().encode("unicode_escape").decode(), text)


class TextFormatter(logging.Formatter):
    """``<time> <role> <logger> <LEVEL> <message> [request_id=... trace_id=...]``."""

    def __init__(self, role: str, *, utc_iso: bool = False) -> None:
        super().__init__(_TEXT_LAYOUT)
        self.role = role
        self.utc_iso = utc_iso

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return _utc_iso(record) if self.utc_iso else super().formatTime(record, datefmt)

    def formatMessage(self, record: logging.LogRecord) -> str:
        # (the record's line; a traceback is added after it, with its own lines)
        return _one_line(super().formatMessage(record))

    def format(self, record: logging.LogRecord) -> str:
        record.role = self.role
        line = super().format(record)
        request_id, request_ids, trace_id = _ids(record)
        ids = [
            f"{name}={value}"
            for name, value in (
                ("request_id", request_id),
                ("request_ids", ",".join(request_ids) if request_ids else None),
                ("trace_id", trace_id),
            )
            if value
        ]
        return f"{line} [{' '.join(ids)}]" if ids else line


class LevelSwitch(logging.Filter):
    """Triton's ``log_info`` / ``log_warning`` / ``log_error`` switches (debug messages are
    let through by the root logger's level, see ``verbose_level``)."""

    def __init__(self, options: LogOptions) -> None:
        super().__init__()
        self.options = options

    def filter(self, record: logging.LogRecord) -> bool:
        level = record.levelno
        if level >= logging.ERROR:
            return self.options.error
        if level >= logging.WARNING:
            return self.options.warning
        if level >= logging.INFO:
            return self.options.info
        return True


class LogControl:
    """This process's log handler and the settings it follows; changed at run time by
    ``POST /v2/logging`` (in the gateway process that answers it)."""

    def __init__(self, role: str, handler: logging.Handler, options: LogOptions) -> None:
        self.role = role
        self.handler = handler
        self.switch = LevelSwitch(options)
        handler.addFilter(self.switch)
        self._apply(options)

    @property
    def options(self) -> LogOptions:
        return self.switch.options

    def update(
        self,
        *,
        info: bool | None = None,
        warning: bool | None = None,
        error: bool | None = None,
        verbose_level: int | None = None,
        format: str | None = None,
    ) -> LogOptions:
        """Change the given settings (None: unchanged); the log file cannot change."""
        if format is not None and format not in FORMATS:
            raise ValueError(f"unknown log format {format!r}")
        now = self.options
        options = replace(
            now,
            info=now.info if info is None else info,
            warning=now.warning if warning is None else warning,
            error=now.error if error is None else error,
            verbose_level=now.verbose_level if verbose_level is None else verbose_level,
            format=now.format if format is None else format,
        )
        self._apply(options)
        return options

    def _apply(self, options: LogOptions) -> None:
        self.switch.options = options
        if options.format == JSON:
            self.handler.setFormatter(JsonFormatter(self.role))
        else:
            self.handler.setFormatter(TextFormatter(self.role, utc_iso=options.format == ISO8601))
        logging.getLogger().setLevel(logging.DEBUG if options.verbose_level else logging.INFO)


_control: LogControl | None = None


def configure_logging(
    role: str,
    settings: CommonSettings | None = None,
    *,
    verbose: bool = False,
    stream: TextIO | None = None,
) -> LogControl:
    """Send this process's log records (the root logger's) to standard error, or to
    ``SLUICE_LOG_FILE``, in ``SLUICE_LOG_FORMAT``; ``verbose`` (the CLI's ``--verbose``)
    adds debug messages as ``SLUICE_LOG_VERBOSE_LEVEL=1`` does. Calling it again replaces
    the handler it installed before; handlers installed by others are left alone."""
    global _control
    settings = settings or CommonSettings()
    root = logging.getLogger()
    if _control is not None:
        root.removeHandler(_control.handler)
        _control.handler.close()
    problem = ""
    handler: logging.Handler
    if settings.log_file:
        try:
            handler = logging.FileHandler(settings.log_file, encoding="utf-8")
        except OSError as exc:
            problem = f"cannot open {settings.log_file}: {exc.strerror}; logging to stderr"
    if not settings.log_file or problem:
        handler = logging.StreamHandler(stream or sys.stderr)
    options = LogOptions(
        file="" if problem else settings.log_file,
        info=settings.log_info,
        warning=settings.log_warning,
        error=settings.log_error,
        verbose_level=max(settings.log_verbose_level, int(verbose)),
        format=_resolve_format(settings.log_format, handler),
    )
    _control = LogControl(role, handler, options)
    root.addHandler(handler)
    if problem:
        logging.getLogger(__name__).error("log file: %s", problem)
    return _control


def control() -> LogControl:
    """The process's :class:`LogControl` (configured with defaults if nobody did)."""
    return _control if _control is not None else configure_logging("gateway")


def _resolve_format(setting: str, handler: logging.Handler) -> str:
    """``auto``: text on a terminal, JSON anywhere else (a file, a pipe, a collector)."""
    if setting != "auto":
        return _SETTING_FORMATS[setting]
    stream = getattr(handler, "stream", None)
    isatty = getattr(stream, "isatty", None)
    return TEXT if isatty is not None and isatty() else JSON
