"""The vast.ai client and the provider's pure parts (marker ``vastai``; against the emulator, over real HTTP).

Retries happen on 429/502/503/504 (and dropped connections of requests that cannot act twice) and on nothing else;
the key is masked everywhere; the offer choice, the plan, the env encoding and the reaper behave as documented.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys

import httpx
import msgspec
import pytest

from backends.vastai import offers as vastai_offers
from backends.vastai.client import ApiKey, VastApiError, VastClient
from backends.vastai.emulator.server import parse_faults
from backends.vastai.emulator.state import make_catalog, priced
from backends.vastai.offers import choose_offers, encode_env, offer_query
from backends.vastai.provider import VastaiProvider, client_from_env, failure_of
from backends.vastai.settings import VastaiSettings
from ppharness.errors import ProviderError, ProvisionFailed
from ppharness.seams.provider import NodeSpec

pytestmark = pytest.mark.vastai


@pytest.fixture
def emu(vastai_api):
    if vastai_api.emulator is None:
        pytest.skip("vastai: client tests drive the emulator's fault switches (not with --vastai-real)")
    return vastai_api.emulator


@pytest.fixture
def client(emu):
    with VastClient(ApiKey(emu.key), emu.url, pace=emu.rate_scale * 3) as c:
        yield c


def _statuses(emu) -> list[int]:
    return [status for _, _, status in emu.requests]


def _stopped_instance(client, emu, label: str = "t") -> int:
    offer = next(o for o in emu.catalog.values() if not o["rented"] and o["id"] not in emu.consumed)
    return client.create_instance(offer["id"], {"image": "img", "disk": 10, "label": label, "target_state": "stopped"})


# --- the key ------------------------------------------------------------------------------------------------------


def test_api_key_is_masked_and_cannot_be_pickled():
    key = ApiKey("sekrit-0123456789")
    assert "sekrit" not in repr(key) + str(key) + f"{key}" + repr([key])
    assert key.reveal() == "sekrit-0123456789"
    with pytest.raises(TypeError):
        pickle.dumps(key)
    with pytest.raises(ProviderError):
        ApiKey("  ")
    assert "sekrit" not in repr(VastClient(key, "http://127.0.0.1:9"))


def test_wrong_key_is_a_401_whose_error_names_no_key(emu):
    with VastClient(ApiKey("wrong-key-abcdef"), emu.url, pace=emu.rate_scale) as c:
        with pytest.raises(VastApiError) as info:
            c.show_instance(1)
    assert info.value.status == 401 and info.value.error == "auth_error"
    assert "wrong-key" not in str(info.value) and emu.key not in str(info.value)
    assert _statuses(emu) == [401], "a 401 must not be retried"


# --- retries ------------------------------------------------------------------------------------------------------


def test_429_in_every_shape_is_retried(client, emu):
    emu.faults.storm_429 = 3  # plain text, {"detail": ...} and {"error": "rate_limit_exceeded"}
    assert client.search_offers(offer_query(VastaiSettings(), 1))
    assert _statuses(emu) == [429, 429, 429, 200]


@pytest.mark.parametrize("status", [502, 503, 504])
def test_gateway_errors_are_retried(client, emu, status):
    emu.faults.server_errors = [status, status]
    assert client.list_instances() == []
    assert _statuses(emu) == [status, status, 200]


@pytest.mark.parametrize("status", [500, 400])
def test_other_errors_are_not_retried(client, emu, status):
    emu.faults.server_errors = [status]
    with pytest.raises(VastApiError) as info:
        client.list_instances()
    assert info.value.status == status and _statuses(emu) == [status]


def test_storm_longer_than_the_attempts_gives_the_last_429(client, emu):
    emu.faults.storm_429 = 50
    with pytest.raises(VastApiError) as info:
        client.list_instances()
    assert info.value.status == 429 and len(emu.requests) == client.attempts


def test_dropped_connection_is_retried_for_reads_but_not_for_create(client, emu):
    emu.faults.resets = 1
    assert client.list_instances() == []
    offer = next(iter(emu.catalog))
    emu.faults.resets = 1
    with pytest.raises(VastApiError, match="no reply"):
        client.create_instance(offer, {"image": "img", "disk": 10})
    assert emu.creates == 0


def test_search_quota_is_not_retried_and_says_when_it_resets(client, emu):
    emu.faults.search_quota = True
    with pytest.raises(VastApiError) as info:
        client.search_offers({})
    assert info.value.error == "search_quota_exceeded" and info.value.reset_at
    assert _statuses(emu) == [429]


@pytest.mark.parametrize(("after", "waits"), [("2", [2.0]), ("120", [])])
def test_retry_after_is_waited_out_up_to_a_minute(after, waits):
    replies = iter(
        [
            httpx.Response(429, text="slow down", headers={"Retry-After": after}),
            httpx.Response(200, json={"instances": [], "next_token": None}),
        ]
    )
    slept: list[float] = []
    transport = httpx.MockTransport(lambda request: next(replies))
    with VastClient(ApiKey("k-0123"), "http://api.test", pace=0, sleep=slept.append, transport=transport) as c:
        if waits:
            assert c.list_instances() == []
        else:
            with pytest.raises(VastApiError, match="HTTP 429"):
                c.list_instances()
    assert [s for s in slept if s > 0] == waits


def test_a_paced_client_stays_under_the_rate_limits(emu):
    emu.rate_scale = 0.05
    with VastClient(ApiKey(emu.key), emu.url, pace=0.05) as c:
        for _ in range(4):
            c.list_instances()
    assert 429 not in _statuses(emu)
    with VastClient(ApiKey(emu.key), emu.url, pace=0.0, attempts=1) as hasty:
        with pytest.raises(VastApiError) as info:
            for _ in range(4):
                hasty.list_instances()
    assert info.value.status == 429 and "too frequent" in info.value.msg


# --- instances ----------------------------------------------------------------------------------------------------


def test_destroy_is_idempotent_and_show_reports_gone(client, emu):
    iid = _stopped_instance(client, emu)
    assert client.show_instance(iid)["actual_status"] == "stopped"
    assert client.destroy_instance(iid) is True
    assert client.destroy_instance(iid) is False
    assert client.show_instance(iid) is None
    emu.faults.gone_404 = True
    assert client.show_instance(iid) is None


def test_destroy_retries_only_transient_statuses(client, emu):
    first, second = _stopped_instance(client, emu), _stopped_instance(client, emu)
    emu.faults.destroy_fail, emu.faults.destroy_fail_status = 1, 500
    with pytest.raises(VastApiError) as info:
        client.destroy_instance(first)
    assert info.value.status == 500 and client.destroy_instance(first) is True
    emu.faults.destroy_fail, emu.faults.destroy_fail_status = 2, 503
    assert client.destroy_instance(second) is True
    assert [s for m, _, s in emu.requests if m == "DELETE"] == [500, 200, 503, 503, 200]


def test_list_pages_through_every_instance(client, emu):
    made = [_stopped_instance(client, emu, label=f"page-{i % 2}") for i in range(30)]
    assert [r["id"] for r in client.list_instances()] == sorted(made)
    assert len(client.list_instances({"label": {"eq": "page-0"}})) == 15
    pages = [(m, p, s) for m, p, s in emu.requests if p == "/api/v1/instances/"]
    assert len(pages) >= 3


def test_failure_of_reads_every_terminal_signal():
    assert failure_of(None)
    assert failure_of({"actual_status": "exited"}) and failure_of({"actual_status": "offline"})
    assert failure_of({"actual_status": "created", "status_msg": "OCI runtime create failed: x"})
    assert failure_of(
        {"actual_status": "loading", "cur_state": "stopped", "intended_status": "stopped", "next_state": "stopped"}
    )
    assert failure_of({"actual_status": "loading", "status_msg": "Pulling image x"}) is None
    assert failure_of({"actual_status": "running", "intended_status": "running", "cur_state": "running"}) is None


# --- offers, plan, env ----------------------------------------------------------------------------------------------


def test_query_carries_every_constraint_in_the_api_units():
    s = VastaiSettings(
        gpu_name=("RTX 3090", "RTX 4090"),
        num_gpus=2,
        min_gpu_ram_gb=24,
        max_dph=0.7,
        min_reliability=0.98,
        min_cuda=12.4,
        direct_ports=2,
        disk_gb=20,
    )
    q = offer_query(s, 5)
    assert q["gpu_name"] == {"in": ["RTX 3090", "RTX 4090"]} and q["num_gpus"] == {"eq": 2}
    assert q["gpu_ram"] == {"gte": 24000} and q["dph_total"] == {"lte": 0.7}
    assert q["reliability"] == {"gte": 0.98} and q["cuda_max_good"] == {"gte": 12.4}
    assert q["direct_port_count"] == {"gte": 2} and q["allocated_storage"] == 20.0
    assert q["order"] == [["dph_total", "asc"]] and q["rented"] == {"eq": False} and q["verified"] == {"eq": True}


def test_cheapest_matching_offers_are_chosen(client, emu):
    s = VastaiSettings(gpu_name="RTX 3090", min_gpu_ram_gb=16, max_dph=0.6)
    offers = client.search_offers(offer_query(s, 3))
    plan = choose_offers(offers, s, 3)
    prices = [o["dph_total"] for o in plan.chosen]
    assert prices == sorted(prices) and all(o["gpu_name"] == "RTX 3090" and o["num_gpus"] == 1 for o in plan.chosen)
    assert all(o["dph_total"] >= prices[-1] for o in plan.spares)
    with pytest.raises(ProvisionFailed, match="only"):
        choose_offers(offers, s, len(offers) + 1)
    with pytest.raises(ProvisionFailed, match="max_total_dph"):
        choose_offers(offers, msgspec.structs.replace(s, max_total_dph=0.1), 3)


def test_long_env_values_are_split_and_the_script_joins_them_exactly():
    plan = '{"plan_id":"x","opts":"' + "é" * 300 + '"}'
    env = {"PLAN": plan, "STAGE": "1", "SEED_ADDR": "tcp://127.0.0.1:5555"}
    env_obj, script = encode_env(env, ("7000/udp", "8080"))
    assert all(len(k) + len(v) <= 256 for k, v in env_obj.items())
    assert env_obj["-p 7000:7000/udp"] == "1" and env_obj["-p 8080:8080"] == "1"
    assert "PLAN" not in env_obj and script.endswith("exec pp-node")
    shown = subprocess.run(
        ["/bin/sh", "-c", script.replace("exec pp-node", 'printf %s "$PLAN"')],
        env=env_obj,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert shown == plan


def test_vanished_offer_is_replaced_by_a_spare(emu, monkeypatch):
    monkeypatch.setattr(vastai_offers, "NODE_COMMAND", "sleep 30")
    emu.faults.vanish_offers.add(1)
    settings = VastaiSettings(poll_s=0.05)
    with VastaiProvider("pp-vt-spare", settings) as provider:
        made = provider.provision([NodeSpec("pp-stage-0", {"STAGE": "0"})])
        assert len(made) == 1 and emu.creates == 2
        assert made[0].meta["public_ipaddr"] == "127.0.0.1"
    assert emu.live_instances() == []


def test_reap_destroys_only_ppharness_instances(client, emu, monkeypatch):
    monkeypatch.setattr(vastai_offers, "NODE_COMMAND", "sleep 30")
    with VastaiProvider("pp-vt-reap", VastaiSettings(poll_s=0.05)) as provider:
        provider.provision([NodeSpec("pp-stage-0", {"STAGE": "0"})])
        provider.instances.clear()  # a crash: this run forgets what it created
        foreign = _stopped_instance(client, emu, label="not-ours")
        reaped = VastaiProvider.reap()
        assert [r.run_label for r in reaped] == ["pp-vt-reap"] and str(foreign) not in reaped[0].what
    assert [i["id"] for i in emu.live_instances()] == [foreign]
    monkeypatch.delenv("VAST_API_KEY")
    assert VastaiProvider.reap() == []


# --- the emulator by hand -------------------------------------------------------------------------------------------


def test_every_fault_switch_parses():
    f = parse_faults(
        [
            "offers-cap=2",
            "reject-create=2",
            "vanish-offer=1",
            "stuck-loading=3",
            "fail-as=4:offline",
            "oci-error=5",
            "outbid=6",
            "null-ssh-port=7",
            "leave-stopped=3",
            "exit-after=8:1.5",
            "storm-429=9",
            "resets=2",
            "server-errors=502,503",
            "search-quota",
            "destroy-fail=-1",
            "gone-404",
        ]
    )
    assert (f.offers_cap, f.fail_as, f.exit_after_s, f.storm_429, f.resets) == (2, {4: "offline"}, {8: 1.5}, 9, 2)
    assert 2 in f.reject_create and f.vanish_offers == {1} and f.stuck_loading == {3} and f.oci_error == {5}
    assert f.outbid == {6} and f.null_ssh_port == {7} and f.leave_stopped == {3} and f.server_errors == [502, 503]
    assert f.search_quota and f.gone_404 and f.destroy_fail == -1
    with pytest.raises(ProviderError, match="fail-as=1:sideways"):
        parse_faults(["fail-as=1:sideways"])


def test_emulator_command_serves_until_terminated(tmp_path):
    env = {**os.environ, "VAST_API_KEY": "by-hand-key-0123"}
    with subprocess.Popen(
        [sys.executable, "-m", "ppharness.cli", "vastai-emulator", "--port", "0", "--fault", "offers-cap=1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,
    ) as proc:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        url = first.split(" at ")[1].split()[0]
        with VastClient(ApiKey("by-hand-key-0123"), url, pace=1.0) as c:
            assert len(c.search_offers({})) == 1
        proc.send_signal(signal.SIGTERM)
        rest = proc.stdout.read()
        assert proc.wait(30) == 0
    assert "by-hand-key" not in first + rest, "a key given in VAST_API_KEY is never printed"
    assert "every instance was destroyed" in rest


# --- against vast.ai itself (no request leaves this machine) ---------------------------------------------------------


class _OffersOnly:
    """A client of https://console.vast.ai that answers searches from the emulator's catalog and rents nothing."""

    base_url = "https://console.vast.ai"

    def search_offers(self, query: dict) -> list[dict]:
        return [priced(o, 16, False) for o in make_catalog()]

    def create_instance(self, offer_id: int, body: dict) -> int:
        raise AssertionError("rented an instance")

    def close(self) -> None:
        pass


def test_real_service_gets_the_documented_pace_and_a_pushed_image(monkeypatch):
    monkeypatch.setenv("VAST_URL", "https://console.vast.ai")
    monkeypatch.setenv("VAST_API_KEY", "k-0123")
    monkeypatch.setenv("PPHARNESS_VASTAI_PACE", "0.01")
    with client_from_env() as real:
        assert real.pace == 1.0
    monkeypatch.delenv("PPHARNESS_VASTAI_IMAGE", raising=False)
    provider = VastaiProvider("pp-vt-real", VastaiSettings(poll_s=0.1), client=_OffersOnly())  # type: ignore[arg-type]
    assert provider.poll_s == 10.0
    with pytest.raises(ProvisionFailed, match="local tag"):
        provider.provision([NodeSpec("pp-stage-0", {"STAGE": "0"})])
