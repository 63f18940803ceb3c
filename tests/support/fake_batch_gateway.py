"""A small HTTP server of the tests' own that speaks the gateway's upload and batch API
(``/v2/uploads``, ``/v2/batches``, outputs), so the client and ``sluice batch`` can be
tested quickly, and against answers a real gateway would not give (a corrupted or cut
download, a hostile output name, a quota refusal).

A batch job's output is its input's bytes reversed, as ``output.bin``, plus a manifest.
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from sluice.scheduler.executor.redis_server import free_port


@dataclass
class FakeGateway:
    """What the server holds, and how it misbehaves when a test asks it to."""

    uploads: dict[str, dict[str, Any]] = field(default_factory=dict)
    upload_bodies: dict[str, bytes] = field(default_factory=dict)
    batches: dict[str, dict[str, Any]] = field(default_factory=dict)
    outputs: dict[str, dict[str, bytes]] = field(default_factory=dict)
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    submitted: list[dict[str, Any]] = field(default_factory=list)
    polls_before_rows: int = 1
    """Status reads answered ``queued`` without rows before the job shows its rows."""
    fail_with: str | None = None
    """The reason every batch fails with, before it has rows (None: they complete)."""
    quota_full: bool = False
    list_sha256: bool = True
    corrupt: bool = False
    """Send each output with a byte changed (its length and listing unchanged)."""
    cut_after: int | None = None
    """Close the connection after this many bytes of each output."""
    extra_names: list[str] = field(default_factory=list)
    """More names in the outputs' listing (a hostile server)."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, method: str, prefix: str) -> int:
        return sum(1 for m, path, _ in self.requests if m == method and path.startswith(prefix))


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    @property
    def fake(self) -> FakeGateway:
        return self.server.fake

    def _record(self) -> tuple[str, dict[str, list[str]]]:
        parts = urlsplit(self.path)
        with self.fake.lock:
            self.fake.requests.append((self.command, parts.path, dict(self.headers.items())))
        return parts.path, parse_qs(parts.query)

    def _json(self, status: int, document: Any, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(document).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        self._json(status, {"error": message}, headers)

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        chunks = []
        while length > 0:
            chunk = self.rfile.read(min(length, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            length -= len(chunk)
        return b"".join(chunks)

    # ------------------------------------------------------------------------- routes

    def do_POST(self) -> None:
        path, query = self._record()
        if path == "/v2/uploads":
            self._upload(query)
        elif path == "/v2/batches":
            self._submit(json.loads(self._body()))
        else:
            self._error(404, f"no route {path}")

    def do_GET(self) -> None:
        path, _ = self._record()
        parts = [unquote(part) for part in path.strip("/").split("/")]
        if path == "/v2/uploads":
            self._json(200, {"uploads": list(self.fake.uploads.values())})
        elif parts[:2] == ["v2", "batches"] and len(parts) == 3:
            self._status(parts[2])
        elif parts[:2] == ["v2", "batches"] and len(parts) == 4 and parts[3] == "outputs":
            self._listing(parts[2])
        elif parts[:2] == ["v2", "batches"] and len(parts) >= 5 and parts[3] == "outputs":
            self._file(parts[2], "/".join(parts[4:]))
        else:
            self._error(404, f"no route {path}")

    def _upload(self, query: dict[str, list[str]]) -> None:
        if self.headers.get("Transfer-Encoding"):
            self._error(400, "this fake takes Content-Length bodies only")
            return
        body = self._body()
        if self.fake.quota_full:
            self._error(
                429, "over SLUICE_TENANT_MAX_STORED_BYTES (100 bytes)", {"Retry-After": "60"}
            )
            return
        digest = hashlib.sha256(body).hexdigest()
        if self.headers.get("Sluice-Content-SHA256") != digest:
            self._error(400, "header 'Sluice-Content-SHA256' does not match the body")
            return
        upload_id = uuid.uuid4().hex
        record = {
            "id": upload_id,
            "name": query["name"][0],
            "bytes": len(body),
            "sha256": digest,
            "expires": 2_000_000_000,
        }
        with self.fake.lock:
            self.fake.uploads[upload_id] = record
            self.fake.upload_bodies[upload_id] = body
        self._json(201, record, {"Location": f"/v2/uploads/{upload_id}"})

    def _submit(self, document: dict[str, Any]) -> None:
        self.fake.submitted.append(document)
        source = document["input"]
        data = b""
        if source.startswith("upload:"):
            upload_id = source.removeprefix("upload:")
            if upload_id not in self.fake.upload_bodies:
                self._error(404, f"no upload '{upload_id}'")
                return
            data = self.fake.upload_bodies[upload_id]
        batch_id = uuid.uuid4().hex
        state = {
            "id": batch_id,
            "model": document["model"],
            "status": "queued",
            "rows_done": 0,
            "rows_total": 0,
            "input": source,
            "output": document.get("output", ""),
            "polls": 0,
        }
        with self.fake.lock:
            self.fake.batches[batch_id] = state
            self.fake.outputs[batch_id] = {
                "output.bin": data[::-1],
                "_manifest.json": json.dumps({"rows": len(data)}).encode(),
            }
        self._json(201, _public(state), {"Location": f"/v2/batches/{batch_id}"})

    def _status(self, batch_id: str) -> None:
        with self.fake.lock:
            state = self.fake.batches.get(batch_id)
            if state is None:
                self._error(404, f"no batch '{batch_id}'")
                return
            state["polls"] += 1
            if state["status"] not in ("completed", "failed"):
                if state["polls"] <= self.fake.polls_before_rows:
                    pass
                elif self.fake.fail_with is not None:
                    state.update(status="failed", error=self.fake.fail_with)
                elif state["rows_total"] == 0:
                    state.update(status="running", rows_total=1_000, rows_done=400)
                else:
                    state.update(status="completed", rows_done=1_000, manifest="_manifest.json")
            document = _public(state)
        self._json(200, document)

    def _listing(self, batch_id: str) -> None:
        state = self.fake.batches.get(batch_id)
        if state is None:
            self._error(404, f"no batch '{batch_id}'")
            return
        if state["status"] != "completed":
            self._error(409, f"batch '{batch_id}' is {state['status']}, not completed")
            return
        files = []
        for name, content in self.fake.outputs[batch_id].items():
            item: dict[str, Any] = {"name": name, "bytes": len(content)}
            if self.fake.list_sha256:
                item["sha256"] = hashlib.sha256(content).hexdigest()
            files.append(item)
        files += [{"name": name, "bytes": 1} for name in self.fake.extra_names]
        self._json(200, {"files": files})

    def _file(self, batch_id: str, name: str) -> None:
        content = self.fake.outputs.get(batch_id, {}).get(name)
        if content is None:
            self._error(404, f"no output '{name}'")
            return
        if self.fake.corrupt and content:
            content = bytes([content[0] ^ 0xFF]) + content[1:]
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        if self.fake.cut_after is not None:
            self.wfile.write(content[: self.fake.cut_after])
            self.wfile.flush()
            self.close_connection = True
            return
        for start in range(0, len(content), 1 << 16):
            self.wfile.write(content[start : start + (1 << 16)])


def _public(state: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in state.items() if key != "polls"}


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], fake: FakeGateway) -> None:
        super().__init__(address, _Handler)
        self.fake = fake

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up on purpose (a test's) is no error of the server's."""


@contextmanager
def fake_gateway(fake: FakeGateway | None = None) -> Iterator[tuple[str, FakeGateway]]:
    """The server's URL and its state, for the ``with`` block."""
    fake = fake or FakeGateway()
    server = _Server(("127.0.0.1", free_port()), fake)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", fake
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
