"""A GGUF file's tokenizer (ppharness.model.text.tokenizer) against the models' own tokenizers, each given the synthetic
file's vocabulary as tiktoken's mergeable ranks (rank = token id): Llama 3's (tiktoken with Meta's pattern) and
DeepSeek-V3's (its tokenizer.json's three splits, run here by the ``regex`` module, then tiktoken's byte-pair merge of
each piece). The patterns below are copied from those sources, not from the module under test.

Kimi K2's own tokenizer (tiktoken with its tokenization_kimi.py pat_str) is not the reference: llama.cpp cuts kimi-k2
text with code of its own that differs from that pattern (no letter-case classes, marks not letters), and ppharness
tokenizes as llama.cpp does (tests/test_tokenizer_llamacpp.py); ``test_kimi_cuts_as_llamacpp_not_as_tiktoken`` shows
where. Decoding is compared before llama.cpp's clean-up of spaces (``cleanup=False``), which llama-3 asks for."""

from __future__ import annotations

import functools

import pytest
import regex
import tiktoken
from hypothesis import given
from hypothesis import strategies as st

from ppharness.errors import ModelError
from ppharness.model.gguf_file import GGUFFile, tokenizer_from
from ppharness.model.synthetic.spec import ModelSpec
from ppharness.model.synthetic.vocab import BYTE_TO_CHAR, build_vocab, special_tokens
from ppharness.model.synthetic.writer import make_synthetic
from ppharness.model.text.tokenizer import PRE_TOKENIZERS, TOKENIZER_FAMILIES, Tokenizer, pre_tokenize

LLAMA3_PAT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"  # noqa: E501
KIMI_PAT = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    "[一-龥\u3040-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",  # noqa: E501
)

# not the text the synthetic vocabularies are learned from
TEXT = """\
模型并行推理：每个节点只保存自己的层，激活值沿着链条传递。中文、日本語、한국어が混ざる文章です。
カタカナのテキストとひらがなの文、そして漢字。東京タワーは333メートル。
Emoji 🙂🙃 🚀🚀🚀 ✨👍🏻👍🏿 ❤️‍🔥 🇩🇪🇯🇵 👩‍💻 — and a ZWJ family 👨‍👩‍👧‍👦!
Digits: 1 12 123 1234 12345 1234567 3.14159 2024-12-31 0x7fff １２３ ٣٤٥ ½ ² ①.
Whitespace:  two,   three,\tone tab,\t\t\ttabs, non\u00a0breaking, ideographic\u3000space, trailing\x20\x20\x20
Windows\r\nline\r\n\r\nendings, blank lines:


and a form feed\x0c, a vertical tab\x0b, a next line\x85 and a line separator\u2028end.
Apostrophes: it's, we're, they've, I'M, YOU'LL, he'd, don't, 's alone, ‘curly’ and ’s, O'Brien's.
Accents: résumé, naïve, Ångström, São Paulo, Dvořák, Łódź, ǅemal, ﬁne; combining: e\u0301 a\u0308 n\u0303.
Scripts: Москва и Санкт-Петербург; Αθήνα; القاهرة; नमस्ते दुनिया; שלום; ภาษาไทย; Ωmega \u212a-Kelvin.
Punctuation runs: ...!!! ??? --- ((x)) [[y]] {{z}} <<>> «quoted» „German“ 'single' "double" ;;; :: ~~ @@ ## $$ %%.
Code: def f(x):\n    return x**2 + 1  # comment\n\tif a != b && c <= d || e >= f: pass
"""
# a curated alphabet for random text: characters every regex engine involved classifies alike
ALPHABET = sorted(set(TEXT))
_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


def _ranks(kv: dict) -> dict[bytes, int]:
    types = kv["tokenizer.ggml.token_type"]
    return {bytes(_BYTE[c] for c in t): i for i, t in enumerate(kv["tokenizer.ggml.tokens"]) if types[i] == 1}


def _isolated(pattern: str, pieces: list[str]) -> list[str]:
    """Each piece cut at the matches of ``pattern``: every match and every stretch between matches a piece."""
    compiled, out = regex.compile(pattern), []
    for piece in pieces:
        pos = 0
        for m in compiled.finditer(piece):
            out += [piece[pos : m.start()]] * (m.start() > pos) + [m.group()]
            pos = m.end()
        out += [piece[pos:]] * (pos < len(piece))
    return out


def _deepseek_v3_pieces(text: str) -> list[str]:
    """tokenizer.json's Sequence: each Split (behavior Isolated) cuts the pieces the one before left."""
    return functools.reduce(lambda pieces, pattern: _isolated(pattern, pieces), DEEPSEEK_V3_SPLITS, [text])


def _deepseek_v3_reference(kv: dict):
    whole = tiktoken.Encoding("piece", pat_str=r"[\s\S]+", mergeable_ranks=_ranks(kv), special_tokens={})
    return lambda text: [i for piece in _deepseek_v3_pieces(text) for i in whole.encode_ordinary(piece)]


def _tiktoken_reference(kv: dict, pattern: str):
    return tiktoken.Encoding("ref", pat_str=pattern, mergeable_ranks=_ranks(kv), special_tokens={}).encode_ordinary


def _synthetic(tmp_path_factory, tokenizer: str, vocab: int) -> GGUFFile:
    spec = ModelSpec(blocks=1, dim=16, ffn=32, heads=2, kv_heads=1, vocab=vocab, tokenizer=tokenizer)
    return GGUFFile(make_synthetic(spec, tmp_path_factory.mktemp(tokenizer) / "model.gguf"))


# (tokenizer type, vocabulary size, reference). The default type's vocabulary at 512 is all learned from its corpus;
# a larger one adds seeded concatenations, which tiktoken's merge by id and the merge list split differently
# (test_merges_by_rank_not_by_id); every other type's vocabulary is built for tiktoken's merge at any size.
CASES = {
    "deepseek-v3": (4096, _deepseek_v3_reference),
    "llama3": (4096, lambda kv: _tiktoken_reference(kv, LLAMA3_PAT)),
    "llama-bpe": (512, lambda kv: _tiktoken_reference(kv, LLAMA3_PAT)),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    vocab, reference = CASES[request.param]
    f = _synthetic(tmp_path_factory, request.param, vocab)
    assert f.kv["tokenizer.ggml.pre"] == request.param and len(f.kv["tokenizer.ggml.tokens"]) == vocab
    return f, reference(f.kv)


def test_text_tokenizes_as_the_models_own_tokenizer(case):
    f, reference = case
    ids = f.tokenizer.encode(TEXT)
    assert ids == reference(TEXT)
    assert len(ids) < len(TEXT.encode())  # merges happened
    assert f.tokenizer.decode(ids, cleanup=False) == TEXT


@given(text=st.text(st.sampled_from(ALPHABET), max_size=80))
def test_any_text_tokenizes_as_the_models_own_tokenizer(case, text):
    f, reference = case
    ids = f.tokenizer.encode(text)
    assert ids == reference(text)
    assert f.tokenizer.decode(ids, cleanup=False) == text


def test_special_tokens_written_in_the_text_are_those_tokens(case):
    f, _ = case
    tokens = f.kv["tokenizer.ggml.tokens"]
    specials = special_tokens(f.kv["tokenizer.ggml.pre"])
    bos, eos = f.config.bos_id, f.kv["tokenizer.ggml.eos_token_id"]
    assert (tokens[bos], tokens[eos]) == specials[:2]
    text = f"{specials[0]}Hi 你好{specials[2]}x{specials[1]}"
    ids = f.tokenizer.encode(text)
    assert ids[0] == bos and ids[-1] == eos and tokens.index(specials[2]) in ids
    assert f.tokenizer.decode(ids, cleanup=False) == text


def _pieces(pre: str, text: str) -> list[str]:
    return [bytes(_BYTE[c] for c in p).decode() for p in pre_tokenize(pre, text)]


SPLITS = {  # the pieces each model's own pre-tokenizer cuts (regex.V1: Kimi's class intersections)
    "llama-bpe": lambda text: regex.findall(LLAMA3_PAT, text),
    "deepseek-v3": _deepseek_v3_pieces,
}


@pytest.mark.parametrize("pre", list(SPLITS))
@given(text=st.text(st.sampled_from(ALPHABET), max_size=80))
def test_text_pre_tokenizes_as_the_models_own_tokenizer(pre, text):
    assert _pieces(pre, text) == SPLITS[pre](text)
    assert _pieces(pre, TEXT) == SPLITS[pre](TEXT)


def test_tokenizer_types_pre_tokenize_as_their_models():
    """A few splits checked by hand against each model's published pattern."""
    pieces = _pieces
    assert pieces("deepseek-v3", "abc 1234 日本語です") == ["abc", " ", "123", "4", " ", "日本語です"]
    assert pieces("kimi-k2", "it's 日本語です") == ["it's", " ", "日本語", "です"]
    assert pieces("llama-bpe", "it's 12345") == ["it", "'s", " ", "123", "45"]
    assert pieces("qwen2", "x 123") == ["x", " ", "1", "2", "3"]
    assert pieces("deepseek-coder", "ab 12\n") == ["ab", " ", "1", "2", "\n"]
    assert pieces("deepseek-llm", "Ωmega 한국") == ["Ω", "mega", " ", "한국"]


def test_merges_by_rank_not_by_id():
    """The merge list's order decides, as in llama.cpp: with merges b+c before a+b and then ab+c, "abcd" merges b+c
    first and then nothing more (a+bc is no merge), where tiktoken's merge by id (tinygrad's SimpleTokenizer's) would go
    on to the token "abc"."""
    tokens = [BYTE_TO_CHAR[b] for b in range(256)] + ["bc", "ab", "abc"]
    tok = Tokenizer(tokens, [1] * len(tokens), ["b c", "a b", "ab c"], "llama-bpe")
    assert tok.encode("abcd") == [ord("a"), 256, ord("d")]
    assert tok.encode("abc") == [258]  # a piece that is a token is that token (llama-bpe ignores merges for it)


def test_kimi_cuts_as_llamacpp_not_as_tiktoken():
    """Where llama.cpp's kimi-k2 code and Kimi's own pattern part: letter case and combining marks."""
    for text, llamacpp in (("HelloWorld", ["HelloWorld"]), ("cafe\u0301", ["cafe", "\u0301"])):
        assert _pieces("kimi-k2", text) == llamacpp
        assert regex.findall(KIMI_PAT, text, flags=regex.V1) != llamacpp


def test_kimi_file_without_merges_is_read_as_llamacpp_reads_it(tmp_path_factory):
    """llama.cpp reads a kimi-k2 file without a merge list, and then merges nothing: a byte token per byte
    (tests/test_tokenizer_llamacpp.py holds its ids); any other type needs the list."""
    f = _synthetic(tmp_path_factory, "kimi-k2", 1024)
    kv = {k: v for k, v in f.kv.items() if k != "tokenizer.ggml.merges"}
    assert tokenizer_from(kv).encode(TEXT) == list(TEXT.encode())  # byte b is token b in a synthetic vocabulary
    with pytest.raises(ModelError, match="no merge list"):
        tokenizer_from(kv | {"tokenizer.ggml.pre": "deepseek-v3"})


def test_unknown_pre_tokenizer_is_refused_saying_where_the_known_ones_are(tiny_model_path):
    f = GGUFFile(tiny_model_path)
    f.kv["tokenizer.ggml.pre"] = "gpt-5"
    with pytest.raises(ModelError, match="unknown tokenizer pre-tokenizer 'gpt-5'") as err:
        _ = f.tokenizer
    assert tiny_model_path in str(err.value)
    assert f"the {len(PRE_TOKENIZERS)} names llama.cpp knows" in str(err.value) and "docs/models.md" in str(err.value)
    with pytest.raises(ModelError, match="'gpt-5'"):
        ModelSpec(tokenizer="gpt-5")


def test_sentencepiece_without_byte_tokens_stops_at_a_character_it_lacks(tiny_gguf):
    """The tiny file's vocabulary read as SentencePiece: it has no ``<0xXX>`` tokens, so a character no token holds
    (U+2581, the escaped space) stops it, as it stops llama.cpp."""
    tok = tokenizer_from(tiny_gguf.kv | {"tokenizer.ggml.model": "llama"})
    with pytest.raises(ModelError, match="no byte token <0xE2>"):
        tok.encode("the stage")


@pytest.mark.parametrize("pre", ["qwen2", "deepseek-llm", "deepseek-coder"])
def test_other_tokenizer_types_round_trip(tmp_path_factory, pre):
    f = _synthetic(tmp_path_factory, pre, 1024)
    ids = f.tokenizer.encode(TEXT)
    assert f.tokenizer.decode(ids, cleanup=False) == TEXT
    assert len(ids) < len(TEXT.encode()) and all(0 <= i < f.config.vocab for i in ids)


def test_default_tokenizer_tokenizes_the_tiny_model_as_before(tiny_gguf):
    """The default synthetic vocabulary is the one the cached files were built with, and on the tiny model (its merges
    all learned from the corpus) the tokenizer agrees with tinygrad's SimpleTokenizer it replaces."""
    from tinygrad.apps.llm import SimpleTokenizer

    before = SimpleTokenizer.from_gguf_kv(tiny_gguf.kv)
    for text in (TEXT, "the pipeline stage sends the token", "<|begin_of_text|>Hello<|eot_id|>"):
        assert tiny_gguf.tokenizer.encode(text) == before.encode(text)


@pytest.mark.parametrize("family", list(TOKENIZER_FAMILIES))
def test_every_byte_level_family_has_a_synthetic_vocabulary(family):
    """A synthetic vocabulary is learned for any byte-level type (its merges fit the vocabulary, the text comes back);
    a type that reads the text's own characters is refused by name."""
    name = TOKENIZER_FAMILIES[family][0]
    if not PRE_TOKENIZERS[name].byte_level:
        with pytest.raises(ModelError, match=f"tokenizer type {name!r} reads the text's own characters"):
            build_vocab(200, 0, name)
        return
    tokens, merges = build_vocab(200, 0, name)
    tok = Tokenizer(tokens, [1] * len(tokens), merges, name)
    ids = tok.encode(TEXT)
    assert tok.decode(ids, cleanup=False) == TEXT and len(ids) < len(TEXT.encode())
