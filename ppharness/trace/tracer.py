"""Recording a stage's spans: cheap when on, absent when off.

A stage holds a ``Tracer`` when the plan turns tracing on and ``None`` otherwise; every call site is guarded by
``if tracer``, so tracing off costs one attribute test per message and no clock reads. Spans are kept per request
(the last few only) until the seed asks for them with a TraceRequest.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from ppharness.wire.messages import Span

KEEP_REQUESTS = 8

now_ns = time.monotonic_ns


class Tracer:
    """Spans of the requests this stage served, on this process's monotonic clock."""

    def __init__(self) -> None:
        self._spans: OrderedDict[str, list[Span]] = OrderedDict()
        self._current: list[Span] | None = None

    def begin(self, request_id: str) -> None:
        """Start collecting for ``request_id`` (forgetting the oldest request beyond the last few)."""
        self._current = self._spans.setdefault(request_id, [])
        while len(self._spans) > KEEP_REQUESTS:
            self._spans.popitem(last=False)

    def add(self, step: int, name: str, t0_ns: int, t1_ns: int, nbytes: int = 0) -> None:
        if self._current is not None:
            self._current.append(Span(step, name, t0_ns, t1_ns, nbytes))

    def take(self, request_id: str) -> list[Span]:
        """The spans of ``request_id`` (empty if unknown), removed from the tracer."""
        spans = self._spans.pop(request_id, [])
        if spans is self._current:
            self._current = None
        return spans
