"""What a run rents as the plan says (``backends.vastai.rentals``) and how one instance runs a host's nodes
(``ppharness.run.node.host``): per-device searches, GPUs of one host as one instance, container ports, pp-host's
environment encoding and its supervision of real processes."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backends.vastai.offers import offer_query
from backends.vastai.rentals import instance_env, port_requests, rentals
from backends.vastai.settings import VastaiSettings
from ppharness.errors import ProvisionFailed
from ppharness.run.node.host import COUNT_VAR, OWN_VAR, HostError, host_env, run_host, split_env
from ppharness.seams.provider import NodeSpec

EIGHT = {"gpu_name": "RTX_4090", "num_gpus": "8"}
ROOT = Path(__file__).resolve().parents[1]


def _spec(name: str, stage: int, **kw: object) -> NodeSpec:
    env = {"STAGE": str(stage), "SEED_ADDR": "tcp://seed:1", "MODEL": "synthetic:tiny", "TRANSPORT": "zmq"}
    return NodeSpec(name=name, env=env, **kw)  # type: ignore[arg-type]


def test_gpus_of_one_host_are_one_instance_and_other_nodes_one_each():
    specs = [
        _spec("pp-stage-0", 0, host="east", gpu=0, offer=EIGHT),
        _spec("pp-stage-1", 1, offer={"gpu_name": "RTX 3090"}),
        _spec("pp-expert-0", 2, host="east", gpu=1, offer=EIGHT),
        _spec("pp-stage-2", 2),
    ]
    out = rentals(specs, VastaiSettings(max_dph=30))
    assert [r.describe() for r in out] == [
        "host east (pp-stage-0, pp-expert-0)",
        "pp-stage-1",
        "pp-stage-2",
    ]
    host, single, default = out
    assert host.command == "pp-host" and single.command == default.command == "pp-node"
    assert host.settings.num_gpus == 8 and host.settings.gpu_names == ("RTX 4090",)
    assert single.settings.gpu_names == ("RTX 3090",) and single.settings.num_gpus == 1
    assert default.settings == VastaiSettings(max_dph=30), "a node without an offer is searched by the scenario's"
    assert len({r.search_key for r in out}) == 3
    # each node its own container port, from node_port by its place in the run
    assert host.ports == {"pp-stage-0": 7100, "pp-expert-0": 7102} and default.ports == {"pp-stage-2": 7103}


def test_a_devices_search_is_sent_with_the_apis_gpu_name():
    out = rentals([_spec("pp-stage-0", 0, offer={"gpu_name": "RTX_4090", "num_gpus": "2"})], VastaiSettings())
    q = offer_query(out[0].settings, 1)
    assert q["gpu_name"] == {"eq": "RTX 4090"} and q["num_gpus"] == {"eq": 2}


def test_equal_searches_are_one_search():
    specs = [_spec(f"pp-stage-{i}", i, offer={"num_gpus": "1", "max_dph": "0.5"}) for i in range(3)]
    assert len({r.search_key for r in rentals(specs, VastaiSettings())}) == 1


def test_a_host_whose_devices_ask_for_different_offers_is_refused():
    specs = [
        _spec("pp-stage-0", 0, host="h", gpu=0, offer=EIGHT),
        _spec("pp-stage-1", 1, host="h", gpu=1, offer={"num_gpus": "8"}),
    ]
    with pytest.raises(ProvisionFailed, match="one machine, but its devices ask for different offers"):
        rentals(specs, VastaiSettings())


def test_a_gpu_beyond_the_offers_count_is_refused():
    with pytest.raises(ProvisionFailed, match="GPU 2 on an offer of 2 GPU"):
        rentals([_spec("pp-stage-0", 0, host="h", gpu=2, offer={"num_gpus": "2"})], VastaiSettings())


def test_an_unknown_offer_field_is_refused_before_any_search():
    with pytest.raises(ProvisionFailed, match="offer field gpu_model"):
        rentals([_spec("pp-stage-0", 0, offer={"gpu_model": "x"})], VastaiSettings())


def test_each_node_binds_its_own_port_and_the_instance_opens_them():
    specs = [_spec("a", 0, host="h", gpu=0, offer=EIGHT), _spec("b", 1, host="h", gpu=3, offer=EIGHT)]
    (host,) = rentals(specs, VastaiSettings(ports=("9000",)))
    assert port_requests(host) == ("9000", "7100", "7101")
    nodes = split_env(instance_env(host, {"PP_RUN_LABEL": "pp-x"}))
    assert [(n["STAGE"], n["PP_PORT"], n["CUDA_VISIBLE_DEVICES"]) for n in nodes] == [
        ("0", "7100", "0"),
        ("1", "7101", "3"),
    ]
    assert all(n["PP_BIND_HOST"] == "0.0.0.0" and n["PP_RUN_LABEL"] == "pp-x" for n in nodes)
    iroh = rentals([NodeSpec("c", {"STAGE": "0", "TRANSPORT": "iroh"})], VastaiSettings())
    assert port_requests(iroh[0]) == ("7100/udp",), "QUIC needs its UDP port opened"


_NAMES = st.from_regex(r"[A-Z][A-Z0-9_]{0,8}", fullmatch=True).filter(lambda n: not n.startswith("PP_HOST"))


@given(st.lists(st.dictionaries(_NAMES, st.text(max_size=20), max_size=6), min_size=1, max_size=8))
def test_a_hosts_environment_gives_each_node_exactly_its_own(envs):
    encoded = host_env(envs)
    assert int(encoded[COUNT_VAR]) == len(envs)
    assert split_env(encoded) == envs


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({}, "whole number"),
        ({COUNT_VAR: "0"}, "1 to 64"),
        ({COUNT_VAR: "1"}, "PP_HOST_OWN must be the nodes' own entries"),
        ({COUNT_VAR: "1", OWN_VAR: "zlib:!!"}, "PP_HOST_OWN is not the nodes' own entries"),
        ({**host_env([{"A": "1"}]), COUNT_VAR: "2"}, "holds 1 node"),
        ({COUNT_VAR: "1", OWN_VAR: "zlib:" + base64.b64encode(zlib.compress(b"[1]")).decode()}, "a list of objects"),
        ({COUNT_VAR: "1", OWN_VAR: "zlib:" + base64.b64encode(zlib.compress(b" " * (17 << 20))).decode()}, "inflates"),
    ],
)
def test_a_broken_host_environment_is_refused(env, says):
    with pytest.raises(HostError, match=says):
        split_env(env)


NODE = textwrap.dedent(
    """
    import os, sys, time
    print("node", os.environ["STAGE"], "on GPU", os.environ["CUDA_VISIBLE_DEVICES"], flush=True)
    if os.environ["STAGE"] == "1":
        time.sleep(0.5)
        sys.exit(3)
    time.sleep(60)
    """
)


def test_pp_host_runs_each_node_and_the_first_to_end_ends_the_others(tmp_path, capfd):
    envs = [{**os.environ, "STAGE": str(k), "CUDA_VISIBLE_DEVICES": str(k)} for k in range(3)]
    t0 = time.monotonic()
    code = run_host(host_env(envs), [sys.executable, "-c", NODE])
    assert code == 3, "the host exits with the code of the node that ended"
    assert time.monotonic() - t0 < 20, "the other nodes were stopped, not waited for"
    out = capfd.readouterr().out
    for k in range(3):
        assert f"[node {k}] node {k} on GPU {k}" in out
    assert "node 1 exited with code 3" in out


def test_a_kimi_host_fits_one_instances_environment():
    """The west host of scenarios/kimi-vastai.json runs four nodes whose programs, compressed one by one, would not
    fit vast.ai's 32 KiB of environment; compressed together they do, and each node gets its program back."""
    from backends.vastai.offers import ENV_TOTAL_MAX, encode_env
    from ppharness.plan.compile import load_compiled, programs
    from ppharness.plan.stages import decode_program, encode_program

    _, compiled = load_compiled(str(ROOT / "scenarios" / "kimi-vastai.json"))
    specs = [
        NodeSpec(
            f"n{i}",
            {"STAGE": str(i), "PLAN": encode_program(p), "TRANSPORT": "zmq"},
            host=d.source.host,
            gpu=d.source.gpu,
            offer=d.source.offer,
        )
        for i, (p, d) in enumerate(zip(programs(compiled, {}), compiled.all_devices))
    ]
    hosts = rentals(specs, VastaiSettings())
    assert len(hosts) == 2
    for rental in hosts:
        env = instance_env(rental, {})
        entries, _ = encode_env(env, port_requests(rental))
        assert sum(len(k) + len(v) for k, v in entries.items()) <= ENV_TOTAL_MAX
        for node, spec in zip(split_env(env), rental.specs):
            assert decode_program(node["PLAN"]) == decode_program(spec.env["PLAN"])


def test_pp_host_without_nodes_exits_1_with_the_reason():
    env = {k: v for k, v in os.environ.items() if k != COUNT_VAR}
    proc = subprocess.run([sys.executable, "-m", "ppharness.run.node.host"], env=env, capture_output=True, text=True)
    assert proc.returncode == 1 and "PP_HOST_NODES must be a whole number" in proc.stderr


def test_kept_log_folders_do_not_pile_up(tmp_path):
    """A failed run's log folder is kept for reading; folders beyond the newest few, and older than any run can last,
    are removed when a new run makes its own, and a recent one is never touched."""
    from ppharness.seams.provider import prune_kept_logs

    old = time.time() - 2 * 86_400
    for i in range(6):
        folder = tmp_path / f"pp-{i}"
        folder.mkdir()
        (folder / "pp-stage-0.log").write_text("x")
        os.utime(folder, (old + i, old + i))
    recent = tmp_path / "pp-live"
    recent.mkdir()
    gone = prune_kept_logs(tmp_path, keep=2)
    assert sorted(p.name for p in gone) == ["pp-0", "pp-1", "pp-2", "pp-3", "pp-4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pp-5", "pp-live"]
    assert prune_kept_logs(tmp_path, keep=0, stale_s=86_400) == [tmp_path / "pp-5"], "a recent folder is kept"
