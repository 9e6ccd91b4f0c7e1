"""A GGUF file's tokenizer, as llama.cpp tokenizes a prompt with special tokens parsed (src/llama-vocab.cpp):

- ``tokenizer.ggml.model = "gpt2"``: BPE that merges by the rank of the file's merge list (``tokenizer.ggml.merges``)
  within the pieces the pre-tokenizer ``tokenizer.ggml.pre`` names cuts the text into; byte-level (GPT-2's byte
  alphabet), or for the SentencePiece-style types (gemma4, sarvam-moe) over the text's own characters with spaces as
  U+2581 and ``<0xXX>`` byte tokens. ``"gemma4"`` is the same with gemma4's pre-tokenizer.
- ``tokenizer.ggml.model = "llama"``: SentencePiece (``ppharness.model.text.spm``).

Control, user-defined and unknown tokens written in the text are those tokens, matched longest first as llama.cpp
does, and text between them is tokenized apart. ``decode`` is llama.cpp's ``llama_detokenize`` with special tokens
rendered: bytes of the tokens, the first token's leading space dropped where the file adds a space prefix, and the
clean-up of spaces before punctuation for the types that ask for it.

The pre-tokenizers (``ppharness.model.text.pretokenizers``) run on Hugging Face ``tokenizers``' Oniguruma regexes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ppharness.errors import ModelError
from ppharness.model.text.pretokenizers import (
    PRE_TOKENIZERS,
    TOKENIZER_FAMILIES,
    PreTokenizer,
    oniguruma,
    pre_tokenizer,
    unknown_pre,
)
from ppharness.model.text.spm import SPACE, spm_encode

if TYPE_CHECKING:  # tokenizers is imported when a tokenizer is built, not with this module
    import tokenizers

__all__ = ["PRE_TOKENIZERS", "TOKENIZER_FAMILIES", "Tokenizer", "pre_tokenize", "pre_tokenizer", "tokenizer_problem"]

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPECIAL = (UNKNOWN, CONTROL, USER_DEFINED)  # the kinds matched in the text as themselves and decoded as their text

# GPT-2's byte <-> character table, the byte-level vocabulary's alphabet
_BS = [*range(33, 127), *range(161, 173), *range(174, 256)]
BYTE_TO_CHAR = {b: chr(b) for b in _BS} | {b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in _BS)}
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}

# the tokenizer models llama.cpp reads and this module does not
_NOT_HERE = {
    "bert": "WordPiece",
    "t5": "Unigram",
    "rwkv": "RWKV's trie",
    "plamo2": "PLaMo-2's",
    "whitespace": "the whitespace-split BPE of embedding models",
    "hybriddna": "DNA k-mers",
    "no_vocab": "no vocabulary",
    "none": "no vocabulary",
}
SUPPORTED_MODELS = ("gpt2", "gemma4", "llama")

# token texts llama.cpp makes control tokens whatever the file says (end of generation, end of turn)
_CONTROL_TEXTS = frozenset(
    (
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
        "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
        "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
    )
)  # fmt: skip
# fill-in-the-middle texts llama.cpp makes control tokens where the file names no token of their kind (llama.cpp
# takes one text of a kind, the first its hash map yields; a vocabulary has at most one of each kind in practice)
_FIM_TEXTS = {
    ("fim_pre", "prefix"): ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                            "<|code_prefix|>", "<|prefix|>"),
    ("fim_suf", "suffix"): ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                            "<|code_suffix|>", "<|suffix|>"),
    ("fim_mid", "middle"): ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                            "<|code_middle|>", "<|middle|>"),
    ("fim_pad",): ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    ("fim_rep",): ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    ("fim_sep",): ("<|file_sep|>",),
}  # fmt: skip
_USER_DEFINED_TEXTS = frozenset(("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"))  # gpt-oss's
_ISSPACE = " \t\n\v\f\r"  # C's isspace, what llama.cpp strips beside a token that strips


def tokenizer_problem(kv: dict[str, Any]) -> str | None:
    """Why ``Tokenizer.from_kv(kv)`` would refuse the file's tokenizer, in one line; None when it builds. Reads only
    the header's scalars and which arrays are there (a header read past its arrays will do)."""
    model = kv.get("tokenizer.ggml.model")
    if model is None:
        return "the file has no tokenizer (tokenizer.ggml.model)"
    if model not in SUPPORTED_MODELS:
        what = f" ({_NOT_HERE[model]})" if model in _NOT_HERE else ""
        return (
            f"tokenizer.ggml.model {model!r}{what} is not supported: the tokenizers here are 'gpt2' (BPE over a "
            "pre-tokenizer), 'gemma4' and 'llama' (SentencePiece)"
        )
    if "tokenizer.ggml.tokens" not in kv:
        return "the file has no vocabulary (tokenizer.ggml.tokens)"
    if model == "llama":
        return None
    pre = _pre_name(kv)
    if pre not in PRE_TOKENIZERS:
        return unknown_pre(pre)
    if "tokenizer.ggml.merges" not in kv and pre != "kimi-k2":  # llama.cpp reads kimi-k2 without merges, no other
        return "the file has no merge list (tokenizer.ggml.merges)"
    return None


def _pre_name(kv: dict[str, Any]) -> str:
    """The pre-tokenizer llama.cpp takes for a BPE file: gemma4's for the gemma4 model, "default" where none is
    named."""
    if kv.get("tokenizer.ggml.model") == "gemma4":
        return "gemma4"
    return str(kv.get("tokenizer.ggml.pre") or "default")


def _hf_pre_tokenizer(how: PreTokenizer) -> Any:
    """The pre-tokenizer's splits, then for a byte-level type the byte -> character mapping, as a ``tokenizers``
    pre-tokenizer."""
    from tokenizers import Regex, pre_tokenizers

    steps: list[Any] = [pre_tokenizers.Split(Regex(oniguruma(r)), "isolated") for r in how.splits]
    if how.byte_level:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def pre_tokenize(pre: str, text: str) -> list[str]:
    """``text`` cut into the pieces ``pre`` gives BPE, each in the vocabulary's alphabet (byte-level characters, or
    the text's own with spaces as U+2581 for the SentencePiece-style types)."""
    how = pre_tokenizer(pre)
    if how.escape_spaces:
        text = text.replace(" ", SPACE)
    return [piece for piece, _ in _hf_pre_tokenizer(how).pre_tokenize_str(text)]


@dataclass(frozen=True)
class _Specials:
    """The tokens matched in the text as themselves, longest first (llama.cpp's ``cache_special_tokens``), and
    those that swallow the whitespace on their left (``lstrip``) or right (``rstrip``)."""

    tokens: tuple[tuple[str, int], ...]
    lstrip: frozenset[int] = frozenset()
    rstrip: frozenset[int] = frozenset()

    def split(self, text: str) -> list[str | int]:
        """``text`` as its special tokens' ids and the stretches of text between them, in order."""
        parts: list[str | int] = [text] if text else []
        for s, tid in self.tokens:
            if s not in text:
                continue
            out: list[str | int] = []
            for part in parts:
                if isinstance(part, int) or s not in part:
                    out.append(part)
                    continue
                pieces = part.split(s)
                for i, piece in enumerate(pieces):
                    if i:
                        out.append(tid)
                    if i and tid in self.rstrip:
                        piece = piece.lstrip(_ISSPACE)
                    if i < len(pieces) - 1 and tid in self.lstrip:
                        piece = piece.rstrip(_ISSPACE)
                    if piece:
                        out.append(piece)
            parts = out
        return parts


def _attributes(tokens: list[str], types: list[int], kv: dict[str, Any]) -> list[int]:
    """Each token's kind as llama.cpp holds it after loading: the file's type, with the end-of-generation and
    fill-in-the-middle texts made control tokens and gpt-oss's markers user-defined (``llama_vocab::impl::load``)."""
    kinds = [t if t in (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE) else 0 for t in types]
    named = {t: i for i, t in enumerate(tokens)}
    promote = set(_CONTROL_TEXTS)
    for keys, texts in _FIM_TEXTS.items():
        if not any(f"tokenizer.ggml.{k}_token_id" in kv for k in keys):
            promote.update(texts)
    for text in promote & named.keys():
        if kinds[named[text]] not in SPECIAL:
            kinds[named[text]] = CONTROL
    for text in _USER_DEFINED_TEXTS & named.keys():
        kinds[named[text]] = USER_DEFINED
    if "</s>" in named and named.keys() & {"<|tool_response>", "<|plamo:eos|>"}:  # gemma4's and plamo's "</s>"
        kinds[named["</s>"]] = NORMAL
    return kinds


def _specials(tokens: list[str], kinds: list[int], kv: dict[str, Any]) -> _Specials:
    order = sorted((i for i, k in enumerate(kinds) if k in SPECIAL), key=lambda i: -len(tokens[i].encode()))
    ids = {tokens[i]: i for i in order}
    lstrip: set[int] = set()
    rstrip: set[int] = set()
    name = str(kv.get("general.name", "")).lower()
    pre, arch = str(kv.get("tokenizer.ggml.pre", "")), str(kv.get("general.architecture", ""))
    jina = any(p in pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code"))
    if jina or arch in ("nomic-bert-moe", "jina-bert-v3"):
        lstrip.update(ids[t] for t in ("<mask>",) if t in ids)
    elif "phi-3" in name or "phi3" in name:  # every special token but these swallows the whitespace after it
        rstrip.update(i for t, i in ids.items() if t not in ("<unk>", "<s>", "<|endoftext|>"))
    elif "modern-bert" in name:
        lstrip.update(ids[t] for t in ("[MASK]",) if t in ids)
    return _Specials(tuple((tokens[i], i) for i in order), frozenset(lstrip), frozenset(rstrip))


class Tokenizer:
    """Text to token ids and back, as llama.cpp tokenizes a prompt with special tokens parsed and detokenizes with
    them rendered (the module's docstring).

    ``Tokenizer(tokens, token_types, merges, pre)`` builds a BPE tokenizer; ``from_kv`` builds any the file
    describes."""

    def __init__(
        self,
        tokens: list[str],
        token_types: list[int],
        merges: list[str] | None,
        pre: str,
        *,
        model: str = "gpt2",
        scores: list[float] | None = None,
        add_space_prefix: bool | None = None,
        kv: dict[str, Any] | None = None,
    ) -> None:
        kv = kv or {}
        # llama.cpp names an empty token "[EMPTY_<id>]"; of equal texts the last holds the id
        tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        types = list(token_types) + [NORMAL] * (len(tokens) - len(token_types))
        self.tokens = tokens
        self.model = model
        self._ids = {t: i for i, t in enumerate(tokens)}
        self._kinds = _attributes(tokens, types, kv)
        self._specials = _specials(tokens, self._kinds, kv)
        self.spm = model == "llama"
        self.how: PreTokenizer | None = None
        if self.spm:
            self.pre = ""
            self._scores = [float(s) for s in scores] if scores is not None else [0.0] * len(tokens)
            self.add_space_prefix = True if add_space_prefix is None else add_space_prefix
            self.clean_spaces = False
        else:
            self.pre = pre
            self.how = pre_tokenizer(pre)
            self.add_space_prefix = bool(add_space_prefix)
            self.clean_spaces = self.how.clean_spaces
            self._hf = self._build_bpe(self.how, merges)
        self._pieces: list[bytes | None] = [None] * len(tokens)

    def _build_bpe(self, how: PreTokenizer, merges: list[str] | None) -> tokenizers.Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models

        if merges is None:  # llama.cpp reads a kimi-k2 file without merges, and merges nothing then; no other
            if self.pre != "kimi-k2":
                raise ModelError("tokenizer: the file has no merge list (tokenizer.ggml.merges)")
            merges = []
        pairs: dict[tuple[str, str], None] = {}  # of a merge listed twice, the first rank holds (as in llama.cpp)
        for m in merges:
            cut = m.find(" ", 1)  # as llama.cpp reads a merge: the first space after the first character
            if cut > 0:  # llama.cpp ranks a merge without one as two empty parts, which never meet
                pairs.setdefault((m[:cut], m[cut + 1 :]))
        try:
            model = models.BPE(
                vocab=self._ids, merges=list(pairs), ignore_merges=how.ignore_merges, byte_fallback=not how.byte_level
            )
        except Exception as exc:  # tokenizers raises its own Exception for a merge of tokens not in the vocabulary
            raise ModelError(f"tokenizer: the merge list does not fit the vocabulary ({exc})") from exc
        hf = HFTokenizer(model)
        hf.pre_tokenizer = _hf_pre_tokenizer(how)
        return hf

    @classmethod
    def from_kv(cls, kv: dict[str, Any]) -> Tokenizer:
        """The tokenizer a GGUF file's metadata describes; ``ModelError`` with ``tokenizer_problem``'s reason for one
        this module does not build."""
        problem = tokenizer_problem(kv)
        if problem is not None:
            raise ModelError(problem)
        model = str(kv["tokenizer.ggml.model"])
        tokens = list(kv["tokenizer.ggml.tokens"])
        types = [int(k) for k in kv.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))]
        merges = kv.get("tokenizer.ggml.merges")
        scores = kv.get("tokenizer.ggml.scores")
        prefix = kv.get("tokenizer.ggml.add_space_prefix")
        return cls(
            tokens,
            types,
            None if merges is None else list(merges),
            "" if model == "llama" else _pre_name(kv),
            model=model,
            scores=None if scores is None else [float(s) for s in scores],
            add_space_prefix=None if prefix is None else bool(prefix),
            kv=kv,
        )

    def encode(self, text: str) -> list[int]:
        """``text``'s token ids, with no BOS or EOS added."""
        out: list[int] = []
        after_special = True  # SentencePiece adds its space prefix at the start and after each special token
        for part in self._specials.split(text):
            if isinstance(part, int):
                out.append(part)
                after_special = True
            elif self.spm:
                prefix = " " if self.add_space_prefix and after_special else ""
                out += spm_encode((prefix + part).replace(" ", SPACE), self._ids, self._scores)
                after_special = False
            else:
                out += self._encode_bpe(part)
                after_special = False
        return out

    def _encode_bpe(self, text: str) -> list[int]:
        assert self.how is not None
        if self.how.escape_spaces:
            text = text.replace(" ", SPACE)
        if self.how.family != "gemma4":
            ids: list[int] = self._hf.encode(text, add_special_tokens=False).ids
            return ids
        # gemma4: a run of newlines that is itself a token is that token, whatever the merges would make of it
        out: list[int] = []
        for piece, _ in self._hf.pre_tokenizer.pre_tokenize_str(text):
            whole = self._ids.get(piece) if not piece.strip("\n") else None
            out += [whole] if whole is not None else [t.id for t in self._hf.model.tokenize(piece)]
        return out

    def piece(self, token: int) -> bytes:
        """The bytes llama.cpp renders one token as (``token_to_piece`` with special tokens rendered)."""
        cached = self._pieces[token]
        if cached is None:
            cached = self._pieces[token] = self._render(token)
        return cached

    def _render(self, token: int) -> bytes:
        text, kind = self.tokens[token], self._kinds[token]
        if kind in SPECIAL:
            return text.encode()
        if kind == BYTE:
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError:
                return b"\x00"
        if kind != NORMAL:
            return b""
        if self.spm or (self.how is not None and self.how.escape_spaces):
            return text.replace(SPACE, " ").encode()
        out = bytearray()
        for c in text:
            if c in CHAR_TO_BYTE:
                out.append(CHAR_TO_BYTE[c])
            else:  # what llama.cpp writes for a character outside the byte-level alphabet
                out += b"[UNK_BYTE_0x" + c.encode().hex().encode() + text.encode() + b"]"
        return bytes(out)

    def decode(self, ids: list[int], cleanup: bool = True) -> str:
        """The text of ``ids`` (an invalid UTF-8 sequence as U+FFFD). ``cleanup``: as llama.cpp's ``llama_detokenize``
        writes it (the leading space of a space prefix dropped, spaces before punctuation cleaned where the type
        asks); without, the tokens' bytes as they are, as llama.cpp prints tokens while it generates."""
        pieces = [self.piece(t) for t in ids]
        if cleanup and pieces and self.add_space_prefix and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]  # of the first token only, as llama.cpp strips it
        data = b"".join(pieces)
        if cleanup and self.clean_spaces:
            data = clean_spaces(data)
        return data.decode("utf-8", errors="replace")


def clean_spaces(data: bytes) -> bytes:
    """llama.cpp's clean-up of detokenized text (``clean_spaces``), pass for pass: the space before ``? ! . ,``
    dropped, `` ' `` between spaces joined to both sides, and the space before the contractions ``'s 'm 're 've``
    dropped."""
    text = bytearray(data)
    n = len(text)
    total = 1 if n else 0
    for i in range(1, n):
        x = text[i]
        if text[i - 1] == 0x20 and x in b"?!.,":
            total -= 1
        text[total] = x
        total += 1
    n, total, i = total, 1 if total else 0, 1
    while i < n:
        x = text[i]
        if x == 0x27 and i + 1 < n and text[i - 1] == 0x20 and text[i + 1] == 0x20:
            total -= 1
            i += 1
            text[i] = 0
        text[total] = x
        total += 1
        i += 1
    n, total = total, 1 if total else 0
    for i in range(1, n):
        x = text[i]
        if text[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = text[i + 1]
            if x1 in b"sm" or (i + 2 < n and (x1, text[i + 2]) in ((0x72, 0x65), (0x76, 0x65))):  # 's 'm 're 've
                total -= 1
        text[total] = x
        total += 1
    return bytes(text[:total])
