"""The vast.ai emulator's world: a seeded offer catalog, the filter grammar, and instances that run real nodes.

Instances go through ``null -> created -> loading -> running`` on a configurable timeline; entering ``running``
publishes the instance's container ports (``network.publish``: a forwarder per ``-p`` entry, and 22/tcp for the
direct ssh runtypes, from the public address at a port the OS picks to the instance's own address) and then starts
the container's command through a runner (``runners``: a local process or a Docker container); a command that ends
turns an ``args`` instance into ``exited`` (other runtypes stay up, as vast.ai's ssh containers do). An instance
that is not running has no forwarders: they are closed when it exits or stops (within one tick) and when it is
destroyed. Every publication and withdrawal is a line of the emulator's log (``EventLog``).
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from backends.vastai.emulator.intake import shown
from backends.vastai.emulator.network import PUBLIC_IPADDR_SHOWN, Forwarder, Reservation, publish, withdraw

if TYPE_CHECKING:
    import subprocess

    from docker.models.containers import Container

    from backends.vastai.emulator.runners import DockerRunner, ProcessRunner

OPS = ("eq", "neq", "gt", "gte", "lt", "lte", "in", "notin")
_PORT_FLAG = re.compile(r"^-p\s+(\d+):(\d+)(/(tcp|udp))?$")
GPUS = (  # name, GPU RAM (MB), $/hr per GPU, cuda_max_good, compute_cap
    ("RTX 3090", 24576, 0.18, 12.4, 860),
    ("RTX 4090", 24564, 0.32, 12.8, 890),
    ("RTX A6000", 49140, 0.45, 12.6, 860),
    ("A100 SXM4", 81920, 1.10, 12.8, 800),
    ("H100 SXM", 81559, 2.20, 12.9, 900),
    ("RTX 4070", 12282, 0.11, 12.6, 890),
)
PLACES = ("Washington, US", "Quebec, CA", "Frankfurt, DE", "Tokyo, JP", "Helsinki, FI", "Texas, US", "Sao Paulo, BR")
GPU_COUNTS = (1, 1, 2, 1, 4, 1, 8, 1)


def make_catalog(count: int = 64, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` offers, the same for the same seed: every GPU model in 1-8 GPU bundles, a few rented or unverified.
    Prices are stored as ``dph_base`` and ``storage_cost``; ``dph_total`` is computed per search."""
    rng = random.Random(seed)
    offers = []
    for i in range(count):
        name, ram, price, cuda, cc = GPUS[i % len(GPUS)]
        n = GPU_COUNTS[(i // len(GPUS)) % len(GPU_COUNTS)]
        base = round(price * n * rng.uniform(0.8, 1.3), 4)
        ask = 20_000_000 + seed * 100_000 + i * 37
        offers.append(
            {
                "id": ask,
                "ask_contract_id": ask,
                "machine_id": 40_000 + i,
                "host_id": 300 + i % 17,
                "gpu_name": name,
                "num_gpus": n,
                "gpu_ram": ram,
                "gpu_total_ram": ram * n,
                "cuda_max_good": cuda,
                "compute_cap": cc,
                "driver_version": "535.86.05",
                "cpu_cores": 16 * n,
                "cpu_cores_effective": 8.0 * n,
                "cpu_ram": 64_000 * n,
                "disk_space": round(rng.uniform(100, 2000), 1),
                "dph_base": base,
                "min_bid": round(base * 0.55, 4),
                "storage_cost": round(rng.uniform(0.05, 0.3), 3),
                "inet_up_cost": 0.01,
                "inet_down_cost": 0.01,
                "inet_down": round(rng.uniform(100, 3000), 1),
                "inet_up": round(rng.uniform(100, 3000), 1),
                "reliability": round(rng.uniform(0.93, 0.9995), 4),
                "verified": i % 13 != 5,
                "verification": "verified" if i % 13 != 5 else "unverified",
                "rentable": True,
                "rented": i % 11 == 3,
                "external": False,
                "datacenter": i % 3 == 0,
                "static_ip": i % 2 == 0,
                "geolocation": PLACES[i % len(PLACES)],
                "public_ipaddr": f"127.0.{i // 250}.{i % 250 + 1}",
                "direct_port_count": (i * 7) % 120,
                "score": round(rng.uniform(10, 400), 2),
                "dlperf": round(rng.uniform(5, 300), 2),
                "start_date": 1.7e9,
                "end_date": 1.9e9,
                "duration": 2e8,
            }
        )
    for o in offers:
        o["reliability2"] = o["reliability"]
    return offers


def priced(offer: dict[str, Any], storage_gb: float, bid: bool) -> dict[str, Any]:
    """The offer as a search shows it: ``dph_total`` for ``storage_gb`` of storage, by bid or on-demand price."""
    hourly = offer["min_bid"] if bid else offer["dph_base"]
    return {**offer, "dph_total": round(hourly + storage_gb * offer["storage_cost"] / 30 / 24, 6)}


def matches(record: dict[str, Any], filters: dict[str, Any]) -> bool:
    """The ``{field: {op: value}}`` grammar, several ops per field; fields the record lacks are not filtered on."""
    for name, ops in filters.items():
        if name not in record or not isinstance(ops, dict):
            continue
        have = record[name]
        for op, want in ops.items():
            if not _holds(op, have, want):
                return False
    return True


def _holds(op: str, have: Any, want: Any) -> bool:
    try:
        if op == "eq":
            return bool(have == want)
        if op == "neq":
            return bool(have != want)
        if op == "in":
            return have in want
        if op == "notin":
            return have not in want
        if have is None or want is None:
            return False
        return bool({"gt": have > want, "gte": have >= want, "lt": have < want, "lte": have <= want}[op])
    except (TypeError, KeyError):
        return False


def order_key(spec: Any) -> list[tuple[str, bool]]:
    """``[[field, "asc"|"desc"], ...]`` (search) or ``[{"col":..., "dir":...}]`` (list) as (field, descending);
    ValueError for an order of another shape."""
    if not isinstance(spec, list):
        raise ValueError(f"the order must be a list, not {type(spec).__name__}")
    out = []
    for item in spec:
        if isinstance(item, dict):
            col, way = item.get("col"), item.get("dir", "asc")
        elif isinstance(item, list) and len(item) >= 2:
            col, way = item[0], item[1]
        else:
            raise ValueError(
                f'order entry {shown(repr(item))} is not [field, "asc"|"desc"] or {{"col": field, "dir": ...}}'
            )
        out.append((str(col), str(way).lower() == "desc"))
    return out


def sort_records(records: list[dict[str, Any]], keys: list[tuple[str, bool]]) -> list[dict[str, Any]]:
    out = sorted(records, key=lambda r: r.get("id", 0))
    for col, desc in reversed(keys):
        out.sort(key=lambda r: (r.get(col) is None, r.get(col) if r.get(col) is not None else 0), reverse=desc)
    return out


@dataclass
class Faults:
    """Fault switches; ordinals count creates (and the instances they make) from 1, in arrival order."""

    offers_cap: int | None = None
    vanish_offers: set[int] = field(default_factory=set)
    reject_create: dict[int, tuple[int, str, str]] = field(default_factory=dict)
    leave_stopped: set[int] = field(default_factory=set)
    stuck_loading: set[int] = field(default_factory=set)
    fail_as: dict[int, str] = field(default_factory=dict)
    oci_error: set[int] = field(default_factory=set)
    outbid: set[int] = field(default_factory=set)
    null_ssh_port: set[int] = field(default_factory=set)
    exit_after_s: dict[int, float] = field(default_factory=dict)
    storm_429: int = 0
    storm_endpoints: frozenset[str] | None = None
    storm_after_creates: int = 0
    server_errors: list[int] = field(default_factory=list)
    resets: int = 0
    search_quota: bool = False
    destroy_fail: int = 0
    destroy_fail_status: int = 503
    gone_404: bool = False


class EventLog:
    """The emulator's own log (``emulator.log`` in its log directory): one timestamped line per event, appended, safe
    to write from any thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def write(self, line: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        with self._lock, open(self.path, "a", encoding="utf-8") as out:
            out.write(f"{stamp} {line}\n")

    def text(self) -> str:
        """Every line written so far."""
        with self._lock:
            return self.path.read_text(encoding="utf-8") if self.path.exists() else ""


@dataclass
class EmuInstance:
    id: int
    ordinal: int
    offer: dict[str, Any]
    body: dict[str, Any]
    env: dict[str, str]
    instance_key: str
    created_at: float
    actual_status: str | None = None
    intended_status: str = "running"
    cur_state: str = "running"
    next_state: str = "running"
    status_msg: str | None = "Scheduling"
    running_at: float | None = None
    handle: subprocess.Popen[bytes] | Container | None = None  # the runner's: a process group or a container
    exit_code: int | None = None
    label: str | None = None
    destroy_attempts: int = 0
    flags: list[str] = field(default_factory=list)
    reservation: Reservation | None = None  # the instance's own address (network.reserve_address)
    forwarders: dict[str, Forwarder] = field(default_factory=dict)  # "7100/tcp" -> its forwarder, while running

    @property
    def address(self) -> str:
        """The instance's own address: what its container binds (the emulator's stand-in for its interface)."""
        assert self.reservation is not None, "the emulator reserves an address for every instance it makes"
        return self.reservation.address

    @property
    def runtype(self) -> str:
        given = self.body.get("runtype")
        return str(given or ("args" if self.body.get("args") or self.body.get("args_str") else "ssh"))

    def container_ports(self) -> list[str]:
        """The container ports vast.ai publishes: each ``-p`` entry's (``"7100/tcp"``), and 22/tcp first for the
        direct ssh runtypes."""
        container = [f"{m[2]}/{m[4] or 'tcp'}" for k in self.flags if (m := _PORT_FLAG.match(k))]
        if "direc" in self.runtype:
            container.insert(0, "22/tcp")
        return list(dict.fromkeys(container))

    def ports(self) -> dict[str, list[dict[str, str]] | None]:
        """Each published container port with the public port its forwarder listens on (a string, as vast.ai's)."""
        return {spec: [{"HostIp": "0.0.0.0", "HostPort": str(f.port)}] for spec, f in self.forwarders.items()}

    def direct_ports(self) -> tuple[int, int]:
        """The instance's direct port range: it covers every public port published now."""
        published = [f.port for f in self.forwarders.values()]
        if published:
            return min(published), max(published)
        start = 40_000 + (self.id % 500) * 20
        return start, start + 19

    def view(self, faults: Faults) -> dict[str, Any]:
        """The instance as the API shows it."""
        o, running = self.offer, self.actual_status == "running"
        start = 40_000 + (self.id % 500) * 20
        direct_start, direct_end = self.direct_ports()
        ports = self.ports() if running else None
        if ports is not None and self.ordinal in faults.null_ssh_port:
            ports = {**ports, "22/tcp": None}
        return {
            "id": self.id,
            "label": self.label,
            "actual_status": self.actual_status,
            "intended_status": self.intended_status,
            "cur_state": self.cur_state,
            "next_state": self.next_state,
            "status_msg": self.status_msg,
            "image_uuid": self.body.get("image"),
            "image_runtype": self.runtype,
            "image_args": list(self.body.get("args") or []),
            "onstart": self.body.get("onstart"),
            "extra_env": [[k, v] for k, v in self.env.items()],
            "public_ipaddr": PUBLIC_IPADDR_SHOWN if running else None,
            "local_ipaddrs": "127.0.0.1 10.0.0.2\n",
            "ssh_host": f"ssh{self.id % 9 + 1}.vast.emulator",
            "ssh_port": start if running else None,
            "direct_port_start": direct_start,
            "direct_port_end": direct_end,
            "ports": ports,
            "dph_total": priced(o, float(self.body.get("disk") or 10), self.is_bid)["dph_total"],
            "dph_base": o["dph_base"],
            "is_bid": self.is_bid,
            "min_bid": o["min_bid"],
            "start_date": self.created_at,
            "end_date": None,
            "machine_id": o["machine_id"],
            "host_id": o["host_id"],
            "num_gpus": o["num_gpus"],
            "gpu_name": o["gpu_name"],
            "gpu_ram": o["gpu_ram"],
            "geolocation": o["geolocation"],
            "disk_space": float(self.body.get("disk") or 10),
            "template_hash_id": self.body.get("template_hash_id"),
            "cuda_max_good": o["cuda_max_good"],
            "reliability2": o["reliability2"],
            "verification": o["verification"],
        }

    @property
    def is_bid(self) -> bool:
        return self.body.get("price") is not None


class Timeline:
    """Advances instances through the status sequence, publishes and withdraws their ports and watches their commands
    (called on a ticker thread); ``runner`` runs the commands (``runners``), ``log`` takes the emulator's log lines."""

    def __init__(
        self,
        delays: tuple[float, float, float],
        faults: Faults,
        runner: ProcessRunner | DockerRunner,
        log: Callable[[str], None],
    ):
        self.delays, self.faults, self.runner, self.log = delays, faults, runner, log
        self.lock = threading.RLock()

    def publish(self, inst: EmuInstance) -> None:
        """Open the running instance's forwarders (one log line per published port)."""
        inst.forwarders = publish(inst.address, inst.container_ports())
        for spec, forwarder in inst.forwarders.items():
            how = "" if forwarder.protocol == "tcp" else ", datagram by datagram"
            self.log(
                f"instance {inst.id}: container port {spec} published at {forwarder.host}:"
                f"{forwarder.port}, forwarded to {inst.address}:{spec.split('/')[0]}{how}"
            )

    def withdraw(self, inst: EmuInstance) -> None:
        """Close the instance's forwarders (one log line when there were any)."""
        if inst.forwarders:
            self.log(f"instance {inst.id}: withdrew {len(inst.forwarders)} published port(s) ({inst.actual_status})")
        withdraw(inst.forwarders)

    def advance(self, inst: EmuInstance, now: float) -> None:
        f, k = self.faults, inst.ordinal
        if inst.actual_status != "running" and inst.forwarders:
            self.withdraw(inst)
        if inst.intended_status != "running":
            return
        t = now - inst.created_at
        d_sched, d_created, d_loading = self.delays
        if inst.actual_status is None and t >= d_sched:
            inst.actual_status, inst.status_msg = "created", "created container"
            if k in f.oci_error:
                inst.status_msg = (
                    "Error response from daemon: failed to create task for container: "
                    "failed to create shim task: OCI runtime create failed: runc create failed"
                )
        if inst.actual_status == "created" and k not in f.oci_error and t >= d_sched + d_created:
            inst.actual_status, inst.status_msg = "loading", f"Pulling image {inst.body.get('image')}"
        if inst.actual_status == "loading" and k not in f.stuck_loading and t >= d_sched + d_created + d_loading:
            if k in f.fail_as:
                inst.actual_status, inst.status_msg = f.fail_as[k], f"host reported {f.fail_as[k]}"
            elif k in f.outbid:
                inst.actual_status = inst.intended_status = inst.cur_state = inst.next_state = "stopped"
                inst.status_msg = "stopped: outbid"
            else:
                inst.actual_status, inst.running_at = "running", now
                inst.status_msg = f"success, running {inst.body.get('image')}/{inst.runtype}"
                self.publish(inst)
                self.runner.start(inst)
        if inst.actual_status == "running":
            self._watch(inst, now)

    def _watch(self, inst: EmuInstance, now: float) -> None:
        after = self.faults.exit_after_s.get(inst.ordinal)
        if after is not None and inst.running_at is not None and now - inst.running_at >= after and inst.handle:
            self.runner.stop(inst, grace_s=0.5)
            inst.actual_status, inst.status_msg = "exited", "container exited (injected by exit_after_s)"
            self.withdraw(inst)
            return
        if inst.handle is None and inst.exit_code is not None:
            return
        rc = self.runner.exit_code(inst)
        if rc is not None and "args" in inst.runtype.split():
            self.runner.stop(inst)
            inst.exit_code = rc
            inst.actual_status, inst.status_msg = "exited", f"container exited with code {rc}"
            self.withdraw(inst)
