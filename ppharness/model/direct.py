"""A dense slice's decode step on tinygrad's CPU device, called without TinyJit's per-call work (``DirectStep``), and
the projection whose one-position product compiles with fixed options there (``DecodeLinear``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from numpy.typing import NDArray

from ppharness.model.kernels import INVARIANT, compiling_invariant, route_choices
from ppharness.model.packed import Packed

if TYPE_CHECKING:  # tinygrad is imported when a step is built, not with this module
    from collections.abc import Callable

    from tinygrad.device import Buffer
    from tinygrad.tensor import Tensor

    from ppharness.model.slicing import ModelSlice


class DirectStep:
    """A dense slice's compiled decode step called without the per-call work around it, for a device whose buffers
    are host memory (tinygrad's CPU device): the input is written straight into the step's input buffer, the
    captured kernels are replayed with the position bound, and the output is copied out of its buffer after one
    synchronisation. Same kernels, same buffers, so the same bits as ``TinyJit.__call__`` + ``Tensor.numpy()``.

    What it saves is a fixed cost per call, which a chain pays once per stage and the unsplit model once per token:
    TinyJit's argument analysis (UOp substitutions on every call), ``Buffer.copyin``, and ``Tensor.numpy()``, which
    schedules a (no-op) realize on the calling thread while holding the GIL that tinygrad's CPU worker thread needs
    to start the kernels just queued (on this machine 0.3-1 ms of a 2-block slice's step)."""

    def __init__(self, model: ModelSlice, inputs: NDArray[Any], outputs: NDArray[Any], in_buf: Buffer) -> None:
        from tinygrad.device import Device

        captured = model._jit.captured
        assert captured is not None
        self._captured, self._in, self._out, self._in_buf = captured, inputs, outputs, in_buf
        self._sync: Callable[[], None] = Device[in_buf.device].synchronize
        self._var: str = model._pos.expr
        self._last, self._shape = model.last, (1, 1, model.config.dim)
        ret = captured.ret
        self._taps = list(ret[1:]) if isinstance(ret, tuple) else []  # with taps: every block's output tensor

    @staticmethod
    def of(model: ModelSlice) -> DirectStep | None:
        """The lean call of ``model``'s captured decode step, or None where it does not apply (another device, a
        step whose input or output is not a whole host-mapped buffer)."""
        captured = model._jit.captured
        if captured is None or model._decode_in is None or (model.config.moe and not model.fused):
            return None
        from tinygrad.dtype import _to_np_dtype

        try:
            out = captured.ret[0] if isinstance(captured.ret, tuple) else captured.ret
            in_buf = cast("Buffer", model._decode_in.uop.base.realized)
            out_buf = cast("Buffer", out.uop.base.realized)
            if in_buf is None or out_buf is None or in_buf.device != "CPU" or out_buf.device != "CPU":
                return None
            if out.uop is not out.uop.base and out.uop.base.realized is not out_buf:
                return None
            want_in = (np.int32, 1) if model.first else (np.float16, model.config.dim)
            want_out = (np.int32, 1) if model.last else (np.float16, model.config.dim)
            if any(_to_np_dtype(b.dtype) is not w[0] for b, w in ((in_buf, want_in), (out_buf, want_out))):
                return None
            in_view = np.frombuffer(in_buf.as_buffer(force_zero_copy=True), dtype=want_in[0])
            out_view = np.frombuffer(out_buf.as_buffer(force_zero_copy=True), dtype=want_out[0])
        except (AssertionError, AttributeError, TypeError, ValueError):
            return None
        if in_view.size != want_in[1] or out_view.size != want_out[1] or in_buf.offset or out_buf.offset:
            return None
        return DirectStep(model, in_view, out_view, in_buf)

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


def on_cpu(device: str | tuple[str, ...]) -> bool:
    return isinstance(device, str) and device.split(":")[0] == "CPU"


def decode_context(device: str | tuple[str, ...]) -> Any:
    """What the decode step compiles under: on the CPU, tinygrad's vector code left to the C compiler
    (``DEVECTORIZE=0``), which turns ``DecodeLinear``'s upcast rows into AVX vectors and fp16 loads into packed
    conversions instead of scalar code (about 3x fewer kernel cycles on ``synthetic:small``). Compile-time only: a
    replayed step runs what was compiled, and tinygrad keys its kernel cache by this setting."""
    from tinygrad.helpers import Context

    return cast(Any, Context)(DEVECTORIZE=0) if on_cpu(device) else contextlib.nullcontext()  # Context is unannotated


@contextlib.contextmanager
def invariant(device: str | tuple[str, ...]) -> Iterator[None]:
    """Compile (and run) a batched step on ``device`` inside this to get batch-invariant kernels
    (``ppharness.model.batch``), with the decode step's compile settings (``decode_context``)."""
    from tinygrad.helpers import Context

    route_choices()
    with cast(Any, Context)(BEAM=INVARIANT), decode_context(device):  # Context is unannotated
        yield


class DecodeLinear:
    """``nn.Linear`` (same ``weight``/``bias`` names, so the same state dict) whose one-position product, a decode
    step's matrix-vector product, is a kernel of its own on the CPU with fixed optimisations: the output rows upcast
    by the largest of 16, 8, 4, 2 that divides them, each row's sum left in input order. tinygrad's heuristic leaves a
    matrix-vector product of fewer than 1024 rows one dependent chain of additions, and BEAM would pick by timing,
    which can differ between processes and machines; fixed options keep a block's kernels the same in every slice,
    process and machine. Other devices and prefills (more than one position) keep tinygrad's own choice.

    The weight is a float16 tensor, or a matrix kept as the file packs it (``ppharness.model.packed.Packed``): then
    the product unpacks it inside its own kernel, multiplies in float32 and rounds the output to float16."""

    def __init__(self, linear: Any):
        self.weight: Tensor | Packed = linear.weight
        self.bias: Tensor | None = linear.bias

    def __call__(self, x: Tensor) -> Tensor:
        from tinygrad.codegen.opt import Opt, OptOps

        if isinstance(self.weight, Packed):
            y = self.weight.product(x)
            y = (y if self.bias is None else y + self.bias.float()).cast(x.dtype)
        else:
            y = x.linear(self.weight.transpose(), self.bias)
        rows = int(self.weight.shape[0])
        upcast = next((n for n in (16, 8, 4, 2) if rows % n == 0), 0)
        if x.shape[-2] != 1 or not upcast or not on_cpu(self.weight.device) or compiling_invariant():
            return y  # a batched slice's kernels are optimised by ppharness.model.batch's rule
        # the kernel's axes: 0 the output rows, then the reduction over the input
        return y.contiguous(arg=(Opt(OptOps.UPCAST, 0, upcast),))
