"""``ppharness bench transport``: round-trip latency of one hop, raw libraries against ppharness transports.

For every payload size it measures, in one run and on loopback, the round trip (send, echo, receive) of:

- raw ZeroMQ: a pyzmq PAIR socket and an echo process, no ppharness code;
- raw iroh: one iroh connection and one bidirectional stream to an echo process that writes back every chunk it
  reads, no framing and no ppharness code; once with the bulk-copy fix of the iroh transport applied in both
  processes ("bulk copy") and once with the binding as shipped ("stock", fewer repeats: it is slow);
- each ppharness transport asked for: ``Transport.send`` of a ``StageActivation`` whose hidden state has the payload
  size, to an echo process that ``recv``s and ``send``s it back, then ``recv`` (codec included on both ends).

Every echo peer is its own process. Measurements are interleaved: each size runs in rounds, and every round gives
each path one batch, so drift and noise on the machine hit every path alike. Figures are p50 and p99 in ms; a
ppharness transport's ratio is its p50 over the p50 of the raw library it wraps, measured in the same run.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import TYPE_CHECKING, TextIO, cast

from ppharness.benchmarks.provenance import stamped
from ppharness.errors import HarnessError
from ppharness.registry import transport_class
from ppharness.seams.transport import JsonObject
from ppharness.trace.report import percentile
from ppharness.wire.messages import StageActivation

if TYPE_CHECKING:
    from iroh import Endpoint, EndpointOptions, RecvStream, SendStream

    from transports.iroh.transport import IrohTransport

BATCH = 10
WARMUP = 5
STOCK_REPEATS_CAP = 20
ALPN = b"ppharness-bench/1"
READ_CHUNK = 1 << 16
TARGET_SIZE, TARGET_RATIO, TARGET_MS = 4096, 1.25, 1.0


@dataclass
class Row:
    size: int
    path: str
    p50_ms: float
    p99_ms: float
    n: int
    baseline: str | None = None
    ratio: float | None = None


def _pct(samples: list[float], q: float) -> float:
    """Seconds in, the ``q``-quantile (0..1) out in ms."""
    return percentile(samples, 100 * q) * 1000


def _human(size: int) -> str:
    return f"{size // 1024} KiB" if size >= 1024 and size % 1024 == 0 else f"{size} B"


# --- echo peers (child processes) -----------------------------------------------------------------------------------


def _iroh_class() -> type[IrohTransport]:
    """The registry's iroh transport, for its bulk-copy switch (the registry types it as any Transport)."""
    return cast("type[IrohTransport]", transport_class("iroh"))


def _iroh_endpoint_options(iroh: ModuleType) -> EndpointOptions:
    options: EndpointOptions = iroh.EndpointOptions(
        preset=iroh.preset_minimal(), bind_addr="127.0.0.1:0", alpns=[ALPN], relay_mode=iroh.RelayMode.disabled()
    )
    return options


def _serve(kind: str, opts: JsonObject) -> None:
    """Run one echo peer; print its address on stdout; exit when stdin closes."""
    threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
    if kind == "raw-zmq":
        import zmq

        sock = zmq.Context().socket(zmq.PAIR)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        print(f"tcp://127.0.0.1:{port}", flush=True)
        while True:
            sock.send(sock.recv(copy=False), copy=False)
    elif kind.startswith("raw-iroh"):
        _iroh_class().bulk_copy(kind == "raw-iroh-bulk")
        asyncio.run(_serve_raw_iroh())
    else:
        transport = transport_class(kind)(**opts)
        print(transport.start(), flush=True)
        while True:
            sender, msg = transport.recv(None)
            transport.send(sender, msg)


async def _serve_raw_iroh() -> None:
    import iroh

    endpoint = await iroh.Endpoint.bind(_iroh_endpoint_options(iroh))
    print(str(iroh.EndpointTicket.from_addr(endpoint.addr())), flush=True)
    incoming = await endpoint.accept_next()
    assert incoming is not None, "the echo endpoint closed before the benchmark connected"
    conn = await (await incoming.accept()).connect()
    stream = await conn.accept_bi()
    recv, send = stream.recv(), stream.send()
    try:
        while chunk := await recv.read(READ_CHUNK):
            await send.write_all(chunk)
    except iroh.IrohError:
        pass


class _Child:
    def __init__(self, kind: str, opts: JsonObject | None = None) -> None:
        env = {**os.environ, "PP_BENCH_OPTS": json.dumps(opts or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ppharness.benchmarks.transport", "--serve", kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        self.address = self.proc.stdout.readline().strip()
        if not self.address:
            self.stop()
            raise HarnessError(f"bench transport: the {kind} echo process did not start (exit {self.proc.returncode})")

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


# --- clients: each returns a function that times ``count`` round trips of one payload -------------------------------

Timer = Callable[[bytes, int], list[float]]
Client = Callable[[_Child], tuple[Timer, Callable[[], None]]]  # connects to an echo peer: (timer, closer)
Measured = tuple[str, str | None, int, Timer]  # (path name, baseline path or None, samples wanted, timer)


def _raw_zmq(child: _Child) -> tuple[Timer, Callable[[], None]]:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.connect(child.address)

    def rounds(payload: bytes, count: int) -> list[float]:
        out = []
        for _ in range(count):
            t0 = time.perf_counter()
            sock.send(payload, copy=False)
            sock.recv(copy=False)
            out.append(time.perf_counter() - t0)
        return out

    def close() -> None:
        sock.close(linger=0)
        ctx.term()

    return rounds, close


def _raw_iroh(child: _Child, bulk: bool) -> tuple[Timer, Callable[[], None]]:
    import iroh

    iroh_cls = _iroh_class()
    loop = asyncio.new_event_loop()

    async def connect() -> tuple[Endpoint, SendStream, RecvStream]:
        endpoint = await iroh.Endpoint.bind(_iroh_endpoint_options(iroh))
        target = iroh.EndpointTicket.from_string(child.address).endpoint_addr()
        stream = await (await endpoint.connect(target, ALPN)).open_bi()
        return endpoint, stream.send(), stream.recv()

    endpoint, send, recv = loop.run_until_complete(connect())

    async def batch(payload: bytes, count: int) -> list[float]:
        out = []
        for _ in range(count):
            t0 = time.perf_counter()
            await send.write_all(payload)
            await recv.read_exact(len(payload))
            out.append(time.perf_counter() - t0)
        return out

    def rounds(payload: bytes, count: int) -> list[float]:
        if not bulk:
            iroh_cls.bulk_copy(False)
        try:
            return loop.run_until_complete(batch(payload, count))
        finally:
            iroh_cls.bulk_copy(True)

    def close() -> None:
        loop.run_until_complete(endpoint.close())
        loop.close()

    return rounds, close


def _ppharness(child: _Child, kind: str, opts: JsonObject) -> tuple[Timer, Callable[[], None]]:
    transport = transport_class(kind)(**opts)
    transport.start()

    def rounds(payload: bytes, count: int) -> list[float]:
        msg = StageActivation(
            request_id="bench",
            position=0,
            hidden=payload,
            seq_len=1,
            is_prefill=False,
            shape=(1, 1, len(payload) // 2),
            dtype="f16",
            plan_id="bench",
        )
        out = []
        for _ in range(count):
            t0 = time.perf_counter()
            transport.send(child.address, msg)
            transport.recv(30.0)
            out.append(time.perf_counter() - t0)
        return out

    return rounds, transport.close


# --- the run --------------------------------------------------------------------------------------------------------


def run_transport_bench(
    sizes: list[int], repeats: int, kinds: list[str], json_out: str | None = None, out: TextIO | None = None
) -> list[Row]:
    """Measure every path for every size (interleaved), print the table, optionally write JSON; return the rows."""
    out = out or sys.stdout
    if repeats < 1 or not sizes or min(sizes) < 2:
        raise HarnessError("bench transport: need repeats >= 1 and payload sizes of at least 2 bytes")
    kinds = [k.strip() for k in kinds if k.strip()]
    if "memory" in kinds:
        raise HarnessError(
            "bench transport: the memory transport works within one process only; every echo peer "
            "here is a process of its own (measure zmq, iroh, ...)"
        )
    paths: list[Measured] = []
    children: list[_Child] = []
    closers: list[Callable[[], None]] = []
    try:
        iroh_wanted = "iroh" in kinds
        if iroh_wanted:
            _iroh_class().bulk_copy(True)
        specs: list[tuple[str, str | None, str, JsonObject | None, Client]] = [
            ("raw zmq", None, "raw-zmq", None, _raw_zmq)
        ]
        if iroh_wanted:
            specs += [
                ("raw iroh, bulk copy", None, "raw-iroh-bulk", None, lambda c: _raw_iroh(c, True)),
                (
                    "raw iroh, stock binding",
                    "raw iroh, bulk copy",
                    "raw-iroh-stock",
                    None,
                    lambda c: _raw_iroh(c, False),
                ),
            ]
        for kind in kinds:
            base = {"zmq": "raw zmq", "iroh": "raw iroh, bulk copy"}.get(kind)
            ends = transport_class(kind).plan_endpoints(2, {})
            specs.append(
                (f"ppharness {kind}", base, kind, ends[1], functools.partial(_ppharness, kind=kind, opts=ends[0]))
            )
        for name, base, serve_kind, child_opts, make in specs:
            child = _Child(serve_kind, child_opts)
            children.append(child)
            timer, closer = make(child)
            closers.append(closer)
            count = min(repeats, STOCK_REPEATS_CAP) if "stock" in name else repeats
            paths.append((name, base, count, timer))
        rows = [row for size in sizes for row in _measure(size, paths)]
    finally:
        for closer in closers:
            closer()
        for child in children:
            child.stop()
    _print(rows, repeats, out)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(stamped({"rows": [asdict(r) for r in rows]}), f, indent=2)
    return rows


def _measure(size: int, paths: list[Measured]) -> list[Row]:
    payload = os.urandom(size)
    samples: dict[str, list[float]] = {name: [] for name, *_ in paths}
    for _, _, _, timer in paths:
        timer(payload, WARMUP)
    while True:
        todo = [(name, count, timer) for name, _, count, timer in paths if len(samples[name]) < count]
        if not todo:
            break
        for name, count, timer in todo:
            samples[name] += timer(payload, min(BATCH, count - len(samples[name])))
    rows = [
        Row(size, name, _pct(samples[name], 0.5), _pct(samples[name], 0.99), len(samples[name]), base)
        for name, base, _, _ in paths
    ]
    p50 = {r.path: r.p50_ms for r in rows}
    for r in rows:
        if r.baseline is not None:
            r.ratio = r.p50_ms / p50[r.baseline]
    return rows


def _print(rows: list[Row], repeats: int, out: TextIO) -> None:
    w = max(len(r.path) for r in rows)
    print(
        f"round trip on loopback (send, echo, receive), ms; {repeats} per cell unless n differs; interleaved, "
        f"batches of {BATCH}",
        file=out,
    )
    print(f"{'size':>8}  {'path':<{w}}  {'p50':>8}  {'p99':>8}  {'n':>4}  vs raw (p50)", file=out)
    for r in rows:
        vs = f"{r.ratio:.2f} x {r.baseline}" if r.ratio is not None else ""
        print(
            f"{_human(r.size):>8}  {r.path:<{w}}  {r.p50_ms:8.3f}  {r.p99_ms:8.3f}  {r.n:>4}  {vs}".rstrip(), file=out
        )
    if any(r.path.startswith("raw iroh") for r in rows):
        print(
            "raw iroh: the binding's asyncio API, as documented; ppharness iroh: direct calls from its own threads",
            file=out,
        )
    target = [r for r in rows if r.path == "ppharness iroh" and r.size == TARGET_SIZE]
    if target:
        t = target[0]
        met = t.ratio is not None and t.ratio <= TARGET_RATIO and t.p50_ms <= TARGET_MS
        print(
            f"target: ppharness iroh {_human(TARGET_SIZE)} p50 <= {TARGET_RATIO} x raw iroh (bulk copy) and "
            f"<= {TARGET_MS:g} ms: {'MET' if met else 'MISSED'} ({t.ratio:.2f} x, {t.p50_ms:.3f} ms)",
            file=out,
        )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        _serve(sys.argv[2], json.loads(os.environ.get("PP_BENCH_OPTS") or "{}"))
    else:
        raise SystemExit("usage: python -m ppharness.benchmarks.transport --serve KIND (an echo peer of the benchmark)")
