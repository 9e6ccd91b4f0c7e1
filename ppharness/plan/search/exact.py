"""The exact search: the least value over every plan that fits (every ordered subset of the devices, every cut into
non-empty contiguous ranges), for up to MAX_EXACT devices.

A dynamic programme over (entry e, set S of devices used, last device v, blocks placed j) gives the least latency of
a path from e through exactly S to v that has placed blocks [0, j); appending w with the range [j, j') costs
ov_w + P_w[j'] - P_w[j] (P_w: w's prefix sums of block times) plus the link v -> w. Memory, and a bound T on every
node time and link serialisation, make each window of j an interval whose left end never decreases: the inner
minimum is a range-minimum query (``window_min``). ``latency`` is one run; ``throughput`` and ``cost`` are best-first
branch and bound over the candidate bottlenecks T, each run giving L*(T), the least latency of a plan whose
bottleneck is at most T. The programme adds the cost model's terms in another order than ``evaluate``: the two agree
to rounding (about 1e-13 relative).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from dataclasses import dataclass

import numpy as np

from ppharness.plan.search.instance import INF, FloatArray, Instance, IntArray, Plan, Windows, window_min
from ppharness.plan.search.objective import MS_PER_HOUR

MAX_EXACT = 12  # the exact programme keeps 2^(n-1) * n * (B + 1) values per entry device
DP_VALUES = 1 << 22  # the exact programme's largest temporary (32 MiB of float64)


# --- the programme over subsets ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Step:
    """Appending one device to every set of ``t`` devices besides the entry (layer t to t + 1), for n devices. The
    devices other than entry e are numbered 0 .. n - 2 ("local"; n - 1 stands for e itself); layer t lists the
    sets of t local devices in ``itertools.combinations`` order, and its table holds, per set, one row per member in
    increasing order (the member being the last device so far). Rows of the next layer are (set, member) pairs, set
    by set, so the new table is these rows reshaped."""

    prev: IntArray  # (P,) the set before the device is appended: its index in layer t
    w: IntArray  # (P,) the device appended (local)
    v: IntArray  # (P, max(t, 1)) the members of the set before (local; [[n - 1]] for the entry alone)
    sets: IntArray  # (n, P) per entry e, the whole set with the entry as a mask over all n devices
    size: int  # number of sets in layer t + 1
    last: bool  # layer t + 1 holds every device: nothing follows


@functools.cache
def _steps(n: int) -> tuple[tuple[_Step, ...], IntArray]:
    """The programme's steps for n devices, and per entry e the local -> device numbering (n - 1 -> e)."""
    m = n - 1
    numbering = np.array([[d for d in range(n) if d != e] + [e] for e in range(n)], dtype=np.int64)
    index: list[dict[tuple[int, ...], int]] = []
    for t in range(n):
        index.append({c: i for i, c in enumerate(itertools.combinations(range(m), t))})
    steps = []
    for t in range(m):
        prev, w, v, local_sets = [], [], [], []
        for combo in index[t + 1]:
            for i in combo:
                rest = tuple(c for c in combo if c != i)
                prev.append(index[t][rest])
                w.append(i)
                v.append(list(rest) if t else [m])
                local_sets.append(sum(1 << c for c in combo))
        local = np.array(local_sets, dtype=np.int64)
        sets = np.zeros((n, len(local)), dtype=np.int64)
        for e in range(n):
            sets[e] = 1 << e
            for c in range(m):
                sets[e] |= ((local >> c) & 1) << numbering[e, c]
        steps.append(
            _Step(
                np.array(prev, dtype=np.int64),
                np.array(w, dtype=np.int64),
                np.array(v, dtype=np.int64).reshape(len(prev), max(t, 1)),
                sets,
                len(index[t + 1]),
                t + 1 == m,
            )
        )
    return tuple(steps), numbering


@dataclass
class Finals:
    """Every closed loop the programme found: its device set (a mask over the instance), entry, exit, latency."""

    sets: IntArray
    entry: IntArray
    exit: IntArray
    value: FloatArray

    def per_set(self, n: int) -> tuple[FloatArray, IntArray]:
        """The least latency per device set (inf where none) and the index of the loop reaching it."""
        best = np.full(1 << n, INF)
        where = np.full(1 << n, -1, dtype=np.int64)
        order = np.lexsort((self.value, self.sets))
        sets = self.sets[order]
        first = np.ones(len(sets), dtype=np.bool_)
        first[1:] = sets[1:] != sets[:-1]
        best[sets[first]] = self.value[order][first]
        where[sets[first]] = order[first]
        return best, where

    def best(self) -> int:
        return int(np.argmin(self.value)) if len(self.value) else -1


def _run(
    inst: Instance, win: Windows, entries: IntArray, keep: list[FloatArray] | None = None
) -> list[tuple[IntArray, IntArray, IntArray, FloatArray]]:
    """The programme for the given entry devices at once: per step, the loops closed by making the appended device
    the exit, as (set masks, entries, exits, latencies). With ``keep``, each layer's table is appended to it."""
    n, nb = inst.n, inst.nb
    out: list[tuple[IntArray, IntArray, IntArray, FloatArray]] = []
    if n < 2 or not len(entries):
        return out
    steps, numbering = _steps(n)
    ne = len(entries)
    glob = numbering[entries]  # (ne, n): local -> device
    j = np.arange(nb + 1)
    first = (j[None, :] >= 1) & (j[None, :] <= win.reach[entries][:, None])
    table = np.where(first, inst.ov[entries][:, None] + inst.pc[entries], INF)[:, None, None, :]
    if keep is not None:
        keep.append(table)
    for step in steps:
        w = glob[:, step.w]  # (ne, P) devices appended
        v = glob[:, step.v]  # (ne, P, t) members before
        links = win.e_act[v, w[:, :, None]]  # (ne, P, t)
        z = table[:, step.prev, 0] + links[:, :, 0, None]  # (ne, P, B + 1): min over the members, one at a time
        for r in range(1, v.shape[2]):
            np.minimum(z, table[:, step.prev, r] + links[:, :, r, None], out=z)
        x = z - inst.pc[w]
        ex = np.where(win.exit_mask[w], x, INF).min(axis=2) + win.exit_add[w] + win.e_tok[w, entries[:, None]]
        out.append((step.sets[entries], np.broadcast_to(entries[:, None], w.shape), w, ex))
        if step.last:
            break
        flat_w = w.reshape(-1)
        mid = window_min(win, x.reshape(-1, nb + 1), flat_w) + inst.pc[flat_w] + inst.ov[flat_w][:, None]
        table = mid.reshape(ne, step.size, -1, nb + 1)
        if keep is not None:
            keep.append(table)
    return out


def subset_dp(inst: Instance, win: Windows) -> Finals:
    """Run the programme for every entry device (as many at once as keep its largest step within DP_VALUES
    values); return every closed loop's least latency."""
    n = inst.n
    widest = max((len(step.prev) * step.v.shape[1] for step in _steps(n)[0]), default=1) * (inst.nb + 1)
    at_once = max(1, DP_VALUES // widest)
    parts = []
    for first in range(0, n, at_once):
        parts += _run(inst, win, np.arange(first, min(n, first + at_once), dtype=np.int64))
    solo = np.nonzero(win.solo)[0].astype(np.int64)
    parts.append((np.left_shift(1, solo), solo, solo, win.solo_value[solo]))
    return Finals(
        np.concatenate([p[0].reshape(-1) for p in parts]).astype(np.int64),
        np.concatenate([p[1].reshape(-1) for p in parts]).astype(np.int64),
        np.concatenate([p[2].reshape(-1) for p in parts]).astype(np.int64),
        np.concatenate([p[3].reshape(-1) for p in parts]).astype(np.float64),
    )


def reconstruct(inst: Instance, win: Windows, full: int, e: int, w: int) -> tuple[list[int], list[int]]:
    """The device order and cuts of the best loop over the set ``full`` entering at ``e`` and leaving at ``w``."""
    if full == 1 << e and e == w:
        return [e], []
    keep: list[FloatArray] = []
    _run(inst, win, np.array([e], dtype=np.int64), keep)
    steps, numbering = _steps(inst.n)
    local = {int(d): i for i, d in enumerate(numbering[e])}
    members = tuple(sorted(local[d] for d in range(inst.n) if full >> d & 1 and d != e))
    t = len(members) - 1  # the step that appended the exit
    combos = list(itertools.combinations(range(inst.n - 1), t + 1))
    row = combos.index(members) * (t + 1) + members.index(local[w])
    order, cuts = [w], []
    cur, j = w, -1
    while True:
        step = steps[t]
        prev = int(step.prev[row])
        before = [int(numbering[e, c]) for c in step.v[row]]
        rows = keep[t][0, prev]  # (t or 1, B + 1)
        links = win.e_act[before, cur]
        z = (rows + links[:, None]).min(axis=0)
        if j < 0:  # the exit: blocks [j, B)
            j = int(np.argmin(np.where(win.exit_mask[cur], z - inst.pc[cur], INF)))
        else:
            lo = int(win.lo[cur, j])
            j = lo + int(np.argmin(z[lo:j] - inst.pc[cur, lo:j]))
        cuts.append(j)
        k = int(np.argmin(rows[:, j] + links))
        cur = before[k]
        if t == 0:
            break
        order.append(cur)
        row = prev * t + k
        t -= 1
    order.append(e)
    return order[::-1], cuts[::-1]


# --- the solvers ------------------------------------------------------------------------------------------------


@dataclass
class _Best:
    value: float = INF
    plan: tuple[float, int, int, int] | None = None  # (bound, set, entry, exit)

    def offer(self, value: float, bound: float, full: int, e: int, w: int) -> None:
        if value < self.value:
            self.value, self.plan = value, (bound, full, e, w)


def _plan_of(inst: Instance, best: _Best) -> Plan:
    assert best.plan is not None
    bound, full, e, w = best.plan
    order, cuts = reconstruct(inst, inst.windows(bound), full, e, w)
    return tuple(inst.ids[d] for d in order), tuple(cuts)


def exact_latency(inst: Instance, bound: float = INF) -> tuple[float, Plan | None]:
    finals = subset_dp(inst, inst.windows(bound))
    i = finals.best()
    if i < 0 or not math.isfinite(finals.value[i]):
        return INF, None
    best = _Best()
    best.offer(float(finals.value[i]), bound, int(finals.sets[i]), int(finals.entry[i]), int(finals.exit[i]))
    return best.value, _plan_of(inst, best)


def exact_throughput(inst: Instance) -> tuple[float, Plan | None]:
    if inst.flight == 1 and not inst.quota:  # max(L, b) = L
        return exact_latency(inst)
    return _exact_bounded(inst, weighted=False)


def set_usd(inst: Instance) -> FloatArray:
    usd = np.zeros(1 << inst.n)
    for d in range(inst.n):
        usd[1 << d : 1 << (d + 1)] = usd[: 1 << d] + inst.usd[d]
    return usd


def exact_cost(inst: Instance) -> tuple[float, Plan | None]:
    n = inst.n
    base, _ = subset_dp(inst, inst.windows(INF)).per_set(n)
    feasible = np.isfinite(base)
    if not feasible.any():
        return INF, None
    if (feasible & (set_usd(inst) == 0)).any():  # free plans: the best throughput among them
        free = [inst.ids[d] for d in range(n) if inst.usd[d] == 0]
        return 0.0, exact_throughput(Instance(inst.model, inst.cluster, free, inst.requests, inst.flight))[1]
    return _exact_bounded(inst, weighted=True)


def _exact_bounded(inst: Instance, weighted: bool) -> tuple[float, Plan | None]:
    """min over T of min over device sets S of w(S) * max(L*_S(T) / R, T), T over the candidate bottlenecks, with
    w(S) = usd(S) / 3.6e6 (``weighted``: $ per token) or 1 (ms per token; then only the best S matters).

    Best-first branch and bound over intervals [a, b] of the sorted candidates, knowing f_S = L*_S / R at C[b]: for T
    in [C[a], C[b]], f_S(T) >= f_S(C[b]) and T >= C[a], so no plan there beats min_S w(S) * max(f_S(C[b]), C[a]).
    An interval whose bound reaches the best plan met is dropped; otherwise the programme runs at its middle and it
    splits in two. Each run offers its best plan, whose value is at most w(S) * max(f_S(T), T)."""
    r, n = inst.flight, inst.n
    cand = inst.candidates()
    nc = len(cand)
    weights = set_usd(inst) / MS_PER_HOUR if weighted else np.ones(1)
    best = _Best()

    def run(i: int) -> FloatArray:
        t = float(cand[i])
        finals = subset_dp(inst, inst.windows(t))
        if weighted:
            lat, where = finals.per_set(n)
        else:
            a = finals.best()
            lat = np.array([finals.value[a] if a >= 0 else INF])
            where = np.array([a], dtype=np.int64)
        f = lat / r
        score = scores(weights, f, t)
        s = int(np.argmin(score))
        if math.isfinite(score[s]):
            a = int(where[s])
            best.offer(float(score[s]), t, int(finals.sets[a]), int(finals.entry[a]), int(finals.exit[a]))
        return f

    if not nc:
        return INF, None
    heap = [(0.0, 0, nc - 1, run(nc - 1))]
    while heap:
        bound, a, b, f_b = heapq.heappop(heap)
        if bound >= best.value:
            break
        if a == b:
            continue
        mid = (a + b) // 2
        f_mid = run(mid)
        heapq.heappush(heap, (float(scores(weights, f_mid, float(cand[a])).min()), a, mid, f_mid))
        heapq.heappush(heap, (float(scores(weights, f_b, float(cand[mid + 1])).min()), mid + 1, b, f_b))
    if best.plan is None:
        return INF, None
    return best.value, _plan_of(inst, best)


def scores(weights: FloatArray, f: FloatArray, t: float) -> FloatArray:
    """w(S) * max(f_S, t), inf where f_S is."""
    out = np.full(len(f), INF)
    ok = np.isfinite(f)
    out[ok] = (weights if len(weights) == len(f) else np.broadcast_to(weights, f.shape))[ok] * np.maximum(f[ok], t)
    return out
