"""A GGUF file's tokenizer: byte-level BPE over the file's vocabulary (``tokenizer.ggml.tokens``) that merges by the
rank of the file's merge list (``tokenizer.ggml.merges``), as llama.cpp does, after the pre-tokenizer that
``tokenizer.ggml.pre`` names; control and user-defined tokens written in the text are those tokens.

The pre-tokenizers are those llama.cpp selects in ``llama_vocab::impl::load`` (src/llama-vocab.cpp) for the models
this harness loads, each written as its model's own tokenizer writes it (tokenizer.json's Split patterns, or Kimi's
tiktoken ``pat_str``), which llama.cpp transcribes for its own regex engine. Hugging Face ``tokenizers`` runs them:
its regexes are Oniguruma's, which reads those patterns as written (Kimi's ``&&`` class intersections included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ppharness.errors import ModelError

if TYPE_CHECKING:  # tokenizers is imported when a tokenizer is built, not with this module
    import tokenizers

CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values of the tokens matched in the text as themselves


@dataclass(frozen=True)
class PreTokenizer:
    """How one ``tokenizer.ggml.pre`` type cuts text into the pieces BPE merges within: each regex in turn cuts the
    pieces the one before left (every match and every stretch between matches a piece). ``ignore_merges``: a piece that
    is itself a token is that token, whatever the merges would make of it (llama.cpp's ``ignore_merges``, tiktoken's
    rule)."""

    splits: tuple[str, ...]
    ignore_merges: bool = False


# tokenizer.json's patterns (llama.cpp spells the case-insensitive contractions out as '[sS] etc.)
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_CJK_KOREAN = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"  # DeepSeek LLM and Coder: Han, the blocks up to it, Hangul
# DeepSeek LLM's letters: the cased letters (Lu, Ll, Lt) of Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee and
# a few more scripts
_DEEPSEEK_LETTERS = (
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
_DEEPSEEK_LLM = (
    r"[\r\n]",
    rf"\s?[{_DEEPSEEK_LETTERS}]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    _CJK_KOREAN,
    r"\p{N}+",
)
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_KOREAN, r"\p{N}")
_DEEPSEEK_V3 = (  # DeepSeek-V3's tokenizer.json: a Sequence of three Splits, digits, then Han and kana, then the rest
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"""
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# Kimi K2's tokenization_kimi.py pat_str: Han runs apart, letters and marks other than Han by case
_KIMI_K2 = "|".join(
    (
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        + _CONTRACTIONS
        + "?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        + _CONTRACTIONS
        + "?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    )
)

# tokenizer.ggml.pre -> its pre-tokenizer, several names where llama.cpp treats them alike. Kimi's own tokenizer is
# tiktoken, hence ignore_merges (llama.cpp does not set it for kimi-k2: the two differ only on a piece that is a token
# its merges cannot build)
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), PreTokenizer((_LLAMA3,), True)),
    "smaug-bpe": PreTokenizer((_LLAMA3,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), PreTokenizer((_QWEN2,))),
    "deepseek-llm": PreTokenizer(_DEEPSEEK_LLM),
    "deepseek-coder": PreTokenizer(_DEEPSEEK_CODER),
    "deepseek-v3": PreTokenizer(_DEEPSEEK_V3),
    "kimi-k2": PreTokenizer((_KIMI_K2,), True),
}


def pre_tokenizer(pre: str) -> PreTokenizer:
    """The pre-tokenizer of a ``tokenizer.ggml.pre`` value; ``ModelError`` naming the known ones for any other."""
    try:
        return PRE_TOKENIZERS[pre]
    except KeyError:
        raise ModelError(
            f"unknown tokenizer pre-tokenizer {pre!r} (tokenizer.ggml.pre); known: {', '.join(PRE_TOKENIZERS)}"
        ) from None


def _hf_pre_tokenizer(pre: str) -> Any:
    """``pre``'s splits then the byte-level mapping (GPT-2's byte -> character table), as a ``tokenizers``
    pre-tokenizer."""
    from tokenizers import Regex, pre_tokenizers

    splits = [pre_tokenizers.Split(Regex(r), "isolated") for r in pre_tokenizer(pre).splits]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def pre_tokenize(pre: str, text: str) -> list[str]:
    """``text`` cut into the pieces ``pre`` gives BPE, each written in the byte-level alphabet of the vocabulary."""
    return [piece for piece, _ in _hf_pre_tokenizer(pre).pre_tokenize_str(text)]


def rank_split(piece: str, ranks: dict[str, int], max_rank: int | None = None) -> list[str]:
    """tiktoken's byte-pair merge of ``piece`` (byte-level characters): merge the adjacent pair whose join has the
    lowest rank, leftmost first, until no join of rank below ``max_rank`` (None: any) is left; the parts it stops at.
    A token of rank ``r`` whose parts at ``max_rank=r`` are two is built by the merge of those two."""
    parts = list(piece)
    limit = 1 << 62 if max_rank is None else max_rank
    while len(parts) > 1:
        best, at = limit, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best:
                best, at = r, i
        if at < 0:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts


def merges_from_ranks(ranks: dict[str, int]) -> list[str]:
    """The merge list of a ranked vocabulary (tiktoken's), as llama.cpp's converter derives it for Kimi K2: in rank
    order, each multi-byte token's two parts, where ``rank_split`` leaves two."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1 and len(parts := rank_split(token, ranks, rank)) == 2:
            merges.append(" ".join(parts))
    return merges


class Tokenizer:
    """Text to token ids and back, as llama.cpp tokenizes a prompt with special tokens parsed: control and
    user-defined tokens (``tokenizer.ggml.token_type`` 3 and 4) written in the text are those tokens, the text
    between them is pre-tokenized and byte-pair merged. ``decode`` joins the tokens' bytes and reads them as UTF-8,
    an invalid sequence as U+FFFD."""

    def __init__(self, tokens: list[str], token_types: list[int], merges: list[str] | None, pre: str) -> None:
        from tokenizers import AddedToken, decoders, models
        from tokenizers import Tokenizer as HFTokenizer

        self.pre = pre
        how = pre_tokenizer(pre)
        if merges is None:  # llama.cpp reads a kimi-k2 file without merges (its vocabulary is ranked by id), no other
            if pre != "kimi-k2":
                raise ModelError("tokenizer: the file has no merge list (tokenizer.ggml.merges)")
            normal = (k not in (CONTROL, USER_DEFINED) for k in token_types)
            merges = merges_from_ranks({t: i for i, (t, n) in enumerate(zip(tokens, normal)) if n})
        pairs = []
        for m in merges:
            cut = m.find(" ", 1)  # as llama.cpp reads a merge: the first space after the first character
            if cut > 0:  # llama.cpp ranks a merge without one as two empty parts, which never meet
                pairs.append((m[:cut], m[cut + 1 :]))
        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)
        try:
            model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=how.ignore_merges)
        except Exception as exc:  # tokenizers raises its own Exception for a merge of tokens not in the vocabulary
            raise ModelError(f"tokenizer: the merge list does not fit the vocabulary ({exc})") from exc
        self._hf: tokenizers.Tokenizer = HFTokenizer(model)
        self._hf.pre_tokenizer = _hf_pre_tokenizer(pre)
        self._hf.decoder = decoders.ByteLevel()
        special = [t for t, k in zip(tokens, token_types) if k in (CONTROL, USER_DEFINED)]
        self._hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])

    @classmethod
    def from_kv(cls, kv: dict[str, Any]) -> Tokenizer:
        """The tokenizer a GGUF file's metadata describes; ``ModelError`` for one this module does not implement."""
        model = kv.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ModelError(
                f"tokenizer.ggml.model {model!r} is not supported: only byte-level BPE ('gpt2') tokenizes here"
            )
        tokens = list(kv["tokenizer.ggml.tokens"])
        types = [int(k) for k in kv.get("tokenizer.ggml.token_type", [1] * len(tokens))]
        merges = kv.get("tokenizer.ggml.merges")
        return cls(tokens, types, None if merges is None else list(merges), str(kv.get("tokenizer.ggml.pre", "")))

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._hf.encode(text, add_special_tokens=False).ids
        return ids

    def decode(self, ids: list[int]) -> str:
        text: str = self._hf.decode(ids, skip_special_tokens=False)
        return text
