"""Is a chain's answer the unsplit model's, bit for bit? Tokens, and the hidden state at every stage boundary.

Each stage but the last keeps an 8-byte digest of every hidden state it sends (fp16 bytes, step order: step 0 is the
prefill, step k the k-th decode step); the oracle, run with boundary taps, digests the output of every block the same
way. A stage that ends at block ``hi`` sends what the unsplit model has after block ``hi - 1``, so the two lists can be
compared boundary by boundary and step by step. A mismatch names the first token that differs and the first
(step, boundary) whose hidden state differs, which is where a split started to change the numbers, and the kernel
table this process compiled with, if any (``ppharness.model.layers.kernels``): a process that read another table, or
none, computes other bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ppharness.model.layers.kernels import ENV, active


@dataclass(frozen=True)
class BoundaryDiff:
    """The first hidden state that differs: after stage ``stage`` (block ``block``) at decode ``step``."""

    stage: int
    block: int
    step: int
    position: int

    def __str__(self) -> str:
        what = "the prefill" if self.step == 0 else f"decode step {self.step} (position {self.position})"
        return (
            f"the hidden state stage {self.stage} sent to stage {self.stage + 1} (after block {self.block}) "
            f"differs from the unsplit model's at {what}"
        )


@dataclass(frozen=True)
class SplitVerdict:
    """What comparing a chain with the oracle found."""

    tokens_equal: bool
    first_token_diff: int | None  # index into the generated tokens; None when they are equal
    boundaries_compared: int  # hidden states compared byte for byte (stage boundaries x steps)
    boundary_diff: BoundaryDiff | None = None
    missing: list[int] = field(default_factory=list)  # stages that reported no digests for this request
    # stages that reported fewer steps than the oracle computed: the steps they left out were not checked
    truncated: list[int] = field(default_factory=list)
    # stages whose node was replaced by a spare that never computed for this request (the request finished on the
    # nodes it started on): their boundaries could not be collected, and are not counted as missing
    unverified: list[int] = field(default_factory=list)
    # the end-of-generation tokens that ended the chain's answer and the unsplit model's (None: max_tokens), when
    # they differ
    stop_diff: tuple[int | None, int | None] | None = None

    @property
    def exact(self) -> bool:
        return (
            self.tokens_equal
            and self.stop_diff is None
            and self.boundary_diff is None
            and not self.missing
            and not self.truncated
        )

    def describe(self, chain: list[int], oracle: list[int]) -> str:
        """One line for a mismatch: the first differing token and the first differing boundary."""
        parts = []
        if not self.tokens_equal:
            k = self.first_token_diff
            assert k is not None
            got = chain[k] if k < len(chain) else "nothing (the chain stopped)"
            want = oracle[k] if k < len(oracle) else "nothing (the oracle stopped)"
            parts.append(f"token {k} differs: the chain gave {got}, the unsplit model {want}")
        elif self.stop_diff is not None:
            chain_stop, oracle_stop = (
                "max_tokens" if s is None else f"end-of-generation token {s}" for s in self.stop_diff
            )
            parts.append(f"the chain's answer ended at {chain_stop}, the unsplit model's at {oracle_stop}")
        if self.boundary_diff is not None:
            parts.append(str(self.boundary_diff))
        elif self.missing:
            parts.append(f"stage(s) {self.missing} sent no hidden-state digests, so no boundary could be checked")
        elif self.truncated:
            parts.append(
                f"stage(s) {self.truncated} reported fewer hidden-state digests than the unsplit model computed "
                "steps, so the steps left out could not be checked"
            )
        elif self.unverified:
            parts.append(
                f"{self.boundaries_compared} stage-boundary hidden states are equal; stage(s) {self.unverified} were "
                "replaced after computing theirs, which went with them"
            )
        else:
            parts.append(f"all {self.boundaries_compared} stage-boundary hidden states are equal")
        pinning = active()
        if pinning is not None and not (self.tokens_equal and self.stop_diff is None and self.boundary_diff is None):
            parts.append(
                f"the unsplit model compiled with the kernel table {pinning.path}, as every stage must: run again "
                f"without it (unset {ENV}) to see whether the table is the cause, and make it again with "
                "`ppharness tune`"
            )
        return "; ".join(parts)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (a shorter list differs where it ends); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(
    chain_tokens: list[int],
    oracle_tokens: list[int],
    ranges: Sequence[tuple[int, int]],
    stage_digests: dict[int, list[bytes]],
    oracle_digests: dict[int, list[bytes]],
    prompt_tokens: int,
    replaced: Sequence[int] = (),
    chain_stop: int | None = None,
    oracle_stop: int | None = None,
    speculative: bool = False,
) -> SplitVerdict:
    """Compare a chain (its tokens, the end-of-generation token that ended them, ``chain_stop``, and
    ``stage_digests[stage]``) with the oracle (the same: tokens, ``oracle_stop`` and ``oracle_digests[block]``, from
    ``oracle_decode(..., boundaries=True)``). ``ranges`` are the stages' block ranges; ``replaced``: stages a spare
    took over during the request (one with no digests is unverified, not missing); ``speculative``: the chain decoded
    by windows (``ppharness.run.stage.speculation``), whose last one's rejected rows are past the answer."""
    k = first_difference(chain_tokens, oracle_tokens)
    absent = [i for i in range(len(ranges) - 1) if not stage_digests.get(i)]
    missing = [i for i in absent if i not in replaced]
    unverified = [i for i in absent if i in replaced]
    truncated = [
        i
        for i, (_, hi) in enumerate(ranges[:-1])
        if i not in absent and i not in replaced and len(stage_digests[i]) < len(oracle_digests.get(hi - 1, []))
    ]
    compared = 0
    first: BoundaryDiff | None = None
    steps = max((len(d) for d in stage_digests.values()), default=0)
    if speculative:
        steps = min(steps, max((len(d) for d in oracle_digests.values()), default=0))
    for step in range(steps):
        for i, (_, hi) in enumerate(ranges[:-1]):
            ours, theirs = stage_digests.get(i, []), oracle_digests.get(hi - 1, [])
            if speculative:  # a last window's rejected rows lie past the answer: no step of it
                ours = ours[: len(theirs)]
            if step >= len(ours):
                continue
            if step >= len(theirs) or ours[step] != theirs[step]:
                first = first or BoundaryDiff(i, hi - 1, step, prompt_tokens + step - 1 if step else 0)
            else:
                compared += 1
        if first is not None:
            break
    return SplitVerdict(
        tokens_equal=k is None,
        first_token_diff=k,
        boundaries_compared=compared,
        boundary_diff=first,
        missing=missing,
        truncated=truncated,
        unverified=unverified,
        stop_diff=None if chain_stop == oracle_stop else (chain_stop, oracle_stop),
    )
