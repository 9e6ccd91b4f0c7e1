"""The planner: which devices run the model, in which order around the loop, and which blocks each one runs.

A plan is a loop over an ordered list of devices d_1 .. d_k, device i running the contiguous blocks
[c_{i-1}, c_i) (c_0 = 0, c_k = B, every range non-empty), d_1 also the embedding and d_k the head. Its numbers come
from the cost model (``ppharness.plan.cost``):

- latency L (one request, ms per token) = sum of ``node_ms`` over the nodes + ``edge_ms`` of each activation edge
  d_i -> d_{i+1} + ``edge_ms`` of the token edge d_k -> d_1; a block's part of ``node_ms`` is ``block_seconds``
  (for a mixture-of-experts block, its dense part and the ``active`` routed experts a token reads, with every expert
  held by the block's node: what ``simulate`` predicts for a plan that places no experts);
- bottleneck b = the largest ``node_ms`` and link ``serialization_ms`` of the loop (b <= L always);
- with R = ``objective.requests`` in flight: ms per token = max(L / R, b) (throughput min(R / L, 1 / b));
- a node on a device with a CPU quota below one CPU counts in b with its time over its share (``cost.busy_ms``), so
  b may exceed L there, and one request's ms per token is max(L, b) (``cost.loop_ms``): the ``latency`` objective is
  then searched as ``throughput`` with one request in flight;
- $ per token = (sum of the used devices' ``usd_per_hour``) * ms per token / 3.6e6.

``evaluate`` returns the objective's value (lower is better): L for ``latency``, ms per token for ``throughput``, $
per token for ``cost``. A device's memory must hold its blocks' weights, their KV cache for ``max_context`` tokens
of each of the R requests, the embedding on the entry, the head on the exit and the device's runtime reserve
(``ppharness.plan.check``). Devices may be left out.

Exact search (``plan_optimal`` with at most ``exact_limit`` devices, 8 by default, 12 at most)
-----------------------------------------------------------------------------------------------

The core is a dynamic programme over (entry device e, set S of devices used so far, last device v, blocks placed j):
the least latency of a path that starts at e, visits exactly S, ends at v and has placed blocks [0, j), each device
on one contiguous range that fits its memory in its role (entry, middle or exit). A transition appends a device w
not in S with the range [j, j'):

    V[S + w, w, j'] = ov_w + P_w[j'] + min over j in window_w(j') of (min over v of (V[S, v, j] + edge(v, w)) - P_w[j])

where P_w is device w's prefix sum of per-block times. Memory (and, below, a time bound) makes window_w(j') an interval
[lo_w(j'), j' - 1] whose left end never decreases, so the inner minimum is a range-minimum query (a sparse table per
row, vectorised over every state of a layer and every entry at once). Closing the loop adds the exit's range [j, B),
its head and the token edge back to e; one device alone runs everything. The work is O(2^n n^2 B (n + log B)); the
programme is exact for arbitrary per-block costs (blocks need not be alike), asymmetric links and per-role memory
limits. Every plan found is rebuilt from the tables by the same arithmetic. "Exact" below means: the least value
over every plan that fits (every ordered subset of the devices, every cut into non-empty contiguous ranges), what
``brute_force`` enumerates; the programme adds the cost model's terms in another order than ``evaluate``, so the two
agree to rounding (about 1e-13 relative).

- ``latency``: exact, one run of the programme.
- ``throughput``: exact. With a bound T on every node time and link serialisation (ranges or links over T refused),
  the programme gives L*(T), the least latency of a plan whose bottleneck is at most T. The optimum is the least over
  T of max(L*(T) / R, T), T over the finite sorted set C of the values a bottleneck can take (every node time of a
  range that fits, every link's serialisation time). L*(T) never increases with T. Best-first branch and bound over
  intervals [C_a, C_b] of C, knowing L*(C_b): no T in the interval does better than max(L*(C_b) / R, C_a); an
  interval whose bound reaches the best plan met is dropped, any other is split at its middle (one run there). With
  one request the value is L (b <= L): one run.
- ``cost``: exact. The same branch and bound, the programme's results kept per device set S, the bound of an interval
  being the least over S of usd(S) * max(L*_S(C_b) / R, C_a) / 3.6e6. When a feasible set costs nothing, every plan
  on free devices is optimal (0 $ per token): the plan returned is the best throughput among the free devices.

Heuristic search (more than ``exact_limit`` devices)
---------------------------------------------------

Local search over ordered device lists, each list scored by the exact cut programme for that order (the same
recurrence along a fixed order, vectorised over a whole neighbourhood, lists sharing their first devices with the
current one starting from its tables); a list that does not fit scores by how many blocks it is short, so that the
search can repair it. Moves: drop a device, insert an unused one anywhere, replace one by an unused one, swap two,
move one elsewhere; best improvement; at a local optimum, once more with compound moves (drop or replace one device
and move another; insert two unused devices side by side, or put them in one device's place) before stopping.
Starting points: the exact plan over a pool of ``exact_limit`` devices (those of the best seed first, then the
fastest), the two best of the fastest-first and largest-memory-first prefixes of the devices and of the best lists
found at other bounds, and the seed closest to fitting. ``latency`` runs it once (no bound); ``throughput`` runs it
at the bounds that a binary search for the crossing of L(T) / R and T visits (L(T) the local search's, kept
non-increasing); ``cost`` runs it at the bounds that the exact search's branch and bound would visit, the bounds of
its intervals computed from the sets the local search met (a guide, not a proof; at most ``COST_PROBES`` bounds,
intervals narrower than ``COST_RESOLUTION`` not split). The answer is the best plan met, by its value from
``evaluate``. ``measure_gap`` compares it with the exact search.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ppharness.errors import PlanError
from ppharness.plan.build import chain
from ppharness.plan.check import gib
from ppharness.plan.cost import (
    block_seconds,
    busy_ms,
    cpu_share,
    edge_ms,
    head_ms,
    loop_ms,
    node_ms,
    serialization_ms,
)
from ppharness.plan.doc import Cluster, ModelGraph, Objective, PlanDoc

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

INF = math.inf
COST_PROBES = 40  # the heuristic's bounds T tried for ``cost``, at most
COST_RESOLUTION = 0.005  # ... and an interval of bounds narrower than this (relative) is not split
MAX_EXACT = 12  # the exact programme keeps 2^(n-1) * n * (B + 1) values per entry device
MS_PER_HOUR = 3.6e6
UNFIT = 1e30  # the heuristic's score of a list that does not fit, per block short (above any plan's score)
DP_VALUES = 1 << 22  # the exact programme's largest temporary (32 MiB of float64)
WINDOW_CHUNK = 128  # rows per sparse table (about 1 MiB)
Plan = tuple[tuple[str, ...], tuple[int, ...]]  # device ids in loop order, inner cut points


# --- the objective, from the cost model ------------------------------------------------------------------------


def loop_metrics(
    model: ModelGraph, cluster: Cluster, devices: Sequence[str], cuts: Sequence[int]
) -> tuple[float, float]:
    """(L, b): one token's time around the loop and the busiest resource's time per token (a node's compute or a
    link's serialisation), both in ms, straight from ``ppharness.plan.cost``."""
    bounds = [0, *cuts, len(model.blocks)]
    k = len(devices)
    total, busiest = 0.0, 0.0
    for i, dev in enumerate(devices):
        device = cluster.device(dev)
        t = node_ms(model, device, bounds[i], bounds[i + 1], head=i == k - 1)
        total += t
        busiest = max(busiest, busy_ms(t, device))
    for a, b in zip(devices, devices[1:]):
        total += edge_ms(cluster, a, b, model.activation_bytes)
        busiest = max(busiest, serialization_ms(cluster, a, b, model.activation_bytes))
    total += edge_ms(cluster, devices[-1], devices[0], model.token_bytes)
    busiest = max(busiest, serialization_ms(cluster, devices[-1], devices[0], model.token_bytes))
    return total, busiest


def _value(kind: str, requests: int, latency: float, busiest: float, usd: float) -> float:
    if kind == "latency":
        return loop_ms(latency, busiest)
    per_token = max(latency / requests, busiest)
    return per_token if kind == "throughput" else usd * per_token / MS_PER_HOUR


def evaluate(
    model: ModelGraph, cluster: Cluster, devices: Sequence[str], cuts: Sequence[int], objective: Objective
) -> float:
    """The objective's value of the loop over ``devices`` cut at ``cuts`` (lower is better): latency in ms per token
    of one request, ms per token with ``objective.requests`` in flight (1 / throughput), or $ per token. Memory is
    not checked here (``fits`` does)."""
    latency, busiest = loop_metrics(model, cluster, devices, cuts)
    usd = sum(cluster.device(d).usd_per_hour for d in devices)
    return _value(objective.kind, objective.requests, latency, busiest, usd)


def fits(model: ModelGraph, cluster: Cluster, devices: Sequence[str], cuts: Sequence[int], requests: int) -> bool:
    """Whether every node's weights, KV cache (``requests`` x ``max_context``), embedding or head and reserve fit its
    device's memory (what ``ppharness.plan.check`` requires)."""
    bounds = [0, *cuts, len(model.blocks)]
    k = len(devices)
    for i, dev in enumerate(devices):
        device = cluster.device(dev)
        need = sum(_block_bytes(model, b, requests) for b in range(bounds[i], bounds[i + 1]))
        need += (model.embed_bytes if i == 0 else 0) + (model.head_bytes if i == k - 1 else 0) + device.reserve
        if need > device.memory:
            return False
    return True


def _block_bytes(model: ModelGraph, index: int, requests: int) -> int:
    block = model.blocks[index]
    return block.weight_bytes + block.kv_bytes * model.max_context * requests


# --- the instance: the cost model as arrays ---------------------------------------------------------------------


class _Instance:
    """The cost model over a list of devices, as arrays: per-block time prefix sums, memory prefix sums, links."""

    def __init__(
        self, model: ModelGraph, cluster: Cluster, ids: Sequence[str], requests: int, flight: int | None = None
    ) -> None:
        """``requests``: whose KV cache every node holds; ``flight``: the requests in flight that share the loop
        (default ``requests``; 1 for the latency objective)."""
        self.model, self.cluster, self.requests = model, cluster, requests
        self.flight = requests if flight is None else flight
        self.ids = tuple(ids)
        n, nb = len(self.ids), len(model.blocks)
        self.n, self.nb = n, nb
        devices = [cluster.device(i) for i in self.ids]
        # each block's time on each device is ``cost.block_seconds``'s, what ``node_ms`` (and so ``evaluate`` and
        # the simulator) adds up: a mixture-of-experts block counts its dense part and its ``active`` experts, not
        # every routed expert's bytes
        per = np.empty((n, nb))
        for d, dev in enumerate(devices):
            per[d] = [block_seconds(b, dev) * 1e3 for b in model.blocks]
        self.pc: FloatArray = np.concatenate([np.zeros((n, 1)), np.cumsum(per, axis=1)], axis=1)
        self.ov: FloatArray = np.array([d.overhead_ms for d in devices], dtype=np.float64)
        self.hd: FloatArray = np.array([head_ms(model, d) for d in devices], dtype=np.float64)
        self.usd: FloatArray = np.array([d.usd_per_hour for d in devices], dtype=np.float64)
        need = [_block_bytes(model, b, requests) for b in range(nb)]
        sums = [0, *itertools.accumulate(need)]
        total = sums[-1] + model.embed_bytes + model.head_bytes
        big = max([total, *(d.memory for d in devices)])
        if big >= 1 << 62:
            raise PlanError(f"sizes of {big} bytes are beyond what the planner counts (2^62)")
        self.need = need
        self.pm: IntArray = np.array(sums, dtype=np.int64)
        self.free: IntArray = np.array([d.memory - d.reserve for d in devices], dtype=np.int64)
        self.embed, self.head = model.embed_bytes, model.head_bytes
        j = np.arange(nb + 1)
        # memory windows: [j, j') fits a middle node on d iff j >= lo_mem[d, j']
        self.lo_mem: IntArray = np.searchsorted(self.pm, self.pm[None, :] - self.free[:, None], side="left").astype(
            np.int64
        )
        self.lo_mem_exit: IntArray = np.searchsorted(self.pm, self.pm[nb] + self.head - self.free, side="left").astype(
            np.int64
        )
        self.reach_mem: IntArray = (np.searchsorted(self.pm, self.free - self.embed, side="right") - 1).astype(np.int64)
        self.solo_mem: BoolArray = self.pm[nb] + self.embed + self.head <= self.free
        # tm[d, j, j']: node time of blocks [j, j') on d (without the head)
        self.tm: FloatArray = self.ov[:, None, None] + (self.pc[:, None, :] - self.pc[:, :, None])
        # each device's CPU share: a node's busy time is its time over it (what a bound T limits)
        self.share: FloatArray = np.array([cpu_share(d) for d in devices], dtype=np.float64)
        self.quota = bool((self.share < 1).any())
        self.tb: FloatArray = self.tm / self.share[:, None, None]
        self.before: BoolArray = j[:, None] < j[None, :]  # [j, j']: j < j'
        self.e_act, self.s_act = self._links(model.activation_bytes)
        self.e_tok, self.s_tok = self._links(model.token_bytes)
        self._windows: dict[float, _Windows] = {}

    def _links(self, nbytes: int) -> tuple[FloatArray, FloatArray]:
        n = self.n
        e, s = np.zeros((n, n)), np.zeros((n, n))
        for a, src in enumerate(self.ids):
            for b, dst in enumerate(self.ids):
                e[a, b] = edge_ms(self.cluster, src, dst, nbytes)
                s[a, b] = serialization_ms(self.cluster, src, dst, nbytes)
        return e, s

    def windows(self, bound: float) -> _Windows:
        found = self._windows.get(bound)
        if found is None:
            found = self._windows[bound] = _Windows(self, bound)
        return found

    def candidates(self) -> FloatArray:
        """Every value a plan's bottleneck can take: node times of ranges that fit, link serialisation times."""
        nb = self.nb
        j = np.arange(nb + 1)
        fit = self.before[None, :, :] & (j[None, :, None] >= self.lo_mem[:, None, :])
        exit_fit = (j[None, :] >= self.lo_mem_exit[:, None]) & (j[None, :] < nb)
        exit_t = (self.tm[:, :, nb] + self.hd[:, None]) / self.share[:, None]
        off = ~np.eye(self.n, dtype=np.bool_)
        values = np.concatenate([self.tb[fit], exit_t[exit_fit], self.s_act[off], self.s_tok[off]])
        return np.unique(values)

    def chain_values(
        self, seqs: Sequence[tuple[int, ...]], bound: float, base: tuple[int, ...] | None = None
    ) -> tuple[FloatArray, IntArray]:
        """Least latency of each ordered device list (indices) under ``bound``, cuts chosen exactly, inf where none
        fits; and the blocks each list is short (``_chain``). Lists of one length are evaluated together; one that
        shares its first s devices with ``base`` joins at position s with ``base``'s table after them (the same
        numbers as from scratch)."""
        out = np.full(len(seqs), INF)
        short = np.zeros(len(seqs), dtype=np.int64)
        win = self.windows(bound)
        prefix: list[FloatArray] = []
        if base is not None and len(base) > 1:
            prefix = _chain(self, win, np.array([base], dtype=np.int64), keep=True)[1]
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
            out[order], _, short[order] = _chain(self, win, arr, keep=False, joins=(joins, prefix))
        return out, short


class _Windows:
    """What a bound T on node times and link serialisation (inf: none) leaves feasible, as the programme uses it."""

    def __init__(self, inst: _Instance, bound: float) -> None:
        n, nb = inst.n, inst.nb
        j = np.arange(nb + 1)
        self.bound = bound
        if math.isinf(bound):
            lo_t: IntArray = np.zeros((n, nb + 1), dtype=np.int64)
            lo_t_exit: IntArray = np.zeros(n, dtype=np.int64)
            reach_t: IntArray = np.full(n, nb, dtype=np.int64)
            solo_t: BoolArray = np.ones(n, dtype=np.bool_)
            self.e_act, self.e_tok = inst.e_act, inst.e_tok
        else:
            slow = inst.tb > bound
            lo_t = (slow & inst.before[None, :, :]).sum(axis=1).astype(np.int64)
            exit_t = (inst.tm[:, :, nb] + inst.hd[:, None]) / inst.share[:, None]
            lo_t_exit = (exit_t[:, :nb] > bound).sum(axis=1).astype(np.int64)
            reach_t = (inst.tb[:, 0, 1:] <= bound).sum(axis=1).astype(np.int64)
            solo_t = exit_t[:, 0] <= bound
            self.e_act = np.where(inst.s_act <= bound, inst.e_act, INF)
            self.e_tok = np.where(inst.s_tok <= bound, inst.e_tok, INF)
        lo = np.maximum(inst.lo_mem, lo_t)
        self.lo = lo
        self.valid: BoolArray = lo < j[None, :]
        length = np.where(self.valid, j[None, :] - lo, 1)
        self.levels = max(1, int(length.max()).bit_length())
        k = np.zeros_like(length)
        for level in range(1, self.levels):
            k += length >= (1 << level)
        # flat offsets into a row's sparse table (levels x (B + 2), the last column inf for empty windows)
        stride = nb + 2
        self.stride = stride
        self.ka: IntArray = np.where(self.valid, k * stride + lo, nb + 1).astype(np.int64)
        self.kb: IntArray = np.where(self.valid, k * stride + j[None, :] - (1 << k), nb + 1).astype(np.int64)
        lo_exit = np.maximum(inst.lo_mem_exit, lo_t_exit)
        self.lo_exit = lo_exit
        self.exit_mask: BoolArray = (j[None, :] >= lo_exit[:, None]) & (j[None, :] < nb)
        self.exit_add: FloatArray = inst.pc[:, nb] + inst.ov + inst.hd
        self.reach: IntArray = np.minimum(inst.reach_mem, reach_t)
        self.solo: BoolArray = inst.solo_mem & solo_t
        self.solo_value: FloatArray = np.where(self.solo, inst.tm[:, 0, nb] + inst.hd, INF)


def _window_min(win: _Windows, x: FloatArray, w: IntArray) -> FloatArray:
    """Row r: for each j', the least x[r, j] over j in device w[r]'s window [lo(j'), j' - 1] (inf when empty): a
    sparse table per row (rows wholly inf skipped), in chunks that stay in cache."""
    m, width = x.shape
    out = np.full((m, width), INF)
    live = np.nonzero(x.min(axis=1) < INF)[0]
    levels, stride = win.levels, win.stride
    for s in range(0, len(live), WINDOW_CHUNK):
        rows = live[s : s + WINDOW_CHUNK]
        c = len(rows)
        table = np.empty((c, levels, stride))
        table[:, 0, :width] = x[rows]
        table[:, :, width] = INF
        for level in range(1, levels):
            h = 1 << (level - 1)
            np.minimum(table[:, level - 1, : width - h], table[:, level - 1, h:width], out=table[:, level, : width - h])
            table[:, level, width - h : width] = INF
        flat = table.reshape(-1)
        base = (np.arange(c, dtype=np.int64) * (levels * stride))[:, None]
        dev = w[rows]
        out[rows] = np.minimum(np.take(flat, base + win.ka[dev]), np.take(flat, base + win.kb[dev]))
    return out


# --- the exact programme over subsets ---------------------------------------------------------------------------


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
class _Finals:
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
    inst: _Instance, win: _Windows, entries: IntArray, keep: list[FloatArray] | None = None
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
        mid = _window_min(win, x.reshape(-1, nb + 1), flat_w) + inst.pc[flat_w] + inst.ov[flat_w][:, None]
        table = mid.reshape(ne, step.size, -1, nb + 1)
        if keep is not None:
            keep.append(table)
    return out


def _subset_dp(inst: _Instance, win: _Windows) -> _Finals:
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
    return _Finals(
        np.concatenate([p[0].reshape(-1) for p in parts]).astype(np.int64),
        np.concatenate([p[1].reshape(-1) for p in parts]).astype(np.int64),
        np.concatenate([p[2].reshape(-1) for p in parts]).astype(np.int64),
        np.concatenate([p[3].reshape(-1) for p in parts]).astype(np.float64),
    )


def _reconstruct(inst: _Instance, win: _Windows, full: int, e: int, w: int) -> tuple[list[int], list[int]]:
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


# --- the programme along a fixed order (the heuristic's scorer) -------------------------------------------------


def _chain(
    inst: _Instance,
    win: _Windows,
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
        table = _window_min(win, x, w) + inst.pc[w] + inst.ov[w][:, None]
        furthest = np.maximum(furthest, np.where(np.isfinite(table), j, 0).max(axis=1))
        if keep:
            tables.append(table)
    raise AssertionError("unreachable")


def _chain_cuts(inst: _Instance, win: _Windows, seq: tuple[int, ...]) -> list[int] | None:
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


# --- exact solvers ---------------------------------------------------------------------------------------------


@dataclass
class _Best:
    value: float = INF
    plan: tuple[float, int, int, int] | None = None  # (bound, set, entry, exit)

    def offer(self, value: float, bound: float, full: int, e: int, w: int) -> None:
        if value < self.value:
            self.value, self.plan = value, (bound, full, e, w)


def _plan_of(inst: _Instance, best: _Best) -> Plan:
    assert best.plan is not None
    bound, full, e, w = best.plan
    order, cuts = _reconstruct(inst, inst.windows(bound), full, e, w)
    return tuple(inst.ids[d] for d in order), tuple(cuts)


def _exact_latency(inst: _Instance, bound: float = INF) -> tuple[float, Plan | None]:
    finals = _subset_dp(inst, inst.windows(bound))
    i = finals.best()
    if i < 0 or not math.isfinite(finals.value[i]):
        return INF, None
    best = _Best()
    best.offer(float(finals.value[i]), bound, int(finals.sets[i]), int(finals.entry[i]), int(finals.exit[i]))
    return best.value, _plan_of(inst, best)


def _exact_throughput(inst: _Instance) -> tuple[float, Plan | None]:
    if inst.flight == 1 and not inst.quota:  # max(L, b) = L
        return _exact_latency(inst)
    return _exact_bounded(inst, weighted=False)


def _set_usd(inst: _Instance) -> FloatArray:
    usd = np.zeros(1 << inst.n)
    for d in range(inst.n):
        usd[1 << d : 1 << (d + 1)] = usd[: 1 << d] + inst.usd[d]
    return usd


def _exact_cost(inst: _Instance) -> tuple[float, Plan | None]:
    n = inst.n
    base, _ = _subset_dp(inst, inst.windows(INF)).per_set(n)
    feasible = np.isfinite(base)
    if not feasible.any():
        return INF, None
    if (feasible & (_set_usd(inst) == 0)).any():  # free plans: the best throughput among them
        free = [inst.ids[d] for d in range(n) if inst.usd[d] == 0]
        return 0.0, _exact_throughput(_Instance(inst.model, inst.cluster, free, inst.requests, inst.flight))[1]
    return _exact_bounded(inst, weighted=True)


def _exact_bounded(inst: _Instance, weighted: bool) -> tuple[float, Plan | None]:
    """min over T of min over device sets S of w(S) * max(L*_S(T) / R, T), T over the candidate bottlenecks, with
    w(S) = usd(S) / 3.6e6 (``weighted``: $ per token) or 1 (ms per token; then only the best S matters).

    Best-first branch and bound over intervals [a, b] of the sorted candidates, knowing f_S = L*_S / R at C[b]: for T
    in [C[a], C[b]], f_S(T) >= f_S(C[b]) and T >= C[a], so no plan there beats min_S w(S) * max(f_S(C[b]), C[a]).
    An interval whose bound reaches the best plan met is dropped; otherwise the programme runs at its middle and it
    splits in two. Each run offers its best plan, whose value is at most w(S) * max(f_S(T), T)."""
    r, n = inst.flight, inst.n
    cand = inst.candidates()
    nc = len(cand)
    weights = _set_usd(inst) / MS_PER_HOUR if weighted else np.ones(1)
    best = _Best()

    def run(i: int) -> FloatArray:
        t = float(cand[i])
        finals = _subset_dp(inst, inst.windows(t))
        if weighted:
            lat, where = finals.per_set(n)
        else:
            a = finals.best()
            lat = np.array([finals.value[a] if a >= 0 else INF])
            where = np.array([a], dtype=np.int64)
        f = lat / r
        score = _scores(weights, f, t)
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
        heapq.heappush(heap, (float(_scores(weights, f_mid, float(cand[a])).min()), a, mid, f_mid))
        heapq.heappush(heap, (float(_scores(weights, f_b, float(cand[mid + 1])).min()), mid + 1, b, f_b))
    if best.plan is None:
        return INF, None
    return best.value, _plan_of(inst, best)


def _scores(weights: FloatArray, f: FloatArray, t: float) -> FloatArray:
    """w(S) * max(f_S, t), inf where f_S is."""
    out = np.full(len(f), INF)
    ok = np.isfinite(f)
    out[ok] = (weights if len(weights) == len(f) else np.broadcast_to(weights, f.shape))[ok] * np.maximum(f[ok], t)
    return out


# --- the heuristic -----------------------------------------------------------------------------------------------


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

    def __init__(self, inst: _Instance, pool: int) -> None:
        self.inst, self.pool = inst, max(0, min(pool, MAX_EXACT, inst.n))
        self.kept: dict[tuple[int, ...], float] = {}  # the best lists found, with the bound they were found at
        self.plans: list[tuple[tuple[int, ...], float]] = []  # every local optimum: order, bound
        self._pools: dict[tuple[int, ...], _Instance] = {}
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
            values, short = self.inst.chain_values(new, bound, base)
            masks, _ = self._sets(new)
            for q, value, miss, mask in zip(new, values.tolist(), short.tolist(), masks.tolist()):
                known[q] = value if miss == 0 else -float(miss)
                if value < self.seen.get(mask, INF):
                    self.seen[mask] = value
        raw = np.array([known[q] for q in seqs])
        lat = np.where(raw >= 0, raw, INF)
        if kind == "cost":
            lat = _scores(self._sets(seqs)[1], lat / self.inst.flight, bound if math.isfinite(bound) else 0.0)
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
            sub = self._pools[key] = _Instance(
                self.inst.model,
                self.inst.cluster,
                [self.inst.ids[d] for d in key],
                self.inst.requests,
                self.inst.flight,
            )
        finals = _subset_dp(sub, sub.windows(bound))
        if not len(finals.value):
            return None
        if kind == "cost":
            lat, where = finals.per_set(sub.n)
            score = _scores(_set_usd(sub), lat / sub.flight, bound if math.isfinite(bound) else 0.0)
            s = int(np.argmin(score))
            if not math.isfinite(score[s]):
                return None
            a = int(where[s])
        else:
            a = int(np.argmin(finals.value))
            if not math.isfinite(finals.value[a]):
                return None
        order, _ = _reconstruct(sub, sub.windows(bound), int(finals.sets[a]), int(finals.entry[a]), int(finals.exit[a]))
        return tuple(key[d] for d in order)

    def solve(self, bound: float, kind: str, starts: int = 2) -> tuple[tuple[int, ...] | None, float]:
        """The best list found at ``bound`` and its score."""
        n = self.inst.n
        self.seen = {}
        seeds: list[tuple[int, ...]] = [tuple(self.fastest[:k]) for k in range(1, n + 1)]
        seeds += [tuple(self.roomiest[:k]) for k in range(1, n + 1)]
        seeds += list(self.kept)
        values = self.score(seeds, bound, kind)
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
            seq, value = self._descend(seq, bound, kind)
            if value >= UNFIT:
                continue
            self.plans.append((seq, bound))
            if value < best_value:
                best, best_value = seq, value
        if best is not None:
            self.kept[best] = bound
        return best, best_value

    def _descend(self, seq: tuple[int, ...], bound: float, kind: str) -> tuple[tuple[int, ...], float]:
        """Best improvement over ``_neighbours``; at a local optimum, once over ``_compound`` (variable
        neighbourhood descent)."""
        value = float(self.score([seq], bound, kind)[0])
        wide = False
        while True:
            near = (_compound if wide else _neighbours)(seq, self.inst.n)
            values = self.score(near, bound, kind, base=seq)
            i = int(np.argmin(values)) if len(near) else -1
            if i >= 0 and values[i] < value - 1e-12 * abs(value):
                seq, value, wide = near[i], float(values[i]), False
            elif wide:
                return seq, value
            else:
                wide = True


def _heuristic(inst: _Instance, objective: Objective, pool: int) -> Plan | None:
    """The heuristic's plan (see the module's docstring), or None when it found none that fits."""
    h = _Heuristic(inst, pool)
    kind, r = objective.kind, inst.flight
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

        lo, hi = int(np.searchsorted(cand, base / r, side="left")), nc
        while lo < hi:
            mid = (lo + hi) // 2
            if f(mid) <= cand[mid]:
                hi = mid
            else:
                lo = mid + 1
        for i in (lo, lo - 1):
            if 0 <= i < nc:
                f(i)
    elif kind == "cost" and nc:
        # the exact search's branch and bound over T (``_exact_bounded``), on what the local search met: its bound
        # for an interval uses the sets seen at the interval's right end only, so it guides rather than proves
        probes = 0

        def run(i: int) -> tuple[FloatArray, FloatArray, float]:
            nonlocal probes
            probes += 1
            score = h.solve(float(cand[i]), "cost")[1]
            prices = inst.usd.tolist()
            usd = np.array([sum(prices[d] for d in range(inst.n) if m >> d & 1) for m in h.seen])
            return usd, np.array(list(h.seen.values())) / r, score

        top = run(nc - 1)
        incumbent = top[2]
        heap = [(0.0, 0, nc - 1, top[0], top[1])]
        while heap and probes < COST_PROBES:
            bound, a, b, usd_b, f_b = heapq.heappop(heap)
            if bound >= incumbent:
                break
            if cand[b] <= cand[a] * (1 + COST_RESOLUTION):
                continue
            mid = (a + b) // 2
            usd_m, f_m, score = run(mid)
            incumbent = min(incumbent, score)
            for lo, hi, usd, per in ((a, mid, usd_m, f_m), (mid + 1, b, usd_b, f_b)):
                lb = float(_scores(usd, per, float(cand[lo])).min()) if len(per) else INF
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
        sub = _Instance(inst.model, inst.cluster, free, inst.requests, r)
        plan = _heuristic(sub, Objective(kind="throughput", requests=r), pool)
        if plan is not None:
            return plan
    return tuple(inst.ids[d] for d in seq), found[seq][1]


def _plan_value(inst: _Instance, seq: tuple[int, ...], cuts: Sequence[int], objective: Objective) -> float:
    return evaluate(inst.model, inst.cluster, [inst.ids[d] for d in seq], cuts, objective)


# --- what no plan can fix ---------------------------------------------------------------------------------------


def _shortfall(inst: _Instance, exact: bool) -> PlanError:
    """The resource that no plan has enough of, and by how much. ``exact``: the exact search found no plan (so
    contiguous ranges are known not to fit); otherwise the heuristic found none."""
    model, r = inst.model, inst.requests
    weights = sum(b.weight_bytes for b in model.blocks) + model.embed_bytes + model.head_bytes
    kv = sum(b.kv_bytes for b in model.blocks) * model.max_context * r
    need = weights + kv
    room = [max(0, int(f)) for f in inst.free]
    cap, largest = sum(room), max(room)
    what = (
        f"{gib(weights)} of weights + {gib(kv)} of KV cache for {model.max_context} tokens x {r} "
        f"request{'s' if r != 1 else ''}"
    )
    if need > cap:
        return PlanError(
            f"the model needs {gib(need)} ({what}) but the cluster's devices hold at most {gib(cap)} together after "
            f"their runtime reserves — {gib(need - cap)} short; add a device or memory (or lower max_context or "
            "requests)"
        )
    worst = max(range(inst.nb), key=lambda b: inst.need[b])
    if inst.need[worst] > largest:
        return PlanError(
            f"block {worst} alone needs {gib(inst.need[worst])} (weights + KV cache) but the largest device holds "
            f"{gib(largest)} after its runtime reserve — {gib(inst.need[worst] - largest)} short; a block is not "
            "split: use a device with more memory (or lower max_context or requests)"
        )
    if inst.nb == 1 or inst.n == 1:
        return PlanError(
            f"the only node needs {gib(need)} ({what}) but the largest device holds {gib(largest)} after its runtime "
            f"reserve — {gib(need - largest)} short; use a device with more memory"
        )
    for role, nbytes, parts in (
        ("entry", model.embed_bytes + inst.need[0], "the embedding + block 0"),
        ("exit", model.head_bytes + inst.need[-1], f"block {inst.nb - 1} + the head"),
    ):
        if nbytes > largest:
            return PlanError(
                f"the {role} needs at least {gib(nbytes)} ({parts}) but the largest device holds {gib(largest)} after "
                f"its runtime reserve — {gib(nbytes - largest)} short; use a device with more memory"
            )
    placed, used = _longest_prefix(inst)
    rest = int(inst.pm[inst.nb] - inst.pm[placed]) + model.head_bytes
    left = f"blocks {placed}..{inst.nb} and the head" if placed < inst.nb else "the head"
    on = ", ".join(inst.ids[d] for d in used) or "none"
    if exact:
        return PlanError(
            f"the devices hold {gib(cap)} together after their runtime reserves, enough for the model's {gib(need)}, "
            f"but not in contiguous block ranges: the most any order of them holds from block 0 is blocks "
            f"0..{placed} (on {on}), leaving {left} ({gib(rest)}) — {gib(rest)} short on one more device; add a "
            "device with that much memory after its reserve"
        )
    return PlanError(
        f"the heuristic search over {inst.n} devices found no plan that fits their memory (packing blocks from block "
        f"0 holds blocks 0..{placed} on {on}, leaving {left}, {gib(rest)}), though the devices hold {gib(cap)} "
        f"together for the model's {gib(need)}; raise exact_limit (up to {MAX_EXACT}) or add memory"
    )


def _longest_prefix(inst: _Instance) -> tuple[int, list[int]]:
    """The most blocks an order of some of the devices holds from block 0 (each device one range that fits, the
    first with the embedding; the head left out), and the devices: exact up to MAX_EXACT devices, greedy beyond."""
    n, nb = inst.n, inst.nb
    pm, free = [int(v) for v in inst.pm], [int(v) for v in inst.free]

    def extend(j: int, d: int, entry: bool) -> int:
        """The end of the longest range from block j that device d holds."""
        room = free[d] - (inst.embed if entry else 0)
        return max(j, min(nb, bisect.bisect_right(pm, pm[j] + room) - 1))

    if n > MAX_EXACT:
        used: list[int] = []
        j = 0
        left = set(range(n))
        while left:
            d = max(sorted(left), key=lambda d: extend(j, d, not used))
            k = extend(j, d, not used)
            if k == j:
                break
            used.append(d)
            left.discard(d)
            j = k
        return j, used
    reach: dict[tuple[int, int], tuple[int, list[int]]] = {}
    best: tuple[int, list[int]] = (0, [])
    for d in range(n):
        k = extend(0, d, True)
        if k > 0:
            reach[(1 << d, d)] = (k, [d])
    for mask in range(1, 1 << n):
        for v in range(n):
            got = reach.get((mask, v))
            if got is None:
                continue
            if got[0] > best[0]:
                best = got
            for w in range(n):
                if mask >> w & 1:
                    continue
                k = extend(got[0], w, False)
                key = (mask | 1 << w, w)
                if k > got[0] and (key not in reach or reach[key][0] < k):
                    reach[key] = (k, [*got[1], w])
    return best


# --- the planner ---------------------------------------------------------------------------------------------------


def _instance(model: ModelGraph, cluster: Cluster, objective: Objective) -> tuple[_Instance, Objective]:
    """The search's instance, and the objective it searches: ``latency`` on a cluster with CPU quotas is max(L, b),
    which is ``throughput`` with one request in flight (the KV cache still counted for ``objective.requests``)."""
    latency = objective.kind == "latency"
    inst = _Instance(
        model, cluster, [d.id for d in cluster.devices], objective.requests, 1 if latency else objective.requests
    )
    if latency and inst.quota:
        return inst, Objective(kind="throughput", requests=1)
    return inst, objective


def _search(model: ModelGraph, cluster: Cluster, objective: Objective, exact_limit: int) -> Plan:
    if not 0 <= exact_limit <= MAX_EXACT:
        raise ValueError(
            f"exact_limit must be 0 to {MAX_EXACT} (the exact search's tables grow as 2^n), got {exact_limit}"
        )
    inst, objective = _instance(model, cluster, objective)
    if inst.n <= exact_limit:
        solver: Callable[[_Instance], tuple[float, Plan | None]] = {
            "latency": _exact_latency,
            "throughput": _exact_throughput,
            "cost": _exact_cost,
        }[objective.kind]
        plan = solver(inst)[1]
        if plan is None:
            raise _shortfall(inst, exact=True)
        return plan
    plan = _heuristic(inst, objective, pool=exact_limit)
    if plan is None:
        raise _shortfall(inst, exact=False)
    return plan


def plan_optimal(model: ModelGraph, cluster: Cluster, objective: Objective, exact_limit: int = 8) -> PlanDoc:
    """The best plan for ``objective``: exact for up to ``exact_limit`` devices (at most 12), the heuristic with an
    exact seed over a pool of ``exact_limit`` devices beyond (see the module's docstring). Unused devices are left
    out (not listed as spares). Raise PlanError naming the short resource, and by how much, when no plan fits."""
    devices, cuts = _search(model, cluster, objective, exact_limit)
    return chain(model, cluster, devices, cuts, objective, policy="optimal")


def solve(
    model: ModelGraph, cluster: Cluster, objective: Objective, exact_limit: int = 8
) -> tuple[float, tuple[str, ...], tuple[int, ...]]:
    """``plan_optimal``'s choice as (value by ``evaluate``, devices in loop order, inner cuts)."""
    devices, cuts = _search(model, cluster, objective, exact_limit)
    return evaluate(model, cluster, devices, cuts, objective), devices, cuts


def solve_heuristic(
    model: ModelGraph, cluster: Cluster, objective: Objective, pool: int
) -> tuple[float, tuple[str, ...], tuple[int, ...]]:
    """The heuristic's choice whatever the number of devices (its exact seed over a pool of ``pool`` devices; 0: no
    exact seed), as (value, devices, cuts)."""
    inst, searched = _instance(model, cluster, objective)
    plan = _heuristic(inst, searched, pool)
    if plan is None:
        raise _shortfall(inst, exact=False)
    return evaluate(model, cluster, plan[0], plan[1], objective), plan[0], plan[1]


def measure_gap(model: ModelGraph, cluster: Cluster, objective: Objective, pool: int) -> dict[str, float]:
    """The heuristic with a pool of ``pool`` devices (fewer than the cluster's, so that it searches) against the exact
    search on one instance: both values and gap = heuristic / exact - 1 (0 when both are 0; never below 0)."""
    exact = solve(model, cluster, objective, exact_limit=MAX_EXACT)[0]
    heuristic = solve_heuristic(model, cluster, objective, pool)[0]
    if exact == 0:
        gap = 0.0 if heuristic == 0 else INF
    else:
        gap = heuristic / exact - 1
    return {"exact": exact, "heuristic": heuristic, "gap": gap}


# --- the reference: every plan -------------------------------------------------------------------------------------


def brute_force(model: ModelGraph, cluster: Cluster, objective: Objective) -> tuple[float, list[str], list[int]]:
    """Every ordered subset of the devices and every cut of the blocks into that many non-empty ranges, each checked
    for memory and valued by ``evaluate``'s arithmetic (``ppharness.plan.cost``): the exact answer, for small
    instances (it grows as n! * C(B - 1, n - 1)). Raise PlanError when no plan fits."""
    nb, r = len(model.blocks), objective.requests
    ids = [d.id for d in cluster.devices]
    need = [0, *itertools.accumulate(_block_bytes(model, b, r) for b in range(nb))]
    room = {d.id: d.memory - d.reserve for d in cluster.devices}
    price = {d.id: d.usd_per_hour for d in cluster.devices}

    @functools.cache
    def node(dev: str, lo: int, hi: int, head: bool) -> float:
        return node_ms(model, cluster.device(dev), lo, hi, head)

    @functools.cache
    def link(a: str, b: str, token: bool) -> tuple[float, float]:
        nbytes = model.token_bytes if token else model.activation_bytes
        return edge_ms(cluster, a, b, nbytes), serialization_ms(cluster, a, b, nbytes)

    best: tuple[float, list[str], list[int]] | None = None
    for k in range(1, min(len(ids), nb) + 1):
        for devices in itertools.permutations(ids, k):
            for cuts in itertools.combinations(range(1, nb), k - 1):
                bounds = (0, *cuts, nb)
                ok = True
                for i, dev in enumerate(devices):
                    extra = (model.embed_bytes if i == 0 else 0) + (model.head_bytes if i == k - 1 else 0)
                    if need[bounds[i + 1]] - need[bounds[i]] + extra > room[dev]:
                        ok = False
                        break
                if not ok:
                    continue
                total, busiest = 0.0, 0.0
                for i, dev in enumerate(devices):
                    t = node(dev, bounds[i], bounds[i + 1], i == k - 1)
                    total += t
                    busiest = max(busiest, busy_ms(t, cluster.device(dev)))
                for a, b in zip(devices, devices[1:]):
                    e, s = link(a, b, False)
                    total += e
                    busiest = max(busiest, s)
                e, s = link(devices[-1], devices[0], True)
                total += e
                busiest = max(busiest, s)
                value = _value(objective.kind, r, total, busiest, sum(price[d] for d in devices))
                if best is None or value < best[0]:
                    best = (value, list(devices), list(cuts))
    if best is None:
        raise _shortfall(_Instance(model, cluster, ids, r), exact=True)
    return best
