"""The projection of every block (``DecodeLinear``): ``nn.Linear``'s product over a weight held as float16 or as the
file packs it (``ppharness.model.formats``), and the compile settings a decode step and a batched step use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

from ppharness.model.formats.packed import Packed
from ppharness.model.layers.kernels import INVARIANT, compiling_invariant, route_choices

if TYPE_CHECKING:
    from tinygrad.tensor import Tensor


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
    (``ppharness.model.layers.rows``), with the decode step's compile settings (``decode_context``)."""
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

    The weight is a float16 tensor, or a matrix kept as the file packs it (``ppharness.model.formats.packed.Packed``):
    then the product unpacks it inside its own kernel, multiplies in float32 and rounds the output to float16."""

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
            return y  # a batched slice's kernels are optimised by ppharness.model.layers.rows's rule
        # the kernel's axes: 0 the output rows, then the reduction over the input
        return y.contiguous(arg=(Opt(OptOps.UPCAST, 0, upcast),))
