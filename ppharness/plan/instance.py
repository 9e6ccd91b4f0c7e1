"""The planner's instance: the cost model (``ppharness.plan.cost``) over a list of devices as arrays — per-block time
and memory prefix sums, the links — and what a bound on node times and link serialisation leaves feasible, for the
exact programme (``ppharness.plan.exact``) and the heuristic (``ppharness.plan.heuristic``)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ppharness.errors import PlanError
from ppharness.plan.cost import block_seconds, cpu_share, edge_ms, head_ms, serialization_ms
from ppharness.plan.doc import Cluster, ModelGraph
from ppharness.plan.objective import block_bytes

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

INF = math.inf
WINDOW_CHUNK = 128  # rows per sparse table (about 1 MiB)
Plan = tuple[tuple[str, ...], tuple[int, ...]]  # device ids in loop order, inner cut points


class Instance:
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
        need = [block_bytes(model, b, requests) for b in range(nb)]
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
        self._windows: dict[float, Windows] = {}

    def _links(self, nbytes: int) -> tuple[FloatArray, FloatArray]:
        n = self.n
        e, s = np.zeros((n, n)), np.zeros((n, n))
        for a, src in enumerate(self.ids):
            for b, dst in enumerate(self.ids):
                e[a, b] = edge_ms(self.cluster, src, dst, nbytes)
                s[a, b] = serialization_ms(self.cluster, src, dst, nbytes)
        return e, s

    def windows(self, bound: float) -> Windows:
        found = self._windows.get(bound)
        if found is None:
            found = self._windows[bound] = Windows(self, bound)
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


class Windows:
    """What a bound T on node times and link serialisation (inf: none) leaves feasible, as the programme uses it."""

    def __init__(self, inst: Instance, bound: float) -> None:
        n, nb = inst.n, inst.nb
        j = np.arange(nb + 1)
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
        self.exit_mask: BoolArray = (j[None, :] >= lo_exit[:, None]) & (j[None, :] < nb)
        self.exit_add: FloatArray = inst.pc[:, nb] + inst.ov + inst.hd
        self.reach: IntArray = np.minimum(inst.reach_mem, reach_t)
        self.solo: BoolArray = inst.solo_mem & solo_t
        self.solo_value: FloatArray = np.where(self.solo, inst.tm[:, 0, nb] + inst.hd, INF)


def window_min(win: Windows, x: FloatArray, w: IntArray) -> FloatArray:
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
