"""What a GGUF file may ask of the engine: every tensor one its architecture computes with, and no metadata key that
changes the computation in a way the engine does not implement. ``check_file`` refuses anything else at load,
naming it, so that a file is never computed differently from its reference implementations (llama.cpp, HF) with a
tensor or key silently dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ppharness.errors import ModelError
from ppharness.model.gguf.names import BLOCK_TENSOR

if TYPE_CHECKING:
    from ppharness.model.arch.base import Architecture

# metadata keys (after "{arch}.") that change what a model computes, with the values that leave it as the engine
# computes it (an empty tuple: any value changes it); an architecture that implements one lists it in ``keys``
COMPUTE_KEYS: dict[str, tuple[Any, ...]] = {
    "rope.scaling.type": ("none",),
    "rope.scaling.factor": (0.0, 1.0),
    "rope.scale_linear": (1.0,),
    "rope.scaling.attn_factor": (1.0,),
    "rope.dimension_sections": (),
    "attention.sliding_window": (0,),
    "attention.layer_norm_epsilon": (),
    "attention.clamp_kqv": (0.0,),
    "attention.max_alibi_bias": (0.0,),
    "attention.scale": (0.0,),
    "attn_logit_softcapping": (0.0,),
    "final_logit_softcapping": (0.0,),
    "logit_scale": (1.0,),
    "embedding_scale": (1.0,),
    "residual_scale": (1.0,),
    "expert_weights_scale": (0.0, 1.0),
    "expert_gating_func": (1,),  # gguf's ExpertGatingFuncType.SOFTMAX
    "expert_group_count": (0, 1),
    "leading_dense_block_count": (0,),
}


def check_file(path: object, arch: Architecture, kv: dict[str, Any], tensor_names: set[str]) -> None:
    """ModelError naming the first tensors and keys of the file at ``path`` that ``arch`` does not compute with as
    its reference implementations do."""
    name = str(kv.get("general.architecture", ""))
    unknown: list[str] = []
    for tensor in sorted(tensor_names):
        m = BLOCK_TENSOR.match(tensor)
        if m is None:
            if tensor not in arch.global_tensors:
                unknown.append(tensor)
        elif m.group(2) not in arch.block_parts:
            unknown.append(tensor)
    if unknown:
        raise ModelError(
            f"{path}: tensor(s) {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''} are not part of "
            f"{name} as this engine computes it; refusing to load a model it would compute differently"
        )
    for suffix, neutral in COMPUTE_KEYS.items():
        key = f"{name}.{suffix}"
        if key in kv and suffix not in arch.keys and _value(kv[key]) not in neutral:
            raise ModelError(
                f"{path}: metadata {key} = {_value(kv[key])!r} changes the computation in a way this engine does "
                f"not implement for {name}; refusing to load it"
            )
    problem = arch.unsupported(kv)
    if problem:
        raise ModelError(f"{path}: {problem}; refusing to load it")


def _value(v: Any) -> Any:
    return v.lower() if isinstance(v, str) else v
