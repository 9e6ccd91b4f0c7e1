"""What speculation buys, predicted (``ppharness.run.speculation`` is the protocol): how many tokens a trip commits
and what a trip costs, from the draft's acceptance, K and the chain's own costs.

- **Acceptance.** Each drafted token is taken to be accepted with probability ``alpha``, given the ones before it
  were (a geometric run). A window of ``k`` drafts then commits ``(1 - alpha^(k+1)) / (1 - alpha)`` tokens on
  average: the accepted drafts and the model's own token after them. ``alpha`` is read from measured windows as the
  geometric estimate: drafts accepted over drafts accepted plus windows that rejected one.
- **A trip** costs what a greedy step costs, with each stage's compute of a window in place of one row's, plus the
  draft's time on stage 0: ``sum of link delays + sum of window compute + draft``.
- **Windows in flight** (W > 1) are not modelled: a window sent behind another pays only when that one is accepted
  whole (``alpha^k``), which the geometric model gives, but the overlap of windows in the chain's stages is the
  simulator's to work out; the bench measures it.
"""

from __future__ import annotations

from dataclasses import dataclass


def tokens_per_trip(alpha: float, k: float) -> float:
    """Tokens a window of ``k`` drafts commits on average, each accepted with probability ``alpha`` given the ones
    before it were (``k`` may be a mean: a draft that proposes fewer than K)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance {alpha} is not a probability")
    if alpha >= 1.0:
        return k + 1.0
    return float((1.0 - alpha ** (k + 1.0)) / (1.0 - alpha))


def acceptance(accepted: int, rejected: int) -> float:
    """The geometric estimate of ``alpha`` from windows: drafts accepted, and windows that rejected a draft."""
    return accepted / (accepted + rejected) if accepted + rejected else 0.0


@dataclass(frozen=True)
class SpecPrediction:
    """A speculating chain's predicted tokens per trip, trip time and decode rate."""

    alpha: float
    k: float
    tokens_per_trip: float
    trip_ms: float
    tok_s: float


def predict(alpha: float, k: float, delay_ms: float, window_ms: float, draft_ms: float = 0.0) -> SpecPrediction:
    """A chain whose trip costs ``delay_ms`` (the token loop's link delays) + ``window_ms`` (every stage's compute of
    a window) + ``draft_ms`` (the draft on stage 0), its windows drafting ``k`` tokens accepted at ``alpha``."""
    per_trip = tokens_per_trip(alpha, k)
    trip = delay_ms + window_ms + draft_ms
    return SpecPrediction(alpha, k, per_trip, trip, per_trip * 1000.0 / trip if trip > 0 else 0.0)
