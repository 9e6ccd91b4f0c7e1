"""Per-token, per-hop timing: from the stages' spans to records, a Perfetto trace and a terminal summary.

How hop time is computed: every stage stamps its spans with its own monotonic clock. After the chain is ready the
orchestrator probes each node's clock (five ping/pong pairs; the one with the shortest round trip gives the offset,
accurate to half that round trip; an offset smaller than that is taken as zero, which it is for processes on one host,
since they share the machine's monotonic clock) and moves every span onto its own clock. A hop is then the receiver's
arrival stamp minus the sender's stamp just before the send call: wire time plus any queueing at either end. The
per-token time is measured on stage 0's clock alone, by the NextToken loop closing there (arrival of token k's NextToken
minus arrival of token k-1's), so it needs no offsets at all; the components (each stage's deserialise, tokenize,
compute, serialise; each hop) add up to it, and what is left is reported as "other" (Python dispatch between the
pieces).
"""

from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ppharness.wire.messages import InferenceResponse, TraceReport

STAGE_PARTS = ("deserialize", "tokenize", "compute", "serialize")


@dataclass
class TokenRecord:
    step: int  # 0 = prefill (the first token), k >= 1 decode
    token_id: int
    total_ms: float
    parts: dict[str, float]  # "stage 2 compute" -> ms, "hop 2->3" -> ms
    hop_bytes: dict[str, int]
    # speculation: the trip that committed the token (its number, what its window drafted and accepted, how many
    # tokens it committed, and this token's place among them); the window's spans are at its first token's step
    trip: dict[str, int] | None = None

    @property
    def other_ms(self) -> float:
        return self.total_ms - sum(self.parts.values())


@dataclass
class Trace:
    request_id: str
    num_stages: int
    records: list[TokenRecord]
    events: list[dict[str, Any]] = field(default_factory=list)  # Chrome trace events

    @property
    def decode(self) -> list[TokenRecord]:
        return [r for r in self.records if r.step > 0]

    def components(self) -> list[str]:
        names: list[str] = []
        for r in self.records:
            names += [k for k in r.parts if k not in names]
        return names

    def chrome(self) -> dict[str, Any]:
        """The trace-event format (Chrome, Perfetto): one track per stage and one per hop."""
        meta: list[dict[str, Any]] = [
            {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": f"ppharness request {self.request_id}"}}
        ]
        for i in range(self.num_stages):
            meta.append(
                {"ph": "M", "pid": 1, "tid": _stage_tid(i), "name": "thread_name", "args": {"name": f"stage {i}"}}
            )
            if self.num_stages > 1:
                meta.append(
                    {
                        "ph": "M",
                        "pid": 1,
                        "tid": _hop_tid(i),
                        "name": "thread_name",
                        "args": {"name": f"hop {_hop_name(i, self.num_stages)}"},
                    }
                )
        return {"traceEvents": meta + self.events, "displayTimeUnit": "ms"}

    def jsonl(self) -> str:
        """One JSON object per token."""
        return "".join(
            json.dumps(
                {
                    "step": r.step,
                    "token_id": r.token_id,
                    "total_ms": round(r.total_ms, 4),
                    "other_ms": round(r.other_ms, 4),
                    "parts_ms": {k: round(v, 4) for k, v in r.parts.items()},
                    "hop_bytes": r.hop_bytes,
                }
                | ({"trip": r.trip} if r.trip is not None else {})
            )
            + "\n"
            for r in self.records
        )

    def write(self, path: str) -> list[str]:
        """Write ``path`` (Chrome JSON) and ``path`` with a .jsonl suffix; return both paths."""
        jsonl = (path[: -len(".json")] if path.endswith(".json") else path) + ".jsonl"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.chrome(), f)
        with open(jsonl, "w") as f:
            f.write(self.jsonl())
        return [path, jsonl]

    def p50_parts(self) -> dict[str, float]:
        """Over the decode tokens: the p50 of every component, of "other", and of the whole ("per token"), in ms."""
        rows = self.decode or self.records
        out = {name: percentile([r.parts.get(name, 0.0) for r in rows], 50) for name in self.components()}
        out["other"] = percentile([r.other_ms for r in rows], 50)
        out["per token"] = percentile([r.total_ms for r in rows], 50)
        return out

    def summary(self) -> str:
        """A small table: per component p50/p99 over decode tokens, bytes per hop, share of the per-token time."""
        rows = self.decode or self.records
        if not rows:
            return "trace: no tokens"
        totals = [r.total_ms for r in rows]
        total_sum = sum(totals)
        prefill = self.records[0].total_ms if self.records and self.records[0].step == 0 else float("nan")
        lines = [
            f"per token (decode, {len(rows)} tokens): p50 {percentile(totals, 50):.3f} ms, "
            f"p99 {percentile(totals, 99):.3f} ms,"
            f" {1000 / statistics.median(totals):.1f} tok/s; first token (prefill) {prefill:.1f} ms",
            f"{'component':<22} {'p50 ms':>9} {'p99 ms':>9} {'bytes':>8} {'share':>7}",
        ]
        for name in self.components() + ["other"]:
            vals = [r.other_ms if name == "other" else r.parts.get(name, 0.0) for r in rows]
            nbytes = rows[-1].hop_bytes.get(name.removeprefix("hop "), 0) if name.startswith("hop") else 0
            lines.append(
                f"{name:<22} {percentile(vals, 50):>9.3f} {percentile(vals, 99):>9.3f} "
                f"{nbytes if nbytes else '':>8} {100 * sum(vals) / total_sum:>6.1f}%"
            )
        return "\n".join(lines)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by nearest rank; NaN for no values."""
    s = sorted(values)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def _stage_tid(i: int) -> int:
    return 2 * i + 1


def _hop_tid(i: int) -> int:
    return 2 * i + 2


def _hop_name(i: int, n: int) -> str:
    return f"{i}->{(i + 1) % n}"


def build_trace(
    reports: list[TraceReport], offsets_ns: dict[int, int], response: InferenceResponse, num_stages: int
) -> Trace:
    """Records and Chrome events from the stages' TraceReports (stage order), on the orchestrator's clock."""
    n = num_stages
    # (stage, step, name) -> list of (t0, t1, nbytes) in ns on the orchestrator's clock
    spans: dict[tuple[int, int, str], list[tuple[int, int, int]]] = defaultdict(list)
    for rep in reports:
        if rep.stage >= n:  # an expert node: its work shows in its block owner's fan-out and gather
            continue
        off = offsets_ns.get(rep.stage, 0)
        for s in rep.spans:
            spans[(rep.stage, s.step, s.name)].append((s.t0_ns - off, s.t1_ns - off, s.nbytes))
    t_origin = min((t0 for v in spans.values() for t0, _, _ in v), default=0)

    def dur_ms(stage: int, step: int, name: str) -> float:
        return sum(t1 - t0 for t0, t1, _ in spans.get((stage, step, name), [])) / 1e6

    def first(stage: int, step: int, name: str) -> tuple[int, int, int] | None:
        v = spans.get((stage, step, name))
        return v[0] if v else None

    # (stage, step) -> MoE block -> the time spent sending its tokens to the expert nodes and waiting for their
    # answers (the stage's own experts' compute excluded)
    waits: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)
    for st, sp, name in spans:
        if name.startswith(("fanout ", "gather ")):
            layer = int(name.split()[1])
            waits[(st, sp)][layer] = waits[(st, sp)].get(layer, 0.0) + dur_ms(st, sp, name)

    def experts_wait(stage: int, step: int) -> dict[int, float]:
        return dict(sorted(waits.get((stage, step), {}).items()))

    records = []
    # the token that ended the answer took a step too (-1: a response that does not name it)
    stop_id = -1 if response.stop_token_id is None else response.stop_token_id
    stop = [] if response.finish_reason == "length" else [stop_id]
    for k, token in enumerate(response.token_ids + stop):
        parts: dict[str, float] = {}
        hop_bytes: dict[str, int] = {}
        for i in range(n):
            for name in STAGE_PARTS:
                ms = dur_ms(i, k, name)
                if ms or name == "compute":
                    parts[f"stage {i} {name}"] = ms
            for layer, wait_ms in experts_wait(i, k).items():  # a MoE block's fan-out and gather, out of its compute
                parts[f"stage {i} experts {layer}"] = wait_ms
                parts[f"stage {i} compute"] -= wait_ms
        if n > 1:
            for i in range(n):
                j, recv_step = (i + 1) % n, k + 1 if i == n - 1 else k
                sent, got = first(i, k, "send"), first(j, recv_step, "recv")
                if sent and got:
                    parts[f"hop {_hop_name(i, n)}"] = (got[0] - sent[0]) / 1e6
                    hop_bytes[_hop_name(i, n)] = sent[2]
            start = first(0, k, "recv") or first(0, k, "tokenize") or first(0, k, "compute")
            end = first(0, k + 1, "recv")
            total = (end[0] - start[0]) / 1e6 if start and end else sum(parts.values())
        else:
            total = sum(parts.values())
        records.append(TokenRecord(step=k, token_id=token, total_ms=total, parts=parts, hop_bytes=hop_bytes))

    events: list[dict[str, Any]] = []
    for (stage, step, name), v in sorted(spans.items()):
        for t0, t1, nbytes in v:
            if name in STAGE_PARTS or name.startswith(("fanout ", "gather ", "local experts ", "experts ")):
                events.append(
                    {
                        "ph": "X",
                        "pid": 1,
                        "tid": _stage_tid(stage),
                        "name": name,
                        "cat": "stage",
                        "ts": (t0 - t_origin) / 1e3,
                        "dur": (t1 - t0) / 1e3,
                        "args": {"step": step},
                    }
                )
            elif name == "send" and n > 1:
                j, recv_step = (stage + 1) % n, step + 1 if stage == n - 1 else step
                got = first(j, recv_step, "recv")
                if got:
                    events.append(
                        {
                            "ph": "X",
                            "pid": 1,
                            "tid": _hop_tid(stage),
                            "cat": "hop",
                            "name": f"hop {_hop_name(stage, n)}",
                            "ts": (t0 - t_origin) / 1e3,
                            "dur": max(0, got[0] - t0) / 1e3,
                            "args": {"step": step, "bytes": nbytes},
                        }
                    )
    for record, trip in zip(records[1:], trips_of(response, len(records) - 1), strict=False):
        record.trip = trip
    return Trace(request_id=response.request_id, num_stages=n, records=records, events=events)


def trips_of(response: InferenceResponse, decoded: int) -> list[dict[str, int]]:
    """For a speculating request, each of its ``decoded`` tokens' trip (``TokenRecord.trip``), in order: a trip
    commits its accepted drafts and the model's own token after them, the last one up to the end of the answer."""
    out: list[dict[str, int]] = []
    for t, (drafted, accepted) in enumerate(zip(response.window_drafts, response.window_accepted, strict=True)):
        committed = min(accepted + 1, decoded - len(out))
        out += [
            {"n": t + 1, "drafted": drafted, "accepted": accepted, "committed": committed, "row": i}
            for i in range(committed)
        ]
    return out
