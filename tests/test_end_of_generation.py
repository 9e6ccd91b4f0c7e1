"""End of generation as llama.cpp decides it: generation stops at any end-of-generation (EOG) token, not only at the
file's EOS; the answer leaves that token out and names it; the unsplit model and a split chain stop alike.

The synthetic vocabulary has two EOG tokens: ``<|end_of_text|>`` (the file's EOS) and ``<|eot_id|>`` (an EOG token by
its text alone). Where a greedy answer first reaches ``<|eot_id|>`` is found by the independent numpy reference
(``tests/reference_model.py``), decoding with no stop rule at all.
"""

from __future__ import annotations

from dataclasses import replace

import gguf
import msgspec
import numpy as np
import pytest
from click.testing import CliRunner

from ppharness.cli.model import split_check
from ppharness.model.arch import read_config
from ppharness.model.decode.exactness import compare
from ppharness.model.decode.oracle import oracle_decode
from ppharness.model.decode.rules import finish_reason, stop_token, visible
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.sources.files import synthetic_path
from ppharness.model.synthetic.spec import PRESETS, synthetic_source
from ppharness.model.text.eog import end_of_generation
from ppharness.run.inprocess import judge, load_slices, run_inprocess
from ppharness.trace.report import build_trace
from ppharness.wire import codec
from ppharness.wire.messages import PROTOCOL_VERSION, InferenceResponse, Span, TraceReport
from tests.reference_model import ReferenceModel

# the tiny preset with weights whose greedy answers reach <|eot_id|> for several of the candidate prompts
SPEC = replace(PRESETS["tiny"], seed=4)
CANDIDATES = (
    "The quick brown fox jumps over the lazy dog Pipeline parallel inference splits a model's transformer blocks "
    "into contiguous ranges one range per stage"
).split()
MAX_TOKENS = 48
MAX_CONTEXT = 256


# --- the EOG set, from the metadata -------------------------------------------------------------------------------


def _kv(tokens: list[str], eos: str, **ids: int) -> dict:
    """Tokenizer metadata: the vocabulary, the EOS id, and further ``tokenizer.ggml.<key>`` ids."""
    return {
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.eos_token_id": tokens.index(eos),
        **{f"tokenizer.ggml.{k}": v for k, v in ids.items()},
    }


def _ids(tokens: list[str], *texts: str) -> frozenset[int]:
    return frozenset(tokens.index(t) for t in texts)


def test_the_eos_the_eot_and_eom_ids_and_the_textual_tokens_end_generation(tmp_path):
    """Written by gguf's own writer: EOS, EOT and EOM by their keys, wherever they point; ``<|im_end|>`` and
    ``<|endoftext|>`` by their text, the latter even typed as a normal token; any other token does not."""
    tokens = ["a", "b", "</answer>", "<|im_end|>", "<|endoftext|>", "<stop-tool>", "<|im_start|>", "<eos-like>"]
    path = tmp_path / "vocab.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_token_list(tokens)
    w.add_token_types([1, 1, 3, 3, 1, 3, 3, 1])
    w.add_eos_token_id(tokens.index("</answer>"))
    w.add_eot_token_id(tokens.index("<stop-tool>"))
    w.add_eom_token_id(tokens.index("b"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(str(path))
    kv = {k: f.contents() for k, f in reader.fields.items()}
    assert end_of_generation(kv) == _ids(tokens, "</answer>", "<stop-tool>", "b", "<|im_end|>", "<|endoftext|>")


def test_without_further_keys_the_eos_alone_ends_generation():
    tokens = ["a", "b", "<s>", "<custom_end>"]
    assert end_of_generation(_kv(tokens, "<custom_end>")) == _ids(tokens, "<custom_end>")


def test_an_eot_id_outside_the_vocabulary_is_left_out():
    tokens = ["a", "</s>"]
    assert end_of_generation(_kv(tokens, "</s>", eot_token_id=7)) == _ids(tokens, "</s>")


@pytest.mark.parametrize(
    "tokens, ending",
    [
        # Llama 3 instruct, Qwen chat, Gemma, Phi-3
        (
            ["x", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>"],
            ["<|end_of_text|>", "<|eot_id|>", "<|eom_id|>"],
        ),
        (["x", "<|im_start|>", "<|im_end|>", "<|endoftext|>"], ["<|im_end|>", "<|endoftext|>"]),
        (["x", "<start_of_turn>", "<end_of_turn>", "<eos>"], ["<end_of_turn>", "<eos>"]),
        (["x", "<|end|>", "<|user|>", "</s>"], ["<|end|>", "</s>"]),
    ],
)
def test_textual_end_of_generation_tokens(tokens, ending):
    assert end_of_generation(_kv(tokens, "x")) == _ids(tokens, "x", *ending)


def test_end_of_a_message_is_no_end_of_generation_beside_return_and_call():
    """gpt-oss's vocabulary: ``<|end|>`` closes a message, ``<|return|>`` and ``<|call|>`` the answer."""
    tokens = ["x", "<|start|>", "<|end|>", "<|return|>", "<|call|>", "<|endoftext|>"]
    assert end_of_generation(_kv(tokens, "<|return|>")) == _ids(tokens, "<|return|>", "<|call|>", "<|endoftext|>")


def test_closing_s_is_no_end_of_generation_beside_a_tool_response():
    tokens = ["x", "<eos>", "</s>", "<|tool_response>", "<turn|>"]
    assert end_of_generation(_kv(tokens, "<eos>")) == _ids(tokens, "<eos>", "<|tool_response>", "<turn|>")


def test_fill_in_the_middle_pad_repo_and_separator_tokens_end_generation():
    """By their keys when the file has them, else by their text (Qwen2.5-Coder's)."""
    tokens = ["x", "<|fim_prefix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<PAD>", "<|endoftext|>"]
    by_text = end_of_generation(_kv(tokens, "<|endoftext|>"))
    assert by_text == _ids(tokens, "<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
    by_key = end_of_generation(_kv(tokens, "<|endoftext|>", fim_pad_token_id=tokens.index("<PAD>")))
    assert by_key == _ids(tokens, "<|endoftext|>", "<PAD>", "<|repo_name|>", "<|file_sep|>")


def test_the_model_config_reads_the_eog_set(tiny_gguf):
    """The synthetic vocabulary's two, and an EOT id the metadata adds."""
    kv = tiny_gguf.kv
    tokens = kv["tokenizer.ggml.tokens"]
    cfg = tiny_gguf.config
    assert cfg.eog_ids == _ids(tokens, "<|end_of_text|>", "<|eot_id|>") and cfg.eos_id in cfg.eog_ids
    more = read_config(kv | {"tokenizer.ggml.eot_token_id": 65}, set(tiny_gguf.names()))
    assert more.eog_ids == cfg.eog_ids | {65}


# --- the stop rule --------------------------------------------------------------------------------------------------


def test_the_stop_rule_takes_any_eog_token():
    eog = frozenset({7, 9})
    assert finish_reason([1, 2, 9], eog, 10) == "eos" and stop_token([1, 2, 9], eog) == 9
    assert visible([1, 2, 9], eog) == [1, 2]
    assert finish_reason([1, 2, 3], eog, 3) == "length" and stop_token([1, 2, 3], eog) is None
    assert visible([1, 2, 3], eog) == [1, 2, 3]
    assert finish_reason([1, 2], eog, 3) is None


# --- where a greedy answer reaches <|eot_id|> ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(synthetic_path(SPEC))


@pytest.fixture(scope="module")
def gguf_file(model_path):
    return GGUFFile(model_path)


@pytest.fixture(scope="module")
def eot_case(model_path, gguf_file) -> tuple[str, list[int], int]:
    """The first candidate prompt whose greedy answer, as the reference computes it, reaches an EOG token within
    MAX_TOKENS and that token is <|eot_id|>: (the prompt, the tokens before it, <|eot_id|>'s id)."""
    ref = ReferenceModel(model_path)
    tokens = list(ref.kv["tokenizer.ggml.tokens"])
    eot, eos = tokens.index("<|eot_id|>"), tokens.index("<|end_of_text|>")
    bos = int(ref.kv["tokenizer.ggml.bos_token_id"])
    for prompt in CANDIDATES:
        seq = [bos, *gguf_file.tokenizer.encode(prompt)]
        answer: list[int] = []
        while len(answer) < MAX_TOKENS:
            token = int(np.argmax(ref.forward(seq + answer)[1][-1]))
            if token in (eot, eos):
                break
            answer.append(token)
        else:
            continue
        if token == eot:
            return prompt, answer, eot
    pytest.fail(f"no candidate prompt's greedy answer reaches <|eot_id|> within {MAX_TOKENS} tokens")


def test_the_unsplit_model_stops_at_eot_and_names_it(model_path, gguf_file, eot_case):
    prompt, answer, eot = eot_case
    got = oracle_decode(model_path, prompt, MAX_TOKENS, MAX_CONTEXT)
    assert got.token_ids == answer, "the unsplit model did not stop where its greedy answer reaches <|eot_id|>"
    assert (got.finish_reason, got.stop_token_id, got.stop_token) == ("eos", eot, "<|eot_id|>")
    assert got.text == gguf_file.tokenizer.decode(answer)


def test_an_answer_cut_by_max_tokens_names_no_stop_token(model_path, eot_case):
    prompt, answer, _ = eot_case
    got = oracle_decode(model_path, prompt, len(answer), MAX_CONTEXT)
    assert got.token_ids == answer
    assert (got.finish_reason, got.stop_token_id, got.stop_token) == ("length", None, "")


@pytest.mark.parametrize("ranges", [[(0, 4), (4, 8)], [(0, 3), (3, 5), (5, 8)]], ids=["2-stage", "3-stage"])
def test_a_split_chain_stops_at_eot_as_the_unsplit_model_does(model_path, gguf_file, eot_case, ranges):
    prompt, answer, eot = eot_case
    whole = load_slices(gguf_file, [(0, gguf_file.config.blocks)], MAX_CONTEXT, taps=True)[0]
    oracle = oracle_decode(model_path, prompt, MAX_TOKENS, MAX_CONTEXT, model=whole, boundaries=True)
    digests: dict[int, list[bytes]] = {}
    chain = run_inprocess(gguf_file, load_slices(gguf_file, ranges, MAX_CONTEXT), prompt, MAX_TOKENS, digests=digests)
    assert chain.token_ids == answer
    assert (chain.finish_reason, chain.stop_token_id, chain.stop_token) == ("eos", eot, "<|eot_id|>")
    assert chain.text == oracle.text
    verdict = judge(chain, oracle, ranges, digests)
    assert verdict.exact, verdict.describe(chain.token_ids, oracle.token_ids)
    # every step was computed, the one that gave <|eot_id|> too
    assert all(len(d) == len(answer) + 1 for stage, d in digests.items() if stage < len(ranges) - 1)


def test_split_check_names_the_token_that_ended_the_answer(eot_case):
    prompt, answer, eot = eot_case
    result = CliRunner().invoke(
        split_check,
        ["--model", synthetic_source(SPEC), "--stages", "2", "--prompt", prompt, "--max-tokens", str(MAX_TOKENS)],
    )
    assert result.exit_code == 0, result.output
    assert f"unsplit model: {len(answer)} tokens (eos '<|eot_id|>' (id {eot}))" in result.output
    assert "MATCH" in result.output


# --- comparing answers, the trace, the wire -------------------------------------------------------------------------


def test_answers_that_end_at_different_eog_tokens_differ():
    v = compare([1, 2], [1, 2], [(0, 8)], {}, {}, prompt_tokens=2, chain_stop=511, oracle_stop=508)
    assert v.tokens_equal and not v.exact and v.stop_diff == (511, 508)
    assert "ended at end-of-generation token 511, the unsplit model's at end-of-generation token 508" in v.describe(
        [1, 2], [1, 2]
    )
    cut = compare([1, 2], [1, 2], [(0, 8)], {}, {}, prompt_tokens=2, chain_stop=511, oracle_stop=None)
    assert not cut.exact and "the unsplit model's at max_tokens" in cut.describe([1, 2], [1, 2])
    assert compare([1, 2], [1, 2], [(0, 8)], {}, {}, prompt_tokens=2, chain_stop=511, oracle_stop=511).exact


def test_the_trace_records_the_stop_tokens_step_with_its_id():
    ms = 10**6
    spans = [Span(k, "compute", k * 10 * ms, k * 10 * ms + ms) for k in range(3)]
    response = InferenceResponse(
        request_id="r",
        text="ab",
        token_ids=[5, 6],
        prompt_tokens=3,
        token_times=[0, 1, 2],
        finish_reason="eos",
        stop_token_id=511,
        stop_token="<|eot_id|>",
    )
    trace = build_trace([TraceReport(0, "r", spans)], {}, response, 1)
    assert [r.token_id for r in trace.records] == [5, 6, 511]


def test_a_response_from_a_peer_that_does_not_name_the_stop_token_still_decodes():
    older = {
        "type": "InferenceResponse",
        "request_id": "r",
        "text": "ab",
        "token_ids": [5, 6],
        "prompt_tokens": 3,
        "token_times": [0.0, 1.0],
        "finish_reason": "eos",
    }
    body = msgspec.msgpack.encode(older)
    got = codec.decode(codec.HEADER.pack(codec.MAGIC, PROTOCOL_VERSION, len(body)) + body)
    assert isinstance(got, InferenceResponse)
    assert (got.finish_reason, got.stop_token_id, got.stop_token) == ("eos", None, "")
