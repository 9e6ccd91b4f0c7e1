"""Speculative decoding inside the pipeline: several tokens per trip round the chain, every answer still the greedy
answer of the unsplit model token for token.

A trip, for one request:

1. **Stage 0 drafts.** Its draft (``ppharness.model.decode.drafts``) proposes up to K tokens after the prompt and the
answer
   so far. The window is the last committed token and the drafted ones, K+1 rows at consecutive positions
   ``p .. p+K`` of the request's slot, numbered (its trip); stage 0 computes them in one step
   (``ModelSlice.decode_window``) and sends them down the chain as rows of one ``ActivationRows`` with each row's token
   and the trip.
2. **Every stage computes the window** in one step and writes the window's keys and values at its positions; each row
   attends to the rows before it, so row ``i`` is exactly the one-at-a-time decode of position ``p+i``
   (``ppharness.model.layers.rows``: batch-invariant kernels, each row over its own length).
3. **The last stage verifies.** Row ``i``'s greedy token ``g_i`` is the model's token at ``p+i+1`` given the rows up
   to ``i``. The longest prefix of drafts with ``g_i == d_{i+1}`` is accepted; the accepted drafts and ``g_a`` (the
   model's own token after them) are committed, at most up to the end of the answer (a stop token or max_tokens), and
   go back to stage 0 (one ``TokenRows``) and to the client.
4. **What was rejected is forgotten by position.** A stage's cache beyond the committed position holds the rejected
   rows' keys and values; the next window starts at the committed position and writes every position before any of
   its rows reads it, and no row reads past its own, so nothing rejected is ever read. No stage needs to be told.

So the answer is the unsplit model's one-at-a-time greedy answer whatever the draft proposes: a draft sets only how
many tokens a trip commits (one at least, K+1 at most).

**Windows in flight** (``windows`` W > 1): stage 0 does not wait for a window's answer before sending the next. A
window sent after another assumes the one before is accepted whole: its first row is the draft's guess of the token
after the earlier window, at the position after it. When an answer comes back that does not bear the guess out (a
draft rejected, or ``g`` not the guess), every window in flight after it is void: the last stage, which sees the
windows in order, drops a window that does not start at the request's committed position with its committed token,
and stage 0, which applies the same rule, drafts again from what was committed. So W > 1 pays only when whole
windows are accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ppharness.errors import HarnessError
from ppharness.model.decode.drafts import Draft, DraftSpec, parse_draft

MAX_WINDOWS = 8


@dataclass(frozen=True)
class Speculation:
    """A run's speculation: its draft (``spec``; ``draft`` the built one, on stage 0 only) and how many windows a
    request keeps in flight."""

    spec: DraftSpec
    draft: Draft | None = None
    windows: int = 1

    @property
    def rows(self) -> int:
        """The most rows a window has: the last committed token and K drafted ones."""
        return self.spec.k + 1


def speculation_of(text: str, windows: int = 1) -> Speculation | None:
    """A plan's ``speculate`` text (a draft name, ``ppharness.model.decode.drafts``; empty: none) as a Speculation
    without its draft (stage 0 builds that)."""
    if not text:
        return None
    if not 1 <= windows <= MAX_WINDOWS:
        raise HarnessError(f"speculation: {windows} windows in flight is outside 1..{MAX_WINDOWS}")
    return Speculation(parse_draft(text), None, windows)


@dataclass
class Window:
    """A window stage 0 sent: its trip number, its first position and its rows' tokens."""

    trip: int
    start: int
    tokens: list[int]


def accepted(tokens: Sequence[int], greedy: Sequence[int]) -> list[int]:
    """What a window commits: its drafts (``tokens[1:]``) as long as each equals the model's greedy token before it
    (``greedy[i]`` follows row ``i``), then the model's own token after the last accepted one."""
    a = 0
    while a < len(tokens) - 1 and greedy[a] == tokens[a + 1]:
        a += 1
    return [*tokens[1 : a + 1], greedy[a]]


def current(start: int, first_token: int, committed: Sequence[int], prompt_tokens: int) -> bool:
    """Whether a window (its first position and token) continues what is committed (``committed``: the answer so
    far): it starts at the last committed token, that token. A window sent in flight behind one that was not accepted
    whole does not, and is void."""
    return bool(committed) and start == prompt_tokens + len(committed) - 1 and first_token == committed[-1]


def next_windows(
    spec: Speculation,
    context: Sequence[int],
    flight: Sequence[Window],
    prompt_tokens: int,
    max_tokens: int,
    max_context: int,
    slot: int,
) -> list[tuple[int, list[int]]]:
    """The windows stage 0 sends now for a request, as (first position, rows' tokens): enough to keep ``windows`` in
    flight behind the ones already there (``flight``). ``context``: the prompt and the committed answer. A window
    never reaches past max_tokens or the context; one behind others needs the draft's guess of its first token."""
    assert spec.draft is not None  # stage 0 builds it
    out: list[tuple[int, list[int]]] = []
    sent = list(flight)
    while len(sent) + len(out) < spec.windows:
        ahead = [*sent, *(Window(0, s, t) for s, t in out)]
        if ahead:  # behind a window in flight: assume it is accepted whole
            last = ahead[-1]
            start = last.start + len(last.tokens)
            ext = [*context, *ahead[0].tokens[1:], *(t for w in ahead[1:] for t in w.tokens)]
        else:
            start, ext = len(context) - 1, list(context)
        room = min(spec.rows, max_tokens - (start - prompt_tokens + 1), max_context - start)
        if room < 1:
            break
        if ahead:
            guess = spec.draft.propose(slot, ext, room)
            if not guess:
                break
            rows = guess[:room]
        else:
            rows = [ext[-1], *spec.draft.propose(slot, ext, room - 1)[: room - 1]] if room > 1 else [ext[-1]]
        out.append((start, rows))
    return out


def rows_ok(request_ids: Sequence[str], positions: Sequence[int], tokens: Sequence[int], trips: Sequence[int]) -> str:
    """Why an ActivationRows' windows do not hold together (empty: they do): each request's rows are one run of
    consecutive positions with one trip."""
    if len(tokens) != len(request_ids) or len(trips) != len(request_ids):
        return f"{len(tokens)} token(s) and {len(trips)} trip(s) for {len(request_ids)} row(s)"
    seen: set[str] = set()
    for r, rid in enumerate(request_ids):
        if r and rid == request_ids[r - 1]:
            if positions[r] != positions[r - 1] + 1 or trips[r] != trips[r - 1]:
                return f"the window of {rid} is not one trip at consecutive positions"
        elif rid in seen:
            return f"the rows of {rid} are not together"
        seen.add(rid)
    return ""


def runs(request_ids: Sequence[str]) -> list[tuple[int, int]]:
    """Each request's rows as (first, end) row indices: a window each."""
    out: list[tuple[int, int]] = []
    for r, rid in enumerate(request_ids):
        if r and rid == request_ids[r - 1]:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return out
