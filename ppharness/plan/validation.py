"""Predictions held against measurements: the runs under ``docs/validation/``, what each holds and how one is made.

Two kinds of run, never the same run in both:

- ``calibration``: runs whose measurements set figures of a shipped cluster file (``calibrated_figures``: the
  transport's cost per hop and a node's fixed cost per token; ``expert_plan_figures``: a mixture-of-experts cluster's
  stage and expert devices); their predictions are reported beside their measurements, not held to a tolerance;
- ``held-out``: runs that fitted nothing, each held to its tolerance (``TOLERANCE_PCT``, unless its ``run.json``
  states another with its reason).

A run is a folder holding

- ``plan.json``: the plan that ran (it carries its cluster);
- ``prediction.json``: the simulator's figures for that plan (``prediction_record``: per-token ms, each row's ms, the
  CPU-quota wait), written before the run started (``made_at``);
- ``summary.json``: per repeat (a fresh ``pp-smoke-run --plan`` each), what its trace measured (``summary_record``:
  over the decode tokens, the per-token p50, p99 and mean, each token's time, each row's p50, the hops' pooled p50),
  when it ran and the machine's load; and ``per_token_p50_ms``, the median of the repeats' p50s: the measurement;
- ``run.json``: its kind, the cluster file its plan was made from (if any), the commands, the machine, the
  repeats, the tolerance (and its reason) when not the default;
- ``run.txt``: each repeat's ``pp-smoke-run`` output (the run's predicted-against-measured table at its end).

A probe (``probe.json``) is a calibration of another shape: ``ppharness plan probe`` run several times, each fit kept,
and the median of each figure.

``python -m ppharness.plan.validation run FOLDER --kind KIND [--tokens N] [--repeats R] -- PLAN-MAKE-ARGS`` makes a
run (the plan with ``ppharness plan make PLAN-MAKE-ARGS``, or ``--plan FILE`` as it is; its prediction; the runs; the
summary; the manifest) and rewrites the README's table; ``probe FOLDER --model M --repeats K`` makes a probe;
``calibrate`` and ``calibrate-experts`` print the figures a calibration gives; ``table`` rewrites the README's table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import msgspec

from ppharness.plan.lang.document import Cluster, PlanDoc, loop
from ppharness.plan.predict import cost
from ppharness.plan.predict.simulate import Prediction, simulate
from ppharness.plan.reader import load_cluster, load_plan
from ppharness.trace.report import TokenRecord, Trace, percentile

Kind = Literal["calibration", "held-out"]
KINDS: tuple[Kind, ...] = ("calibration", "held-out")
TOLERANCE_PCT = 15.0  # a held-out run's per-token prediction against its measured p50, unless its run.json says
ROUNDING = 4  # decimals of the milliseconds written (0.1 µs)
ROOT = Path(__file__).resolve().parents[2]
VALIDATION = ROOT / "docs" / "validation"
TABLE_START, TABLE_END = "<!-- runs: python -m ppharness.plan.validation table -->", "<!-- end of runs -->"
PROBE_FIELDS = ("gflops", "bandwidth_gbs", "overhead_ms", "prefill_ms", "prefill_block_ms", "prefill_gflops")


def jsonl_path(trace_path: str | Path) -> Path:
    """Where ``Trace.write(trace_path)`` puts the per-token lines."""
    text = str(trace_path)
    return Path((text[: -len(".json")] if text.endswith(".json") else text) + ".jsonl")


def read_trace(path: str | Path, request_id: str = "") -> Trace:
    """A trace back from its per-token lines (``Trace.jsonl``): each token's step, total, rows and hop bytes."""
    records = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        parts = {str(k): float(v) for k, v in row["parts_ms"].items()}
        hop_bytes = {str(k): int(v) for k, v in row.get("hop_bytes", {}).items()}
        records.append(TokenRecord(int(row["step"]), int(row["token_id"]), float(row["total_ms"]), parts, hop_bytes))
    stages = {name.split()[1] for r in records for name in r.parts if name.startswith("stage ")}
    return Trace(request_id=request_id or Path(path).stem, num_stages=len(stages), records=records)


def _ms(value: float) -> float:
    return round(value, ROUNDING)


def prediction_record(prediction: Prediction) -> dict[str, Any]:
    """The figures of ``prediction`` a run is held to: per-token ms (the quota wait included), each row's ms."""
    return {
        "plan_id": prediction.plan_id,
        "per_token_ms": _ms(prediction.per_token_ms),
        "quota_wait_ms": _ms(prediction.quota_wait_ms),
        "bottleneck": prediction.bottleneck,
        "rows_ms": {r.name: _ms(r.ms) for r in prediction.rows},
    }


def summary_record(trace: Trace) -> dict[str, Any]:
    """What ``trace`` measured over its decode tokens: the per-token p50, p99 and mean, each token's time, each row's
    p50 (the trace summary's rows), and the p50 of every hop of every token pooled (the transport's cost per hop
    where the links add no delay)."""
    decode = trace.decode
    totals = [r.total_ms for r in decode]
    hops = [v for r in decode for name, v in r.parts.items() if name.startswith("hop ")]
    first = trace.records[0].total_ms if trace.records and trace.records[0].step == 0 else None
    return {
        "decode_tokens": len(decode),
        "per_token_ms": {
            "p50": _ms(percentile(totals, 50)),
            "p99": _ms(percentile(totals, 99)),
            "mean": _ms(statistics.fmean(totals)) if totals else None,
        },
        "first_token_ms": None if first is None else _ms(first),
        "rows_p50_ms": {name: _ms(ms) for name, ms in trace.p50_parts().items() if name != "per token"},
        "hop_p50_ms": _ms(percentile(hops, 50)) if hops else None,
        "tokens_ms": [_ms(t) for t in totals],
    }


def error_pct(predicted: float, measured: float) -> float:
    """The prediction's error in % of the measurement."""
    return 100 * (predicted - measured) / measured


@dataclass(frozen=True)
class Run:
    """One committed run: its folder (relative to ``docs/validation``) and its four files, read."""

    name: str
    folder: Path
    manifest: dict[str, Any]
    plan: PlanDoc
    prediction: dict[str, Any]
    summary: dict[str, Any]

    @property
    def kind(self) -> Kind:
        kind: Kind = self.manifest["kind"]
        return kind

    @property
    def tolerance_pct(self) -> float | None:
        """The per-token tolerance: the manifest's, else ``TOLERANCE_PCT`` for a held-out run, none for calibration."""
        if "tolerance_pct" in self.manifest:
            value = self.manifest["tolerance_pct"]
            return None if value is None else float(value)
        return TOLERANCE_PCT if self.kind == "held-out" else None

    @property
    def predicted_ms(self) -> float:
        return float(self.prediction["per_token_ms"])

    @property
    def measured_ms(self) -> float:
        """The median over the repeats of each one's per-token p50."""
        return float(self.summary["per_token_p50_ms"])

    @property
    def error_pct(self) -> float:
        return error_pct(self.predicted_ms, self.measured_ms)

    def cluster_file(self) -> Cluster | None:
        """The cluster file the plan was made from, as it reads today (None: the plan's own cluster)."""
        name = self.manifest.get("cluster")
        return None if not name else load_cluster(ROOT / name)


def load_run(folder: Path) -> Run:
    """The run committed in ``folder`` (``<kind>/<name>``)."""
    return Run(
        name=f"{folder.parent.name}/{folder.name}",
        folder=folder,
        manifest=json.loads((folder / "run.json").read_text()),
        plan=load_plan(folder / "plan.json"),
        prediction=json.loads((folder / "prediction.json").read_text()),
        summary=json.loads((folder / "summary.json").read_text()),
    )


def load_runs(root: Path = VALIDATION) -> list[Run]:
    """Every run under ``root/<kind>/``, by kind then name."""
    return [load_run(m.parent) for kind in KINDS for m in sorted((root / kind).glob("*/run.json"))]


def load_probes(root: Path = VALIDATION) -> dict[str, dict[str, Any]]:
    """Every committed probe, by its folder relative to ``root``."""
    return {
        str(p.parent.relative_to(root)): json.loads(p.read_text())
        for p in sorted(root.glob("calibration/*/probe.json"))
    }


def without_delays(cluster: Cluster) -> Cluster:
    """``cluster`` with every link's configured one-way delay set to 0 (what the emulator adds exactly)."""

    def zero(link: Any) -> Any:
        return msgspec.structs.replace(link, delay_ms=0.0)

    return msgspec.structs.replace(
        cluster,
        default=zero(cluster.default),
        links=tuple(zero(x) for x in cluster.links),
        region_links=tuple(zero(x) for x in cluster.region_links),
        host_link=zero(cluster.host_link),
    )


def delay_ms(doc: PlanDoc) -> float:
    """How much of ``doc``'s predicted per-token time is its links' configured delay, which the emulator adds
    exactly: its rows' sum less their sum with every delay at 0 (the rest is what the cost model predicts of compute,
    the transport and the quotas)."""
    bare = msgspec.structs.replace(doc, cluster=without_delays(doc.cluster))
    return sum(r.ms for r in simulate(doc).rows) - sum(r.ms for r in simulate(bare).rows)


def table(runs: Sequence[Run]) -> str:
    """The README's table: run, kind, plan, the predicted per-token ms and how much of it is configured link delay,
    the measured p50 (median over the repeats) and the error, the tolerance, and the measured mean."""
    lines = [
        "| run | kind | plan | predicted ms/token | of it, link delay | measured p50 | error | error less the delay | "
        "tolerance | measured mean (error) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        tol = r.tolerance_pct
        mean = statistics.median(rep["per_token_ms"]["mean"] for rep in r.summary["repeats"])
        delay = delay_ms(r.plan)
        lines.append(
            f"| [{r.name}]({r.name}/) | {r.kind} | `{r.plan.id}` | {r.predicted_ms:.2f} | {delay:.1f} "
            f"({100 * delay / r.predicted_ms:.0f} %) | {r.measured_ms:.2f} | {r.error_pct:+.1f} % | "
            f"{error_pct(r.predicted_ms - delay, r.measured_ms - delay):+.1f} % | "
            f"{'none (calibration)' if tol is None else f'{tol:g} %'} | {mean:.2f} "
            f"({error_pct(r.predicted_ms, mean):+.1f} %) |"
        )
    return "\n".join(lines)


def write_table(root: Path = VALIDATION) -> None:
    """Rewrite the table between the README's markers from the committed runs."""
    readme = root / "README.md"
    text = readme.read_text()
    start, end = text.index(TABLE_START) + len(TABLE_START), text.index(TABLE_END)
    readme.write_text(text[:start] + "\n" + table(load_runs(root)) + "\n" + text[end:])


def calibrated_figures(probe: dict[str, Any], run: Run) -> dict[str, float]:
    """This machine's figures for a device entry: the probe's medians (a block's speed, the prefill), and from
    ``run``, a calibration chain without link delays or CPU quotas, the fixed cost per token of a node (everything in
    its per-token p50 that is neither the cost model's blocks and head nor a hop, shared equally among its nodes:
    what the probe's isolated slices do not see) and the transport's cost per hop (the pooled p50 of its hops), each
    the median over the run's repeats."""
    compute = [r for r in simulate(run.plan).rows if r.kind == "compute"]
    blocks_and_head = sum(r.ms - run.plan.cluster.device(r.device).overhead_ms for r in compute)
    overheads, hops = [], []
    for each in run.summary["repeats"]:
        hop_rows = sum(ms for name, ms in each["rows_p50_ms"].items() if name.startswith("hop "))
        overheads.append((each["per_token_ms"]["p50"] - hop_rows - blocks_and_head) / len(compute))
        hops.append(each["hop_p50_ms"])
    figures = {k: float(probe["median"][k]) for k in PROBE_FIELDS}
    figures["overhead_ms"] = statistics.median(overheads)
    figures["hop_ms"] = statistics.median(hops)
    return figures


def _median_rows(run: Run) -> dict[str, float]:
    """Each trace row's p50, the median over the run's repeats."""
    names = run.summary["repeats"][0]["rows_p50_ms"]
    return {n: statistics.median(r["rows_p50_ms"][n] for r in run.summary["repeats"]) for n in names}


def expert_plan_figures(run: Run) -> dict[str, float]:
    """The figures of a mixture-of-experts cluster's devices from ``run``, a calibration run of a plan that places
    the experts (its stage devices alike, its expert devices alike; the rows are the medians over the repeats):

    - the stages' speed and fixed cost per token: the line through each stage's compute p50 against its blocks' and
      head's time at 1 GFLOP/s (``cost.node_ms``; through the origin when the line's intercept is negative);
    - the transport's cost per hop: the loop's hops' p50s less their links' delay and wire time (median);
    - the expert nodes' fixed cost per request: the value that makes the plan's predicted fan-out rows add up to the
      measured ones, their speed per routed expert being the stages'.

    Returns ``stage_gflops``, ``stage_overhead_ms``, ``expert_gflops``, ``expert_overhead_ms``, ``hop_ms``."""
    doc, measured = run.plan, _median_rows(run)
    order = loop(doc)
    unit = [msgspec.structs.replace(doc.cluster.device(n.device), gflops=1.0, overhead_ms=0.0) for n in order]
    spans = [n.blocks or (0, 0) for n in order]
    at_one = [cost.node_ms(doc.model, d, lo, hi, n.heads, routed=False) for d, (lo, hi), n in zip(unit, spans, order)]
    compute = [measured[f"stage {i} compute"] for i in range(len(order))]
    slope, intercept = statistics.linear_regression(at_one, compute) if len(order) > 1 else (0.0, -1.0)
    if intercept < 0:
        slope, intercept = sum(k * c for k, c in zip(at_one, compute)) / sum(k * k for k in at_one), 0.0
    gflops = 1.0 / slope
    prediction = simulate(doc)
    hop_rows = [r for r in prediction.rows if r.kind in ("activation", "token")]
    hop_ms = statistics.median(measured[r.name] - (r.ms - doc.cluster.hop_ms) for r in hop_rows)
    stage_ids = {n.device for n in order}
    expert_ids = {n.device for n in doc.placement.nodes if n.expert_only}
    target = sum(ms for name, ms in measured.items() if " experts " in name)

    def fanout_ms(overhead: float) -> float:
        devices = []
        for d in doc.cluster.devices:
            if d.id in stage_ids:
                d = msgspec.structs.replace(d, gflops=gflops, overhead_ms=intercept)
            elif d.id in expert_ids:
                d = msgspec.structs.replace(d, gflops=gflops, overhead_ms=overhead)
            devices.append(d)
        cluster = msgspec.structs.replace(doc.cluster, devices=tuple(devices), hop_ms=hop_ms)
        rows = simulate(msgspec.structs.replace(doc, cluster=cluster)).rows
        return sum(r.ms for r in rows if r.kind == "experts")

    low, high = 0.0, 1.0  # the fan-out rows grow (piecewise) linearly with the expert nodes' fixed cost
    f_low, f_high = fanout_ms(low), fanout_ms(high)
    for _ in range(6):  # the secant, from the first two guesses
        if abs(f_high - target) < 1e-6 or f_high == f_low:
            break
        guess = max(0.0, low + (target - f_low) * (high - low) / (f_high - f_low))
        low, f_low, high, f_high = high, f_high, guess, fanout_ms(guess)
    return {
        "stage_gflops": gflops,
        "stage_overhead_ms": intercept,
        "expert_gflops": gflops,
        "expert_overhead_ms": high,
        "hop_ms": hop_ms,
    }


# --- making runs ------------------------------------------------------------------------------------------------


def hardware() -> str:
    """This machine in a few words: the CPU's model name and the number of cores."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=1, ensure_ascii=False) + "\n")


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "ppharness.cli", *args]


def _shown(argv: Sequence[str]) -> str:
    """A command as a person types it, paths relative to the repository."""
    words = ["ppharness" if argv[:3] == _cli()[:3] else "pp-smoke-run", *argv[3:]]
    return " ".join(w.replace(str(ROOT) + "/", "") for w in words)


def _make_plan(folder: Path, plan_file: str | None, make_args: Sequence[str]) -> tuple[str | None, list[str]]:
    """``folder/plan.json``: ``plan_file`` as it is, or ``ppharness plan make make_args``. Returns the cluster file
    the plan was made from (None for a given plan) and the command."""
    out = folder / "plan.json"
    if plan_file is not None:
        shutil.copyfile(plan_file, out)
        return None, [f"cp {Path(plan_file).resolve().relative_to(ROOT)} {out.relative_to(ROOT)}"]
    argv = _cli("plan", "make", *make_args, "-o", str(out))
    subprocess.run(argv, check=True, cwd=ROOT)
    cluster = next((make_args[i + 1] for i, a in enumerate(make_args[:-1]) if a == "--cluster"), None)
    if cluster is not None:
        cluster = str(Path(cluster).resolve().relative_to(ROOT))
    return cluster, [_shown(argv)]


def _run_once(plan: Path, tokens: int) -> tuple[dict[str, Any], str]:
    """One ``pp-smoke-run --plan`` (a fresh chain, traced): its summary, timed, and its output."""
    with tempfile.TemporaryDirectory(prefix="ppharness-validation-") as tmp:
        trace = Path(tmp) / "trace.json"
        argv = [sys.executable, "-m", "ppharness.cli.smoke", "--plan", str(plan), "--trace", str(trace)]
        argv += ["--max-tokens", str(tokens), "--quiet"]
        started, load_before = _now(), os.getloadavg()[0]
        done = subprocess.run(argv, capture_output=True, text=True, check=False, cwd=ROOT)
        finished, load_after = _now(), os.getloadavg()[0]
        if done.returncode != 0:
            raise SystemExit(f"{plan}: the run failed (exit {done.returncode}):\n{done.stdout}{done.stderr}")
        summary = summary_record(read_trace(jsonl_path(trace)))
    loads = {"load_before": round(load_before, 2), "load_after": round(load_after, 2)}  # this machine's, 1 minute
    return {**summary, "started_at": started, "finished_at": finished, **loads}, done.stdout


def make_run(
    folder: Path,
    kind: Kind,
    tokens: int,
    repeats: int,
    make_args: Sequence[str],
    plan_file: str | None = None,
    note: str = "",
) -> Run:
    """Make the plan, write its prediction, run it ``repeats`` times (``pp-smoke-run --plan``, traced, each a fresh
    chain), write the summary (each repeat's, and the median of their per-token p50s) and the manifest. The
    prediction is written before the first run starts."""
    folder.mkdir(parents=True, exist_ok=True)
    cluster, commands = _make_plan(folder, plan_file, make_args)
    doc = load_plan(folder / "plan.json")
    if cluster is not None and doc.cluster != load_cluster(ROOT / cluster):
        raise SystemExit(f"{folder}: the plan's cluster is not {cluster}'s")
    _write_json(folder / "prediction.json", {**prediction_record(simulate(doc)), "made_at": _now()})
    done = [_run_once(folder / "plan.json", tokens) for _ in range(repeats)]
    (folder / "run.txt").write_text(
        "".join(f"--- repeat {i + 1} of {repeats}\n{out}" for i, (_, out) in enumerate(done))
    )
    each = [summary for summary, _ in done]
    median = statistics.median(s["per_token_ms"]["p50"] for s in each)
    _write_json(folder / "summary.json", {"plan_id": doc.id, "per_token_p50_ms": _ms(median), "repeats": each})
    shown = (folder / "plan.json").relative_to(ROOT)
    commands.append(f"pp-smoke-run --plan {shown} --trace TRACE --max-tokens {tokens}  # {repeats} times")
    manifest: dict[str, Any] = {"kind": kind, "cluster": cluster, "tokens": tokens, "repeats": repeats}
    manifest |= {"commands": commands, "hardware": hardware(), "date": time.strftime("%Y-%m-%d")}
    if note:
        manifest["note"] = note
    _write_json(folder / "run.json", manifest)
    return load_run(folder)


def make_probe(folder: Path, model: str, repeats: int) -> dict[str, Any]:
    """Run ``ppharness plan probe --model model`` ``repeats`` times; keep every fit and the median of each figure."""
    folder.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    started = _now()
    with tempfile.TemporaryDirectory(prefix="ppharness-probe-") as tmp:
        for i in range(repeats):
            out = Path(tmp) / f"probe-{i}.yaml"
            argv = _cli("plan", "probe", "--model", model, "-o", str(out))
            done = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT)
            device: dict[str, Any] = msgspec.yaml.decode(out.read_bytes())[0]
            runs.append({"device": {k: device.get(k) for k in PROBE_FIELDS}, "report": done.stderr.strip()})
    median = {k: statistics.median(float(r["device"][k]) for r in runs) for k in PROBE_FIELDS}
    record = {
        "command": f"ppharness plan probe --model {model}",
        "repeats": repeats,
        "hardware": hardware(),
        "started_at": started,
        "finished_at": _now(),
        "median": median,
        "runs": runs,
    }
    _write_json(folder / "probe.json", record)
    return record


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ppharness.plan.validation", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    run = sub.add_parser("run", help="make a run: plan, prediction, run, summary, manifest")
    run.add_argument("folder", help="e.g. docs/validation/held-out/strong")
    run.add_argument("--kind", choices=KINDS, required=True)
    run.add_argument("--tokens", type=int, default=48)
    run.add_argument("--repeats", type=int, default=3, help="fresh runs of the plan; the median p50 is measured")
    run.add_argument("--plan", dest="plan_file", help="run this plan file as it is instead of making one")
    run.add_argument("--note", default="", help="a sentence for the manifest: what the run is for")
    run.epilog = "then, after --, `ppharness plan make`'s arguments (unless --plan)"
    probe = sub.add_parser("probe", help="time this machine with `ppharness plan probe` several times")
    probe.add_argument("folder")
    probe.add_argument("--model", default="small")
    probe.add_argument("--repeats", type=int, default=5)
    calibrate = sub.add_parser("calibrate", help="print a device entry's figures from a probe and a calibration run")
    calibrate.add_argument("--probe", default="calibration/probe-small", help="a probe's folder under docs/validation")
    calibrate.add_argument("--run", default="calibration/hop-docker", help="a calibration run's folder, likewise")
    experts = sub.add_parser("calibrate-experts", help="print a MoE cluster's figures from a calibration run")
    experts.add_argument("--run", default="calibration/kimi-docker", help="a calibration run's folder")
    sub.add_parser("table", help="rewrite docs/validation/README.md's table from the committed runs")
    words = list(sys.argv[1:] if argv is None else argv)
    cut = words.index("--") if "--" in words else len(words)
    args, make_args = parser.parse_args(words[:cut]), words[cut + 1 :]
    if args.what == "run":
        if bool(make_args) == bool(args.plan_file):
            parser.error("give `-- PLAN-MAKE-ARGS` or --plan FILE (one of them)")
        r = make_run(
            Path(args.folder).resolve(), args.kind, args.tokens, args.repeats, make_args, args.plan_file, args.note
        )
        print(
            f"{r.name}: predicted {r.predicted_ms:.2f} ms, measured p50 {r.measured_ms:.2f} ms ({r.error_pct:+.1f} %)"
        )
        write_table()
    elif args.what == "calibrate":
        figures = calibrated_figures(load_probes()[args.probe], load_run(VALIDATION / args.run))
        print(", ".join(f"{k}: {v:.3f}" for k, v in figures.items() if k != "hop_ms"))
        print(f"hop_ms: {figures['hop_ms']:.3f}")
    elif args.what == "calibrate-experts":
        print(", ".join(f"{k}: {v:.4g}" for k, v in expert_plan_figures(load_run(VALIDATION / args.run)).items()))
    elif args.what == "probe":
        record = make_probe(Path(args.folder).resolve(), args.model, args.repeats)
        print(json.dumps(record["median"], indent=1))
    else:
        write_table()


if __name__ == "__main__":
    main()
