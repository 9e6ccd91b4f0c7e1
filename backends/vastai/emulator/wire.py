"""The vast.ai emulator's HTTP layer: the standard library's ThreadingHTTPServer and the handler that reads each
request within its bounds (``intake``), hands it to ``Emulator.dispatch`` and writes the reply.

Every refusal is JSON in the contract's shape, ``{"success": false, "error": <code>, "msg": <text>}``: a malformed
request line or header (the standard library's own refusals included), a method the API has no route for, a body
framed other than by one ``Content-Length`` up to ``MAX_BODY_BYTES``, and a connection silent for
``Emulator.read_timeout_s`` (408, or closed between requests). An error of the emulator's own is a JSON 500 and one
line in its log; a connection's handler never prints a traceback.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from backends.vastai.emulator.api import Reply
from backends.vastai.emulator.intake import BadRequest, body_length, parse_json, shown

if TYPE_CHECKING:
    from backends.vastai.emulator.server import Emulator

METHODS = ("GET", "POST", "PUT", "DELETE")
# the error code of each refusal made before a request is read through
FRAMING_ERRORS = {
    400: "invalid_request",
    405: "method_not_allowed",
    408: "request_timeout",
    411: "length_required",
    413: "request_too_large",
    414: "uri_too_long",
    431: "headers_too_large",
    505: "http_version_not_supported",
}
# the standard library's refusals (by the start of its message), in the emulator's words
STDLIB_REFUSALS = {
    "Bad request version": "the request line's version is not HTTP/<major>.<minor>",
    "Bad request syntax": "the request line is not <method> <target> HTTP/<version>",
    "Bad HTTP/0.9 request type": "the request line names no HTTP version: this API speaks HTTP/1.0 and 1.1",
    "Invalid HTTP version": "this API speaks HTTP/1.0 and 1.1",
    "Line too long": "a header line is over 65,536 bytes",
    "Too many headers": "the request has over 100 header lines",
}
LINGER_S, LINGER_BYTES = 1.0, 4 * (1 << 20)  # what is read and dropped after a refusal, before closing


class EmulatorServer(ThreadingHTTPServer):
    """The HTTP server of ``emu``, its handler threads daemons; what escapes a connection's handler is one line in the
    emulator's log."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], emu: Emulator) -> None:
        super().__init__(address, EmulatorHandler)
        self.emu = emu

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        self.emu.events.write(
            f"http: the connection from {client_address[0]} ended on {type(exc).__name__}: {shown(str(exc))}"
        )


class EmulatorHandler(BaseHTTPRequestHandler):
    """One connection's requests, each read within its bounds and answered by the server's emulator."""

    server: EmulatorServer

    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.0"  # a refusal before the version is read still gets a status line
    server_version = "vastai-emulator/1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the stdlib's name)
        return

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.emu.read_timeout_s)

    def parse_request(self) -> bool:
        """The standard library's parse, then refusals of a request line without a version (HTTP/0.9 gets no
        status line) and of methods the API has no route for."""
        if not super().parse_request():
            return False
        if len(self.requestline.split()) == 2 or self.request_version == "HTTP/0.9":
            self.request_version = self.default_request_version
            self.send_error(400, "the request line names no HTTP version: this API speaks HTTP/1.0 and 1.1")
            return False
        if self.command not in METHODS:
            self.send_error(405, f"method {shown(str(self.command), 20)!r}: this API takes {', '.join(METHODS)}")
            return False
        return True

    def handle_expect_100(self) -> bool:
        """Ask for the body only when its length is one the emulator reads; ``_serve`` refuses the others."""
        try:
            body_length(self.headers)
        except BadRequest:
            return True
        return super().handle_expect_100()

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """A refusal before the request is read through (the standard library's too): a JSON error, then the
        connection closed after what the client still sends is read and dropped (``_linger``)."""
        self.server.emu.requests.append((self.command or "", shown(getattr(self, "path", "")), code))
        error = FRAMING_ERRORS.get(code, "invalid_request" if code < 500 else "server_error")
        if code == 414:
            message = "the request line is over 65,536 bytes"
        text = message or HTTPStatus(code).phrase
        text = next((own for prefix, own in STDLIB_REFUSALS.items() if text.startswith(prefix)), text)
        body = {"success": False, "error": error, "msg": shown(text, 200)}
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Connection", "close")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if code == 405:
            self.send_header("Allow", ", ".join(METHODS))
        self.end_headers()
        self.wfile.write(data)
        self._linger()

    def _linger(self) -> None:
        """Stop writing, then read and drop what the client still sends (at most ``LINGER_BYTES``, for at most
        ``LINGER_S``) so that closing does not reset the connection before the client reads the answer."""
        deadline, left = time.monotonic() + LINGER_S, LINGER_BYTES
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            while left > 0 and (wait := deadline - time.monotonic()) > 0:
                self.connection.settimeout(wait)
                chunk = self.connection.recv(min(left, 1 << 16))
                if not chunk:
                    return
                left -= len(chunk)
        except OSError:
            return

    def _serve(self) -> None:
        try:
            length = body_length(self.headers)
        except BadRequest as exc:
            return self.send_error(exc.status, str(exc))
        try:
            raw = self.rfile.read(length) if length else b""
        except TimeoutError:
            return self.send_error(
                408, f"the body's {length} bytes did not come within {self.server.emu.read_timeout_s:g} s"
            )
        if len(raw) < length:  # the client closed the connection partway through the body
            self.close_connection = True
            return
        try:
            reply, path = self._answer(raw)
        except Exception as exc:  # the emulator's own error, not the client's: a JSON 500 and a line in its log
            self.server.emu.events.write(
                f"http: {self.command} {shown(self.path)} failed: {type(exc).__name__}: {shown(str(exc))}"
            )
            failed = "the emulator failed on this request (emulator.log says how)"
            reply, path = Reply(500, {"success": False, "error": "server_error", "msg": failed}), shown(self.path)
        self._send(reply, path)

    def _answer(self, raw: bytes) -> tuple[Reply, str]:
        try:
            url = urlsplit(self.path)
        except ValueError:
            bad = {"success": False, "error": "invalid_request", "msg": f"{shown(self.path)!r} is not a URL"}
            return Reply(400, bad), shown(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        body: Any = {}
        if raw.strip():
            try:
                body = parse_json(raw, "the request body")
            except BadRequest as exc:
                return Reply(400, {"success": False, "error": "invalid_args", "msg": str(exc)}), url.path
        return self.server.emu.dispatch(
            self.command, url.path, query, self.headers, body, self.client_address[0]
        ), url.path

    def _send(self, reply: Reply, path: str) -> None:
        self.server.emu.requests.append((self.command, path, reply.status))
        if reply.status == 0:
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        if isinstance(reply.body, str):
            data, ctype = (
                reply.body.encode(),
                "text/plain; charset=utf-8" if not reply.body.startswith("<") else "text/html; charset=utf-8",
            )
        else:
            data, ctype = json.dumps(reply.body).encode(), "application/json"
        self.send_response(reply.status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for k, v in reply.headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = _serve
