"""The synthetic GGUF writer: ``make_synthetic(spec, path)`` writes a model that tinygrad 0.12 and llama.cpp read like
any file of its architecture, random weights from a seeded generator and the byte-level BPE vocabulary of
``ppharness.model.synthetic.vocab``. The same spec gives the same bytes.

``spec.type`` picks how the weight matrices are stored: ``f16`` (default), ``bf16`` or ``f32``, or quantised to
``q8_0`` (the format ``ollama pull llama3.2:1b`` serves), ``q4_0``, ``q4_1`` (by the ``gguf`` package's own
quantisers), ``q4_k``, ``q5_k`` or ``q6_k`` (by ``ppharness.model.formats.kquants``, in ggml's exact block formats); the
quantised model is the f16 model of the same seed, quantised. q4_k and q5_k are llama.cpp's Q4_K_M and Q5_K_M mixes,
loosely (the head and some blocks' ``attn_v`` and ``ffn_down`` in Q6_K), and a K-quant tensor whose rows are not a
multiple of 256 falls back to Q8_0 (a row not a multiple of 32, in any quantised type, to F16): the ``tiny`` preset's
rows of 64 are all Q8_0 at type=q4_k, the ``small`` preset's (256, 768) all K-quants; ``tensor_type`` in
``ppharness.model.synthetic.spec`` is the rule. 1-D weights (the norms) and the MoE routers stay F32, as llama.cpp keeps
them. What is written here is every architecture's: the shared metadata, the vocabulary, the embedding, the final norm
and the output head; the architecture (``ppharness.model.arch``) writes its own keys and its blocks' tensors through a
``TensorWriter``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ppharness.model.arch import architecture
from ppharness.model.formats.codecs import quantize
from ppharness.model.synthetic.spec import WEIGHT_TYPES, ModelSpec, check_fits, tensor_types
from ppharness.model.synthetic.vocab import build_vocab, special_tokens


class TensorWriter:
    """A synthetic file's tensors as they are drawn, in order, from one generator seeded by the spec: the order of
    the calls is the file's content."""

    def __init__(self, writer: Any, types: dict[str, str], seed: int) -> None:
        import gguf  # loads with the writer only

        self.rng = np.random.default_rng(seed)
        self._writer, self._types, self._ggml = writer, types, gguf.GGMLQuantizationType

    def rand(self, *shape: int, std: float) -> NDArray[np.float16]:
        """Normal weights of standard deviation ``std``, as float16."""
        return (self.rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float16)

    def norm(self, n: int) -> NDArray[np.float32]:
        """An RMS norm's weight: about 1."""
        return (1.0 + self.rng.standard_normal(n, dtype=np.float32) * 0.1).astype(np.float32)

    def vector(self, n: int, std: float) -> NDArray[np.float32]:
        return (self.rng.standard_normal(n, dtype=np.float32) * std).astype(np.float32)

    def matrix(self, name: str, arr: NDArray[Any]) -> None:
        """A weight matrix, stored in its type (``ppharness.model.synthetic.spec.tensor_type``)."""
        ggml_type = self._types[name]
        if ggml_type in ("F16", "F32"):
            self._writer.add_tensor(name, quantize(arr, ggml_type))
        else:  # (rows, bytes) of blocks; the writer records the element shape
            self._writer.add_tensor(name, quantize(arr, ggml_type), raw_dtype=self._ggml[ggml_type])

    def add(self, name: str, arr: NDArray[Any]) -> None:
        """A tensor stored as it is (the norms, routers and biases: F32)."""
        self._writer.add_tensor(name, arr)


def make_synthetic(spec: ModelSpec, path: str | os.PathLike[str]) -> Path:
    """Write ``spec`` as a GGUF file at ``path`` (atomically) and return the path. Deterministic in ``spec``.

    Every weight matrix (embedding, attention and FFN matrices, the untied head) is stored in ``spec.type``:
    quantised with ``gguf.quants.quantize`` for q8_0, q4_0, q4_1 and bf16, as llama.cpp's converter writes
    ``--outtype q8_0``, and with ``ppharness.model.formats.kquants`` for q4_k, q5_k and q6_k; the 1-D norm weights and
    the routers are F32. The exceptions (``ppharness.model.synthetic.spec.tensor_type``): q4_k and q5_k mix in Q6_K as
    llama.cpp's Q4_K_M and Q5_K_M do (the head, and ``attn_v`` and ``ffn_down`` in the first and last eighth of the
    blocks and every third between); a K-quant matrix whose rows are not a multiple of 256 is stored as Q8_0
    (llama.cpp's
    ``llama-quantize`` takes Q5_0 / Q5_1 for Q4_K / Q5_K, Q8_0 for Q6_K), and a quantised matrix whose rows are not
    a multiple of 32 as F16. (``llama-quantize`` to Q4_0 or Q4_1 would also store the output head as Q6_K; here the
    head is Q4_0 / Q4_1 like every other matrix.) ``ModelError`` for a spec that needs more memory than this machine
    has (``spec.check_fits``).
    """
    import gguf

    check_fits(spec)  # refused before a byte is drawn, instead of failing to allocate part way
    arch = architecture(spec.arch)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    specials = special_tokens(spec.tokenizer)  # the BOS, the EOS, more
    n_special = len(specials)
    tokens, merges = build_vocab(spec.vocab - 256 - n_special, spec.seed, spec.tokenizer)
    tokens = tokens + list(specials)
    token_types = [1] * (len(tokens) - n_special) + [3] * n_special
    bos, eos = tokens.index(specials[0]), tokens.index(specials[1])

    tmp = path.with_suffix(f"{path.suffix}.{os.getpid()}.tmp")  # processes building the same model do not collide
    w = gguf.GGUFWriter(str(tmp), spec.arch)
    w.add_name(spec.slug())
    w.add_context_length(spec.context)
    w.add_embedding_length(spec.dim)
    w.add_block_count(spec.blocks)
    w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.heads)
    w.add_head_count_kv(arch.cache_heads(spec))
    w.add_layer_norm_rms_eps(spec.norm_eps)
    w.add_rope_freq_base(spec.rope_theta)
    arch.write_keys(spec, w)
    w.add_vocab_size(spec.vocab)
    _, file_type = WEIGHT_TYPES[spec.type]
    w.add_file_type(gguf.LlamaFileType[file_type])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(spec.tokenizer)
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(True)

    # Shapes are tinygrad's (out, in); GGUF stores dimensions reversed and tinygrad reverses them back.
    out = TensorWriter(w, tensor_types(spec), spec.seed)
    out.matrix("token_embd.weight", out.rand(spec.vocab, spec.dim, std=1.0))
    for i in range(spec.blocks):
        arch.write_block(spec, i, out)
    out.add("output_norm.weight", out.norm(spec.dim))
    if not spec.tied_embeddings:
        out.matrix("output.weight", out.rand(spec.vocab, spec.dim, std=1.0 / np.sqrt(spec.dim)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    os.replace(tmp, path)
    return path
