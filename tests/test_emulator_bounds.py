"""Malformed requests to the vast.ai emulator over raw sockets (marker ``vastai``): each gets a 4xx status line and
a JSON error within seconds, never a traceback, and the emulator answers a good request afterwards."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from backends.vastai.emulator.intake import MAX_BODY_BYTES, MAX_JSON_DEPTH, json_depth

pytestmark = [pytest.mark.vastai, pytest.mark.timeout(60)]
REPLY_WITHIN_S = 5.0
SEARCH = b"POST /api/v0/bundles/ HTTP/1.1\r\nHost: emulator\r\n"
AUTH = "Authorization: Bearer {key}"


def _request(line: str, *headers: str, body: bytes = b"", length: bool = True) -> tuple[str, bytes]:
    """A request's head (``{key}`` and ``{offer}`` stand for the emulator's key and a free offer's id) and body."""
    sized = [f"Content-Length: {len(body)}"] if length and body else []
    return "".join(f"{h}\r\n" for h in [line, "Host: emulator", *headers, *sized]) + "\r\n", body


def _search(body: bytes) -> tuple[str, bytes]:
    return _request("POST /api/v0/bundles/ HTTP/1.1", body=body)


def _create(body: bytes) -> tuple[str, bytes]:
    return _request("PUT /api/v0/asks/{offer}/ HTTP/1.1", AUTH, body=body)


def _get(target: str) -> tuple[str, bytes]:
    return _request(f"GET {target} HTTP/1.1", AUTH)


BIG = "1" * 5000
DEEP = b"[" * 100_000 + b"]" * 100_000
CASES: dict[str, tuple[tuple[str, bytes], int]] = {
    # Content-Length and Transfer-Encoding
    "length-abc": (_request("POST /api/v0/bundles/ HTTP/1.1", "Content-Length: abc"), 400),
    "length-negative": (_request("POST /api/v0/bundles/ HTTP/1.1", "Content-Length: -1"), 400),
    "length-plus": (_request("POST /api/v0/bundles/ HTTP/1.1", "Content-Length: +5", body=b"{}", length=False), 400),
    "length-empty": (_request("POST /api/v0/bundles/ HTTP/1.1", "Content-Length: "), 400),
    "length-superscript": (_request("POST /api/v0/bundles/ HTTP/1.1", "Content-Length: \u00b2"), 400),
    "length-two": (
        _request("POST /api/v0/bundles/ HTTP/1.1", "Content-Length: 2", "Content-Length: 3", body=b"{}", length=False),
        400,
    ),
    "length-400-digits": (_request("POST /api/v0/bundles/ HTTP/1.1", "Content-Length: " + "9" * 400), 413),
    "length-over-cap": (_request("POST /api/v0/bundles/ HTTP/1.1", f"Content-Length: {MAX_BODY_BYTES + 1}"), 413),
    "body-over-cap-sent": (_search(b" " * (2 * MAX_BODY_BYTES)), 413),
    "expect-100-over-cap": (
        _request("POST /api/v0/bundles/ HTTP/1.1", "Expect: 100-continue", f"Content-Length: {MAX_BODY_BYTES + 1}"),
        413,
    ),
    "chunked": (
        _request(
            "POST /api/v0/bundles/ HTTP/1.1", "Transfer-Encoding: chunked", body=b"2\r\n{}\r\n0\r\n\r\n", length=False
        ),
        411,
    ),
    # the body
    "body-not-json": (_search(b"{not json"), 400),
    "body-not-utf8": (_search(b'{"limit": 2, "x": "\xff"}'), 400),
    "body-lone-surrogate": (_create(b'{"image": "img", "disk": 10, "args": ["\\ud800"]}'), 400),
    "body-nested-1e5": (_search(DEEP), 400),
    "body-nested-500": (_search(b'{"a": ' * 500 + b"1" + b"}" * 500), 400),
    "body-5000-digit-number": (_search(b'{"limit": ' + BIG.encode() + b"}"), 400),
    "body-400-digit-storage": (_search(b'{"allocated_storage": ' + b"9" * 400 + b"}"), 400),
    "body-infinite-limit": (_search(b'{"limit": Infinity}'), 400),
    "body-list-search": (_search(b"[1, 2]"), 400),
    "body-list-create": (_create(b'[{"image": "img"}]'), 400),
    "search-type-list": (_search(b'{"type": []}'), 400),
    "search-order-number": (_search(b'{"order": 5}'), 400),
    "search-order-short": (_search(b'{"order": [["score"]]}'), 400),
    "create-env-unclosed-quote": (_create(b'{"image": "img", "disk": 10, "env": "-e \'A=1"}'), 400),
    # the path and query
    "id-5000-digits-show": (_get(f"/api/v0/instances/{BIG}/"), 400),
    "id-5000-digits-destroy": (_request(f"DELETE /api/v0/instances/{BIG}/ HTTP/1.1", AUTH), 400),
    "id-5000-digits-manage": (
        _request(f"PUT /api/v0/instances/{BIG}/ HTTP/1.1", AUTH, body=b'{"state": "stopped"}'),
        400,
    ),
    "id-5000-digits-create": (_request(f"PUT /api/v0/asks/{BIG}/ HTTP/1.1", AUTH, body=b'{"image": "i"}'), 400),
    "id-2-to-the-64": (_get(f"/api/v0/instances/{1 << 64}/"), 400),
    "id-negative": (_get("/api/v0/instances/-1/"), 404),
    "id-not-a-number": (_get("/api/v0/instances/abc/"), 404),
    "target-bad-ipv6": (_get("http://[::1/api/v0/instances/"), 400),
    "query-q-nested": (_get("/api/v0/bundles/?q=" + "[" * 20_000), 400),
    "query-filters-nested": (_get("/api/v1/instances/?select_filters=" + "[" * 20_000), 400),
    "query-order-by-number": (_get("/api/v1/instances/?order_by=[5]"), 400),
    "query-limit-5000-digits": (_get(f"/api/v1/instances/?limit={BIG}"), 400),
    # the request line and headers
    "request-line-70000": (_request("GET /" + "a" * 70_000 + " HTTP/1.1"), 414),
    "header-line-70000": (_request("GET /api/v0/bundles/ HTTP/1.1", "X-Long: " + "a" * 70_000), 431),
    "headers-101": (_request("GET /api/v0/bundles/ HTTP/1.1", *(f"X-H{i}: v" for i in range(101))), 431),
    "version-garbled": (_request("GET /api/v0/bundles/ HTTP/1.x"), 400),
    "version-0.9": (_request("GET /api/v0/bundles/"), 400),
    "request-line-garbage": (_request("\x00\x01\x02"), 400),
    "method-patch": (_request("PATCH /api/v0/instances/1/ HTTP/1.1", AUTH), 405),
    "method-unknown": (_request("BREW /api/v0/bundles/ HTTP/1.1"), 405),
}


def _address(emu: Any) -> tuple[str, int]:
    url = urlsplit(emu.url)
    assert url.hostname is not None and url.port is not None
    return url.hostname, url.port


def _reply(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP reply read off ``sock``: status, headers (lower-case names), body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"the connection closed without a complete reply: {data[:200]!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(status_line.split()[1]), headers, body


def _exchange(emu: Any, head: str, body: bytes) -> tuple[int, dict[str, str], bytes, float]:
    """Send one raw request; (status, headers, body, seconds to the reply)."""
    offer = min(i for i, o in emu.catalog.items() if not o["rented"])
    start = time.monotonic()
    with socket.create_connection(_address(emu), timeout=REPLY_WITHIN_S) as sock:
        sock.sendall(head.replace("{key}", emu.key).replace("{offer}", str(offer)).encode("latin-1") + body)
        try:
            status, headers, reply = _reply(sock)
        except TimeoutError:
            raise AssertionError(f"no reply within {REPLY_WITHIN_S} s") from None
    return status, headers, reply, time.monotonic() - start


def _still_serves(emu: Any) -> None:
    time.sleep(0.1)  # past every scaled rate limit
    with httpx.Client(base_url=emu.url, headers={"Authorization": f"Bearer {emu.key}"}, timeout=5) as http:
        assert http.post("/api/v0/bundles/", json={"limit": 2}).json()["offers"]
        assert http.get("/api/v1/instances/").json()["success"] is True


@pytest.fixture
def emu(vastai_api: Any) -> Any:
    if vastai_api.emulator is None:
        pytest.skip("vastai: malformed requests go to the emulator only (not with --vastai-real)")
    vastai_api.emulator.read_timeout_s = 1.0
    return vastai_api.emulator


@pytest.mark.parametrize("case", list(CASES))
def test_a_malformed_request_gets_a_json_4xx(emu, capfd, case):
    (head, body), want = CASES[case]
    status, headers, reply, took = _exchange(emu, head, body)
    assert status == want, (status, reply[:300])
    assert headers.get("content-type") == "application/json", headers
    error = json.loads(reply)
    assert error["success"] is False and error["error"] and error["msg"], error
    assert len(reply) < 1024 and took < REPLY_WITHIN_S, (len(reply), took)
    _still_serves(emu)
    assert "Traceback" not in capfd.readouterr().err
    assert "Traceback" not in emu.log_text()


def _handler_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if "process_request" in t.name}


def _gone(threads: set[threading.Thread], within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(t.is_alive() for t in threads):
        time.sleep(0.05)
    return not any(t.is_alive() for t in threads)


def test_a_stalled_body_is_answered_408_and_its_thread_ends(emu, capfd):
    before = _handler_threads()
    start = time.monotonic()
    with socket.create_connection(_address(emu), timeout=REPLY_WITHIN_S) as sock:
        sock.sendall(SEARCH + b"Content-Length: 10\r\n\r\n{}")
        status, _, reply = _reply(sock)
        took = time.monotonic() - start
        assert status == 408 and json.loads(reply)["error"], reply
        assert emu.read_timeout_s <= took < emu.read_timeout_s + 2, took
        assert _gone(_handler_threads() - before, within=3), "a handler thread outlived the stalled request"
    _still_serves(emu)
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("sent", [b"", SEARCH, SEARCH + b"Content-Length: 2\r\n"], ids=["nothing", "line", "headers"])
def test_a_stalled_request_head_is_closed_within_the_read_timeout(emu, capfd, sent):
    before = _handler_threads()
    start = time.monotonic()
    with socket.create_connection(_address(emu), timeout=REPLY_WITHIN_S) as sock:
        sock.sendall(sent)
        try:
            left = sock.recv(65536)
        except TimeoutError:
            raise AssertionError(f"the emulator held a stalled connection over {REPLY_WITHIN_S} s") from None
        assert left == b"" or left.startswith(b"HTTP/1.1 408 "), left
    assert time.monotonic() - start < emu.read_timeout_s + 2
    assert _gone(_handler_threads() - before, within=3), "a handler thread outlived the stalled connection"
    _still_serves(emu)
    assert "Traceback" not in capfd.readouterr().err


def test_a_client_that_leaves_mid_body_costs_one_log_line_at_most(emu, capfd):
    with socket.create_connection(_address(emu), timeout=REPLY_WITHIN_S) as sock:
        sock.sendall(SEARCH + b"Content-Length: 100\r\n\r\n{")
    _still_serves(emu)
    assert "Traceback" not in capfd.readouterr().err and "Traceback" not in emu.log_text()


def test_the_depth_scan_counts_brackets_outside_strings_only_in_linear_time():
    assert json_depth(b'{"a": [1, {"b": "[[[[{{{{"}]}') == 3
    assert json_depth(b'["\\"[[[", [[]]]') == 3
    assert json_depth(b'[["unterminated [[[[') == 2
    assert json_depth(DEEP) == MAX_JSON_DEPTH + 1
    for worst in (b'"' + b'\\"' * (MAX_BODY_BYTES // 2), b'"' * MAX_BODY_BYTES, b"[]" * (MAX_BODY_BYTES // 2)):
        start = time.monotonic()
        json_depth(worst)
        assert time.monotonic() - start < 1.0, worst[:8]


def test_http_2_is_refused_505_in_json(emu, capfd):
    status, headers, reply, _ = _exchange(emu, *_request("GET /api/v0/bundles/ HTTP/2.0"))
    assert status == 505 and headers.get("content-type") == "application/json"
    assert json.loads(reply)["error"] == "http_version_not_supported"
    _still_serves(emu)
    assert "Traceback" not in capfd.readouterr().err


def test_an_emulator_error_is_a_json_500_and_one_log_line(emu, capfd, monkeypatch):
    def broken(*args: Any) -> None:
        raise RuntimeError("a bug of the emulator's")

    monkeypatch.setattr(emu, "dispatch", broken)
    status, _, reply, _ = _exchange(emu, *_search(b'{"limit": 2}'))
    assert status == 500 and json.loads(reply)["error"] == "server_error", reply
    lines = [line for line in emu.log_text().splitlines() if "RuntimeError" in line]
    assert len(lines) == 1 and "POST /api/v0/bundles/" in lines[0], lines
    assert "Traceback" not in capfd.readouterr().err


def test_what_escapes_a_handler_is_one_log_line(emu, capfd, monkeypatch):
    class Unrecorded:
        def append(self, entry: object) -> None:
            raise RuntimeError("the request log is broken")

    monkeypatch.setattr(emu, "requests", Unrecorded())
    with socket.create_connection(_address(emu), timeout=REPLY_WITHIN_S) as sock:
        sock.sendall(SEARCH + b"\r\n")
        assert sock.recv(65536) == b""  # no reply: the connection closes
    lines = [line for line in emu.log_text().splitlines() if "RuntimeError" in line]
    assert len(lines) == 1 and "the connection from 127.0.0.1" in lines[0], lines
    assert "Traceback" not in capfd.readouterr().err
