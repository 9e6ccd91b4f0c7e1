"""The heuristic search, beyond the exact search's reach: local search over ordered device lists, each list scored by
the exact cuts for its order (the exact programme along that order, ``_chain``); a list that does not fit scores by
how many blocks it is short, so that the search can repair it.

Moves: drop a device, insert an unused one, replace one, swap two, move one; best improvement, then once more with
compound moves at a local optimum. Starting points: the exact plan over a pool of ``exact_limit`` devices, the best
fastest-first and largest-memory-first prefixes, the best lists met at other bounds, the seed closest to fitting.
``throughput`` runs it at the bounds T a binary search for the crossing of L(T) / R and T visits; ``cost`` at the
bounds the exact search's branch and bound would visit, from the device sets met (a guide, not a proof). The answer
is the best plan met, by ``evaluate``.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence

import numpy as np

from ppharness.plan.lang.document import Objective
from ppharness.plan.search.budget import Budget
from ppharness.plan.search.exact import MAX_EXACT, reconstruct, scores, set_usd, subset_dp
from ppharness.plan.search.instance import INF, FloatArray, Instance, IntArray, Plan, Windows, window_min
from ppharness.plan.search.objective import evaluate

COST_PROBES = 40  # the bounds T tried for ``cost``, at most
COST_RESOLUTION = 0.005  # ... and an interval of bounds narrower than this (relative) is not split
UNFIT = 1e30  # the score of a list that does not fit, per block short (above any plan's score)
SEED_CHUNK = 64  # starting lists scored between looks at the time limit
NEAR_CHUNK = 20_000  # ... and neighbouring lists


# --- the programme along a fixed order --------------------------------------------------------------------------


def _chain(
    inst: Instance,
    win: Windows,
    seqs: IntArray,
    keep: bool,
    joins: tuple[IntArray, list[FloatArray]] | None = None,
) -> tuple[FloatArray, list[FloatArray], IntArray]:
    """Least latency of each row of ``seqs`` (device indices in loop order) with exact cuts, inf where nothing fits;
    with ``keep`` the per-position tables (after 1, 2, .. k - 1 devices) for reconstruction; and per row the blocks
    short: 0 where it fits, else B + 1 - the most blocks any of its first devices hold from block 0 (how far the list
    is from fitting, to guide the search). ``joins``: (s per row, non-decreasing, and tables after 1, 2, .. devices
    of a list that every row with s > 1 shares its first s devices with): such a row starts from that table at
    position s instead of from its entry."""
    m, k = seqs.shape
    nb = inst.nb
    first = seqs[:, 0]
    j = np.arange(nb + 1)
    if k == 1:
        solo = win.solo_value[first].copy()
        return solo, [], np.where(np.isfinite(solo), 0, 1 + nb - np.minimum(win.reach[first], nb)).astype(np.int64)
    start, shared = (np.ones(m, dtype=np.int64), []) if joins is None else joins
    own = int(np.searchsorted(start, 2))  # rows from their own entry
    reach = (j[None, :] >= 1) & (j[None, :] <= win.reach[first[:own]][:, None])
    table = np.where(reach, inst.ov[first[:own]][:, None] + inst.pc[first[:own]], INF)
    tables = [table] if keep else []
    furthest = np.where(np.isfinite(table), j, 0).max(axis=1, initial=0)
    for p in range(1, k):
        joining = int(np.searchsorted(start, p + 1)) - len(table)
        if joining:
            table = np.concatenate([table, np.broadcast_to(shared[p - 1][0], (joining, nb + 1))])
            held = int(np.where(np.isfinite(shared[p - 1][0]), j, 0).max())
            furthest = np.concatenate([furthest, np.full(joining, held)])
        rows = len(table)
        v, w = seqs[:rows, p - 1], seqs[:rows, p]
        x = table + win.e_act[v, w][:, None] - inst.pc[w]
        if p == k - 1:
            ex = np.where(win.exit_mask[w], x, INF).min(axis=1) + win.exit_add[w] + win.e_tok[w, first[:rows]]
            return ex, tables, np.where(np.isfinite(ex), 0, nb + 1 - furthest).astype(np.int64)
        table = window_min(win, x, w) + inst.pc[w] + inst.ov[w][:, None]
        furthest = np.maximum(furthest, np.where(np.isfinite(table), j, 0).max(axis=1))
        if keep:
            tables.append(table)
    raise AssertionError("unreachable")


def _chain_cuts(inst: Instance, win: Windows, seq: tuple[int, ...]) -> list[int] | None:
    """The exact cuts of one order under ``win`` (None when nothing fits)."""
    arr = np.array([seq], dtype=np.int64)
    values, tables, _ = _chain(inst, win, arr, keep=True)
    if not math.isfinite(values[0]):
        return None
    k = len(seq)
    if k == 1:
        return []
    w = seq[-1]
    x = tables[-1][0] + win.e_act[seq[-2], w] - inst.pc[w]
    j = int(np.argmin(np.where(win.exit_mask[w], x, INF)))
    cuts = [j]
    for p in range(k - 2, 0, -1):
        w, v = seq[p], seq[p - 1]
        lo = int(win.lo[w, j])
        x = tables[p - 1][0, lo:j] + win.e_act[v, w] - inst.pc[w, lo:j]
        j = lo + int(np.argmin(x))
        cuts.append(j)
    return cuts[::-1]


def _chain_values(
    inst: Instance, seqs: Sequence[tuple[int, ...]], bound: float, base: tuple[int, ...] | None = None
) -> tuple[FloatArray, IntArray]:
    """Least latency of each ordered device list (indices) under ``bound``, cuts chosen exactly, inf where none fits;
    and the blocks each list is short (``_chain``). Lists of one length are evaluated together; one that shares its
    first s devices with ``base`` joins at position s with ``base``'s table after them (the same numbers as from
    scratch)."""
    out = np.full(len(seqs), INF)
    short = np.zeros(len(seqs), dtype=np.int64)
    win = inst.windows(bound)
    prefix: list[FloatArray] = []
    if base is not None and len(base) > 1:
        prefix = _chain(inst, win, np.array([base], dtype=np.int64), keep=True)[1]
    groups: dict[int, list[tuple[int, int]]] = {}
    for i, q in enumerate(seqs):
        shared = 0
        if prefix:
            assert base is not None
            limit = min(len(q) - 1, len(base) - 1)
            while shared < limit and q[shared] == base[shared]:
                shared += 1
        groups.setdefault(len(q), []).append((shared, i))
    for rows in groups.values():
        rows.sort()
        order = [i for _, i in rows]
        joins = np.array([max(shared, 1) for shared, _ in rows], dtype=np.int64)
        arr = np.array([seqs[i] for i in order], dtype=np.int64)
        out[order], _, short[order] = _chain(inst, win, arr, keep=False, joins=(joins, prefix))
    return out, short


# --- the local search -------------------------------------------------------------------------------------------


def _neighbours(seq: tuple[int, ...], n: int) -> list[tuple[int, ...]]:
    k = len(seq)
    unused = [d for d in range(n) if d not in seq]
    out: set[tuple[int, ...]] = set()
    if k > 1:
        for p in range(k):
            out.add(seq[:p] + seq[p + 1 :])
    for u in unused:
        for p in range(k + 1):
            out.add(seq[:p] + (u,) + seq[p:])
        for p in range(k):
            out.add(seq[:p] + (u,) + seq[p + 1 :])
    for p, q in itertools.combinations(range(k), 2):
        s = list(seq)
        s[p], s[q] = s[q], s[p]
        out.add(tuple(s))
    out.update(_relocations(seq))
    out.discard(seq)
    return sorted(out)


def _relocations(seq: tuple[int, ...]) -> set[tuple[int, ...]]:
    """``seq`` with one device moved elsewhere in the order."""
    out = set()
    for p in range(len(seq)):
        rest = seq[:p] + seq[p + 1 :]
        for q in range(len(seq)):
            if q != p:
                out.add(rest[:q] + (seq[p],) + rest[q:])
    return out


def _compound(seq: tuple[int, ...], n: int) -> list[tuple[int, ...]]:
    """The second neighbourhood, tried at a local optimum of the first: drop a device, or put an unused one in its
    place, and move one other device elsewhere in the order; or insert two unused devices side by side, or put them
    in one device's place."""
    out: set[tuple[int, ...]] = set()
    unused = [d for d in range(n) if d not in seq]
    for p in range(len(seq)):
        for u in [None, *unused]:
            changed = seq[:p] + ((u,) if u is not None else ()) + seq[p + 1 :]
            if changed:
                out.update(_relocations(changed))
    for pair in itertools.permutations(unused, 2):
        for p in range(len(seq) + 1):
            out.add(seq[:p] + pair + seq[p:])
            if p < len(seq):
                out.add(seq[:p] + pair + seq[p + 1 :])
    out.discard(seq)
    return sorted(out)


class _Heuristic:
    """Local search over ordered device lists, each scored by its exact cuts (see the module's docstring)."""

    def __init__(self, inst: Instance, pool: int, budget: Budget | None = None) -> None:
        self.inst, self.pool = inst, max(0, min(pool, MAX_EXACT, inst.n))
        self.budget = budget or Budget()
        self.kept: dict[tuple[int, ...], float] = {}  # the best lists found, with the bound they were found at
        self.plans: list[tuple[tuple[int, ...], float]] = []  # every local optimum: order, bound
        self._pools: dict[tuple[int, ...], Instance] = {}
        self.seen: dict[int, float] = {}  # device set (mask) -> least latency met, in the current ``solve``
        self._bound = INF
        self._latency: dict[tuple[int, ...], float] = {}  # scores at the last bound: list -> latency
        speed = inst.pc[:, inst.nb] + inst.ov
        self.fastest = [int(d) for d in np.argsort(speed, kind="stable")]
        self.roomiest = [int(d) for d in np.argsort(-inst.free, kind="stable")]

    def score(
        self, seqs: Sequence[tuple[int, ...]], bound: float, kind: str, base: tuple[int, ...] | None = None
    ) -> FloatArray:
        """Latency under ``bound`` (``cost``: usd * max(L / R, bound)) of each list; a list that does not fit scores
        UNFIT times (1 + the blocks it is short), so that the search moves towards lists that fit. Every set met is
        noted in ``seen`` with its least latency. Lists already scored at this bound are not computed again."""
        if bound != self._bound:
            self._bound, self._latency = bound, {}
        known = self._latency
        new = [q for q in dict.fromkeys(seqs) if q not in known]
        if new:
            values, short = _chain_values(self.inst, new, bound, base)
            masks, _ = self._sets(new)
            for q, value, miss, mask in zip(new, values.tolist(), short.tolist(), masks.tolist()):
                known[q] = value if miss == 0 else -float(miss)
                if value < self.seen.get(mask, INF):
                    self.seen[mask] = value
        raw = np.array([known[q] for q in seqs])
        lat = np.where(raw >= 0, raw, INF)
        if kind == "cost":
            lat = scores(self._sets(seqs)[1], lat / self.inst.flight, bound if math.isfinite(bound) else 0.0)
        return np.where(raw >= 0, lat, UNFIT * (1 - raw))

    def _sets(self, seqs: Sequence[tuple[int, ...]]) -> tuple[IntArray, FloatArray]:
        """Each list's device set (a mask) and hourly price."""
        if not seqs:  # an empty neighbourhood (``_compound`` of two devices out of two)
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
        flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lengths.sum()))
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        masks = np.add.reduceat(np.left_shift(1, flat), starts).astype(np.int64)
        return masks, np.add.reduceat(self.inst.usd[flat], starts).astype(np.float64)

    def _pool_seed(self, start: tuple[int, ...] | None, bound: float, kind: str) -> tuple[int, ...] | None:
        if self.pool < 1:
            return None
        members = list(dict.fromkeys([*(start or ()), *self.fastest]))[: self.pool]
        key = tuple(sorted(members))
        sub = self._pools.get(key)
        if sub is None:
            sub = self._pools[key] = Instance(
                self.inst.model,
                self.inst.cluster,
                [self.inst.ids[d] for d in key],
                self.inst.requests,
                self.inst.flight,
            )
        finals = subset_dp(sub, sub.windows(bound))
        if not len(finals.value):
            return None
        if kind == "cost":
            lat, where = finals.per_set(sub.n)
            score = scores(set_usd(sub), lat / sub.flight, bound if math.isfinite(bound) else 0.0)
            s = int(np.argmin(score))
            if not math.isfinite(score[s]):
                return None
            a = int(where[s])
        else:
            a = int(np.argmin(finals.value))
            if not math.isfinite(finals.value[a]):
                return None
        order, _ = reconstruct(sub, sub.windows(bound), int(finals.sets[a]), int(finals.entry[a]), int(finals.exit[a]))
        return tuple(key[d] for d in order)

    def solve(self, bound: float, kind: str, starts: int = 2) -> tuple[tuple[int, ...] | None, float]:
        """The best list found at ``bound`` and its score."""
        n = self.inst.n
        self.seen = {}
        seeds: list[tuple[int, ...]] = [tuple(self.fastest[:k]) for k in range(1, n + 1)]
        seeds += [tuple(self.roomiest[:k]) for k in range(1, n + 1)]
        seeds += list(self.kept)
        scored = []
        for s in range(0, len(seeds), SEED_CHUNK):
            if self.budget.expired():
                break
            scored.append(self.score(seeds[s : s + SEED_CHUNK], bound, kind))
        if not scored:
            return None, INF
        values = np.concatenate(scored)
        seeds = seeds[: len(values)]
        order = np.argsort(values, kind="stable")
        top = seeds[int(order[0])] if values[order[0]] < UNFIT else None
        pooled = self._pool_seed(top, bound, kind)
        picks: list[tuple[int, ...]] = [] if pooled is None else [pooled]
        for i in order:
            if len(picks) >= starts + (pooled is not None):
                break
            if seeds[int(i)] not in picks:
                picks.append(seeds[int(i)])
        unfit = [seeds[int(i)] for i in order if values[i] >= UNFIT]
        if unfit and unfit[0] not in picks:  # the list closest to fitting, repaired by the search
            picks.append(unfit[0])
        best: tuple[int, ...] | None = None
        best_value = INF
        for seq in picks:
            if best is not None and self.budget.expired():
                break
            seq, value = self._descend(seq, bound, kind)
            if value >= UNFIT:
                continue
            self.plans.append((seq, bound))
            if value < best_value:
                best, best_value = seq, value
        if best is not None:
            self.kept[best] = bound
        return best, best_value

    def _score_near(self, near: list[tuple[int, ...]], bound: float, kind: str, base: tuple[int, ...]) -> FloatArray:
        """``score`` of a neighbourhood in chunks of NEAR_CHUNK lists, stopping early when the time limit passes (the
        lists scored so far)."""
        parts = [np.zeros(0)]
        for s in range(0, len(near), NEAR_CHUNK):
            if s and self.budget.expired():
                break
            parts.append(self.score(near[s : s + NEAR_CHUNK], bound, kind, base=base))
        return np.concatenate(parts)

    def _descend(self, seq: tuple[int, ...], bound: float, kind: str) -> tuple[tuple[int, ...], float]:
        """Best improvement over ``_neighbours``; at a local optimum, once over ``_compound`` (variable
        neighbourhood descent)."""
        value = float(self.score([seq], bound, kind)[0])
        wide = False
        while not self.budget.expired():
            near = (_compound if wide else _neighbours)(seq, self.inst.n)
            values = self._score_near(near, bound, kind, seq)
            near = near[: len(values)]
            i = int(np.argmin(values)) if len(near) else -1
            if i >= 0 and values[i] < value - 1e-12 * abs(value):
                seq, value, wide = near[i], float(values[i]), False
            elif wide:
                return seq, value
            else:
                wide = True
        return seq, value


def heuristic_plan(inst: Instance, objective: Objective, pool: int, budget: Budget | None = None) -> Plan | None:
    """The heuristic's plan (see the module's docstring), or None when it found none that fits. ``budget``: its time
    limit; when it passes, each search stops where it is and the best plan met so far is the answer (the budget says
    which phase was cut short)."""
    h = _Heuristic(inst, pool, budget)
    budget = h.budget
    kind, r = objective.kind, inst.flight
    budget.phase = f"the local search over {inst.n} devices without a bound"
    base_seq, base = h.solve(INF, "cost" if kind == "cost" else "latency", starts=3)
    if base_seq is None:
        return None
    cand = inst.candidates()
    nc = len(cand)
    if kind == "throughput" and (r > 1 or inst.quota):
        seen: dict[int, float] = {}

        def f(i: int) -> float:
            """The heuristic's L(T) / R at cand[i], kept non-increasing: a plan found under a smaller bound also
            meets this one."""
            if i not in seen:
                seq, lat = h.solve(float(cand[i]), "latency")
                seen[i] = min([lat / r if seq is not None else INF, *(v for k, v in seen.items() if k < i)])
            return seen[i]

        budget.phase = f"the throughput search over {nc} bottleneck bounds"
        lo, hi = int(np.searchsorted(cand, base / r, side="left")), nc
        while lo < hi and not budget.expired():
            mid = (lo + hi) // 2
            if f(mid) <= cand[mid]:
                hi = mid
            else:
                lo = mid + 1
        for i in (lo, lo - 1):
            if 0 <= i < nc and not budget.expired():
                f(i)
    elif kind == "cost" and nc:
        # the exact search's branch and bound over T (``ppharness.plan.search.exact``), on what the local search met:
        # its bound for an interval uses the sets seen at the interval's right end only, so it guides rather than proves
        probes = 0

        def run(i: int) -> tuple[FloatArray, FloatArray, float]:
            nonlocal probes
            probes += 1
            score = h.solve(float(cand[i]), "cost")[1]
            prices = inst.usd.tolist()
            usd = np.array([sum(prices[d] for d in range(inst.n) if m >> d & 1) for m in h.seen])
            return usd, np.array(list(h.seen.values())) / r, score

        budget.phase = f"the cost search over {nc} bottleneck bounds"
        top = run(nc - 1)
        incumbent = top[2]
        heap = [(0.0, 0, nc - 1, top[0], top[1])]
        while heap and probes < COST_PROBES and not budget.expired():
            bound, a, b, usd_b, f_b = heapq.heappop(heap)
            if bound >= incumbent:
                break
            if cand[b] <= cand[a] * (1 + COST_RESOLUTION):
                continue
            mid = (a + b) // 2
            usd_m, f_m, score = run(mid)
            incumbent = min(incumbent, score)
            for lo, hi, usd, per in ((a, mid, usd_m, f_m), (mid + 1, b, usd_b, f_b)):
                lb = float(scores(usd, per, float(cand[lo])).min()) if len(per) else INF
                heapq.heappush(heap, (lb, lo, hi, usd, per))
    found: dict[tuple[int, ...], tuple[float, tuple[int, ...]]] = {}  # list -> (value, cuts), the best per list
    for seq, bound in h.plans:
        cuts = _chain_cuts(inst, inst.windows(bound), seq)
        if cuts is not None:
            value = _plan_value(inst, seq, cuts, objective)
            if value < found.get(seq, (INF, ()))[0]:
                found[seq] = (value, tuple(cuts))
    if not found:
        return None
    seq = min(found, key=lambda q: found[q][0])
    if kind == "cost" and found[seq][0] == 0:  # free plans: the best throughput among the free devices
        free = [inst.ids[d] for d in range(inst.n) if inst.usd[d] == 0]
        sub = Instance(inst.model, inst.cluster, free, inst.requests, r)
        plan = heuristic_plan(sub, Objective(kind="throughput", requests=r), pool, budget)
        if plan is not None:
            return plan
    return tuple(inst.ids[d] for d in seq), found[seq][1]


def _plan_value(inst: Instance, seq: tuple[int, ...], cuts: Sequence[int], objective: Objective) -> float:
    return evaluate(inst.model, inst.cluster, [inst.ids[d] for d in seq], cuts, objective)
