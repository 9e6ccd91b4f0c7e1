"""A hidden state left on its device between co-located stages (``ppharness.run.colocated``).

A slice whose next stage is driven by the same process keeps its decode output on the device (``device_out``): the
handle is the compiled step's own output buffer, which that slot's next step overwrites, and the next stage copies it,
device to device, into its own step's input buffer before it runs (``copy``). Nothing waits for the device on the
way: the next stage's kernels queue behind the previous stage's, as one process's would. Only a slot's own decode step
does so (one output buffer per slot, which the next position cannot overwrite before the token came round); prefills,
batched rows and the CPU, whose buffers are host memory, hand over host arrays.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np

if TYPE_CHECKING:
    from tinygrad.device import Buffer
    from tinygrad.tensor import Tensor
    from typing_extensions import TypeIs


def held(x: object) -> TypeIs[Tensor]:
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
