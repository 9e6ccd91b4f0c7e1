"""One directed link's behaviour over time: for each message (or packet) sent on it, when it arrives, if at all.

Both emulation layers use this one model: the message-level transport wrapper (``transports/faults.py``) and the
packet-level bridges between iroh's sockets (``ppharness.network.bridge``). A ``LinkShaper`` is deterministic given
its seed and the sizes and send times of what crosses it.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from ppharness.network.spec import Impairment, Network

PARETO_ALPHA = 3.0  # the pareto jitter's shape; its scale is chosen so that its mean is jitter_ms


def link_rng(seed: int, src: str, dst: str, stream: str = "") -> random.Random:
    """A generator for one link, from the run's seed and the link's name (stable across processes and runs)."""
    digest = hashlib.blake2b(f"{seed}|{src}|{dst}|{stream}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "big"))


class LinkShaper:
    """The fate of each message on one directed link.

    ``fate(nbytes, now_s)`` returns the times (seconds, on the caller's clock) at which copies of the message arrive:
    ``[]`` when it is lost, two times when it is duplicated. Order is kept (an arrival is never before the previous
    one's) except for a message held back by ``reorder``. The random choices (loss, duplicate, reorder, jitter) come
    from the link's own generator in message order, so the same seed gives the same fate to the k-th message.
    """

    def __init__(self, impairment: Impairment, rng: random.Random) -> None:
        self.spec = impairment
        self._rng = rng
        self._bad = False  # Gilbert-Elliott state
        self._busy_until = 0.0  # when the rate cap's "wire" is free again
        self._last_arrival = 0.0
        self.sent = self.lost = self.duplicated = self.reordered = self.dropped_by_queue = 0

    def _lost(self) -> bool:
        spec, rng = self.spec, self._rng
        if spec.bursty is None:
            return spec.loss > 0 and rng.random() < spec.loss
        g = spec.bursty
        self._bad = (rng.random() >= g.r) if self._bad else (rng.random() < g.p)
        loss = g.loss_bad if self._bad else g.loss_good
        return loss > 0 and rng.random() < loss

    def _jitter_s(self) -> float:
        spec, rng = self.spec, self._rng
        j = spec.jitter_ms / 1000.0
        if j <= 0:
            return 0.0
        if spec.jitter == "uniform":
            return rng.uniform(-j, j)
        if spec.jitter == "pareto":  # heavy tail, never early; mean j
            return (rng.paretovariate(PARETO_ALPHA) - 1.0) * j * (PARETO_ALPHA - 1.0)
        return rng.gauss(0.0, j)

    def fate(self, nbytes: int, now_s: float) -> list[float]:
        spec, rng = self.spec, self._rng
        self.sent += 1
        # every draw happens for every message, in the same order, so a message's fate never depends on timing
        lost = self._lost()
        duplicate = spec.duplicate > 0 and rng.random() < spec.duplicate
        reorder = spec.reorder > 0 and rng.random() < spec.reorder
        jitter = self._jitter_s()
        if lost:
            self.lost += 1
            return []
        depart = now_s
        if spec.rate_mbit is not None:
            rate_bytes_s = spec.rate_mbit * 1e6 / 8.0
            start = max(now_s, self._busy_until)
            if (start - now_s) * rate_bytes_s > spec.queue_kb * 1024.0:
                self.dropped_by_queue += 1
                return []
            self._busy_until = depart = start + nbytes / rate_bytes_s
        arrival = depart + max(0.0, spec.delay_ms / 1000.0 + jitter)
        if reorder:
            self.reordered += 1
            arrival += spec.reorder_ms / 1000.0  # held back; later messages may overtake it
        else:
            arrival = max(arrival, self._last_arrival)
            self._last_arrival = arrival
        if duplicate:
            self.duplicated += 1
            return [arrival, arrival + 0.0001]
        return [arrival]


@dataclass
class LinkStats:
    """What one directed link did to the messages (or datagrams) its sender gave it.

    ``sent``: messages taken for this link (cut ones included); ``lost``, ``duplicated``, ``reordered``,
    ``dropped_by_queue``: the link's shaper's counts (random or bursty loss, an extra copy, held back, tail drop
    behind the rate cap); ``cut``: dropped by a partition; ``overflow``: dropped because the sender's queue was full
    (packet layer); ``delivered``: copies passed on towards the receiver when due; ``send_errors``: copies that could
    not be.
    """

    sent: int = 0
    lost: int = 0
    duplicated: int = 0
    reordered: int = 0
    dropped_by_queue: int = 0
    cut: int = 0
    overflow: int = 0
    delivered: int = 0
    send_errors: int = 0


class ShapedLink:
    """One directed link ``src -> dst`` of a layer: its shaper, seeded with ``link_rng(network.seed, src, dst,
    stream)`` so the k-th message or datagram on it meets the same fate in every run with that seed, and its counters.
    ``stream`` keeps the layers' draws apart (the packet layer's is ``packet``)."""

    def __init__(self, network: Network, src: str, dst: str, stream: str = "") -> None:
        self.src, self.dst = src, dst
        self.shaper = LinkShaper(network.impairment(src, dst), link_rng(network.seed, src, dst, stream))
        self.stats = LinkStats()

    def snapshot(self) -> LinkStats:
        s, sh = self.stats, self.shaper
        return LinkStats(
            sent=s.sent,
            lost=sh.lost,
            duplicated=sh.duplicated,
            reordered=sh.reordered,
            dropped_by_queue=sh.dropped_by_queue,
            cut=s.cut,
            overflow=s.overflow,
            delivered=s.delivered,
            send_errors=s.send_errors,
        )
