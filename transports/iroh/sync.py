"""Calling the iroh binding's async methods from a plain thread, without an asyncio event loop hop.

Every async method of the uniffi-generated ``iroh.iroh_ffi`` is a coroutine that asks ``asyncio.get_running_loop()``
for a loop, polls a Rust future with ``loop.create_future()`` as the continuation, and awaits it; Rust completes it
through ``loop.call_soon_threadsafe``. ``call()`` runs such a coroutine on the calling thread with a stand-in for
that loop and future built on ``threading.Event``: a Rust future that is ready at once (a stream write with window
to spare) completes inside the poll, and one that is not wakes the calling thread directly from the Rust thread. A
send then costs no hand-over to the transport's loop thread and back.

Guarantees: ``supported()`` allows it only for binding versions whose async machinery hashes to the recorded source
(``KNOWN_GOOD``); ``call()`` refuses (``RuntimeError``, nothing started) on a thread that already runs an asyncio
loop; a call that outlives its timeout is cancelled (the coroutine is closed, which frees the Rust future) and raises
``TimeoutError``; exceptions of the coroutine propagate unchanged.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Generator
from types import ModuleType
from typing import Any, TypeVar

from transports.iroh.fastcopy import source_digest

KNOWN_GOOD: dict[str, dict[str, str]] = {
    "1.2.0": {
        "_uniffi_rust_call_async": "1fa6d2e8b917543dc5c99228f82669b57b387012de1c514b5b5294d58f906fbd",
        "_uniffi_get_event_loop": "52c958aa3c8542a247e8ca2790da22da3b9760134e14fb1b0f079d53c9c3c77c",
        "_uniffi_set_future_result": "7151bf2ce14127bd3519feca8bb418de9c5589b7a4e43c16ddf93a8848e8200d",
    },
}
_T = TypeVar("_T")
_CONTINUATION = (
    "def _uniffi_continuation_callback(future_ptr, poll_code):\n"
    "    (eventloop, future) = _UniffiContinuationHandleMap.remove(future_ptr)\n"
    "    eventloop.call_soon_threadsafe(_uniffi_set_future_result, future, poll_code)\n"
)


def refusal(ffi: ModuleType, version: str | None) -> str | None:
    """Why ``call()`` must not be used with ``ffi`` at ``version`` (None: it may be)."""
    expected = KNOWN_GOOD.get(version or "")
    if expected is None:
        return f"iroh {version} is not a version the direct calls were checked against ({', '.join(KNOWN_GOOD)})"
    try:
        for name, digest in expected.items():
            if source_digest(getattr(ffi, name)) != digest:
                return f"iroh {version}: the source of {name} is not the one the direct calls were checked against"
        import inspect

        if _CONTINUATION not in inspect.getsource(ffi):
            return f"iroh {version}: _uniffi_continuation_callback is not the one the direct calls were checked against"
    except (AttributeError, OSError, TypeError) as exc:
        return f"iroh {version}: cannot inspect the async machinery ({exc})"
    return None


class _Waiter:
    """Stands in for the asyncio loop (``create_future``, ``call_soon_threadsafe``) and for the future the binding
    awaits (``cancelled``, ``set_result``, ``__await__``). One poll is outstanding at a time."""

    __slots__ = ("event", "result", "done")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.result: object = None
        self.done = False

    def create_future(self) -> _Waiter:
        self.event.clear()
        self.done = False
        return self

    def call_soon_threadsafe(self, callback: Callable[..., object], *args: object) -> None:
        callback(*args)

    def cancelled(self) -> bool:
        return False

    def set_result(self, result: object) -> None:
        self.result = result
        self.done = True
        self.event.set()

    def __await__(self) -> Generator[_Waiter, None, object]:
        if not self.done:
            yield self
        return self.result


def can_call() -> bool:
    """Whether ``call()`` may run on this thread (it runs no asyncio loop)."""
    return asyncio._get_running_loop() is None


def call(coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
    """Run one binding coroutine to completion on this thread; ``timeout`` bounds each wait for Rust."""
    if asyncio._get_running_loop() is not None:
        coro.close()
        raise RuntimeError("this thread runs an asyncio loop: await the binding instead")
    waiter = _Waiter()
    # a stand-in, not an AbstractEventLoop: the binding only calls its create_future and call_soon_threadsafe
    asyncio._set_running_loop(waiter)  # type: ignore[arg-type]
    try:
        while True:
            try:
                yielded = coro.send(None)
            except StopIteration as stop:
                value: _T = stop.value  # the coroutine's return value
                return value
            if yielded is not waiter:
                coro.close()
                raise RuntimeError(f"a binding coroutine awaited {yielded!r}, not the binding's continuation")
            if not waiter.event.wait(timeout):
                coro.close()
                raise TimeoutError(f"the iroh call did not complete within {timeout} s")
    finally:
        asyncio._set_running_loop(None)
