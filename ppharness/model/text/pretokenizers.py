"""The BPE pre-tokenizers llama.cpp knows: every ``tokenizer.ggml.pre`` name its ``llama_vocab::impl::load``
(src/llama-vocab.cpp) accepts, the regex list ``llm_tokenizer_bpe`` cuts the text with for it (each regex cuts the
pieces the one before left: every match and every stretch between matches a piece), and the per-name settings that
change what the tokens are (``ignore_merges``) or how they read back (``clean_spaces``).

A family is one regex list; the names that share it share a family (the family named after llama.cpp's first
``LLAMA_VOCAB_PRE_TYPE`` with that list). The lists below are llama.cpp's, as written there. ``oniguruma`` gives the
regex Hugging Face ``tokenizers`` runs for each, reading it as llama.cpp's engine does (src/unicode.cpp), which is not
always as a regex library reads the same text:

- llama.cpp matches the regexes that name Unicode categories on text with every non-ASCII character replaced by its
  category, so ``\\p{Lu}``, ``\\p{Ll}``, ``\\p{Lt}``, ``\\p{Lm}`` and ``\\p{Lo}`` all read as ``\\p{L}``;
- it matches the others on the text with non-ASCII whitespace replaced by a vertical tab, so a class that spans such
  whitespace (DeepSeek's ``ࠀ-一``, ``　-。``) does not match it;
- ``\\d`` is ASCII's digits; ``$`` is the end of the piece (std::regex's ECMAScript);
- where llama.cpp runs hand-written code instead of the regex, the regex of what that code does: Kimi K2's (no
  letter-case classes, no marks, Han by llama.cpp's ranges) and the digit groups of afmoe and tiny_aya (three from
  the right, the text before a number joined to its first group).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ppharness.errors import ModelError


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp cuts text for one ``tokenizer.ggml.pre`` name before BPE merges within the pieces.

    ``ignore_merges``: a piece that is itself a token is that token, whatever the merges would make of it.
    ``clean_spaces``: decoding drops the space before ``? ! . ,`` and before ``'s 'm 're 've`` (llama.cpp's
    detokenizer). ``byte_level``: the vocabulary is GPT-2's byte alphabet; otherwise it is the text's own characters
    with ``<0xXX>`` tokens for bytes no token holds. ``escape_spaces``: spaces are U+2581 before splitting."""

    family: str
    splits: tuple[str, ...]
    ignore_merges: bool = False
    clean_spaces: bool = True
    byte_level: bool = True
    escape_spaces: bool = False


# llama.cpp's spelling of (?i:'s|'t|'re|'ve|'m|'ll|'d)
_C = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_TAIL = r"\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|" + _TAIL
_QWEN2 = _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|" + _TAIL
_JAIS2 = (
    _C
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    + "".join(rf"\s{{{n}}}(?!\S)|" for n in (512, 256, 128, 64, 32, 16, 8, 4))
    + r"\s{1,2}(?!\S)|\s{1}"
)
_DEEPSEEK_LETTERS = (  # DeepSeek LLM's letters: the cased letters of Latin, Greek, Cyrillic and a few more scripts
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_CJK_KOREAN = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_HAN_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
# with a carriage return and a line feed in the class, as llama.cpp writes it for deepseek-v3
_DEEPSEEK_V3_WORDS = r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^""" + "\r\n"
_DEEPSEEK_V3_WORDS += r"\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+"
_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_UP, _LOW = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"  # llama.cpp's letter-case classes: not a-z, not A-Z
_UPM, _LOWM = r"((?=[\p{L}\p{M}])([^a-z]))", r"((?=[\p{L}\p{M}])([^A-Z]))"
_X = r"[^\r\n\p{L}\p{N}]?"
_CASED = (  # the o200k / tekken letter-case alternatives, as tokenizer.json writes them
    _X + r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _C + "?|"
    + _X + r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _C + "?"
)  # fmt: skip
_NEWLINES = r"[^\n]+|[\n]+"

# family -> llama.cpp's regex list
FAMILY_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),
    "llama3": (_LLAMA3,),
    "jais2": (_JAIS2,),
    "deepseek-llm": ("[\r\n]", rf"\s?[{_DEEPSEEK_LETTERS}]+",
                     "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$",
                     _CJK_KOREAN, r"\p{N}+"),
    "deepseek-v3": (r"\p{N}{1,3}", _HAN_KANA, _DEEPSEEK_V3_WORDS + "[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"),
    "spark2.5": (r"\p{N}{1,3}", _HAN_KANA, _DEEPSEEK_V3_WORDS + "|[\r\n]|\\s+(?!\\S)|\\s+", r"\p{N}"),
    "youtu": (
        "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f"
        "\ufe30-\ufe4f]+|[\u3105-\u312f]+|" + _HAN_KANA,
        _CASED + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|" + _TAIL,
    ),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_KOREAN, r"\p{N}"),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"),
    "starcoder": (r"\p{N}", _GPT2),
    "gpt2": (_GPT2,),
    "qwen2": (_QWEN2,),
    "qwen35": (_C + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|" + _TAIL,),
    "bloom": (_BLOOM,),
    "viking": (_BLOOM, r"\p{N}"),
    "tekken": (
        f"{_X}{_UP}*{_LOW}+|{_X}{_UP}+{_LOW}*|" + r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|" + _TAIL,
    ),
    "chameleon": ("<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\\t\\n]|    |  )", r"\p{N}",
                  r"[\p{P}!-/:-@\[-`{-~]", _GPT2),
    "gpt4o": (
        f"{_X}{_UP}*{_LOW}+{_C}?|{_X}{_UP}+{_LOW}*{_C}?|" + r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|" + _TAIL,
    ),
    "granite-embed-multi": (
        f"{_X}{_UPM}*{_LOWM}+{_C}?|{_X}{_UPM}+{_LOWM}*{_C}?|" + r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|" + _TAIL,
    ),
    "tiny-aya": (r"\d{1,3}(?=(?:\d{3})*\b)", _CASED + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|" + _TAIL),
    "kimi-k2": (r"\p{Han}+",),
    "superbpe": (r"\p{N}+", r"(?=(\d{3})+(?!\d))"),
    "bailingmoe": (
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "seed-coder": (_C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|" + _TAIL,),
    "ufakzeka": (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|" + _TAIL,),
    "afmoe": (
        r"\p{AFMoE_digits}",
        "[\u4e00-\u9fff\u3400-\u4dbf\u8c48-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f\u2f00-\u2fdf\u0e40-\u0e7f"
        "\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f\ua9e0-\ua9ff\uac00-\ud7af\u1100-\u11ff]+",
        _DEEPSEEK_V3_WORDS.replace("\r\n", r"\r\n") + r"[\r\n]*|" + _TAIL,
    ),
    "laguna": (_NEWLINES, _QWEN2),
    "exaone-moe": (
        _C + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]"
        r"|\s+(?!\S)|\s+",
    ),
    "gemma4": (_NEWLINES,),
    "minicpm5": (r"\p{N}{1,3}", _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|" + _TAIL),
    "whitespace": (r"\S+",),
}  # fmt: skip


def _named(family: str, *names: str, **settings: bool) -> dict[str, PreTokenizer]:
    return dict.fromkeys(names, PreTokenizer(family, FAMILY_SPLITS[family], **settings))


_NO_CLEAN = {"clean_spaces": False}
_SPM_STYLE = {"byte_level": False, "escape_spaces": True}
# tokenizer.ggml.pre -> its pre-tokenizer, in llama_vocab::impl::load's order
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **_named("default", "default"),
    **_named("minicpm5", "minicpm5", ignore_merges=True),
    **_named("llama3", "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
             "jina-v5-nano", ignore_merges=True),
    **_named("deepseek-llm", "deepseek-llm", **_NO_CLEAN),
    **_named("deepseek-coder", "deepseek-coder", **_NO_CLEAN),
    **_named("deepseek-v3", "deepseek-v3", **_NO_CLEAN),
    **_named("spark2.5", "spark2_5", **_NO_CLEAN),
    **_named("youtu", "youtu", ignore_merges=True, **_NO_CLEAN),
    **_named("falcon", "falcon"),
    **_named("gpt2", "mpt"),
    **_named("starcoder", "starcoder"),
    **_named("gpt2", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
             "mellum", "modern-bert"),
    **_named("jais2", "jais-2"),
    **_named("gemma4", "gemma4", "granite-embed-multi-311m", **_SPM_STYLE),
    **_named("gemma4", "sarvam-moe", **_SPM_STYLE, **_NO_CLEAN),
    **_named("gpt2", "jina-v1-en", "jina-v2-code", "roberta-bpe"),
    **_named("whitespace", "whitespace", byte_level=False),
    **_named("starcoder", "refact"),
    **_named("starcoder", "command-r", **_NO_CLEAN),
    **_named("qwen2", "qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", **_NO_CLEAN),
    **_named("qwen35", "qwen35", **_NO_CLEAN),
    **_named("qwen2", "stablelm2"),
    **_named("gpt2", "olmo"),
    **_named("llama3", "dbrx", "smaug-bpe"),
    **_named("bloom", "poro-chat", **_NO_CLEAN),
    **_named("llama3", "chatglm-bpe"),
    **_named("llama3", "glm4", "glm5", ignore_merges=True),
    **_named("viking", "viking", **_NO_CLEAN),
    **_named("gpt2", "jais"),
    **_named("tekken", "tekken", ignore_merges=True, **_NO_CLEAN),
    **_named("starcoder", "smollm", **_NO_CLEAN),
    **_named("starcoder", "codeshell"),
    **_named("bloom", "bloom", "gpt3-finnish"),
    **_named("starcoder", "exaone"),
    **_named("gpt2", "exaone4"),
    **_named("exaone-moe", "exaone-moe"),
    **_named("chameleon", "chameleon", **_NO_CLEAN),
    **_named("starcoder", "minerva-7b"),
    **_named("qwen2", "megrez"),
    **_named("gpt4o", "gpt-4o", "llama4", "kanana2", "talkie", **_NO_CLEAN),
    **_named("granite-embed-multi", "granite-embed-multi-97m", ignore_merges=True, **_NO_CLEAN),
    **_named("tiny-aya", "tiny_aya", "cohere2moe", **_NO_CLEAN),
    **_named("superbpe", "superbpe", **_NO_CLEAN),
    **_named("gpt2", "trillion", "granite-docling", **_NO_CLEAN),
    **_named("bailingmoe", "bailingmoe", "bailingmoe2", "llada-moe", **_NO_CLEAN),
    **_named("seed-coder", "seed-coder", **_NO_CLEAN),
    **_named("qwen2", "hunyuan", **_NO_CLEAN),
    **_named("deepseek-v3", "hunyuan-dense", "hy_v4", "joyai-llm", **_NO_CLEAN),
    **_named("kimi-k2", "kimi-k2", **_NO_CLEAN),
    **_named("ufakzeka", "ufakzeka", **_NO_CLEAN),
    **_named("qwen2", "grok-2", **_NO_CLEAN),
    **_named("afmoe", "afmoe", **_NO_CLEAN),
    **_named("laguna", "laguna", **_NO_CLEAN),
    **_named("gpt4o", "minimax-m2", **_NO_CLEAN),
    **_named("qwen2", "solar-open", **_NO_CLEAN),
    **_named("starcoder", "mellum2"),
}  # fmt: skip

# family -> its tokenizer.ggml.pre names
TOKENIZER_FAMILIES: dict[str, tuple[str, ...]] = {
    family: tuple(name for name, how in PRE_TOKENIZERS.items() if how.family == family) for family in FAMILY_SPLITS
}


def pre_tokenizer(pre: str) -> PreTokenizer:
    """The pre-tokenizer of a ``tokenizer.ggml.pre`` name; ``ModelError`` for a name llama.cpp does not know."""
    try:
        return PRE_TOKENIZERS[pre]
    except KeyError:
        raise ModelError(unknown_pre(pre)) from None


def unknown_pre(pre: str) -> str:
    """What is wrong with a ``tokenizer.ggml.pre`` name llama.cpp does not know, and where the known ones are."""
    return (
        f"unknown tokenizer pre-tokenizer {pre!r} (tokenizer.ggml.pre): the {len(PRE_TOKENIZERS)} names llama.cpp "
        f"knows are known here, in {len(TOKENIZER_FAMILIES)} families (docs/models.md lists them)"
    )


# llama.cpp's Han (unicode_cpt_is_han)
_HAN = (
    "\u4e00-\u9fff\u3400-\u4dbf\U00020000-\U0002a6df\U0002a700-\U0002b73f\U0002b740-\U0002b81f\U0002b820-\U0002ceaf"
    "\U0002ceb0-\U0002ebef\uf900-\ufaff\U0002f800-\U0002fa1f"
)
_DIGIT_GROUPS = r"(?<=\p{N})(?=(?:\p{N}{3})*(?!\p{N}))"  # a cut after each group of three counted from the right
# the regexes llama.cpp runs as hand-written code (unicode_regex_split_custom), as regexes of what that code does
_HAND_WRITTEN = {
    r"\p{Han}+": f"[{_HAN}]+|{_X}[\\p{{L}}&&[^{_HAN}]]+{_C}?|" + r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|" + _TAIL,
    r"\p{AFMoE_digits}": _DIGIT_GROUPS,
    r"\d{1,3}(?=(?:\d{3})*\b)": _DIGIT_GROUPS,
}
_CATEGORIES = re.compile(r"\\p\{(?:N|L|P|M|S|Lu|Ll|Lt|Lm|Lo)\}")  # the categories llama.cpp's engine knows
_NON_ASCII_SPACE = "\u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_NON_ASCII_SPACES = (0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000)
_CLASS = re.compile(r"\[(?!\^)((?:\\.|[^\]\\])*)\]")


def oniguruma(regex: str) -> str:
    """The Oniguruma regex that cuts text as llama.cpp's engine cuts it with ``regex`` (the module's docstring)."""
    if regex in _HAND_WRITTEN:
        return _HAND_WRITTEN[regex]
    regex = regex.replace(r"\d", "[0-9]")
    if _CATEGORIES.search(regex):  # matched on the text's categories
        return re.sub(r"\\p\{L[ultmo]\}", r"\\p{L}", regex)
    if regex.endswith("$") and not regex.endswith("\\$"):
        regex = regex[:-1] + r"\z"

    def no_space(m: re.Match[str]) -> str:
        spans = any(re.fullmatch(m.group(0), chr(c)) for c in _NON_ASCII_SPACES)
        return f"[{m.group(1)}&&[^{_NON_ASCII_SPACE}]]" if spans else m.group(0)

    return _CLASS.sub(no_space, regex)
