"""Every request/response example of shared/vastai-api.md, replayed against the emulator (marker ``vastai``).

Each example quotes the contract verbatim (``test_every_example_is_quoted_from_the_contract`` checks the quote is
still there) and replays it over real HTTP: through the client where the client sends that request, raw otherwise.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.vastai.client import ApiKey, VastApiError, VastClient
from backends.vastai.emulator.network import RESERVATION_NAME
from backends.vastai.emulator.server import Emulator
from backends.vastai.provider import failure_of, is_running

pytestmark = pytest.mark.vastai
CONTRACT = Path(__file__).resolve().parent.parent.parent / "shared" / "vastai-api.md"
OFFER_FIELDS = (
    "id",
    "ask_contract_id",
    "machine_id",
    "host_id",
    "num_gpus",
    "gpu_name",
    "gpu_ram",
    "cpu_cores",
    "cpu_cores_effective",
    "cpu_ram",
    "disk_space",
    "cuda_max_good",
    "compute_cap",
    "dph_base",
    "dph_total",
    "min_bid",
    "storage_cost",
    "inet_up_cost",
    "inet_down_cost",
    "geolocation",
    "public_ipaddr",
    "direct_port_count",
    "reliability",
    "verification",
    "rentable",
    "rented",
    "score",
    "start_date",
    "end_date",
)
INSTANCE_FIELDS = (
    "id",
    "label",
    "actual_status",
    "intended_status",
    "cur_state",
    "next_state",
    "status_msg",
    "image_uuid",
    "image_runtype",
    "image_args",
    "onstart",
    "extra_env",
    "public_ipaddr",
    "local_ipaddrs",
    "ssh_host",
    "ssh_port",
    "direct_port_start",
    "direct_port_end",
    "ports",
    "dph_total",
    "dph_base",
    "is_bid",
    "min_bid",
    "start_date",
    "end_date",
    "machine_id",
    "host_id",
    "num_gpus",
    "gpu_name",
    "geolocation",
    "disk_space",
    "template_hash_id",
)


class Api:
    """The emulator, a client on it, and a raw authenticated httpx client for requests the client never sends."""

    def __init__(self, emu: Any) -> None:
        self.emu = emu
        self.client = VastClient(ApiKey(emu.key), emu.url, pace=emu.rate_scale * 3)
        self.raw = httpx.Client(base_url=emu.url, headers={"Authorization": f"Bearer {emu.key}"})

    def offer(self, **want: Any) -> int:
        return next(
            o["id"]
            for o in sorted(self.emu.catalog.values(), key=lambda o: o["id"])
            if not o["rented"] and o["id"] not in self.emu.consumed and all(o[k] == v for k, v in want.items())
        )

    def create(self, **body: Any) -> int:
        return self.client.create_instance(self.offer(), {"image": "img", "disk": 10, **body})

    def running(self, iid: int) -> dict[str, Any]:
        for _ in range(200):
            inst = self.client.show_instance(iid)
            if inst and inst["actual_status"] == "running":
                return inst
            time.sleep(0.05)
        raise AssertionError(f"instance {iid} never ran: {inst}")

    def pause(self) -> None:
        time.sleep(0.1)  # past every scaled rate limit, for raw requests

    def close(self) -> None:
        self.client.close()
        self.raw.close()


def ex_error_shape(api: Api) -> None:
    r = api.raw.delete("/api/v0/instances/1/")
    assert r.status_code == 404 and set(r.json()) == {"success", "error", "msg"} and r.json()["success"] is False


def ex_auth_error(api: Api) -> None:
    r = httpx.get(f"{api.emu.url}/api/v0/instances/1/", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json() == {"success": False, "error": "auth_error", "msg": "Invalid user key"}
    r = httpx.get(f"{api.emu.url}/api/v1/instances/")
    assert r.status_code == 401


def ex_query_key(api: Api) -> None:
    r = httpx.get(f"{api.emu.url}/api/v1/instances/", params={"api_key": api.emu.key})
    assert r.status_code == 200 and r.json()["instances"] == []


def ex_legacy_list(api: Api) -> None:
    r = api.raw.get("/api/v0/instances/")
    assert r.status_code == 410 and "Use /api/v1/instances/ instead" in r.json()["msg"]


def ex_trailing_slash(api: Api) -> None:
    assert api.raw.get("/api/v1/instances").status_code == 404


def ex_search(api: Api) -> None:
    offers = api.client.search_offers({"rentable": {"eq": True}, "limit": 3000})
    assert offers and all(f in o for o in offers for f in OFFER_FIELDS)
    assert all(o["id"] == o["ask_contract_id"] and ", " in o["geolocation"] and o["gpu_ram"] > 1000 for o in offers)
    assert any(" " in o["gpu_name"] for o in offers)


def ex_search_get(api: Api) -> None:
    r = api.raw.get("/api/v0/bundles/", params={"q": '{"num_gpus": {"eq": 2}}'})
    assert r.status_code == 200 and r.headers["Content-Type"] == "application/json"
    assert r.json()["offers"] and all(o["num_gpus"] == 2 for o in r.json()["offers"])


def ex_anonymous_search(api: Api) -> None:
    assert httpx.post(f"{api.emu.url}/api/v0/bundles/", json={"limit": 2}).json()["offers"]


def ex_dstack_filters(api: Api) -> None:
    q = {
        "direct_port_count": {"gte": 1},
        "inet_down": {"gt": 128},
        "cuda_max_good": {"gte": 12.8},
        "compute_cap": {"gte": 600},
        "verified": {"eq": True},
        "gpu_ram": {"gte": 20000, "lte": 90000},
        "gpu_name": {"notin": ["RTX 4070"]},
        "num_gpus": {"in": [1, 2]},
        "reliability": {"neq": 0, "lt": 1},
        "unknown_field": {"eq": 1},
        "chunked": True,
    }
    offers = api.client.search_offers(q)
    assert offers and all(
        o["direct_port_count"] >= 1
        and o["cuda_max_good"] >= 12.8
        and o["verified"]
        and 20000 <= o["gpu_ram"] <= 90000
        and o["num_gpus"] in (1, 2)
        for o in offers
    )


def ex_order_and_storage(api: Api) -> None:
    cheap = api.client.search_offers({"order": [["dph_total", "asc"]], "allocated_storage": 5.0})
    big = api.client.search_offers({"order": [["dph_total", "asc"]], "allocated_storage": 500.0})
    assert [o["dph_total"] for o in cheap] == sorted(o["dph_total"] for o in cheap)
    by_id = {o["id"]: o["dph_total"] for o in cheap}
    assert all(o["dph_total"] > by_id[o["id"]] for o in big)


def ex_bid_prices(api: Api) -> None:
    on_demand = {o["id"]: o for o in api.client.search_offers({"type": "on-demand"})}
    bids = api.client.search_offers({"type": "bid"})
    assert all(o["dph_total"] < on_demand[o["id"]]["dph_total"] and o["min_bid"] > 0 for o in bids)
    assert api.client.search_offers({"type": "ondemand", "limit": 1})


def ex_create(api: Api) -> None:
    r = api.raw.put(f"/api/v0/asks/{api.offer()}/", json={"image": "img", "disk": 10})
    body = r.json()
    assert r.status_code == 200 and body["success"] is True and isinstance(body["new_contract"], int)
    assert isinstance(body["instance_api_key"], str)


def ex_create_env_and_runtype(api: Api) -> None:
    iid = api.create(
        env={"-p 8000:8000": "1", "-h": "name", "HF_TOKEN": "x"},
        runtype="ssh_direc ssh_proxy",
        onstart="sleep 30",
        label=None,
        price=None,
        args=None,
    )
    inst = api.running(iid)
    assert inst["ports"]["22/tcp"][0]["HostPort"] != "22" and isinstance(inst["ports"]["8000/tcp"][0]["HostPort"], str)
    assert inst["public_ipaddr"] != inst["public_ipaddr"].strip() and inst["ssh_port"]
    assert ["HF_TOKEN", "x"] in inst["extra_env"]


def ex_create_args_runtype(api: Api) -> None:
    iid = api.create(runtype="args", onstart="/bin/sh", args=["-c", "exit 3"])
    for _ in range(200):
        inst = api.client.show_instance(iid)
        if inst["actual_status"] == "exited":
            break
        time.sleep(0.05)
    assert inst["actual_status"] == "exited" and "3" in inst["status_msg"]


def ex_create_invalid(api: Api) -> None:
    for body in (
        {"image": "img", "disk": 4},
        {"image": "img", "price": 500},
        {"disk": 10},
        {"image": "img", "env": {"A": "x" * 300}},
        {"image": "img", "runtype": "telnet"},
        {"image": "img", "onstart": "x" * 5000},
    ):
        api.pause()
        r = api.raw.put(f"/api/v0/asks/{api.offer()}/", json=body)
        assert r.status_code == 400 and r.json()["error"] in ("invalid_args", "invalid_price"), body
        assert r.json()["msg"].startswith("error 400/"), r.json()


def ex_no_such_ask(api: Api) -> None:
    offer = api.offer()
    api.client.create_instance(offer, {"image": "img", "disk": 10})
    with pytest.raises(VastApiError) as info:
        api.client.create_instance(offer, {"image": "img", "disk": 10})
    assert info.value.status == 404 and info.value.error == "no_such_ask"
    api.pause()
    assert api.raw.put(f"/api/v0/asks/{offer}/", json={"image": "i", "cancel_unavail": True}).status_code == 410


def ex_bid_under_floor(api: Api) -> None:
    with pytest.raises(VastApiError) as info:
        api.client.create_instance(api.offer(), {"image": "img", "disk": 10, "price": 0.001})
    assert info.value.new_contract is not None
    assert api.client.show_instance(info.value.new_contract)["actual_status"] == "stopped"


def ex_success_false_on_200(api: Api) -> None:
    api.emu.faults.reject_create[api.emu.creates + 1] = (200, "insufficient_credit", "not enough credit")
    with pytest.raises(VastApiError) as info:
        api.create()
    assert info.value.status == 200 and info.value.error == "insufficient_credit"


def ex_null_ssh_port(api: Api) -> None:
    api.emu.faults.null_ssh_port.add(api.emu.creates + 1)
    inst = api.running(api.create(runtype="ssh_direc ssh_proxy", onstart="sleep 30"))
    assert inst["ports"]["22/tcp"] is None and is_running(inst) and failure_of(inst) is None


def ex_show(api: Api) -> None:
    iid = api.create()
    r = api.raw.get(f"/api/v0/instances/{iid}/", params={"owner": "me"})
    inst = r.json()["instances"]
    assert isinstance(inst, dict) and all(f in inst for f in INSTANCE_FIELDS)
    assert inst["ports"] is None and inst["ssh_port"] is None and inst["public_ipaddr"] is None


def ex_show_gone(api: Api) -> None:
    assert api.raw.get("/api/v0/instances/12345/").json() == {"instances": None}
    api.emu.faults.gone_404 = True
    api.pause()
    assert api.raw.get("/api/v0/instances/12345/").status_code == 404


def ex_timeline(api: Api) -> None:
    iid = api.create(runtype="ssh", onstart="sleep 30")
    seen = []
    for _ in range(200):
        inst = api.client.show_instance(iid)
        if not seen or seen[-1] != inst["actual_status"]:
            seen.append(inst["actual_status"])
            assert inst["intended_status"] == inst["cur_state"] == "running" and inst["status_msg"]
        if inst["actual_status"] == "running":
            break
        time.sleep(0.02)
    assert seen == [None, "created", "loading", "running"]


def ex_list(api: Api) -> None:
    ids = [api.create(label="x") for _ in range(2)] + [api.create()]
    r = api.raw.get(
        "/api/v1/instances/",
        params={"select_filters": '{"label":{"in":["x"]}}', "order_by": '[{"col":"id","dir":"asc"}]', "limit": "1"},
    )
    body = r.json()
    assert set(body) >= {"success", "instances_found", "total_instances", "label_counts", "next_token", "instances"}
    assert body["instances_found"] == 1 and body["total_instances"] == 2 and body["label_counts"] == {"x": 2, "": 1}
    assert body["next_token"] and body["instances"][0]["id"] == ids[0]
    api.pause()
    last = api.raw.get(
        "/api/v1/instances/",
        params={"select_filters": '{"label":{"in":["x"]}}', "limit": "1", "after_token": body["next_token"]},
    ).json()
    assert last["instances"][0]["id"] == ids[1] and last["next_token"] is None


def ex_list_computed(api: Api) -> None:
    r = api.raw.get("/api/v1/instances/", params={"select_filters": '{"dph_total":{"lte":1}}'})
    assert r.status_code == 400


def ex_manage(api: Api) -> None:
    iid = api.create(runtype="ssh", onstart="sleep 30")
    api.running(iid)
    api.client.manage_instance(iid, {"state": "stopped"})
    assert api.client.show_instance(iid)["actual_status"] == "stopped"
    api.client.manage_instance(iid, {"label": "renamed"})
    assert [i["id"] for i in api.client.list_instances({"label": {"eq": "renamed"}})] == [iid]
    api.client.manage_instance(iid, {"state": "running"})
    assert api.running(iid)


def ex_destroy(api: Api) -> None:
    iid = api.create()
    r = api.raw.request("DELETE", f"/api/v0/instances/{iid}/", json={})
    assert r.status_code == 200 and r.json()["success"] is True and r.json()["msg"]
    api.pause()
    again = api.raw.delete(f"/api/v0/instances/{iid}/")  # an empty body this time
    assert again.status_code == 404 and again.json()["error"] == "no_such_instance"
    assert api.client.destroy_instance(iid) is False
    assert iid not in [i["id"] for i in api.client.list_instances()]


def ex_rate_limit_text(api: Api) -> None:
    api.emu.rate_scale = 1.0  # vast.ai's own intervals: the second call comes far too soon
    api.raw.get("/api/v1/instances/")
    r = api.raw.get("/api/v1/instances/")
    assert r.status_code == 429 and r.headers["Content-Type"].startswith("text/plain")
    assert r.text.startswith("API requests too frequent") and "Retry-After" not in r.headers


def ex_rate_limit_json(api: Api) -> None:
    api.emu.faults.storm_429 = 3
    text, detail, coded = (api.raw.get("/api/v1/instances/") for _ in range(3))
    assert text.status_code == detail.status_code == coded.status_code == 429
    assert text.text.startswith("API requests too frequent")
    assert detail.json() == {"detail": "API requests too frequent"}
    assert coded.json() == {"success": False, "error": "rate_limit_exceeded", "msg": "API requests too frequent"}


def ex_search_quota(api: Api) -> None:
    api.emu.faults.search_quota = True
    r = api.raw.post("/api/v0/bundles/", json={})
    assert r.status_code == 429 and r.json()["error"] == "search_quota_exceeded"
    assert int(r.headers["X-RateLimit-Reset"]) % 86400 == 0


def ex_transient_5xx(api: Api) -> None:
    api.emu.faults.server_errors = [502, 503, 504]
    assert api.client.list_instances() == []


EXAMPLES: list[tuple[str, Callable[[Api], None]]] = [
    ('`{"success": false, "error": "<code>", "msg": "<text>"}`', ex_error_shape),
    ('`{"success":false,"error":"auth_error","msg":"Invalid user key"}`', ex_auth_error),
    ("Also accepted: `?api_key=<key>`", ex_query_key),
    ('answers 410 "Use /api/v1/instances/ instead"', ex_legacy_list),
    ("Every path ends in `/`.", ex_trailing_slash),
    ("`POST /api/v0/bundles/`; the body is the query object", ex_search),
    ("`GET /api/v0/bundles/?q=<url-encoded JSON>`", ex_search_get),
    ("gpuhunt searches offers with no key at all", ex_anonymous_search),
    ("Example (dstack): `direct_port_count gte 1`, `inet_down gt 128`, `cuda_max_good gte 12.8`", ex_dstack_filters),
    ("Make `dph_total` depend on `allocated_storage`", ex_order_and_storage),
    ('`type:"bid"` prices offers by bid', ex_bid_prices),
    ('`{"success": true, "new_contract": <int instance id>, "instance_api_key": "..."}`', ex_create),
    ('Port: `"-p 8000:8000": "1"` (`/udp` allowed). Hostname: `"-h": "name"`', ex_create_env_and_runtype),
    ('dstack sends `runtype:"args"`, `onstart:"/bin/sh"`, `args:["-c", script]`', ex_create_args_runtype),
    ("with `msg` like `error 400/NNNN: ...`", ex_create_invalid),
    ("Create: `no_such_ask` (the offer is gone)", ex_no_such_ask),
    ("a bid below the floor leaves a **stopped** instance plus an error", ex_bid_under_floor),
    ("Always check `success`, even on HTTP 200", ex_success_false_on_200),
    ('SkyPilot notes `ports["22/tcp"]` can be null even on a running instance.', ex_null_ssh_port),
    ('The body is `{"instances": {<one object>}}`', ex_show),
    ('Unknown or destroyed ids give `{"instances":null}`, with an optional 404 mode', ex_show_gone),
    ("`actual_status` goes null → `created` → `loading` → `running`", ex_timeline),
    ('`select_filters`: e.g. `{"label":{"in":["x"]}}`', ex_list),
    ("Computed columns such as `dph_total` give 400.", ex_list_computed),
    ('`PUT /api/v0/instances/{id}/` with `{"state":"stopped"|"running"}` or `{"label":"..."}`', ex_manage),
    ('200 `{"success":true,"msg":...}`; the instance then vanishes from GET and the list', ex_destroy),
    ("The body is often plain text `API requests too frequent[: endpoint threshold=X]`", ex_rate_limit_text),
    ('sometimes JSON `{"detail": ...}` or `{success,error:"rate_limit_exceeded",msg}`', ex_rate_limit_json),
    ('`error:"search_quota_exceeded"` with an `X-RateLimit-Reset` epoch header', ex_search_quota),
    ("vastai treats 502, 503 and 504 as transient", ex_transient_5xx),
]


def test_every_example_is_quoted_from_the_contract():
    if not CONTRACT.is_file():
        pytest.skip(f"vastai: the contract {CONTRACT} is not beside this checkout")
    text = CONTRACT.read_text()
    missing = [quote for quote, _ in EXAMPLES if quote not in text]
    assert not missing, f"quotes no longer in {CONTRACT.name}: {missing}"


@pytest.mark.parametrize("example", [fn for _, fn in EXAMPLES], ids=[fn.__name__[3:] for _, fn in EXAMPLES])
def test_example_replays_against_the_emulator(vastai_api, example):
    if vastai_api.emulator is None:
        pytest.skip("vastai: the contract's examples replay against the emulator (not with --vastai-real)")
    api = Api(vastai_api.emulator)
    try:
        example(api)
    finally:
        api.close()


# --- ports: what vast.ai publishes, and where ------------------------------------------------------------------------

SERVE_PORTS = """
import json, os, socket, threading
host = os.environ["PP_BIND_HOST"]
tcp = socket.create_server((host, 7100))
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.bind((host, 7101))
names = ("PP_BIND_HOST", "PUBLIC_IPADDR", "VAST_TCP_PORT_7100", "VAST_UDP_PORT_7101")
print("ENV " + json.dumps({k: os.environ.get(k) for k in names}), flush=True)
def echo():
    while True:
        data, peer = udp.recvfrom(65535)
        udp.sendto(b"udp:" + data, peer)
threading.Thread(target=echo, daemon=True).start()
while True:
    conn, _ = tcp.accept()
    conn.sendall(b"tcp:" + conn.recv(100))
    conn.close()
"""


def _serving_ports(api: Api) -> tuple[int, dict[str, Any], dict[str, str]]:
    """An instance whose command serves TCP on container port 7100 and UDP on 7101 at the address it is told to
    bind (the client asks for 0.0.0.0, as the provider does): (its id, its view once running, the environment its
    command saw)."""
    iid = api.create(
        env={"-p 7100:7100": "1", "-p 7101:7101/udp": "1", "PP_BIND_HOST": "0.0.0.0"},
        runtype="args",
        onstart=sys.executable,
        args=["-c", SERVE_PORTS],
    )
    inst = api.running(iid)
    for _ in range(200):
        lines = [ln for ln in api.emu.node_log(iid).splitlines() if ln.startswith("ENV ")]
        if lines:
            return iid, inst, json.loads(lines[0][4:])
        time.sleep(0.05)
    raise AssertionError(f"instance {iid}'s command never served: {api.emu.node_log(iid)}")


def _host_port(inst: dict[str, Any], spec: str) -> str:
    return str(inst["ports"][spec][0]["HostPort"])


@pytest.fixture
def api(vastai_api):
    if vastai_api.emulator is None:
        pytest.skip("vastai: the emulator's own network is tested against the emulator (not with --vastai-real)")
    api = Api(vastai_api.emulator)
    yield api
    api.close()


def test_a_published_container_port_is_reached_at_another_public_port(api):
    iid, inst, env = _serving_ports(api)
    host_port = _host_port(inst, "7100/tcp")
    assert isinstance(inst["ports"]["7100/tcp"][0]["HostPort"], str) and host_port != "7100"
    assert inst["direct_port_start"] <= int(host_port) <= inst["direct_port_end"]
    assert env["VAST_TCP_PORT_7100"] == host_port
    assert env["PUBLIC_IPADDR"] == inst["public_ipaddr"] and env["PUBLIC_IPADDR"].strip() == "127.0.0.1"
    address = api.emu.instances[iid].address
    assert env["PP_BIND_HOST"] == address and address.startswith("127.77.")  # not the client's 0.0.0.0
    with socket.create_connection(("127.0.0.1", int(host_port)), timeout=5) as conn:
        conn.sendall(b"hello")
        assert conn.recv(100) == b"tcp:hello"
    forwarders = list(api.emu.instances[iid].forwarders.values())
    assert api.client.destroy_instance(iid) is True
    assert forwarders and not any(f.alive for f in forwarders)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", int(host_port)), timeout=5).close()
    assert f"instance {iid}: withdrew 2 published port(s)" in api.emu.log_text()


def test_a_published_udp_port_relays_datagrams_both_ways(api):
    _, inst, env = _serving_ports(api)
    host_port = _host_port(inst, "7101/udp")
    assert env["VAST_UDP_PORT_7101"] == host_port and host_port != "7101"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
        client.settimeout(5)
        for datagram in (b"one", b"two"):
            client.sendto(datagram, ("127.0.0.1", int(host_port)))
            assert client.recvfrom(100) == (b"udp:" + datagram, ("127.0.0.1", int(host_port)))


def test_two_instances_bind_the_same_container_port_at_addresses_of_their_own(api):
    first, second = _serving_ports(api), _serving_ports(api)
    assert first[2]["PP_BIND_HOST"] != second[2]["PP_BIND_HOST"]
    assert _host_port(first[1], "7100/tcp") != _host_port(second[1], "7100/tcp")
    for _, inst, _ in (first, second):
        with socket.create_connection(("127.0.0.1", int(_host_port(inst, "7100/tcp"))), timeout=5) as conn:
            conn.sendall(b"which")
            assert conn.recv(100) == b"tcp:which"


def test_a_stopped_instance_publishes_no_ports_until_it_runs_again(api):
    iid, inst, _ = _serving_ports(api)
    forwarders = list(api.emu.instances[iid].forwarders.values())
    api.client.manage_instance(iid, {"state": "stopped"})
    for _ in range(100):
        if not any(f.alive for f in forwarders):
            break
        time.sleep(0.05)
    assert not any(f.alive for f in forwarders) and api.client.show_instance(iid)["ports"] is None
    api.client.manage_instance(iid, {"state": "running"})
    again = api.running(iid)
    assert set(again["ports"]) == set(inst["ports"]) == {"7100/tcp", "7101/udp"}


def test_an_offer_search_is_logged_with_each_filter_field_it_ignored(api):
    offers = api.client.search_offers({"gpu_nmae": {"eq": "RTX 4090"}, "num_gpus": {"eq": 1}, "verified": True})
    assert len({o["gpu_name"] for o in offers}) > 1  # answered as vast.ai does: the misspelt field filtered nothing
    lines = [ln for ln in api.emu.log_text().splitlines() if " search: " in ln]
    assert len([ln for ln in lines if "search: filters" in ln]) == 1
    assert any('"gpu_nmae": {"eq": "RTX 4090"}' in ln and '"num_gpus": {"eq": 1}' in ln for ln in lines)
    ignored = [ln.split("search: ")[1] for ln in lines if "ignored filter field" in ln]
    assert ignored == [
        "ignored filter field 'gpu_nmae': offers have no such field",
        "ignored filter field 'verified': True is not an {op: value} object",
    ]


def test_no_forwarder_or_address_outlives_the_emulator(tmp_path):
    with Emulator.for_ci(tmp_path / "emulator") as emu:
        api = Api(emu)
        try:
            iid, _, env = _serving_ports(api)
            forwarders = list(emu.instances[iid].forwarders.values())
        finally:
            api.close()
    assert forwarders and not any(f.alive for f in forwarders)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.bind(RESERVATION_NAME.format(env["PP_BIND_HOST"]))  # the instance's address is free again
