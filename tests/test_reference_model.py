"""The project's model against an independent reference (``tests/reference_model.py``: numpy, float32, written from
llama.cpp's graphs and HF transformers' modelling code, reading the GGUF with the ``gguf`` package alone).

What is compared: the oracle (``oracle_decode``, the unsplit model's greedy decode) answers two prompts with 32 tokens
on every cheap synthetic preset. Its logits are the project's own: the last block's output at every step (the
oracle's boundary taps) through the project's own final norm and head (``ModelSlice.output_norm``, ``.output``), the
very fp16 logits whose argmax the oracle took. The reference computes the prompt followed by the oracle's tokens in
one causal pass (teacher-forced), so at every step both models see the same prefix and every step is comparable.

The criterion, vLLM's ``check_logprobs_close`` made stricter by the shared prefix:

- tokens: at every step the project's token is the reference's first choice, or the reference's top-2 margin is below
  ``MARGIN`` and the project's token is its second choice;
- logits: every logit within ``LOGIT_ATOL`` of the reference's; the last block's output within
  ``HIDDEN_ATOL + HIDDEN_RTOL * |reference|``.
- experts (MoE): at every position every block chose the reference's experts, or the reference's router-logit gap
  between its last chosen expert and the first left out is below ``ROUTE_MARGIN`` (a routing near-tie: either choice
  is right within the project's fp16 residual stream); there the reference takes the project's experts, as it takes
  the project's tokens, so that both go on computing the same thing. A different choice at a wider gap fails.

The thresholds: the project keeps weights in fp16, rounds every block's output to fp16 and computes its head in fp16
(half an fp16 ulp is 2e-3 for logits in [4, 8)); measured on these presets and prompts, logits differ by at most
6.1e-3 and last-block outputs by at most 1.5e-2 (|h| up to 12). ``LOGIT_ATOL = 0.02`` leaves three times that. A
margin above ``2 * LOGIT_ATOL`` cannot flip within the logit tolerance, so ``MARGIN`` is that. The fp32 router's
logits (from the fp16 residual stream) lie within about 2e-3 of the reference's; ``ROUTE_MARGIN = 0.01`` leaves five
times that. Mistakes the
comparison must catch move logits by far more: Llama-3's RoPE factors left out by 0.5 and more, a wrong rotary
pairing, a missing renormalisation or a missing shared expert, qwen2's q/k/v biases (by 4.4) or qwen3's per-head q/k
norms (by 0.87) left out (each tested below).

Llama-3 RoPE frequency factors (``rope_freqs.weight``): the ``tiny-llama3`` preset (written by the project's own
writer) and a copy of ``tiny`` with the tensor added by this file (Llama-3.2's formula, its original context scaled
to the tiny model's) both change the reference's answer, and the project equals the reference on both.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
import pytest

import ppharness.model.engine.slicing
import ppharness.model.layers.moe
from ppharness.errors import ModelError
from ppharness.model.decode.oracle import oracle_decode
from ppharness.model.decode.rules import warm_up
from ppharness.model.engine.slicing import ModelSlice
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.sources.files import resolve_model
from ppharness.model.synthetic.spec import PRESETS as PRESETS_BY_NAME
from tests.reference_model import ReferenceModel, rope, rope_angles

if TYPE_CHECKING:
    from numpy.typing import NDArray

PRESETS = ["tiny", "tiny-llama3", "small", "tiny-qwen2", "tiny-qwen3", "tiny-moe", "tiny-moe-shared", "small-moe"]
PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Pipeline parallel inference: héllo wörld, naïve café 1234.",
)
TOKENS = 32
MAX_CONTEXT = 256
LOGIT_ATOL = 0.02
MARGIN = 2 * LOGIT_ATOL
HIDDEN_ATOL, HIDDEN_RTOL = 2e-2, 1e-2
ROUTE_MARGIN = 1e-2  # a router-logit gap below this at the top-k boundary is a routing near-tie
F32 = np.float32


# --- the project's side -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProjectRun:
    """The oracle's answer to one prompt: the prompt's ids, the generated tokens (with the closing end-of-generation
    token, if any), and at each step the last block's output and the logits the token was chosen from."""

    prompt_ids: list[int]
    tokens: list[int]
    hidden: NDArray[np.float32]  # (steps, D)
    logits: NDArray[np.float32]  # (steps, vocab)
    routing: dict[int, NDArray[np.int64]]  # MoE block -> (positions, k) the experts it chose at every position


_models: dict[Path, ModelSlice] = {}
_runs: dict[tuple[Path, str], ProjectRun] = {}


def project_run(path: Path, prompt: str) -> ProjectRun:
    """``oracle_decode`` of ``prompt`` (``TOKENS`` tokens) on the unsplit model with boundary taps, recording the last
    block's output at every step; one model per file, one run per file and prompt."""
    from tinygrad.tensor import Tensor

    if (path, prompt) in _runs:
        return _runs[path, prompt]
    if path not in _models:
        f = GGUFFile(path)
        # in pieces (not fused), so that every block's routing is seen: the same bits (tests/test_moe.py)
        _models[path] = ModelSlice(f, 0, f.config.blocks, True, True, MAX_CONTEXT, taps=True, fused=False)
        warm_up(_models[path])
    model = _models[path]
    cfg, last = model.config, model.config.blocks - 1
    finals: list[NDArray[np.float16]] = []
    tapped = model.tapped

    def recording() -> dict[int, NDArray[np.float16]]:  # the oracle reads the taps after every step
        out = tapped()
        finals.append(np.asarray(out[last])[0, -1].copy())
        return out

    routed: list[NDArray[np.int64]] = []  # every routing call's (rows, k) ids, in call order

    def recording_route(layer: int, logits: Any, routing: Any) -> Any:
        routed.append(np.asarray(routing.ids))
        return routing

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model, "tapped", recording)
        mp.setattr(ppharness.model.layers.moe, "routed", recording_route)
        result = oracle_decode(path, prompt, TOKENS, MAX_CONTEXT, model=model, boundaries=True)
    moe_blocks = sorted(cfg.moe_blocks)  # each step routes once per MoE block, in block order
    routing = {b: np.concatenate(routed[n :: len(moe_blocks)]) for n, b in enumerate(moe_blocks)}
    tokens = result.token_ids + ([result.stop_token_id] if result.stop_token_id is not None else [])
    hidden = np.stack(finals)
    assert hidden.shape[0] == len(tokens)
    logits = model.output(model.output_norm(Tensor(hidden[None]))).numpy()[0].astype(F32)
    # these are the logits the oracle chose from: each token is their argmax (or ties with it)
    assert all(logits[j, tok] == logits[j].max() for j, tok in enumerate(tokens))
    ids = ([cfg.bos_id] if cfg.bos_id is not None else []) + model.file.tokenizer.encode(prompt)
    assert len(ids) == result.prompt_tokens
    run = ProjectRun(ids, tokens, hidden.astype(F32), logits, routing)
    _runs[path, prompt] = run
    return run


# --- the reference's side and the criterion -----------------------------------------------------------------------

_references: dict[Path, ReferenceModel] = {}


def reference(path: Path) -> ReferenceModel:
    if path not in _references:
        _references[path] = ReferenceModel(path)
    return _references[path]


@dataclass(frozen=True)
class Comparison:
    failures: list[str]
    min_margin: float  # the reference's smallest top-2 margin over the steps
    flips: int  # steps where the project took the reference's second choice (near-ties)
    logit_diff: float  # max |project - reference| over every logit of every step
    hidden_excess: float  # max |dh| / (HIDDEN_ATOL + HIDDEN_RTOL |h|): <= 1 agrees
    route_flips: int  # (position, block)s where the project took other experts at a routing near-tie


def compare(run: ProjectRun, ref: ReferenceModel) -> Comparison:
    """The criterion, every step: the reference teacher-forced on the prompt and the project's tokens, and on the
    project's experts where the reference's own choice is a routing near-tie."""
    seq = run.prompt_ids + run.tokens[:-1]
    hidden, logits = ref.forward(seq, follow=run.routing, margin=ROUTE_MARGIN)
    start = len(run.prompt_ids) - 1  # position whose logits choose the first generated token
    hidden, logits = hidden[start:], logits[start:]
    failures, margins, flips, route_flips = [], [], 0, 0
    for block, chosen in run.routing.items():
        ref_ids, gaps = ref.routing[block]
        for p in range(len(seq)):
            if set(chosen[p].tolist()) == set(ref_ids[p].tolist()):
                continue
            if gaps[p] < ROUTE_MARGIN:
                route_flips += 1
                continue
            failures.append(
                f"position {p}, block {block}: the project routed to {sorted(chosen[p].tolist())}, the reference "
                f"to {sorted(ref_ids[p].tolist())} by a router-logit gap of {gaps[p]:.4f} >= {ROUTE_MARGIN}"
            )
    for j, tok in enumerate(run.tokens):
        first, second = np.argsort(-logits[j], kind="stable")[:2]
        margin = float(logits[j, first] - logits[j, second])
        margins.append(margin)
        if tok == first:
            continue
        if margin < MARGIN and tok == second:
            flips += 1
            continue
        failures.append(
            f"step {j}: the project chose {tok}, the reference {first} (second {second}) by a margin of {margin:.4f}"
            + (f" >= {MARGIN}" if margin >= MARGIN else "")
        )
    diff = np.abs(run.logits - logits)
    if diff.max() > LOGIT_ATOL:
        j = int(diff.max(-1).argmax())
        failures.append(f"logits differ by up to {diff.max():.4f} > {LOGIT_ATOL} (most at step {j})")
    excess = float((np.abs(run.hidden - hidden) / (HIDDEN_ATOL + HIDDEN_RTOL * np.abs(hidden))).max())
    if excess > 1:
        failures.append(f"the last block's output is {excess:.2f}x outside its tolerance")
    return Comparison(failures, min(margins), flips, float(diff.max()), excess, route_flips)


# --- the presets --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    # qwen2moe's shared expert and the larger MoE with the slow tests; tiny-moe is the default run's MoE
    "preset",
    [pytest.param(p, marks=pytest.mark.slow) if p in ("small-moe", "tiny-moe-shared") else p for p in PRESETS],
)
def test_the_oracle_equals_the_reference(preset):
    """Two prompts, 32 tokens each: the criterion at every step."""
    path = resolve_model(f"synthetic:{preset}")
    ref = reference(path)
    for prompt in PROMPTS:
        run = project_run(path, prompt)
        assert len(run.tokens) >= 8, f"{preset}: the oracle stopped after {len(run.tokens)} tokens"
        result = compare(run, ref)
        assert not result.failures, f"{preset}, {prompt!r}: " + "; ".join(result.failures)


# a mistake the reference can make in each architecture: the comparison must catch it
MISTAKES = {
    "tiny": {"neox": True},  # the llama file's rows rotated as HF's halves (the row permutation forgotten)
    "tiny-llama3": {"rope_factors": False},  # Llama-3's rope_freqs ignored, as tinygrad's loader drops them
    "small": {"neox": True},
    "tiny-qwen2": {"biases": False},  # qwen2's q/k/v biases left out
    "tiny-qwen3": {"qk_norm": False},  # qwen3's per-head query and key norms left out
    "tiny-moe": {"renormalise": False},  # qwen3moe's top-k weights not renormalised
    "tiny-moe-shared": {"shared_expert": False},  # qwen2moe's shared expert left out
    "small-moe": {"renormalise": False},
}


# small and small-moe make the same mistakes as tiny and tiny-moe on larger files: with the slow tests
@pytest.mark.parametrize(
    "preset", [pytest.param(p, marks=pytest.mark.slow) if p in ("small", "small-moe") else p for p in PRESETS]
)
def test_the_comparison_catches_a_mistake(preset):
    """The same comparison with one mistake in the reference fails, by a wide margin."""
    path = resolve_model(f"synthetic:{preset}")
    wrong = copy.copy(reference(path))
    wrong.arch = dataclasses.replace(wrong.arch, **MISTAKES[preset])
    if not wrong.arch.rope_factors:
        wrong.factors = None
    result = compare(project_run(path, PROMPTS[0]), wrong)
    assert result.failures and result.logit_diff > 5 * LOGIT_ATOL, (preset, result)


# --- the reference's own conventions ------------------------------------------------------------------------------


def hf_rotate_half(x: NDArray[np.float32], angles: NDArray[np.float64]) -> NDArray[np.float32]:
    """HF transformers' ``apply_rotary_pos_emb``: ``x * cos + rotate_half(x) * sin`` with ``cos = cat(cos, cos)``."""
    cos = np.concatenate([np.cos(angles)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(angles)] * 2, -1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return (x * cos + rotated * sin).astype(F32)


def test_llamas_pairwise_rotation_of_the_file_is_hfs_rotate_half_of_the_unpermuted_rows():
    """llama.cpp's converter permutes HF's query rows ``(heads, 2, hd/2) -> (heads, hd/2, 2)``; the reference rotates
    the file's adjacent pairs (NORM). That is HF's rotate_half of the un-permuted rows, permuted the same way -- with
    Llama-3's frequency factors too (HF divides ``inv_freq[i]``, which turns HF's coordinates i and i + hd/2)."""
    ref = reference(resolve_model("synthetic:tiny"))
    heads, hd = ref.heads, ref.head_dim
    w_file = ref.block_weights[0]["attn_q.weight"]  # (heads * hd, dim), as the file stores it
    w_hf = w_file.reshape(heads, hd // 2, 2, -1).swapaxes(1, 2).reshape(w_file.shape)  # the converter's inverse
    x = np.random.default_rng(0).standard_normal((40, ref.dim)).astype(F32)
    for factors in (None, llama3_rope_factors(hd, ref.base, original_context=128)):
        angles = rope_angles(np.arange(40), hd, ref.base, factors)
        ours = rope((x @ w_file.T).reshape(40, heads, hd), angles, neox=False)
        hf = hf_rotate_half((x @ w_hf.T).reshape(40, heads, hd), angles)
        hf_in_file_order = hf.reshape(40, heads, 2, hd // 2).swapaxes(2, 3).reshape(40, heads, hd)
        np.testing.assert_allclose(ours, hf_in_file_order, rtol=1e-5, atol=1e-5)
        # and the other pairing is not the same thing
        assert not np.allclose(rope((x @ w_file.T).reshape(40, heads, hd), angles, neox=True), hf_in_file_order)


# --- Llama-3 RoPE frequency factors -------------------------------------------------------------------------------


def llama3_rope_factors(
    n_rot: int, base: float, factor: float = 32.0, low: float = 1.0, high: float = 4.0, original_context: int = 8192
) -> NDArray[np.float32]:
    """``rope_freqs.weight`` as llama.cpp's converter writes it for Llama 3.1/3.2 (``LlamaModel``'s rope factors):
    1 for wavelengths below ``original_context / high``, ``factor`` above ``original_context / low``, smoothed
    between. Llama-3.2's: factor 32, low 1, high 4, original context 8192."""
    out = []
    for freq in base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot):
        wavelen = 2 * math.pi / freq
        if wavelen < original_context / high:
            out.append(1.0)
        elif wavelen > original_context / low:
            out.append(factor)
        else:
            smooth = (original_context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=F32)


def copy_gguf(
    src: Path,
    dst: Path,
    rope_freqs: NDArray[np.float32] | None,
    extra_tensors: dict[str, int] | None = None,
    extra_keys: dict[str, int] | None = None,
) -> Path:
    """``src`` rewritten by ``gguf.GGUFWriter``, every key and tensor as it is, with ``rope_freqs.weight`` (F32)
    added when given, and F32 zero vectors of the given lengths and uint32 keys added."""
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":  # the writer's own
            continue
        vtype = field.types[0]
        writer.add_key_value(
            key, field.contents(), vtype, field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        )
    for key, value in (extra_keys or {}).items():
        writer.add_uint32(key, value)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    for name, n in (extra_tensors or {}).items():
        writer.add_tensor(name, np.zeros(n, dtype=F32))
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    return dst


@pytest.fixture(scope="module")
def rope_copies(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``tiny`` as it is, and copies with Llama-3.2's factors (its original context of 8192 in a context of 131072
    scaled to the tiny model's 2048: 128) and with every factor 1."""
    src = resolve_model("synthetic:tiny")
    ref, out = reference(src), tmp_path_factory.mktemp("rope_freqs")
    original = int(ref.key("context_length")) * 8192 // 131072
    return {
        "plain": src,
        "llama3": copy_gguf(
            src, out / "tiny-llama3-rope.gguf", llama3_rope_factors(ref.n_rot, ref.base, original_context=original)
        ),
        "ones": copy_gguf(src, out / "tiny-rope-ones.gguf", np.ones(ref.n_rot // 2, dtype=F32)),
    }


def test_the_copy_writer_copies_the_file_byte_for_byte(tmp_path):
    src = resolve_model("synthetic:tiny")
    assert copy_gguf(src, tmp_path / "copy.gguf", None).read_bytes() == src.read_bytes()


def test_the_reference_applies_llama3_rope_factors(rope_copies):
    """Factors of 1 change nothing, bit for bit; Llama-3.2's factors change the logits by far more than the
    tolerance and the reference's own greedy answer within 32 tokens, on both prompts."""
    plain, llama3, ones = (ReferenceModel(rope_copies[k]) for k in ("plain", "llama3", "ones"))
    assert plain.factors is None and ones.factors is not None
    np.testing.assert_allclose(llama3.factors[:2], 1.0)
    assert llama3.factors.max() == 32.0
    tok = GGUFFile(rope_copies["plain"]).tokenizer
    for prompt in PROMPTS:
        ids = [int(plain.kv["tokenizer.ggml.bos_token_id"]), *tok.encode(prompt)]
        answer = plain.greedy(ids, TOKENS)
        seq = ids + answer
        logits = plain.forward(seq)[1]
        assert np.array_equal(ones.forward(seq)[1], logits)
        with_factors = llama3.forward(seq)[1]
        assert np.abs(with_factors - logits).max() > 10 * LOGIT_ATOL
        # on the same prefix, the factors' first choice differs from the answer somewhere: their greedy answer differs
        assert (with_factors[len(ids) - 1 : -1].argmax(-1) != answer).any()


def test_the_oracle_equals_the_reference_with_llama3_rope_factors(rope_copies):
    path = rope_copies["llama3"]
    ref = ReferenceModel(path)
    for prompt in PROMPTS:
        result = compare(project_run(path, prompt), ref)
        assert not result.failures, f"{prompt!r}: " + "; ".join(result.failures)


def test_the_writer_writes_llama3_rope_factors_as_llama_cpps_converter():
    """``tiny-llama3``'s ``rope_freqs.weight`` is this file's formula for its head, base and original context."""
    spec = PRESETS_BY_NAME["tiny-llama3"]
    ref = ReferenceModel(resolve_model("synthetic:tiny-llama3"))
    expected = llama3_rope_factors(ref.n_rot, ref.base, original_context=spec.rope_original_context)
    assert ref.factors is not None and expected[0] == 1.0 and expected[-1] == 32.0
    np.testing.assert_allclose(ref.factors, expected, rtol=1e-6)


def test_a_tensor_or_key_the_engine_does_not_compute_is_refused_at_load(tmp_path):
    """A bias on llama's attention output, or a sliding window, would be computed by llama.cpp and ignored here: the
    file is refused, naming it, instead of answering differently."""
    src = resolve_model("synthetic:tiny")
    with_bias = copy_gguf(src, tmp_path / "bias.gguf", None, extra_tensors={"blk.0.attn_output.bias": 64})
    with pytest.raises(ModelError, match=r"blk\.0\.attn_output\.bias are not part of llama"):
        GGUFFile(with_bias)
    window = copy_gguf(src, tmp_path / "window.gguf", None, extra_keys={"llama.attention.sliding_window": 16})
    with pytest.raises(ModelError, match=r"llama\.attention\.sliding_window = 16 changes the computation"):
        GGUFFile(window)
    wrong = copy_gguf(src, tmp_path / "few.gguf", np.ones(3, dtype=F32))
    with pytest.raises(ModelError, match="rope_freqs.weight holds 3 factors"):
        GGUFFile(wrong)


def test_a_dense_qwen_file_with_a_tensor_its_graph_does_not_read_is_refused(tmp_path):
    """llama.cpp's qwen2 and qwen3 graphs read no ``rope_freqs.weight`` and no per-head norms in qwen2: a file with
    them is refused at load, naming the tensor, as llama.cpp's loader refuses it."""
    qwen2, qwen3 = resolve_model("synthetic:tiny-qwen2"), resolve_model("synthetic:tiny-qwen3")
    factors = copy_gguf(qwen3, tmp_path / "factors.gguf", np.ones(16, dtype=F32))
    with pytest.raises(ModelError, match=r"rope_freqs\.weight are not part of qwen3"):
        GGUFFile(factors)
    norms = copy_gguf(qwen2, tmp_path / "norms.gguf", None, extra_tensors={"blk.0.attn_q_norm.weight": 16})
    with pytest.raises(ModelError, match=r"blk\.0\.attn_q_norm\.weight are not part of qwen2"):
        GGUFFile(norms)
