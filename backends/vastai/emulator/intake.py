"""What the vast.ai emulator reads from a request before any endpoint sees it, each with a bound.

A request whose framing, body or path is malformed is refused with a ``BadRequest``: its status (4xx) and the message
of the JSON error the emulator answers with. Nothing here reads more than ``MAX_BODY_BYTES`` or recurses on what a
client sent.
"""

from __future__ import annotations

import json
import re
from email.message import Message
from typing import Any

MAX_BODY_BYTES = 1 << 20  # a request body the emulator reads; vast.ai's requests are a few KiB (env: 32 KiB at most)
MAX_JSON_DEPTH = 32  # nesting of a JSON body or parameter; the API's deepest value nests 3 levels
MAX_ID = (1 << 63) - 1  # ids in a path: vast.ai's ids are 64-bit database keys
# a string, or an unterminated one to the end: it always matches where it starts, so one pass removes every string
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


class BadRequest(ValueError):
    """A request the emulator refuses: ``status`` and the ``msg`` of its JSON error."""

    def __init__(self, msg: str, status: int = 400) -> None:
        super().__init__(msg)
        self.status = status


def shown(text: str, limit: int = 80) -> str:
    """``text`` cut to ``limit`` characters for a message, saying how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def body_length(headers: Message) -> int:
    """The body's length from its ``Content-Length``: 0 without one (RFC 9112 §6.3). Refused: a body sent chunked
    (411), a length that is not one decimal byte count (400), or one over ``MAX_BODY_BYTES`` (413)."""
    if headers.get_all("Transfer-Encoding"):
        raise BadRequest("send the body with a Content-Length: this API takes no Transfer-Encoding", 411)
    given = [str(v).strip(" \t") for v in headers.get_all("Content-Length") or []]
    if not given:
        return 0
    if len(given) > 1:
        raise BadRequest(f"{len(given)} Content-Length headers: a request has one")
    text = given[0]
    if not text.isascii() or not text.isdigit():
        raise BadRequest(f"Content-Length {shown(text)!r} is not a byte count (a non-negative decimal integer)")
    if len(text) > len(str(MAX_BODY_BYTES)):
        raise BadRequest(f"a {len(text)}-digit Content-Length is over the emulator's {MAX_BODY_BYTES}-byte limit", 413)
    if int(text) > MAX_BODY_BYTES:
        raise BadRequest(f"a body of {text} bytes is over the emulator's {MAX_BODY_BYTES}-byte limit", 413)
    return int(text)


def json_depth(data: bytes, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep ``data``'s arrays and objects nest, counted up to ``limit + 1`` (brackets inside strings are not
    counted); linear in ``data``, without recursion."""
    depth = deepest = 0
    for bracket in _STRING.sub(b"", data).translate(None, _NOT_BRACKET):
        depth += 1 if bracket in b"[{" else -1
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                break
    return deepest


def parse_json(data: bytes, what: str) -> Any:
    """``data`` as JSON; ``BadRequest`` names ``what`` when it is not UTF-8, nests deeper than ``MAX_JSON_DEPTH``,
    is not JSON, or holds a string that is not Unicode text (a lone surrogate)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"{what} is not UTF-8 (byte {exc.start})") from None
    if json_depth(data) > MAX_JSON_DEPTH:
        raise BadRequest(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"{what} is not JSON (line {exc.lineno}, column {exc.colno})") from None
    except ValueError:
        raise BadRequest(f"{what} holds a number of more than 4300 digits") from None
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"{what} holds a string with a lone UTF-16 surrogate") from None
    return value


def path_id(text: str, what: str) -> int:
    """An id from a path (its digits matched by the route), refused over ``MAX_ID``."""
    if len(text) > len(str(MAX_ID)) or int(text) > MAX_ID:
        raise BadRequest(f"{what} {shown(text, 24)} is out of range: ids are below 2^63")
    return int(text)
