"""What a model architecture provides (``Architecture``), with the defaults of a dense llama-family model, and the
checks and metadata keys the mixture-of-experts architectures share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Protocol

from ppharness.errors import ModelError
from ppharness.model.gguf.names import BLOCK_TENSOR

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

    from ppharness.model.gguf.config import ModelConfig

Shape = tuple[int, ...]  # a tensor's shape in tinygrad's (out, in) order


class SyntheticSpec(Protocol):
    """What an architecture reads of a synthetic model's spec (``ppharness.model.synthetic.spec.ModelSpec``) to
    check it, list its tensors and write them."""

    @property
    def blocks(self) -> int: ...
    @property
    def dim(self) -> int: ...
    @property
    def ffn(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def vocab(self) -> int: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def tied_embeddings(self) -> bool: ...
    @property
    def arch(self) -> str: ...
    @property
    def experts(self) -> int: ...
    @property
    def experts_used(self) -> int: ...
    @property
    def expert_ffn(self) -> int: ...
    @property
    def shared_ffn(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def dense_blocks(self) -> int: ...
    @property
    def q_lora_rank(self) -> int: ...
    @property
    def kv_lora_rank(self) -> int: ...
    @property
    def rope_dim(self) -> int: ...
    @property
    def v_head_dim(self) -> int: ...
    @property
    def shared_experts(self) -> int: ...
    @property
    def expert_groups(self) -> int: ...
    @property
    def groups_used(self) -> int: ...
    @property
    def routed_scale(self) -> float: ...
    @property
    def gating(self) -> str: ...
    @property
    def yarn_factor(self) -> float: ...
    @property
    def yarn_original_context(self) -> int: ...
    @property
    def yarn_log_mul(self) -> float: ...
    @property
    def yarn_beta_fast(self) -> float: ...
    @property
    def yarn_beta_slow(self) -> float: ...
    @property
    def rope_scaling(self) -> str: ...
    @property
    def rope_scaling_factor(self) -> float: ...
    @property
    def rope_original_context(self) -> int: ...
    @property
    def hd(self) -> int: ...


class TensorSink(Protocol):
    """Where an architecture writes a synthetic model's tensors (``ppharness.model.synthetic.writer.TensorWriter``):
    weights drawn in order from one seeded generator, stored in the type the spec gives each."""

    rng: np.random.Generator

    def rand(self, *shape: int, std: float) -> NDArray[np.float16]: ...
    def norm(self, n: int) -> NDArray[np.float32]: ...
    def vector(self, n: int, std: float) -> NDArray[np.float32]: ...
    def matrix(self, name: str, arr: NDArray[Any]) -> None: ...
    def add(self, name: str, arr: NDArray[Any]) -> None: ...


class AttentionShape(Protocol):
    """What costing a block's attention reads: a ``ModelConfig`` or the plan graph's shape of a model."""

    @property
    def heads(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def kv_lora_rank(self) -> int: ...
    @property
    def rope_dim(self) -> int: ...


class Architecture(ABC):
    """One model architecture: a synthetic model's checks, tensors and file contents; a GGUF file's metadata beyond
    the keys every architecture shares, its tensors as the blocks need them, and its tinygrad blocks; and what the
    plan graph needs to cost its attention and shared experts."""

    name: str = ""
    moe: bool = False  # its blocks have routed experts (a synthetic spec must give them)
    renormalise: bool = False  # top-k weights renormalised where the file does not say (llama.cpp's ``norm_w``)
    gating: str = "softmax"  # the experts' scoring where a synthetic spec does not say
    router_bias: str = ""  # a block's tensor holding the router's selection bias, "" for none
    # a MoE block's tensors kept float32 as the file stores them, not rounded to float16 (``keeps_f32``)
    f32_tensors: tuple[str, ...] = ()
    # what it computes with (``ppharness.model.support`` refuses a file holding anything else): the tensors outside
    # the blocks, a block's parts (``blk.{i}.{part}``), and the computation-changing metadata keys
    # (``support.COMPUTE_KEYS``) it implements
    global_tensors: frozenset[str] = frozenset({"token_embd.weight", "output_norm.weight", "output.weight"})
    block_parts: frozenset[str] = frozenset()
    keys: frozenset[str] = frozenset()

    # --- a synthetic model ------------------------------------------------------------------------------------------

    @abstractmethod
    def check(self, spec: SyntheticSpec) -> None:
        """ModelError unless ``spec``'s architecture-specific fields fit this architecture."""

    def tensors(self, spec: SyntheticSpec) -> dict[str, Shape]:
        """Every tensor of the synthetic model ``spec``, name -> shape, in the order the writer stores them."""
        d = spec.dim
        out: dict[str, Shape] = {"token_embd.weight": (spec.vocab, d)}
        for i in range(spec.blocks):
            out |= self.block_tensors(spec, i)
        out["output_norm.weight"] = (d,)
        if not spec.tied_embeddings:
            out["output.weight"] = (spec.vocab, d)
        return out

    @abstractmethod
    def block_tensors(self, spec: SyntheticSpec, i: int) -> dict[str, Shape]:
        """Block ``i``'s tensors (``blk.{i}.*``), in the order the writer stores them."""

    def cache_heads(self, spec: SyntheticSpec) -> int:
        """The KV head count the file states."""
        return spec.kv_heads

    @abstractmethod
    def write_keys(self, spec: SyntheticSpec, w: Any) -> None:
        """The metadata keys of this architecture, on the ``gguf.GGUFWriter`` ``w``, after the rope base."""

    @abstractmethod
    def write_block(self, spec: SyntheticSpec, i: int, out: TensorSink) -> None:
        """Block ``i``'s tensors, drawn from ``out``'s generator in ``block_tensors``' order."""

    # --- a GGUF file ------------------------------------------------------------------------------------------------

    def read(self, kv: dict[str, Any], tensor_names: set[str], common: dict[str, Any]) -> dict[str, Any]:
        """The ``ModelConfig`` fields this architecture reads its own way, over the ``common`` ones read from the keys
        every architecture has; KeyError names a key the file lacks."""
        return {}

    def unsupported(self, kv: dict[str, Any]) -> str:
        """What of a file's metadata this architecture does not compute, "" for nothing: by default a rotary width
        (``rope.dimension_count``) other than the whole head."""
        a = kv["general.architecture"]
        head_dim = kv.get(f"{a}.attention.key_length", kv[f"{a}.embedding_length"] // kv[f"{a}.attention.head_count"])
        rot = kv.get(f"{a}.rope.dimension_count", head_dim)
        if int(rot) != int(head_dim):
            return f"{a}.rope.dimension_count {rot} rotates part of a head of {head_dim}, which this engine does not"
        return ""

    def file_tensor(self, cfg: ModelConfig, name: str, arr: NDArray[np.float16]) -> NDArray[np.float16]:
        """A tensor as read from the file -> as the blocks compute with it."""
        return arr

    def keeps_f32(self, cfg: ModelConfig, name: str) -> bool:
        """Whether the file tensor ``name`` is loaded and computed with as float32: a MoE block's ``f32_tensors`` (its
        router and the norm before it, which llama.cpp and HF compute in float32: with hundreds of experts, logits
        rounded to fp16 change which ones near-ties choose). Every other tensor is float16."""
        m = BLOCK_TENSOR.match(name)
        return m is not None and int(m.group(1)) in cfg.moe_blocks and m.group(2) in self.f32_tensors

    @abstractmethod
    def block(self, cfg: ModelConfig, max_context: int, layer: int) -> Any:
        """Block ``layer`` of the model, on tinygrad, with a KV cache of ``max_context`` positions."""

    # --- the plan graph ---------------------------------------------------------------------------------------------

    def attention_cost(self, shape: AttentionShape) -> tuple[int, int]:
        """(values a block caches per token, FLOPs of attending to one cached position): keys and values of every KV
        head; q.k and p.v for every head."""
        return 2 * shape.kv_heads * shape.head_dim, 2 * 2 * shape.heads * shape.head_dim

    def shared_experts(self, width: int, expert_ffn: int) -> int:
        """How many shared experts a block whose shared experts are ``width`` wide has (one, unless said)."""
        return 1


def check_experts(spec: SyntheticSpec) -> None:
    """A mixture-of-experts spec's routed experts."""
    if not (1 <= spec.experts_used <= spec.experts and spec.expert_ffn >= 1):
        raise ModelError(
            f"{spec.arch} needs experts >= experts_used >= 1 and expert_ffn >= 1 (got experts {spec.experts}, "
            f"experts_used {spec.experts_used}, expert_ffn {spec.expert_ffn})"
        )


def check_no_mla(spec: SyntheticSpec) -> None:
    """A spec without deepseek2's fields."""
    mla = (spec.q_lora_rank, spec.kv_lora_rank, spec.rope_dim, spec.v_head_dim, spec.dense_blocks)
    if any(mla) or spec.shared_experts or spec.expert_groups or spec.yarn_factor:
        raise ModelError(
            "MLA attention, leading dense blocks, shared_experts, expert groups and YaRN belong to arch=deepseek2"
        )


def check_no_rope_factors(spec: SyntheticSpec) -> None:
    """A spec without Llama-3's rope frequency factors."""
    if spec.rope_scaling or spec.rope_scaling_factor or spec.rope_original_context:
        raise ModelError(f"Llama-3's rope factors (rope_scaling) belong to arch=llama, not {spec.arch}")


def check_no_shared_ffn(spec: SyntheticSpec) -> None:
    if spec.shared_ffn:
        raise ModelError(f"a shared expert belongs to qwen2moe, not {spec.arch}")


def write_expert_keys(spec: SyntheticSpec, w: Any) -> None:
    """The routed experts' metadata keys (and the gated shared expert's width, where there is one)."""
    w.add_expert_count(spec.experts)
    w.add_expert_used_count(spec.experts_used)
    w.add_expert_feed_forward_length(spec.expert_ffn)
    if spec.shared_ffn:
        w.add_expert_shared_feed_forward_length(spec.shared_ffn)
