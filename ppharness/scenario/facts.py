"""What is known of a scenario's model before anything runs, and the checks of a scenario against it.

When the model is known without running anything (a synthetic preset, or a local GGUF file's header) the split,
``max_context`` and the prompt's length are checked against it: ``known_model`` finds the facts,
``check_against_model`` raises ``ScenarioError`` naming the file, the ``$.field.path`` and the fix.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ppharness.errors import ModelError, ScenarioError
from ppharness.model.gguf.header import header_facts
from ppharness.model.sources.files import cache_dir
from ppharness.model.synthetic.vocab import build_vocab, special_tokens
from ppharness.model.verdict import judge_file, read_header_contents
from ppharness.scenario.sections import ModelSection, RequestSection, Stages, SyntheticModel


class ScenarioParts(Protocol):
    """What these checks read of a scenario (``ppharness.scenario.schema.Scenario`` has it): its model, stages and
    request sections."""

    @property
    def model(self) -> ModelSection: ...

    @property
    def stages(self) -> Stages: ...

    @property
    def request(self) -> RequestSection: ...


@dataclass(frozen=True)
class ModelFacts:
    """What is known about a scenario's model before anything runs: its blocks and, when known, its own context
    length, whether a BOS token precedes the prompt and the byte length of its vocabulary's longest token."""

    blocks: int
    context: int | None = None
    bos: bool = True
    longest_token: int | None = None
    name: str = "the model"


def check_against_model(scenario: ScenarioParts, model: int | ModelFacts, source: str = "<file>") -> None:
    """Raise ``ScenarioError`` if the stage split, ``max_context`` or the prompt does not fit the model (a bare int is
    its block count)."""
    facts = model if isinstance(model, ModelFacts) else ModelFacts(blocks=model)
    num_blocks = facts.blocks
    stages = scenario.stages
    n = stages.num_stages
    if n > num_blocks:
        raise ScenarioError(
            f"{source}: $.stages.count: {n} stages but the model has {num_blocks} blocks — "
            f"use at most {num_blocks} stages or fewer split points"
        )
    for i, point in enumerate(stages.splits or ()):
        if point >= num_blocks:
            raise ScenarioError(
                f"{source}: $.stages.splits[{i}]: split point {point} is outside the model's {num_blocks} blocks — "
                f"split points must lie in 1..{num_blocks - 1}"
            )
    max_context = scenario.model.max_context
    if facts.context is not None and max_context > facts.context:
        raise ScenarioError(
            f"{source}: $.model.max_context: {max_context} is above the {facts.context}-token context of "
            f"{facts.name} — set max_context to at most {facts.context}"
        )
    if facts.longest_token is not None:
        _check_prompt_fits(scenario, facts, source)


def _check_prompt_fits(scenario: ScenarioParts, facts: ModelFacts, source: str) -> None:
    """Refuse a prompt that cannot leave room for ``max_tokens``, judged from its UTF-8 length alone.

    A stage needs ``BOS + prompt tokens + max_tokens <= max_context``. Encoding the prompt would give the exact count,
    but building the tokenizer costs a third of a second (and the vocabulary of a large synthetic preset far more), so
    only a lower bound on the token count is used: every token the byte-level BPE emits stands for at most
    ``longest_token`` bytes of the prompt (a special token, matched literally, for its UTF-8 length), so a prompt of
    ``b`` bytes is at least ``ceil(b / longest_token)`` tokens. The converse bound (``tokens <= b + 1``) is an upper
    bound and proves nothing here: a prompt is refused only when even its fewest possible tokens leave no room, so a
    prompt that passes can still be refused at run time by the stage's exact count.
    """
    assert facts.longest_token is not None
    request, max_context = scenario.request, scenario.model.max_context
    n_bytes = len(request.prompt.encode("utf-8", "surrogatepass"))
    fewest = -(-n_bytes // facts.longest_token) + int(facts.bos)
    if fewest + request.max_tokens > max_context:
        bos = ", counting the BOS token" if facts.bos else ""
        raise ScenarioError(
            f"{source}: $.request.prompt: the prompt is {n_bytes:,} bytes, so at least {fewest:,} tokens of "
            f"{facts.name}{bos} (its longest token is {facts.longest_token} bytes); with max_tokens "
            f"{request.max_tokens} that is more than max_context {max_context} — shorten the prompt, lower "
            "request.max_tokens or raise model.max_context"
        )


# a synthetic vocabulary this size or smaller is built at check time (well under 0.1 s; for a tokenizer type other
# than the default, learned from a larger corpus, about 0.3 s)
SMALL_VOCAB = 4096


def known_model(scenario: ScenarioParts, source: str = "<file>") -> ModelFacts | None:
    """The model's facts when they are known without running anything: a synthetic preset's (its vocabulary built
    when small, else read from the model cache when the file exists; a synthetic model always loads) or a local GGUF
    file's header (memory-mapped); ``None`` for a URL (judged once downloaded). ``ScenarioError`` for a local path
    with no file behind it, and for a file the engine cannot run (``ppharness.model.verdict``)."""
    model = scenario.model
    if model.synthetic is not None:
        return _synthetic_facts(model.synthetic)
    if model.gguf is None or "://" in model.gguf:
        return None
    path = Path(model.gguf).expanduser()
    if not path.is_file():
        raise ScenarioError(
            f"{source}: $.model.gguf: {model.gguf}: no such file ({path.resolve()}) — point gguf at a GGUF file (a "
            "relative path is taken from the directory the command runs in), an http(s) URL, or use synthetic"
        )
    if model.size is not None and path.stat().st_size != model.size:
        raise ScenarioError(
            f"{source}: $.model.size: {model.gguf} is {path.stat().st_size:,} bytes, not {model.size:,} — fix "
            "model.size, or point gguf at the right file"
        )
    try:
        verdict = judge_file(path)
        facts = _gguf_facts(path)
    except ModelError as exc:
        raise ScenarioError(f"{source}: $.model.gguf: {exc} — point gguf at a GGUF file this engine runs") from None
    if not verdict.loads:
        raise ScenarioError(f"{source}: $.model.gguf: {verdict.refusal()}")
    return facts


def _synthetic_facts(synthetic: SyntheticModel) -> ModelFacts:
    spec = synthetic.spec()
    name = f"synthetic preset {synthetic.preset!r}"
    longest: int | None = None
    if spec.vocab <= SMALL_VOCAB:
        longest = _synthetic_longest_token(spec.vocab, spec.seed, spec.tokenizer)
    else:
        cached = cache_dir() / "models" / f"{spec.slug()}.gguf"  # where synthetic_path builds it
        if cached.is_file():
            try:
                longest = _gguf_facts(cached).longest_token
            except ModelError:
                pass  # a broken cache file is rebuilt by the run
    return ModelFacts(blocks=spec.blocks, context=spec.context, bos=True, longest_token=longest, name=name)


@functools.lru_cache(maxsize=8)
def _synthetic_longest_token(vocab: int, seed: int, tokenizer: str) -> int:
    specials = special_tokens(tokenizer)
    tokens, _ = build_vocab(vocab - 256 - len(specials), seed, tokenizer)
    # measured as the GGUF stores them: a normal token's characters stand for one byte each, and their UTF-8 length is
    # never less than that; a special token is matched in the text as itself
    return max(len(t.encode("utf-8")) for t in (*tokens, *specials))


def _gguf_facts(path: Path) -> ModelFacts:
    """A GGUF file's facts from its header; ``ModelError`` if it is not a readable llama-family GGUF file."""
    stat = path.stat()
    return _gguf_header_facts(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _gguf_header_facts(path: str, size: int, mtime_ns: int) -> ModelFacts:
    h = header_facts(read_header_contents(path))  # the header the verdict read
    return ModelFacts(
        blocks=h.blocks,
        context=h.context,
        bos=h.bos,
        longest_token=h.longest_token,
        name=f"model file {Path(path).name}",
    )
