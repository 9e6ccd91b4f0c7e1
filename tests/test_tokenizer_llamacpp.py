"""ppharness's tokenizer against llama.cpp's own tokenizer, for every ``tokenizer.ggml.pre`` name llama.cpp knows,
for SentencePiece with and without the space prefix, and for the real SmolLM2-135M-Instruct file.

The ids are llama.cpp's, kept in ``tests/fixtures/tokenizer_llamacpp.json`` (with the three vocabularies they were
made on) and ``tests/fixtures/tokenizer_llamacpp_smollm2.json``. They were made by
``tests/fixtures/make_tokenizer_fixtures.py``: llama.cpp as llama-cpp-python 0.3.36 vendors it (the shared
``tools/llamacpp``: ``fetch.sh``, then ``build.sh ARCHIVE DEST cpu``), its ``llama-tokenize`` run on
vocabulary-only GGUF files of those vocabularies, one per name, as

    llama-tokenize -m VOCAB.gguf -f TEXT_FILE --no-escape --ids --log-disable --no-bos

(special tokens parsed; the text's bytes as they are; no BOS). To make them again:

    .venv/bin/python tests/fixtures/make_tokenizer_fixtures.py PATH/TO/llama-tokenize --smollm2 FILE
"""

from __future__ import annotations

import json
import time
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from ppharness.errors import ModelError
from ppharness.model.gguf.header import read_gguf
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.text.pretokenizers import FAMILY_SPLITS, PRE_TOKENIZERS, TOKENIZER_FAMILIES
from ppharness.model.text.tokenizer import Tokenizer, clean_spaces, tokenizer_problem
from tests.fixtures.make_tokenizer_fixtures import write_vocab_gguf

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FIXTURE = json.loads((FIXTURES / "tokenizer_llamacpp.json").read_text())
SMOLLM2 = json.loads((FIXTURES / "tokenizer_llamacpp_smollm2.json").read_text())
TEXTS: list[str] = FIXTURE["texts"]
VOCABULARIES: dict[str, dict[str, Any]] = FIXTURE["vocabularies"]
SPECIAL_KINDS = (2, 3, 4)
PROMOTED = ("<|eot_id|>", "<fim_prefix>")  # normal in the vocabulary, control tokens to llama.cpp by their text


def _kv(
    vocabulary: str, model: str, pre: str | None, add_space_prefix: bool | None, merges: bool = True
) -> dict[str, Any]:
    """The metadata of the vocabulary-only file llama.cpp read."""
    v = {k: x for k, x in VOCABULARIES[vocabulary].items() if merges or k != "merges"}
    kv: dict[str, Any] = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": model,
        "tokenizer.ggml.tokens": v["tokens"],
        "tokenizer.ggml.token_type": v["token_type"],
        "tokenizer.ggml.bos_token_id": v["bos"],
        "tokenizer.ggml.eos_token_id": v["eos"],
    }
    for key, name in (("merges", "merges"), ("scores", "scores"), ("unk", "unknown_token_id")):
        if key in v:
            kv[f"tokenizer.ggml.{name}"] = v[key]
    if pre is not None:
        kv["tokenizer.ggml.pre"] = pre
    if add_space_prefix is not None:
        kv["tokenizer.ggml.add_space_prefix"] = add_space_prefix
    return kv


@cache
def _tokenizer(
    vocabulary: str, model: str, pre: str | None, add_space_prefix: bool | None, merges: bool = True
) -> Tokenizer:
    return Tokenizer.from_kv(_kv(vocabulary, model, pre, add_space_prefix, merges))


def _case_tokenizer(case: dict[str, Any], pre: str | None) -> Tokenizer:
    return _tokenizer(case["vocabulary"], case["model"], pre, case["add_space_prefix"], case["merges"])


def _label(case: dict[str, Any], pre: str | None) -> str:
    if case["model"] == "llama":
        return f"SentencePiece (add_space_prefix {case['add_space_prefix']})"
    family = PRE_TOKENIZERS[pre].family if pre else "default"
    name = "no tokenizer.ggml.pre" if pre is None else f"tokenizer.ggml.pre {pre!r}"
    merges = "" if case["merges"] else ", no merge list"
    return f"{case['model']} {name} (family {family}, {case['vocabulary']} vocabulary{merges})"


def _differ(what: str, i: int, text: str, ours: list[int], theirs: list[int], tokens: list[str]) -> str:
    """Where ppharness's ids first part from llama.cpp's, with the tokens' texts around it."""
    k = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))

    def show(ids: list[int]) -> str:
        return " ".join(f"{t}:{tokens[t]!r}" for t in ids[k : k + 6]) or "(nothing)"

    return (
        f"{what}, text {i} {text!r}: ppharness's ids part from llama.cpp's at token {k} "
        f"(of {len(ours)} here, {len(theirs)} there): here {show(ours)}; llama.cpp {show(theirs)}"
    )


CASES = [(case, pre) for case in FIXTURE["cases"] for pre in case["pre"]]


def _case_id(case_pre: tuple[dict[str, Any], str | None]) -> str:
    case, pre = case_pre
    merges = "" if case["merges"] or case["model"] == "llama" else "-no-merges"
    return f"{case['model']}-{pre or case['add_space_prefix']}{merges}"


@pytest.mark.parametrize("case_pre", CASES, ids=[_case_id(c) for c in CASES])
def test_ids_equal_llamacpps(case_pre: tuple[dict[str, Any], str | None]) -> None:
    case, pre = case_pre
    tok = _case_tokenizer(case, pre)
    what = _label(case, pre)
    for i, (text, theirs) in enumerate(zip(TEXTS, case["ids"], strict=True)):
        if theirs is None:  # llama.cpp aborts on it (test_whitespace_type_where_llamacpp_aborts)
            continue
        ours = tok.encode(text)
        assert ours == theirs, _differ(what, i, text, ours, theirs, tok.tokens)


def test_every_name_llamacpp_knows_is_held() -> None:
    held = {pre for case in FIXTURE["cases"] if case["model"] == "gpt2" and case["merges"] for pre in case["pre"]}
    assert held == set(PRE_TOKENIZERS) | {None}, (
        f"names without llama.cpp's ids in the fixture: {sorted(set(PRE_TOKENIZERS) - held)}; names the fixture "
        f"holds that ppharness does not know: {sorted(held - set(PRE_TOKENIZERS) - {None})} — make the fixture again"
    )
    assert {(c["model"], c["add_space_prefix"]) for c in FIXTURE["cases"] if c["model"] != "gpt2"} == {
        ("gemma4", None), ("llama", True), ("llama", False), ("llama", None)
    }  # fmt: skip


def test_families_tell_apart() -> None:
    """The texts and the vocabulary show each family's cut: no two families share all their ids, but bailingmoe and
    qwen2, whose regexes as llama.cpp writes them cut alike (bailingmoe's newline alternative, whitespace then one
    newline, ends where qwen2's, whitespace then newlines, does; their contractions are the same)."""
    shared = [
        families
        for case in FIXTURE["cases"]
        if len(families := {PRE_TOKENIZERS[p].family for p in case["pre"] if p}) > 1
    ]
    assert shared == [{"qwen2", "bailingmoe"}], f"families whose ids are alike on every text: {shared}"


def test_whitespace_type_where_llamacpp_aborts() -> None:
    """llama.cpp's ``whitespace`` type (for a 'gpt2' file) leaves runs of spaces as pieces, and its BPE aborts on a
    symbol with a space in it (GGML_ASSERT in find_bpe_rank): the fixture has no ids for those texts. Every other
    text has them."""
    for case in FIXTURE["cases"]:
        missing = [i for i, ids in enumerate(case["ids"]) if ids is None]
        if case["pre"] == ["whitespace"]:
            assert missing and all("  " in TEXTS[i] or " \t" in TEXTS[i] or "\t " in TEXTS[i] for i in missing)
        else:
            assert not missing, f"{_label(case, case['pre'][0])}: llama.cpp gave no ids for texts {missing}"


def _specials(vocabulary: str) -> list[str]:
    v = VOCABULARIES[vocabulary]
    return [t for t, k in zip(v["tokens"], v["token_type"]) if k in SPECIAL_KINDS] + list(PROMOTED)


def _round_trips(case: dict[str, Any], pre: str | None, text: str) -> bool:
    """Whether llama.cpp's detokenizer gives ``text`` back from its ids: SentencePiece adds a space after a special
    token and reads U+2581 as a space; ``whitespace`` decodes its pieces as byte-level text; the clean-up of spaces
    changes the texts it applies to."""
    how = PRE_TOKENIZERS[pre] if pre else None
    if how is not None and how.family == "whitespace":
        return False
    if (case["model"] != "gpt2" or (how is not None and how.escape_spaces)) and "\u2581" in text:
        return False
    if case["model"] == "llama" and case["add_space_prefix"] is not False:
        if any(s in text for s in _specials(case["vocabulary"])):
            return False
    clean = how.clean_spaces if how is not None else case["model"] == "gemma4" or case["model"] == "gpt2"
    return not (clean and any(p in text for p in (" ?", " !", " .", " ,", " '")))


@pytest.mark.parametrize("case_pre", CASES, ids=[_case_id(c) for c in CASES])
def test_decode_gives_the_text_back(case_pre: tuple[dict[str, Any], str | None]) -> None:
    case, pre = case_pre
    tok = _case_tokenizer(case, pre)
    back = [(i, t) for i, t in enumerate(TEXTS) if _round_trips(case, pre, t)]
    assert len(back) >= len(TEXTS) // 2 or (pre and PRE_TOKENIZERS[pre].family == "whitespace")
    for i, text in back:
        got = tok.decode(tok.encode(text))
        assert got == text, f"{_label(case, pre)}, text {i}: decoded {got!r}, not the text {text!r}"


def test_decode_cleans_spaces_as_llamacpp() -> None:
    """llama.cpp's clean-up (llama3 sets it; qwen2 does not), pass by pass as its detokenizer writes it."""
    llama3, qwen2 = _tokenizer("bpe", "gpt2", "llama3", None), _tokenizer("bpe", "gpt2", "qwen2", None)
    text = "Hello , world ! Why ? Yes . a ' b it 's I 'm we 're they 've he 'd you 'll don 't"
    want = "Hello, world! Why? Yes. a'b it's I'm we're they've he 'd you 'll don 't"
    assert llama3.decode(llama3.encode(text)) == want
    assert llama3.decode(llama3.encode(text), cleanup=False) == text
    assert qwen2.decode(qwen2.encode(text)) == text
    # the second pass blanks the space after a joined quote, so a quote right after is not joined: " ' ' x" -> "'' x"
    assert clean_spaces(b" ' ' x") == b"'' x" and clean_spaces(b"") == b"" and clean_spaces(b" ,") == b","


def test_sentencepiece_decode_drops_only_the_prefix_space() -> None:
    tok = _tokenizer("spm", "llama", None, None)
    ids = tok.encode("Hello world")
    assert tok.decode(ids) == "Hello world"
    assert tok.decode(ids, cleanup=False) == " Hello world"  # what llama.cpp prints token by token
    assert tok.decode(tok.encode("  two")) == "  two"
    no_prefix = _tokenizer("spm", "llama", None, False)
    assert no_prefix.decode(no_prefix.encode(" x")) == " x"
    text = "<s>Text</s>"
    assert tok.decode(tok.encode(text)) == "<s> Text</s>"  # the space llama.cpp adds after a special token stays


def test_sentencepiece_falls_back_to_bytes() -> None:
    tok = _tokenizer("spm", "llama", None, True)
    ids = tok.encode("\U0001f9ec")  # a character the vocabulary lacks: its four bytes
    assert [tok.tokens[t] for t in ids][-4:] == ["<0xF0>", "<0x9F>", "<0xA7>", "<0xAC>"]
    assert tok.decode(ids) == "\U0001f9ec" and tok.decode(ids[:-1]).endswith("\ufffd")


def test_sentencepiece_is_fast_on_long_prompts() -> None:
    tok = _tokenizer("spm", "llama", None, True)
    text = "".join(TEXTS) * 4  # about 20,000 characters
    t0 = time.perf_counter()
    ids = tok.encode(text)
    took = time.perf_counter() - t0
    assert tok.decode(ids).count("Pipeline parallel") == 4
    assert took < 2.0, f"SentencePiece took {took:.2f} s for {len(text):,} characters"


@pytest.mark.parametrize(
    ("vocabulary", "model", "pre", "prefix"),
    [("bpe", "gpt2", "llama3", None), ("spm-style", "gemma4", None, None), ("spm", "llama", None, False)],
)
def test_a_vocabulary_only_file_tokenizes_as_its_metadata(
    tmp_path: Path, vocabulary: str, model: str, pre: str | None, prefix: bool | None
) -> None:
    """The same vocabulary through a GGUF file and ppharness's reader: the header alone says it builds, and the ids
    are those of the metadata above."""
    path = tmp_path / "vocab.gguf"
    write_vocab_gguf(path, VOCABULARIES[vocabulary], model, pre, prefix)
    assert tokenizer_problem(read_gguf(path, arrays=False).kv) is None
    from_file = Tokenizer.from_kv(read_gguf(path).kv)
    want = _tokenizer(vocabulary, model, pre, prefix)
    for text in TEXTS:
        assert from_file.encode(text) == want.encode(text), f"{model} {pre}: {text!r}"


PROBLEMS = {
    "bert": ("bert", None, "tokenizer.ggml.model 'bert' (WordPiece) is not supported"),
    "t5": ("t5", None, "'t5' (Unigram) is not supported"),
    "rwkv": ("rwkv", None, "'rwkv' (RWKV's trie) is not supported"),
    "whitespace model": ("whitespace", None, "'whitespace' (the whitespace-split BPE of embedding models)"),
    "unknown pre": ("gpt2", "gpt-5", "unknown tokenizer pre-tokenizer 'gpt-5' (tokenizer.ggml.pre): the 91 names"),
}


@pytest.mark.parametrize("what", list(PROBLEMS))
def test_tokenizers_not_built_are_refused_saying_why(what: str) -> None:
    model, pre, message = PROBLEMS[what]
    kv = _kv("bpe", model, pre, None)
    problem = tokenizer_problem(kv)
    assert problem is not None and message in problem
    with pytest.raises(ModelError) as err:
        Tokenizer.from_kv(kv)
    assert str(err.value) == problem


def test_the_header_check_names_what_is_missing() -> None:
    kv = _kv("bpe", "gpt2", "qwen2", None)
    assert tokenizer_problem(kv) is None
    assert "merge list" in str(tokenizer_problem({k: v for k, v in kv.items() if k != "tokenizer.ggml.merges"}))
    assert "no vocabulary" in str(tokenizer_problem({k: v for k, v in kv.items() if k != "tokenizer.ggml.tokens"}))
    assert "no tokenizer" in str(tokenizer_problem({}))
    unknown = str(tokenizer_problem(kv | {"tokenizer.ggml.pre": "gpt-5"}))
    assert f"{len(TOKENIZER_FAMILIES)} families" in unknown and "docs/models.md" in unknown and "qwen2" not in unknown
    assert tokenizer_problem(kv | {"tokenizer.ggml.pre": ""}) is None  # llama.cpp takes "default" for no name


def test_docs_list_every_family_and_name() -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "models.md").read_text()
    section = text[text.index("## Tokenizers") :]
    missing = [f"`{n}`" for n in [*FAMILY_SPLITS, *PRE_TOKENIZERS] if f"`{n}`" not in section]
    assert not missing, f"docs/models.md's tokenizer section does not name {', '.join(missing)}"


def test_smollm2_ids_equal_llamacpps(smollm2: str) -> None:
    tok = GGUFFile(smollm2).tokenizer
    assert SMOLLM2["texts"] == TEXTS, "the SmolLM2 fixture was made on other texts: make both again"
    for i, (text, theirs) in enumerate(zip(TEXTS, SMOLLM2["ids"], strict=True)):
        ours = tok.encode(text)
        assert ours == theirs, _differ("SmolLM2-135M-Instruct (smollm)", i, text, ours, theirs, tok.tokens)
        assert tok.decode(ours) == text, f"SmolLM2-135M-Instruct, text {i}: decoded {tok.decode(ours)!r}"
