"""Finding a record of a large tuple by its id in constant time: an index built once per tuple (a plan's devices, a
cluster of thousands), kept while that very tuple is in use, so that a check or the simulator that looks up every
node's device stays linear in the plan's size."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

T = TypeVar("T")
KEPT = 16  # tuples indexed at once (the few plans and clusters a command holds)

_lock = threading.Lock()
_indexes: dict[int, tuple[Sequence[object], dict[Hashable, object]]] = {}


def by_key(items: Sequence[T], key: Callable[[T], Hashable]) -> dict[Hashable, T]:
    """``items`` indexed by ``key`` (the first of equal keys wins), built on the first call for this very sequence
    and reused while it is among the last ``KEPT`` indexed (the sequence is held, so its id is not reused)."""
    with _lock:
        hit = _indexes.get(id(items))
        if hit is not None and hit[0] is items:
            return hit[1]  # type: ignore[return-value]
    index: dict[Hashable, T] = {}
    for item in items:
        index.setdefault(key(item), item)
    with _lock:
        if len(_indexes) >= KEPT:
            _indexes.pop(next(iter(_indexes)))
        _indexes[id(items)] = (items, index)  # type: ignore[assignment]
    return index
