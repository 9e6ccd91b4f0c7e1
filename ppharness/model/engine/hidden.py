"""The hidden-state handle: what a stage's model hands on at the model/stage boundary.

A ``Hidden`` says where the value lives (a tinygrad tensor on its device, or a host numpy array), its shape (rows, one
per request of a batch; positions; width) and its element type, without touching the value. The host array is made
only when asked (``host()``), once. Only the codec turns a Hidden into bytes (``ppharness.wire.codec.pack_hidden``),
and only where exactness is asked for is one digested (``digest``: the 8 bytes a stage keeps of each hidden state it
sends and the oracle of each it computes, ``ppharness.model.decode.exactness`` compares): everything else passes the
handle.

A hidden state left on its device between co-located stages (``ppharness.run.node.colocated``): a slice whose next
stage is driven by the same process keeps its decode output on the device (``device_out``). The handle is the
compiled step's own output buffer, which that slot's next step overwrites, and the next stage copies it, device to
device, into its own step's input buffer before it runs (``copy``). Nothing waits for the device on the way: the next
stage's kernels queue behind the previous stage's, as one process's would. Only a slot's own decode step does so (one
output buffer per slot, which the next position cannot overwrite before the token came round); prefills, batched rows
and the CPU, whose buffers are host memory, hand over host arrays.

This module imports no tinygrad: a device tensor is recognised by what it offers (``numpy()``, ``shape``, ``dtype``).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:
    from tinygrad.device import Buffer
    from tinygrad.tensor import Tensor
    from typing_extensions import TypeIs


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


def left_on_device(x: object) -> TypeIs[Tensor]:
    """Whether ``x`` is a device tensor (a handle a co-located stage left on the device), not ids or a host array."""
    return not isinstance(x, list | tuple | np.ndarray) and hasattr(x, "uop")


def copy(dst: Tensor, src: Tensor) -> None:
    """``src``'s bytes into ``dst``'s buffer, on the device when both are on one (queued behind what computed
    ``src``); through the host otherwise."""
    d = cast("Buffer", dst.uop.base.realized)
    s = cast("Buffer", src.uop.base.realized)
    if d.nbytes != s.nbytes:
        raise ValueError(f"a hand-over of {s.nbytes} bytes into a step input of {d.nbytes}")
    allocator: Any = d.allocator
    if d.device == s.device and hasattr(allocator, "_transfer") and not d.device.startswith("CPU"):
        allocator._transfer(d._buf, s._buf, d.nbytes, src_dev=s.allocator.dev, dest_dev=allocator.dev)
    else:
        d.copyin(s.as_buffer())


def digest(hidden: NDArray[np.floating]) -> bytes:
    """The digest of a hidden state as the chain defines it: its fp16 bytes (an f32 wire widens them exactly)."""
    # no copy; ``.data``: the array's buffer (numpy's stubs declare ndarray a Buffer only for Python 3.12+)
    return hashlib.blake2b(np.ascontiguousarray(hidden, dtype=np.float16).data, digest_size=8).digest()
