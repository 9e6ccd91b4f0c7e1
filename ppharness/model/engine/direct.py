"""A dense slice's decode step on tinygrad's CPU device, called without TinyJit's per-call work (``DirectStep``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:  # tinygrad is imported when a step is built, not with this module
    from collections.abc import Callable

    from tinygrad.device import Buffer
    from tinygrad.tensor import Tensor


class DirectStep:
    """A dense slice's compiled decode step called without the per-call work around it, for a device whose buffers
    are host memory (tinygrad's CPU device): the input is written straight into the step's input buffer, the
    captured kernels are replayed with the position bound, and the output is copied out of its buffer after one
    synchronisation. Same kernels, same buffers, so the same bits as ``TinyJit.__call__`` + ``Tensor.numpy()``.

    What it saves is a fixed cost per call, which a chain pays once per stage and the unsplit model once per token:
    TinyJit's argument analysis (UOp substitutions on every call), ``Buffer.copyin``, and ``Tensor.numpy()``, which
    schedules a (no-op) realize on the calling thread while holding the GIL that tinygrad's CPU worker thread needs
    to start the kernels just queued (on this machine 0.3-1 ms of a 2-block slice's step)."""

    def __init__(
        self, captured: Any, var: str, last: bool, dim: int, inputs: NDArray[Any], outputs: NDArray[Any], in_buf: Buffer
    ) -> None:
        from tinygrad.device import Device

        self._captured, self._in, self._out, self._in_buf = captured, inputs, outputs, in_buf
        self._sync: Callable[[], None] = Device[in_buf.device].synchronize
        self._var = var
        self._last, self._shape = last, (1, 1, dim)
        ret = captured.ret
        self._taps = list(ret[1:]) if isinstance(ret, tuple) else []  # with taps: every block's output tensor

    @staticmethod
    def of(captured: Any, decode_in: Tensor | None, var: str, first: bool, last: bool, dim: int) -> DirectStep | None:
        """The lean call of a slice's ``captured`` decode step (``TinyJit.captured``; its input tensor
        ``decode_in``, its position variable ``var``), or None where it does not apply (another device, a step whose
        input or output is not a whole host-mapped buffer)."""
        if captured is None or decode_in is None:
            return None
        from tinygrad.dtype import _to_np_dtype

        try:
            out = captured.ret[0] if isinstance(captured.ret, tuple) else captured.ret
            in_buf = cast("Buffer", decode_in.uop.base.realized)
            out_buf = cast("Buffer", out.uop.base.realized)
            if in_buf is None or out_buf is None or in_buf.device != "CPU" or out_buf.device != "CPU":
                return None
            if out.uop is not out.uop.base and out.uop.base.realized is not out_buf:
                return None
            want_in = (np.int32, 1) if first else (np.float16, dim)
            want_out = (np.int32, 1) if last else (np.float16, dim)
            if any(_to_np_dtype(b.dtype) is not w[0] for b, w in ((in_buf, want_in), (out_buf, want_out))):
                return None
            in_view = np.frombuffer(in_buf.as_buffer(force_zero_copy=True), dtype=want_in[0])
            out_view = np.frombuffer(out_buf.as_buffer(force_zero_copy=True), dtype=want_out[0])
        except (AssertionError, AttributeError, TypeError, ValueError):
            return None
        if in_view.size != want_in[1] or out_view.size != want_out[1] or in_buf.offset or out_buf.offset:
            return None
        return DirectStep(captured, var, last, dim, in_view, out_view, in_buf)

    def __call__(self, x: NDArray[Any], position: int) -> NDArray[np.float16] | int:
        self._sync()  # nothing may still read the input buffer (a no-op after the last step)
        self._in[:] = x.reshape(-1)
        self._captured([self._in_buf], {self._var: position})
        self._sync()
        if self._last:
            return int(self._out[0])
        return self._out.copy().reshape(self._shape)

    @property
    def taps(self) -> list[Tensor]:
        return self._taps
