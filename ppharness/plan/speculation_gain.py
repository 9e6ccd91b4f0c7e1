"""What speculation buys, predicted (``ppharness.run.stage.speculation`` is the protocol): how many tokens a trip
commits and what a trip costs, from the draft's acceptance, K and the chain's own costs.

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
from typing import TYPE_CHECKING

import msgspec

from ppharness.plan.consumer import consumer_cluster, kimi_graph
from ppharness.plan.lang.document import Objective
from ppharness.plan.predict.simulate import simulate
from ppharness.plan.search.planner import policy_plan

if TYPE_CHECKING:
    from ppharness.plan.lang.document import ModelGraph, PlanDoc


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


def predict(
    alpha: float, k: float | list[int], delay_ms: float, window_ms: float, draft_ms: float = 0.0
) -> SpecPrediction:
    """A chain whose trip costs ``delay_ms`` (the token loop's link delays) + ``window_ms`` (every stage's compute of
    a window) + ``draft_ms`` (the draft on stage 0), its windows drafting ``k`` tokens accepted at ``alpha``; ``k``
    may be each window's drafts (a draft that proposes fewer than K, or none, commits accordingly)."""
    if isinstance(k, list):
        per_trip = sum(tokens_per_trip(alpha, n) for n in k) / len(k) if k else 1.0
        k = sum(k) / len(k) if k else 0.0
    else:
        per_trip = tokens_per_trip(alpha, k)
    trip = delay_ms + window_ms + draft_ms
    return SpecPrediction(alpha, k, per_trip, trip, per_trip * 1000.0 / trip if trip > 0 else 0.0)


def distinct_experts(count: int, active: int, rows: int) -> float:
    """Experts a window of ``rows`` rows reads in one MoE block, each row routed to ``active`` of ``count``
    independently and uniformly (an assumption: real routing is correlated between neighbouring tokens, so fewer)."""
    return count * (1.0 - (1.0 - active / count) ** rows)


def window_graph(graph: ModelGraph, rows: int) -> ModelGraph:
    """``graph`` with one decode step standing for a window of ``rows`` rows: each MoE block reads the experts the
    window's rows are routed to between them (``distinct_experts``), and a hop carries every row's hidden state.
    The dense weights are read once for all rows; their compute is taken as free beside the bytes (decode is
    bandwidth-bound at a handful of rows)."""
    blocks = tuple(
        msgspec.structs.replace(
            b,
            experts=msgspec.structs.replace(
                b.experts,
                active=min(b.experts.count, max(1, round(distinct_experts(b.experts.count, b.experts.active, rows)))),
            ),
        )
        if b.experts.count
        else b
        for b in graph.blocks
    )
    return msgspec.structs.replace(graph, blocks=blocks, activation_bytes=graph.activation_bytes * rows)


@dataclass(frozen=True)
class PlanSpeculation:
    """A plan's prediction with speculation: a window of ``k + 1`` rows per trip (``window_graph``), beside greedy
    decoding's one token per trip."""

    alpha: float
    k: int
    draft_ms: float
    greedy_ms: float  # the plan's time per token, greedy
    trip_ms: float  # one window's trip: the window graph's time per step, plus the draft
    tokens_per_trip: float
    tok_s: float

    def summary(self) -> str:
        return (
            f"with speculation (alpha {self.alpha:g}, K = {self.k}, a draft of {self.draft_ms:g} ms on stage 0): a "
            f"window of {self.k + 1} rows costs {self.trip_ms:.1f} ms per trip (greedy: {self.greedy_ms:.1f} ms per "
            f"token) and commits {self.tokens_per_trip:.2f} tokens on average: {self.tok_s:.1f} tok/s for one request "
            f"(greedy {1000 / self.greedy_ms:.1f}); ppharness.plan.speculation_gain says what is assumed"
        )


def parse_alpha_k(text: str) -> tuple[float, int]:
    """``ALPHA:K`` (acceptance in (0, 1], drafted tokens 1..31) as a pair; ValueError saying what is expected."""
    alpha_text, _, k_text = text.partition(":")
    try:
        alpha, k = float(alpha_text), int(k_text)
    except ValueError:
        raise ValueError(f"{text!r}: expected ALPHA:K, e.g. 0.8:6 (acceptance, drafted tokens)") from None
    if not 0.0 < alpha <= 1.0 or not 1 <= k <= 31:
        raise ValueError(f"{text!r}: the acceptance must be in (0, 1] and K in 1..31")
    return alpha, k


def plan_with_speculation(doc: PlanDoc, alpha: float, k: int, draft_ms: float = 0.0) -> PlanSpeculation:
    """``doc``'s one-request prediction with speculation (``PlanSpeculation``), from the simulator's time for one
    step of the plan with its model as a window of ``k + 1`` rows."""
    greedy = simulate(doc).per_token_ms
    window = simulate(msgspec.structs.replace(doc, model=window_graph(doc.model, k + 1))).per_token_ms
    per_trip = tokens_per_trip(alpha, k)
    trip = window + draft_ms
    return PlanSpeculation(alpha, k, draft_ms, greedy, trip, per_trip, per_trip * 1000 / trip)


@dataclass(frozen=True)
class WindowRow:
    """A speculating Kimi-class chain at one acceptance and K: the planner's best plan for a window of K+1 rows."""

    alpha: float
    k: int
    tokens_per_trip: float
    trip_ms: float
    tok_s: float
    greedy_tok_s: float


def kimi_table(alphas: tuple[float, ...] = (0.6, 0.7, 0.8, 0.9), ks: tuple[int, ...] = (1, 2, 3, 4, 6, 8),
               card: str = "4090", count: int = 32) -> list[WindowRow]:  # fmt: skip
    """Kimi K2 (Q4_K) on ``count`` consumer cards in 8-GPU hosts (``ppharness.plan.consumer``'s measured-basis
    cluster): per acceptance, the best K, its trip (the simulator's time for one step of the window graph) and the
    decode rate; beside it, greedy decoding's."""
    graph = kimi_graph()
    cluster = consumer_cluster(card, count, "hosts8")
    trips = {}
    for k in (0, *ks):
        doc = policy_plan("optimal", window_graph(graph, k + 1), cluster, Objective())
        trips[k] = simulate(doc).per_token_ms
    out = []
    for alpha in alphas:
        best = max(ks, key=lambda k: tokens_per_trip(alpha, k) / trips[k])
        per_trip = tokens_per_trip(alpha, best)
        out.append(WindowRow(alpha, best, per_trip, trips[best], per_trip * 1000 / trips[best], 1000 / trips[0]))
    return out


if __name__ == "__main__":
    for row in kimi_table():
        print(
            f"alpha {row.alpha:.1f}: K = {row.k}, {row.tokens_per_trip:.2f} tokens per trip of {row.trip_ms:.1f} ms: "
            f"{row.tok_s:.1f} tok/s (greedy {row.greedy_tok_s:.1f})"
        )
