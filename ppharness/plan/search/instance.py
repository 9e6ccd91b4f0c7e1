"""The planner's instance: the cost model (``ppharness.plan.predict.cost``) over a list of devices as arrays — per-block
time and memory prefix sums, the links — and what a bound on node times and link serialisation leaves feasible, for the
exact programme (``ppharness.plan.search.exact``) and the heuristic (``ppharness.plan.search.heuristic``)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ppharness.errors import PlanError
from ppharness.network.spec import Impairment
from ppharness.plan.lang.document import Cluster, Link, ModelGraph
from ppharness.plan.predict.cost import block_seconds, cpu_share, head_ms
from ppharness.plan.search.objective import block_bytes

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
            raise PlanError(
                f"the model's weights and KV cache for {model.max_context} tokens x {requests} request(s) come to "
                f"{big:,} bytes, beyond what the planner counts (2^62) — lower max_context or requests, or check the "
                "model's sizes"
            )
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
        self._pairs: tuple[IntArray, list[Impairment]] | None = None
        self.e_act, self.s_act = self._links(model.activation_bytes)
        self.e_tok, self.s_tok = self._links(model.token_bytes)
        self._windows: dict[float, Windows] = {}

    def _links(self, nbytes: int) -> tuple[FloatArray, FloatArray]:
        """``cost.edge_ms`` and ``cost.serialization_ms`` of every pair of the devices, by ``Cluster.link``'s rule
        (a pair's own link, else the host link, else its regions' link, else the default) worked out as arrays, so
        that a cluster of thousands of devices costs no per-pair lookups."""
        which, links = self._link_index()
        rate = np.array([x.rate_mbit if x.rate_mbit is not None else INF for x in links])
        delay = np.array([x.delay_ms for x in links])
        wire = np.where(np.isfinite(rate), nbytes * 8 / (rate * 1e6) * 1e3, 0.0)[which]
        e = delay[which] + wire + self.cluster.hop_ms
        np.fill_diagonal(e, 0.0)
        np.fill_diagonal(wire, 0.0)
        return e, wire

    def _link_index(self) -> tuple[IntArray, list[Impairment]]:
        """For each pair of the devices, which of the returned impairments its link is."""
        if self._pairs is not None:
            return self._pairs
        cluster, n = self.cluster, self.n
        devices = [cluster.device(i) for i in self.ids]
        links: list[Impairment] = [cluster.default, cluster.host_link]
        which = np.zeros((n, n), dtype=np.int64)
        code = {r: k for k, r in enumerate(sorted({d.region for d in devices if d.region is not None}))}
        if code:
            reg = np.array([code[d.region] if d.region is not None else -1 for d in devices])
            table = np.zeros((len(code), len(code)), dtype=np.int64)
            for a, b, k in _directed(cluster.region_links, code, len(links)):
                table[a, b] = k
            links += cluster.region_links
            apart = (reg[:, None] >= 0) & (reg[None, :] >= 0) & (reg[:, None] != reg[None, :])
            safe = np.maximum(reg, 0)
            which = np.where(apart, table[safe[:, None], safe[None, :]], which)
        hosts = {h: k for k, h in enumerate(dict.fromkeys(d.source.host for d in devices if d.source.host))}
        if hosts:
            host = np.array([hosts[d.source.host] if d.source.host else -1 for d in devices])
            which = np.where((host[:, None] >= 0) & (host[:, None] == host[None, :]), 1, which)
        for a, b, k in _directed(cluster.links, {d: k for k, d in enumerate(self.ids)}, len(links)):
            which[a, b] = k
        links += cluster.links
        self._pairs = (which, links)
        return self._pairs

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


def _directed(links: Sequence[Link], code: dict[str, int], first: int) -> list[tuple[int, int, int]]:
    """(from, to, first + k) for each of ``links`` (k: its index) whose ends ``code`` numbers, both ways, a link given
    one way only holding the other way too: a pair's own direction first, so that it wins when written after."""
    given = {(link.src, link.dst) for link in links}
    back, ahead = [], []
    for k, link in enumerate(links, start=first):
        a, b = code.get(link.src), code.get(link.dst)
        if a is None or b is None:
            continue
        ahead.append((a, b, k))
        if (link.dst, link.src) not in given:
            back.append((b, a, k))
    return back + ahead


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
