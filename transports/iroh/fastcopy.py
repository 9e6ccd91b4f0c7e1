"""Bulk copies for the iroh Python bindings' byte marshalling (a version-guarded patch, not a fork).

The uniffi-generated ``iroh.iroh_ffi`` (iroh 1.2.0) lowers every ``bytes`` argument by copying it into the Rust buffer
one byte at a time in a Python loop (``_UniffiRustBufferBuilder.write``, and ``_pack_into`` for integers). On the
development machine the loop adds about 1.5 ms to a 4 KiB round trip and 40-80 ms to a 128 KiB one. ``apply()``
replaces the two methods with equivalents that copy with one ``ctypes.memmove``; the buffer they produce is
byte-for-byte the same.

The read direction needs nothing: ``_UniffiRustBufferStream.read`` slices a ``POINTER(c_char)``, which ctypes copies
in C. ``apply()`` still checks that method's source, so a binding that changes it is noticed.

Guarantees:

- the patch is applied only when the installed ``iroh`` distribution's version is in ``KNOWN_GOOD`` *and* the source
  of every method it replaces or relies on hashes to the value recorded for that version; otherwise it logs one line
  on stderr saying why and leaves the module untouched;
- after patching, a self-check lowers sample payloads with the original and the patched methods and compares the
  bytes; on any difference the originals are restored and the reason is logged;
- inputs the fast path does not cover (anything but ``bytes``, ``bytearray`` or a contiguous unsigned-byte
  ``memoryview``) go to the original method, so behaviour for them is unchanged;
- ``apply()`` is idempotent and thread-safe; ``revert()`` restores the originals (for tests and benchmarks).
"""

from __future__ import annotations

import ctypes
import hashlib
import inspect
import struct
import sys
import threading
from collections.abc import Callable
from importlib import metadata
from types import ModuleType
from typing import Any

KNOWN_GOOD: dict[str, dict[str, str]] = {
    "1.2.0": {
        "_UniffiRustBufferBuilder.write": "80a30c45daf7f127f8d5137f736f90066d36ec166a28ea47d9d4f0fc1d941f84",
        "_UniffiRustBufferBuilder._pack_into": "5abce300b8865b7d5a5ca1370679ef683baf31d69c2d8c2830eef0434e6fee1d",
        "_UniffiRustBufferStream.read": "fbecdf3c9824b90205b91ffde5479571ecb496c141b641d6a818704b08bfeec1",
    },
}

_lock = threading.Lock()
# (module, original write, _pack_into)
_patched: tuple[ModuleType, Callable[..., Any], Callable[..., Any]] | None = None
_status: str = "not applied"


def _log(text: str) -> None:
    print(f"[ppharness iroh] {text}", file=sys.stderr, flush=True)


def installed_version() -> str | None:
    """The installed ``iroh`` distribution's version, or None when it is not installed."""
    try:
        return metadata.version("iroh")
    except metadata.PackageNotFoundError:
        return None


def source_digest(func: Callable[..., Any]) -> str:
    """sha256 of a function's source text."""
    return hashlib.sha256(inspect.getsource(func).encode()).hexdigest()


def _attr(ffi: ModuleType, dotted: str) -> Any:
    cls_name, _, meth = dotted.partition(".")
    return getattr(getattr(ffi, cls_name), meth)


def refusal(ffi: ModuleType, version: str | None) -> str | None:
    """Why the patch must not be applied to ``ffi`` at ``version`` (None: it may be)."""
    expected = KNOWN_GOOD.get(version or "")
    if expected is None:
        return f"iroh {version} is not a version the bulk-copy patch was checked against ({', '.join(KNOWN_GOOD)})"
    for dotted, digest in expected.items():
        try:
            found = source_digest(_attr(ffi, dotted))
        except (AttributeError, OSError, TypeError) as exc:
            return f"iroh {version}: cannot inspect {dotted} ({exc})"
        if found != digest:
            return f"iroh {version}: the source of {dotted} is not the one the bulk-copy patch was checked against"
    return None


def _make_fast(ffi: ModuleType, original_write: Callable[..., Any]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    rust_buffer = ffi._UniffiRustBuffer
    memmove, cast, c_void_p = ctypes.memmove, ctypes.cast, ctypes.c_void_p

    def _append(self: Any, data: bytes) -> None:
        n = len(data)
        rbuf = self.rbuf
        if rbuf.len + n > rbuf.capacity:
            rbuf = self.rbuf = rust_buffer.reserve(rbuf, n)
        if n:
            memmove(cast(rbuf.data, c_void_p).value + rbuf.len, data, n)
        rbuf.len += n

    def write(self: Any, value: Any) -> None:
        if type(value) is not bytes:
            if isinstance(value, bytearray):
                value = bytes(value)
            elif isinstance(value, memoryview) and value.format == "B" and value.c_contiguous:
                value = value.tobytes()
            else:
                original_write(self, value)
                return
        _append(self, value)

    def _pack_into(self: Any, size: int, format: str, value: Any) -> None:
        packed = struct.pack(format, value)
        if len(packed) != size:
            raise struct.error(f"packing {format!r} gave {len(packed)} bytes, expected {size}")
        _append(self, packed)

    write.__doc__ = "Append ``value``'s bytes with one memmove (ppharness bulk-copy patch)."
    _pack_into.__doc__ = "Append ``struct.pack(format, value)`` with one memmove (ppharness bulk-copy patch)."
    return write, _pack_into


def lower_bytes(ffi: ModuleType, payload: Any) -> bytes:
    """``payload`` lowered exactly as a uniffi ``bytes`` argument is (i32 length, then the bytes), read back."""
    builder = ffi._UniffiRustBufferBuilder()
    try:
        ffi._UniffiFfiConverterBytes.write(payload, builder)
        builder.write_u64(len(payload))
        builder.write_i8(-1)
    except BaseException:
        builder.discard()
        raise
    rbuf = builder.finalize()
    try:
        return ctypes.string_at(rbuf.data, rbuf.len)
    finally:
        rbuf.free()


_SELF_CHECK = (b"", b"\x00", bytes(range(256)), b"\xff" * 4099, bytearray(b"ppharness" * 7))


def apply(ffi: ModuleType | None = None, version: str | None = None) -> bool:
    """Patch ``ffi`` (default: ``iroh.iroh_ffi``) if it is safe to; True when the patch is in place."""
    global _patched, _status
    with _lock:
        if _patched is not None:
            return True
        if ffi is None:
            from iroh import iroh_ffi

            ffi = iroh_ffi
        version = installed_version() if version is None else version
        why = refusal(ffi, version)
        if why is not None:
            _status = f"not applied: {why}"
            _log(f"bulk-copy patch not applied, stream writes stay slow: {why}")
            return False
        builder = ffi._UniffiRustBufferBuilder
        expected = [lower_bytes(ffi, p) for p in _SELF_CHECK]
        _patched = (ffi, builder.write, builder._pack_into)
        builder.write, builder._pack_into = _make_fast(ffi, builder.write)
        got = [lower_bytes(ffi, p) for p in _SELF_CHECK]
        if got != expected:
            _restore()
            _status = "not applied: the self-check found different bytes"
            _log("bulk-copy patch reverted: its self-check lowered different bytes than the original binding")
            return False
        _status = f"applied (iroh {version})"
        return True


def _restore() -> None:
    global _patched
    if _patched is not None:
        ffi, write, pack_into = _patched
        ffi._UniffiRustBufferBuilder.write = write
        ffi._UniffiRustBufferBuilder._pack_into = pack_into
        _patched = None


def revert() -> None:
    """Restore the original methods (no-op when the patch is not applied)."""
    global _status
    with _lock:
        if _patched is not None:
            _restore()
            _status = "reverted"


def applied() -> bool:
    """Whether the patched methods are in place."""
    return _patched is not None


def status() -> str:
    """One line: whether the patch is in place and why not."""
    return _status
