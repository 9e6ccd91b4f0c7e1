import json

import msgspec

from ppharness.model.synthetic.spec import parse_synthetic
from ppharness.plan.compile import scenario_plan
from ppharness.plan.graph import spec_graph
from ppharness.plan.predict.simulate import simulate
from ppharness.plan.reader import load_cluster

src = "synthetic:qwen3-30b-a3b,blocks=8"
graph = spec_graph(parse_synthetic(src), src, 256)
doc = scenario_plan(graph, 4, None, "local")
cl = load_cluster("docs/gpu-bench-runs/2026-12-03/one-gpu-4-stage-qwen3/cluster.yaml")
devs = tuple(msgspec.structs.replace(d, id=f"local-{i}") for i, d in enumerate(cl.devices))
doc = msgspec.structs.replace(doc, cluster=msgspec.structs.replace(cl, devices=devs))
for r in (1, 16):
    p = simulate(doc, prompt_tokens=32, requests=r)
    print("requests", r, {k: v for k, v in msgspec.to_builtins(p).items() if not isinstance(v, (list, dict))})
    if r == 1:
        print(json.dumps(msgspec.to_builtins(p), default=str)[:1500])
