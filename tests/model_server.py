"""A loopback HTTP server of model files that misbehave, for the tests of downloads within bounds."""

from __future__ import annotations

import contextlib
import http.server
import threading
import time
from collections.abc import Iterator
from typing import Any

CHUNK = 64 << 10


class ModelFiles(http.server.BaseHTTPRequestHandler):
    """``/endless``: bytes until the client leaves, no size; ``/trickle``: a byte every 0.2 s; ``/stall``: 10 bytes,
    then nothing; ``/huge``: announces 1 TiB; ``/small``: 1,000 bytes with their size."""

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        if self.path == "/huge":
            self.send_header("Content-Length", str(1 << 40))
        if self.path == "/small":
            self.send_header("Content-Length", "1000")
        self.end_headers()
        try:
            if self.path == "/small":
                self.wfile.write(b"x" * 1000)
            elif self.path == "/stall":
                self.wfile.write(b"x" * 10)
                self.wfile.flush()
                time.sleep(20)
            elif self.path in ("/endless", "/trickle", "/huge"):
                trickle = self.path == "/trickle"
                for _ in range(10**6):
                    self.wfile.write(b"x" if trickle else b"x" * CHUNK)
                    self.wfile.flush()
                    if trickle:
                        time.sleep(0.2)
        except (BrokenPipeError, ConnectionResetError):
            pass


@contextlib.contextmanager
def model_files() -> Iterator[str]:
    """Serve ``ModelFiles`` on loopback for the block: its base URL."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ModelFiles)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
