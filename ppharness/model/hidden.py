"""The hidden-state handle: what a stage's model hands on at the model/stage boundary.

A ``Hidden`` says where the value lives (a tinygrad tensor on its device, or a host numpy array), its shape (rows, one
per request of a batch; positions; width) and its element type, without touching the value. The host array is made
only when asked (``host()``), once. Only the codec turns a Hidden into bytes (``ppharness.wire.codec.pack_hidden``),
and only ``ppharness.model.exactness`` digests one, where exactness is asked for: everything else passes the handle.

This module imports no tinygrad: a device tensor is recognised by what it offers (``numpy()``, ``shape``, ``dtype``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:
    from tinygrad.tensor import Tensor


class Hidden:
    """A hidden state, on a device or on the host.

    ``value``: a tinygrad ``Tensor`` (left where it is) or a numpy array. ``host()`` is the numpy array, copied from
    the device on the first call only. A transport between stages on one host may pass the handle itself to the next
    stage without a host copy (and without the codec); a transport that crosses a process boundary packs it through
    the codec, which is where the host copy happens.
    """

    __slots__ = ("_host", "value")

    def __init__(self, value: Tensor | NDArray[Any]):
        self.value = value
        self._host: NDArray[Any] | None = value if isinstance(value, np.ndarray) else None

    @property
    def on_device(self) -> bool:
        """Whether the value is a device tensor (its host copy not made yet, or made and kept beside it)."""
        return not isinstance(self.value, np.ndarray)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.value.shape)

    @property
    def dtype(self) -> str:
        """The element type as numpy names it (``float16``); a device type numpy lacks keeps tinygrad's name."""
        if isinstance(self.value, np.ndarray):
            return str(self.value.dtype)
        fmt = getattr(self.value.dtype, "fmt", None)
        return str(np.dtype(fmt)) if fmt else str(self.value.dtype.name)

    @property
    def rows(self) -> int:
        """The first dimension: one row per request of a batch."""
        return self.shape[0]

    @property
    def seq_len(self) -> int:
        """The positions it holds (the second dimension)."""
        return self.shape[1]

    def host(self) -> NDArray[Any]:
        """The value as a host numpy array (a device tensor is copied once, on the first call)."""
        if self._host is None:
            value = self.value
            assert not isinstance(value, np.ndarray)  # a host array is its own host copy, set on construction
            self._host = value.numpy()
        return self._host

    def __repr__(self) -> str:
        where = "device" if self.on_device else "host"
        return f"Hidden({self.shape}, {self.dtype}, on the {where})"
