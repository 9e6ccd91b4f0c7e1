"""``ppharness bench wan --calibrate``: how faithfully the packet-level emulator does what a scenario tells it.

Each case sets up the packet layer of a run for two nodes, ``stage-0`` and ``stage-1``, on loopback: their ports
from ``plan_ports``, a bridge each (``ppharness.network.bridge``) with the case's impairment as the network's
``default``, and their Unix sockets in a temporary folder. A client socket bound on stage-0's quic port sends to
127.0.0.1:<stage-1's virtual port>, where stage-0's bridge stands for stage-1; the datagrams cross the link
stage-0 -> stage-1 and stage-1's bridge hands them to a sink socket bound on stage-1's quic port. Every payload starts
with a sequence number and the send time (``time.monotonic()``), padded to a size drawn from the case's range. The
sink asks the kernel to stamp each arrival (``recv_stamped``), so the figures are the emulator's and not the
measuring loop's lateness. Per case, configured against measured:

- delay (5, 25 and 50 ms, no jitter), at the chain's packet rates (hundreds of datagrams a second, 100 B to 1200 B):
  one-way delay p50 within 1 ms and p99 within 2 ms of the configured delay;
- loss (1 % and 5 % random, and a Gilbert-Elliott case against ``Bursty.steady_loss()``): the fraction of sequence
  numbers that never reach the sink, within 5 % (relative) of the configured loss;
- bandwidth (10 and 50 Mbit/s caps, offered 25 % above the cap in full-size datagrams): the sink's throughput from
  its first arrival to its last, within 5 % of the cap.

The client, the sink and both bridges' threads share one process (in a run, each bridge shares its node's process);
both nodes share this network namespace, which the bridges allow when every node has ports of its own.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import select
import socket
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Literal, TextIO

from ppharness.benchmarks.provenance import stamped
from ppharness.errors import HarnessError
from ppharness.network.bridge import Bridge
from ppharness.network.datagram import enable_timestamps, recv_stamped, set_buffers
from ppharness.network.packet import plan_ports
from ppharness.network.shaper import LinkStats
from ppharness.network.spec import Bursty, Impairment, Network
from ppharness.trace.report import percentile

CLIENT_NODE, SINK_NODE = "stage-0", "stage-1"
HOST = "127.0.0.1"
HEADER = struct.Struct("!Qd")  # sequence number, send time (time.monotonic(), seconds)
SOCKET_BUFFER = 4 * 2**20
SEND_BURST = 64  # datagrams sent in one go before the loop reads the sink again
QUIET_S = 0.25  # the sink is done when nothing has arrived for this long (after the configured delay)

DELAY_P50_MS, DELAY_P99_MS = 1.0, 2.0  # targets: measured within this much of the configured delay
RELATIVE = 0.05  # target for loss and bandwidth: within 5 % of the configured value
CHAIN_PPS = 400.0  # the chain's packet rate: a few hundred datagrams a second
CHAIN_SIZES = (100, 1200)
DELAY_PACKETS = 600
# Loss is measured by counting, so its figure is only as good as the count is large: with n datagrams and loss p the
# measured fraction has a standard error of sqrt(p(1-p)/n) (more for bursty loss, whose losses come in runs). Each loss
# case sends enough datagrams that this error is at most half the 5 % tolerance: a faithful emulator then lands within
# the tolerance about 95 times in 100, and one off by 10 % lands outside it about 98 times in 100 (a tolerance smaller
# than the count's own noise would decide nothing). For 1 % loss that is 158,400 datagrams. A datagram's fate is
# drawn from the link's generator in order and does not depend on when it is sent, so the loss cases send faster than
# the chain does, to stay within a minute in all; a window of datagrams in flight keeps them from outrunning the
# bridges on a busy machine (a socket buffer overflowing would add losses that are not the link's).
LOSS_SE_SHARE = 0.5
LOSS_PPS = 10_000.0
LOSS_WINDOW = 256
WINDOW_POLL_S = 0.0005
BANDWIDTH_S = 2.0
BANDWIDTH_OVERLOAD = 1.25  # offered load over the cap
BULK_SIZE = 1200  # bulk transfer fills datagrams to the path's MTU: the rate cap bites on full-size datagrams

Kind = Literal["delay", "loss", "bandwidth"]


@dataclass(frozen=True)
class Case:
    """One calibration case: an impairment, and the traffic that measures it."""

    name: str
    kind: Kind
    impairment: Impairment
    packets: int
    rate_pps: float
    sizes: tuple[int, int] = CHAIN_SIZES
    window: int | None = None  # at most this many datagrams between the sender and the sink (None: paced by time)


@dataclass
class Check:
    """One target: the configured figure, the measured one, and whether it was met."""

    metric: str
    unit: str
    configured: float
    measured: float
    target: str
    met: bool


@dataclass
class CaseResult:
    case: str
    kind: str
    sent: int
    received: int
    seconds: float
    checks: list[Check]
    link: dict[str, int] = field(default_factory=dict)  # stage-0's bridge's counters for the link stage-0 -> stage-1
    extra: dict[str, float] = field(default_factory=dict)  # further figures (min delay, loss as drawn, offered rate)


@dataclass
class Calibration:
    seed: int
    cases: list[CaseResult]

    @property
    def checks(self) -> list[Check]:
        return [c for r in self.cases for c in r.checks]

    @property
    def met(self) -> bool:
        return all(c.met for c in self.checks)


# --- the cases ------------------------------------------------------------------------------------------------------


def loss_packets(impairment: Impairment, tolerance: float = RELATIVE, se_share: float = LOSS_SE_SHARE) -> int:
    """Datagrams needed for the measured loss's standard error to be ``se_share`` of ``tolerance`` (relative).

    Random loss: each datagram is lost independently, variance p(1-p) per datagram. Gilbert-Elliott: the state is a
    two-state Markov chain whose correlation decays by lam = 1 - p - r per datagram, so neighbouring losses covary by
    (loss_bad - loss_good)^2 pi (1 - pi) lam^k and the long-run variance per datagram adds twice their sum.
    """
    m = impairment.mean_loss()
    if m <= 0:
        return 0
    variance = m * (1.0 - m)
    g = impairment.bursty
    if g is not None:
        pi = g.p / (g.p + g.r)
        lam = 1.0 - g.p - g.r
        if lam < 1.0:
            variance += 2.0 * (g.loss_bad - g.loss_good) ** 2 * pi * (1.0 - pi) * lam / (1.0 - lam)
    return math.ceil(variance / (m * tolerance * se_share) ** 2)


def _loss_case(name: str, impairment: Impairment) -> Case:
    return Case(name, "loss", impairment, loss_packets(impairment), LOSS_PPS, window=LOSS_WINDOW)


def _bandwidth_case(rate_mbit: float) -> Case:
    offered_pps = rate_mbit * 1e6 / 8 / BULK_SIZE * BANDWIDTH_OVERLOAD
    return Case(
        f"rate {rate_mbit:g} Mbit/s",
        "bandwidth",
        Impairment(rate_mbit=rate_mbit),
        math.ceil(offered_pps * BANDWIDTH_S),
        offered_pps,
        (BULK_SIZE, BULK_SIZE),
    )


GILBERT_ELLIOTT = Bursty(p=0.05, r=0.5, loss_bad=0.5)  # bad 1 datagram in 11, runs of 2 on average; 4.5 % lost


def default_cases() -> list[Case]:
    return [
        *(Case(f"delay {d} ms", "delay", Impairment(delay_ms=d), DELAY_PACKETS, CHAIN_PPS) for d in (5, 25, 50)),
        _loss_case("loss 1 %", Impairment(loss=0.01)),
        _loss_case("loss 5 %", Impairment(loss=0.05)),
        _loss_case("bursty loss (Gilbert-Elliott)", Impairment(bursty=GILBERT_ELLIOTT)),
        _bandwidth_case(10.0),
        _bandwidth_case(50.0),
    ]


def quick_cases() -> list[Case]:
    """One small case of each kind (seconds in all): the structure of a calibration, not its precision."""
    return [
        Case("delay 5 ms", "delay", Impairment(delay_ms=5), 100, CHAIN_PPS),
        Case("loss 5 %", "loss", Impairment(loss=0.05), 2000, 4000.0, window=LOSS_WINDOW),
        Case("rate 10 Mbit/s", "bandwidth", Impairment(rate_mbit=10.0), 500, 1300.0, (BULK_SIZE, BULK_SIZE)),
    ]


# --- measuring one case ---------------------------------------------------------------------------------------------


@dataclass
class _Traffic:
    sent: int
    seconds: float
    seqs: list[int]  # per arrival
    one_way_s: list[float]
    sizes: list[int]
    arrived: list[float]  # kernel arrival times, time.monotonic()'s clock
    link: LinkStats


def _udp_socket(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        set_buffers(sock, SOCKET_BUFFER)
        sock.bind((HOST, port))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _drive(case: Case, seed: int) -> _Traffic:
    """Send the case's datagrams through two bridges to a sink; what arrived, when."""
    lo, hi = case.sizes
    if lo < HEADER.size or hi < lo or case.packets < 1 or case.rate_pps <= 0:
        raise HarnessError(f"bench wan: case {case.name!r} needs sizes of at least {HEADER.size} B and some datagrams")
    rng = random.Random(seed)
    sizes = [rng.randint(lo, hi) for _ in range(case.packets)]
    padding = bytes(hi)
    network = Network(seed=seed, default=case.impairment)
    table = plan_ports([CLIENT_NODE, SINK_NODE], HOST)
    seqs: list[int] = []
    one_way: list[float] = []
    got_sizes: list[int] = []
    arrived: list[float] = []
    quiet_s = QUIET_S + case.impairment.delay_ms / 1000.0
    with tempfile.TemporaryDirectory(prefix="ppharness-wan-") as directory, contextlib.ExitStack() as stack:
        try:
            client = stack.enter_context(_udp_socket(table[CLIENT_NODE][0]))
            sink = stack.enter_context(_udp_socket(table[SINK_NODE][0]))
            enable_timestamps(sink)
            sender = stack.enter_context(Bridge(network, CLIENT_NODE, table, directory))
            receiver = stack.enter_context(Bridge(network, SINK_NODE, table, directory))
        except OSError as exc:
            raise HarnessError(f"bench wan: cannot set up two bridges on loopback: {exc}") from exc
        address = (HOST, table[SINK_NODE][1])  # the sender's bridge stands there for the sink's node
        interval = 1.0 / case.rate_pps
        t0 = time.monotonic()
        k = 0
        last = t0
        while True:
            now = time.monotonic()
            burst = 0
            room = SEND_BURST
            if case.window is not None:
                link = sender.stats().get((CLIENT_NODE, SINK_NODE), LinkStats())
                gone = link.lost + link.dropped_by_queue + link.cut + link.overflow + link.send_errors + receiver.errors
                in_flight = k + link.duplicated - gone - len(seqs)  # anywhere between the client and the sink
                room = min(room, case.window - in_flight)
            while k < case.packets and t0 + k * interval <= now and burst < room:
                payload = HEADER.pack(k, time.monotonic()) + padding[: sizes[k] - HEADER.size]
                try:
                    client.sendto(payload, address)
                except BlockingIOError:
                    break  # the send buffer is full: this datagram goes again on the next round
                k += 1
                burst += 1
            if burst:
                last = max(last, time.monotonic())  # the last sign of life: a send, or an arrival
            if k < case.packets:
                timeout = max(0.0, t0 + k * interval - time.monotonic())
                if burst >= room and case.window is not None:  # the window is full: arrivals (or a moment) open it
                    timeout = max(timeout, WINDOW_POLL_S)
            else:
                timeout = max(0.0, last + quiet_s - time.monotonic())
                if timeout == 0.0:
                    break
            ready, _, _ = select.select([sink], [], [], timeout)
            if not ready:
                continue
            while True:
                try:
                    data, _, at = recv_stamped(sink)
                except BlockingIOError:
                    break
                if len(data) < HEADER.size:
                    continue
                seq, sent_at = HEADER.unpack_from(data)
                seqs.append(seq)
                one_way.append(at - sent_at)
                got_sizes.append(len(data))
                arrived.append(at)
                last = max(last, time.monotonic())
        seconds = time.monotonic() - t0
        link = sender.stats().get((CLIENT_NODE, SINK_NODE), LinkStats())
    return _Traffic(k, seconds, seqs, one_way, got_sizes, arrived, link)


def _relative_check(metric: str, unit: str, configured: float, measured: float) -> Check:
    met = configured > 0 and abs(measured - configured) <= RELATIVE * configured
    return Check(metric, unit, configured, measured, f"within {RELATIVE * 100:g} %", met)


def _measure(case: Case, seed: int) -> CaseResult:
    t = _drive(case, seed)
    imp = case.impairment
    checks: list[Check] = []
    extra: dict[str, float] = {}
    if case.kind == "delay":
        ms = [x * 1000.0 for x in t.one_way_s]
        p50, p99 = percentile(ms, 50), percentile(ms, 99)
        for metric, value, tol in (("delay p50", p50, DELAY_P50_MS), ("delay p99", p99, DELAY_P99_MS)):
            met = bool(ms) and abs(value - imp.delay_ms) <= tol
            checks.append(Check(metric, "ms", imp.delay_ms, value, f"within {tol:g} ms", met))
        extra["min_ms"] = min(ms) if ms else float("nan")
        extra["max_ms"] = max(ms) if ms else float("nan")
    elif case.kind == "loss":
        delivered = len(set(t.seqs))
        measured = 1.0 - delivered / t.sent if t.sent else float("nan")
        checks.append(_relative_check("loss", "%", imp.mean_loss() * 100.0, measured * 100.0))
        # the shaper's own draws, beside the count at the sink: any difference was lost in the plumbing
        extra["drawn_loss_pct"] = 100.0 * t.link.lost / t.link.sent if t.link.sent else float("nan")
    else:
        assert imp.rate_mbit is not None, "a bandwidth case has a rate cap"
        order = sorted(range(len(t.arrived)), key=t.arrived.__getitem__)
        if len(order) >= 2:
            span = t.arrived[order[-1]] - t.arrived[order[0]]
            nbytes = sum(t.sizes[i] for i in order[1:])  # the first arrival opens the window; its bytes came before
            mbit = nbytes * 8 / span / 1e6 if span > 0 else float("nan")
        else:
            mbit = float("nan")
        checks.append(_relative_check("throughput", "Mbit/s", imp.rate_mbit, mbit))
        extra["offered_mbit"] = case.rate_pps * sum(case.sizes) / 2 * 8 / 1e6
    return CaseResult(case.name, case.kind, t.sent, len(t.seqs), t.seconds, checks, asdict(t.link), extra)


# --- the run --------------------------------------------------------------------------------------------------------


def calibrate(
    cases: list[Case] | None = None, seed: int = 0, progress: Callable[[CaseResult], None] | None = None
) -> Calibration:
    """Measure every case (``default_cases()`` unless given), one after another; ``progress`` hears of each."""
    results: list[CaseResult] = []
    for case in cases if cases is not None else default_cases():
        result = _measure(case, seed)
        results.append(result)
        if progress is not None:
            progress(result)
    return Calibration(seed, results)


def case_line(r: CaseResult) -> str:
    return f"{r.case}: {r.sent} datagrams sent, {r.received} received, {r.seconds:.1f} s"


def table(cal: Calibration) -> str:
    """Configured against measured, one line per target, with MET or MISSED."""
    head = f"{'case':<32} {'metric':<11} {'configured':>12} {'measured':>12}  {'target':<14} result"
    lines = [head, "-" * len(head)]
    for r in cal.cases:
        for c in r.checks:
            lines.append(
                f"{r.case:<32} {c.metric:<11} {_fmt(c.configured, c.unit):>12} {_fmt(c.measured, c.unit):>12}  "
                f"{c.target:<14} {'MET' if c.met else 'MISSED'}"
            )
    met = sum(c.met for c in cal.checks)
    lines.append(f"\n{met} of {len(cal.checks)} targets met (seed {cal.seed})")
    return "\n".join(lines)


def _fmt(value: float, unit: str) -> str:
    if math.isnan(value):
        return "-"
    if unit == "%":
        return f"{value:.3f} %"
    if unit == "ms":
        return f"{value:.2f} ms"
    return f"{value:.2f} {unit}"


def write_json(cal: Calibration, path: str) -> None:
    """The calibration as JSON (a figure that could not be measured is null)."""
    doc = stamped({"seed": cal.seed, "met": cal.met, "cases": [asdict(r) for r in cal.cases]})
    with open(path, "w") as f:
        json.dump(_no_nan(doc), f, indent=2, allow_nan=False)


def _no_nan(value: object) -> object:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_nan(v) for v in value]
    return value


def run_calibration(json_out: str | None = None, seed: int = 0, out: TextIO | None = None) -> Calibration:
    """``ppharness bench wan --calibrate``: every default case, a line each as it ends, then the table."""
    out = out or sys.stdout

    def say(r: CaseResult) -> None:
        print(case_line(r), file=out, flush=True)

    cal = calibrate(seed=seed, progress=say)
    print("\n" + table(cal), file=out)
    if json_out:
        write_json(cal, json_out)
        print(f"written: {json_out}", file=out)
    return cal
