"""A registration's download (``POST /models?url=`` of a URL the operator allows) ends,
whatever the server at the other end does."""

from __future__ import annotations

import asyncio
import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.core.errors import InvalidInput
from sluice.gateway.torchserve import archives


class _Dripping(http.server.BaseHTTPRequestHandler):
    """An archive that never ends: a byte every tenth of a second, each well within the
    wait for the next bytes."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(1 << 30))
        self.end_headers()
        try:
            while True:
                self.wfile.write(b"P")
                self.wfile.flush()
                time.sleep(0.1)
        except OSError:
            return

    def log_message(self, format: str, *args: object) -> None:
        return


@pytest.fixture
def dripping() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Dripping)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/slow.mar"
    server.shutdown()
    server.server_close()


@pytest.mark.slow
async def test_a_download_that_never_ends_fails_at_its_deadline(
    dripping: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(archives, "_DOWNLOAD_DEADLINE_S", 1, raising=False)
    started = time.monotonic()
    with pytest.raises(InvalidInput, match=r"Failed to download archive from: .*not done in 1 s"):
        await asyncio.wait_for(archives.find_archive(dripping, tmp_path, r"http://127\..*"), 20)
    assert time.monotonic() - started < 10
