"""What a plan will do, before it runs: time to first token, per-token latency, throughput and price.

Every number comes from the cost model (``ppharness.plan.predict.cost``), so that what the planner searches is what is
predicted here and what a traced run is compared with:

- decode (one token around the loop): each node's ``node_ms`` (fixed cost per token, its blocks, the head on the exit)
  and each edge's ``edge_ms`` (one-way latency, bytes over bandwidth, the cluster's cost per hop): activations of
  ``activation_bytes`` along the chain, then the token of ``token_bytes`` back from the exit to the entry;
- time to first token (prefill of ``prompt_tokens``): each node's ``cost.prefill_ms`` (fixed costs, the blocks' FLOPs
  for every prompt token at the device's batched speed, the head once) over the device's CPU share (a long prefill
  uses up a quota); activation edges carry ``prompt_tokens`` hidden states, the token edge one token;
- a device with a CPU quota bounds the loop: a token takes at least the node's time over its share
  (``cost.loop_ms``);
- throughput with R requests in flight: each request takes one token per loop of L ms, and the busiest resource (a
  node's compute, or a link's serialisation of its message) serves one token at a time, so
  ``min(R / L, 1 / bottleneck)`` tokens per ms;
- batched (``batch`` B above 1, ``serving.batched``): the requests travel in steps of up to B rows; a node's step
  reads its weights once for all of them, each row's KV cache (of ``prompt_tokens`` positions) and does every row's
  FLOPs, and each message carries every row; L is a batch's loop, and the busiest resource serves B tokens per busy
  time, so ``min(R / L, B / bottleneck)``;
- price: the hourly price of every device a node runs on, over the throughput;
- a plan that places the experts of a mixture-of-experts model (``ppharness.plan.experts.place``): each stage's compute
  leaves out its blocks' routed experts, and each mixture-of-experts block has a row of its own, the expected time of
  its fan-out (``ppharness.plan.predict.fanout``: the owner's own experts overlapping the round trips to the expert
  nodes, over a fixed set of routings); these rows are part of the loop. A node's busy time adds the expected expert
  work it serves: a stage's to its compute row, an expert node's to the expert row of each block it serves (the row's
  busy time is its busiest expert node's, over every block that node serves). Fan-out links are not counted as a
  bottleneck.

The rows are named as the trace names its components (``stage {i} compute`` with i the position along the loop, entry
first; ``stage {i} experts {L}`` for block L's experts, after its owner's compute; ``hop {i}->{j}`` with
j = (i + 1) % n, the last one the token back), so ``compare`` puts prediction and measurement side by side row for
row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from ppharness.plan.lang.document import PlanDoc, hops, loop, plan_id
from ppharness.plan.predict import cost
from ppharness.plan.predict.fanout import LayerTime, layer_times
from ppharness.trace.report import Trace

RowKind = Literal["compute", "activation", "token", "experts"]


@dataclass(frozen=True)
class Row:
    """One component of the per-token time: a node's compute, one block's expert fan-out or one edge of the loop."""

    name: str  # "stage 0 compute", "stage 0 experts 3", "hop 0->1"
    ms: float  # decode, one token
    prefill_ms: float  # the first token (prefill of the prompt)
    kind: RowKind
    # compute: the node's device; experts: the owner's device, then "->" and the expert nodes' devices when any;
    # hop: "src->dst" device ids
    device: str
    node: str = ""  # compute, experts: the (owner) node's label
    nbytes: int = 0  # hop: bytes of one decode message
    busy_ms: float = 0.0  # how long one token occupies the resource (node: its compute; link: serialisation)


@dataclass(frozen=True)
class Prediction:
    """A plan's predicted timing: the rows, their totals and what they give with ``requests`` in flight."""

    plan_id: str
    rows: tuple[Row, ...]
    prompt_tokens: int
    requests: int
    per_token_ms: float  # L: one token (of a batch of ``batch`` rows) around the loop (decode)
    ttft_ms: float  # time to first token (prefill of the prompt, and the token back to the entry)
    bottleneck: str  # the row of the busiest resource
    bottleneck_ms: float
    throughput_tok_s: float  # with ``requests`` in flight
    usd_per_hour: float  # of the devices the nodes run on
    batch: int = 1  # rows per step (batched serving); the rows' costs are those of one step of them

    def as_json(self) -> dict[str, Any]:
        """``plan simulate --json``: stable keys (docs/plans.md, Machine-readable output)."""
        return {
            "format": "ppharness-prediction/1",
            "plan": self.plan_id,
            "per_token_ms": round(self.per_token_ms, 6),
            "tok_s": round(self.tok_s, 6),
            "ttft_ms": round(self.ttft_ms, 6),
            "quota_wait_ms": round(self.quota_wait_ms, 6),
            "requests": self.requests,
            "batch": self.batch,
            "throughput_tok_s": round(self.throughput_tok_s, 6),
            "bottleneck": self.bottleneck,
            "usd_per_hour": self.usd_per_hour,
            "rows": [
                {
                    "name": r.name,
                    "kind": r.kind,
                    "ms": round(r.ms, 6),
                    "prefill_ms": round(r.prefill_ms, 6),
                    "device": r.device,
                    "bytes": r.nbytes,
                }
                for r in self.rows
            ],
        }

    @property
    def tok_s(self) -> float:
        """Decode tokens per second of one request."""
        return 1e3 / self.per_token_ms if self.per_token_ms > 0 else math.inf

    @property
    def usd_per_token(self) -> float | None:
        """Dollars per generated token at the predicted throughput; None when no device is priced."""
        if self.usd_per_hour <= 0:
            return None
        return self.usd_per_hour / 3600 / self.throughput_tok_s

    @property
    def usd_per_mtoken(self) -> float | None:
        per = self.usd_per_token
        return None if per is None else per * 1e6

    @property
    def quota_wait_ms(self) -> float:
        """How much longer than its rows a token takes because a node's CPU quota bounds the loop (``cost.loop_ms``:
        the busiest node's time over its share); 0 when no quota does. ``per_token_ms`` includes it."""
        wait = self.per_token_ms - sum(r.ms for r in self.rows)
        return wait if wait > 1e-9 else 0.0

    def parts(self) -> dict[str, float]:
        """Row name -> predicted ms, and ``per token``: the shape of ``Trace.p50_parts``."""
        out = {r.name: r.ms for r in self.rows}
        out["per token"] = self.per_token_ms
        return out

    def throughput(self, requests: int) -> float:
        """Tokens per second with ``requests`` in flight: min(R / L, 1 / bottleneck)."""
        return throughput_tok_s(self.per_token_ms, self.bottleneck_ms, requests)

    def header(self) -> str:
        price = self.usd_per_mtoken
        return (
            f"plan {self.plan_id}: per token (decode, predicted) {self.per_token_ms:.3f} ms, {self.tok_s:.1f} tok/s; "
            f"first token (prefill, {self.prompt_tokens} prompt tokens) {self.ttft_ms:.1f} ms; "
            f"{self.throughput_tok_s:.1f} tok/s with {self.requests} in flight"
            + (f", batched {self.batch} per step" if self.batch > 1 else "")
            + f" (bottleneck {self.bottleneck}, {self.bottleneck_ms:.3f} ms)"
            + (f"; ${price:.4g}/Mtoken" if price is not None else "")
        )

    def summary(self) -> str:
        """The table ``Trace.summary`` prints, predicted: component, ms, bytes of a hop, share of the token, and the
        device of each node (the device pair of each hop)."""
        lines = [self.header(), f"{'component':<22} {'predicted ms':>12} {'bytes':>8} {'share':>7}  device"]
        for r in self.rows:
            lines.append(
                f"{r.name:<22} {r.ms:>12.3f} {r.nbytes if r.nbytes else '':>8} {_share(r.ms, self.per_token_ms):>7}  "
                f"{r.device}"
            )
        wait = self.quota_wait_ms
        if wait:  # a node's CPU quota bounds the loop (ppharness.plan.predict.cost.loop_ms)
            lines.append(
                f"{'cpu quota wait':<22} {wait:>12.3f} {'':>8} {_share(wait, self.per_token_ms):>7}  {self.bottleneck}"
            )
        lines.append(
            f"{'per token':<22} {self.per_token_ms:>12.3f} {'':>8} {_share(self.per_token_ms, self.per_token_ms):>7}"
        )
        return "\n".join(lines)


def _share(ms: float, total: float) -> str:
    return f"{100 * ms / total:.1f}%" if total > 0 else ""


def throughput_tok_s(per_token_ms: float, bottleneck_ms: float, requests: int) -> float:
    """min(R / L, 1 / bottleneck) in tokens per second (infinite where both times are zero)."""
    rates = [requests / per_token_ms if per_token_ms > 0 else math.inf]
    if bottleneck_ms > 0:
        rates.append(1 / bottleneck_ms)
    return min(rates) * 1e3


def simulate(doc: PlanDoc, prompt_tokens: int = 8, requests: int | None = None, batch: int = 1) -> Prediction:
    """Predict ``doc``'s timing (the plan must have passed ``check_plan``); ``requests`` defaults to the objective's.
    ``batch`` above 1: batched serving, steps of up to that many requests (the module docstring)."""
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be at least 1, got {prompt_tokens}")
    r = doc.placement.objective.requests if requests is None else requests
    if r < 1:
        raise ValueError(f"requests must be at least 1, got {r}")
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    rows_per_step = min(batch, r)
    context = prompt_tokens if rows_per_step > 1 else 0
    model, cluster = doc.model, doc.cluster
    order = loop(doc)
    position = {n.label: i for i, n in enumerate(order)}
    layers = layer_times(doc, prompt_tokens)
    routed = not layers
    serving: dict[str, float] = {}  # node label -> expected expert work per token it does, over every block
    for t in layers:
        for label, ms in t.busy.items():
            serving[label] = serving.get(label, 0.0) + ms
    devices = [cluster.device(node.device) for node in order]
    spans = [node.blocks or (0, 0) for node in order]
    nodes = [
        cost.LoopNode(device, lo, hi, node.heads, serving.get(node.label, 0.0))
        for node, device, (lo, hi) in zip(order, devices, spans)
    ]
    compute, edges = cost.loop_parts(model, cluster, nodes, routed, rows_per_step, context)
    rows: list[Row] = []
    for i, (node, device, (lo, hi), part) in enumerate(zip(order, devices, spans, compute)):
        prefill = cost.busy_ms(cost.prefill_ms(model, device, lo, hi, node.heads, prompt_tokens, routed), device)
        rows.append(Row(f"stage {i} compute", part.ms, prefill, "compute", device.id, node.label, busy_ms=part.busy_ms))
        rows += [_experts_row(doc, t, serving) for t in layers if t.stage == i]
    for hop, part in zip(hops(doc), edges):  # none for one node: the trace has no hop either
        i, j = position[hop.src.label], position[hop.dst.label]
        a, b = hop.src.device, hop.dst.device
        one = model.activation_bytes if hop.kind == "activation" else model.token_bytes
        first = prompt_tokens * one if hop.kind == "activation" else one
        nbytes = rows_per_step * one
        rows.append(
            Row(
                f"hop {i}->{j}",
                part.ms,
                cost.edge_ms(cluster, a, b, first),
                hop.kind,
                f"{a}->{b}",
                nbytes=nbytes,
                busy_ms=part.busy_ms,
            )
        )
    busiest = max(rows, key=lambda row: row.busy_ms)
    per_token = cost.loop_ms(*cost.loop_time(cost.Part(row.ms, row.busy_ms) for row in rows))
    price = sum(cluster.device(n.device).usd_per_hour for n in doc.placement.nodes)
    return Prediction(
        plan_id=doc.id or plan_id(doc),
        rows=tuple(rows),
        prompt_tokens=prompt_tokens,
        requests=r,
        per_token_ms=per_token,
        ttft_ms=sum(row.prefill_ms for row in rows),
        bottleneck=busiest.name,
        bottleneck_ms=busiest.busy_ms,
        throughput_tok_s=throughput_tok_s(per_token, busiest.busy_ms / rows_per_step, r),
        usd_per_hour=price,
        batch=rows_per_step,
    )


def _experts_row(doc: PlanDoc, t: LayerTime, serving: dict[str, float]) -> Row:
    """Block ``t.layer``'s fan-out as a row: its expected time, and the busiest expert node it uses (over all the
    blocks that node serves)."""
    nodes = {n.label: n for n in doc.placement.nodes}
    home = nodes[t.owner].device
    device = home + ("->" + ",".join(nodes[label].device for label in t.remote) if t.remote else "")
    busy = [
        cost.busy_ms(serving.get(label, 0.0), doc.cluster.device(nodes[label].device))
        for label in t.remote
        if nodes[label].expert_only
    ]
    return Row(
        f"stage {t.stage} experts {t.layer}",
        t.ms,
        t.prefill_ms,
        "experts",
        device,
        t.owner,
        busy_ms=max(busy, default=0.0),
    )


def compare(prediction: Prediction, trace: Trace, first_token: bool = True) -> str:
    """Predicted against measured p50 (over the trace's decode tokens), row for row, with the error of the prediction
    in % of the measurement; the CPU-quota wait the prediction adds (no trace row measures it: the token waits inside
    the others); one line for the trace's rows the cost model does not predict (deserialise, tokenize, serialise,
    "other": a node's fixed cost per token stands for them), with the sum of their p50s; the per-token total; and,
    when ``first_token``, the first token against the prediction's prefill of ``prompt_tokens``."""
    measured = trace.p50_parts()
    lines = [
        f"plan {prediction.plan_id} against trace {trace.request_id} ({len(trace.decode)} decode tokens, p50)",
        f"{'component':<22} {'predicted ms':>12} {'measured ms':>12} {'error':>8}  device",
    ]

    def line(name: str, predicted: float | None, got: float | None, device: str = "") -> str:
        p = f"{predicted:>12.3f}" if predicted is not None else f"{'-':>12}"
        m = f"{got:>12.3f}" if got is not None and not math.isnan(got) else f"{'-':>12}"
        return f"{name:<22} {p} {m} {_error(predicted, got):>8}  {device}".rstrip()

    for row in prediction.rows:
        lines.append(line(row.name, row.ms, measured.get(row.name), row.device))
    if prediction.quota_wait_ms:
        lines.append(
            line(
                "cpu quota wait", prediction.quota_wait_ms, None, f"{prediction.bottleneck} (no trace row measures it)"
            )
        )
    predicted_names = {row.name for row in prediction.rows}
    rest = {name: ms for name, ms in measured.items() if name not in predicted_names and name != "per token"}
    if rest:
        kinds = list(dict.fromkeys(name.split()[-1] for name in rest))
        total = sum(ms for ms in rest.values() if not math.isnan(ms))
        lines.append(line("not predicted", None, total, f"{len(rest)} trace rows: {', '.join(kinds)} (sum of p50s)"))
    lines.append(line("per token", prediction.per_token_ms, measured.get("per token")))
    if first_token:
        first = trace.records[0].total_ms if trace.records and trace.records[0].step == 0 else None
        lines.append(line("first token", prediction.ttft_ms, first, f"prefill of {prediction.prompt_tokens} tokens"))
    return "\n".join(lines)


def _error(predicted: float | None, measured: float | None) -> str:
    if predicted is None or measured is None or math.isnan(measured) or measured == 0:
        return "-"
    return f"{100 * (predicted - measured) / measured:+.1f}%"
