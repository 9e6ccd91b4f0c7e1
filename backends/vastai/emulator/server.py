"""An API-compatible vast.ai emulator for CI: the subset in shared/vastai-api.md, over real HTTP on loopback.

Same paths (trailing slash included), bodies, status codes and error shapes as the contract's checklist (§8): bearer or
``?api_key=`` auth with 401 ``auth_error``; offer search with the filter grammar over a seeded catalog; create with the
contract's validations; single GET (``instances: null`` or, switched on, 404 for unknown ids); the v1 list with
filters, ordering, 25-per-page keyset paging and ``label_counts``; destroy (404 ``no_such_instance`` when gone);
per-endpoint, per-identity minimum intervals answered with plain-text 429s; and fault switches (``Faults``) for every
provider-side failure. Instances run real nodes (``state``), each at its own address with its container ports
published at other public ports, as vast.ai maps them (``network``).

The emulator keeps a log of its own, ``emulator.log`` in its log directory (``Emulator.log_text()``): a line per
published or withdrawn port, and for every offer search it answers one line with the query's filters and options,
then one line per filter field it ignored (a field no offer has, or a value that is not an ``{op: value}`` object).
The API answers such searches as vast.ai does, ignoring those keys (shared/vastai-api.md §8.3); the log is where a
client's misspelt filter shows.

The server is the standard library's ThreadingHTTPServer: no dependency, and full control of every status line,
header and body (plain-text 429s, ``X-RateLimit-Reset``, dropped connections). A malformed request (its framing, body,
path or query) gets a 4xx and a JSON error in the contract's shape (``wire``, ``intake``); an error of the emulator's
own, a JSON 500 and one line in its log, never a traceback.
"""

from __future__ import annotations

import json
import re
import secrets
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from email.message import Message
from pathlib import Path
from types import FrameType
from typing import Any

from backends.vastai.emulator.api import (
    SEARCH_KEYS,
    Reply,
    handle_create,
    handle_list,
    handle_manage,
    handle_search,
    validate_key,
)
from backends.vastai.emulator.intake import BadRequest, parse_json, path_id
from backends.vastai.emulator.network import reserve_address
from backends.vastai.emulator.runners import DockerRunner, ProcessRunner
from backends.vastai.emulator.state import EmuInstance, EventLog, Faults, Timeline, make_catalog, priced
from backends.vastai.emulator.wire import EmulatorServer
from ppharness.errors import ProviderError

# Minimum seconds between calls of one endpoint by one identity (shared/vastai-api.md §1), before ``rate_scale``.
RATE_LIMITS_S = {"search": 6.0, "create": 4.5, "show": 2.0, "destroy": 3.0, "manage": 1.0, "list": 1.0}
ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    ("POST", re.compile(r"^/api/v0/bundles/$"), "search"),
    ("GET", re.compile(r"^/api/v0/bundles/$"), "search"),
    ("PUT", re.compile(r"^/api/v0/asks/(\d+)/$"), "create"),
    ("GET", re.compile(r"^/api/v0/instances/$"), "legacy"),
    ("GET", re.compile(r"^/api/v0/instances/(\d+)/$"), "show"),
    ("PUT", re.compile(r"^/api/v0/instances/(\d+)/$"), "manage"),
    ("DELETE", re.compile(r"^/api/v0/instances/(\d+)/$"), "destroy"),
    ("GET", re.compile(r"^/api/v1/instances/$"), "list"),
]
STORM_BODIES: tuple[object, ...] = (
    "API requests too frequent",
    {"detail": "API requests too frequent"},
    {"success": False, "error": "rate_limit_exceeded", "msg": "API requests too frequent"},
)
CI_DELAYS = (0.1, 0.1, 0.2)  # scheduling, created, loading: quick, every state still shows for a few polls
CI_RATE_SCALE = 0.01
__all__ = ["ApiTarget", "Emulator", "Faults", "serve_forever"]


class Emulator:
    """One emulated account: a catalog, instances, faults and an HTTP server. A context manager: leaving it destroys
    every instance (killing its node, closing its forwarders and their threads, releasing its address) and stops the
    server."""

    read_timeout_s = 10.0  # a connection silent this long (mid-request or idle between requests) is answered or closed

    def __init__(
        self,
        key: str | None = None,
        *,
        seed: int = 0,
        offers: int = 64,
        delays: tuple[float, float, float] = (1.0, 2.0, 5.0),
        rate_scale: float = 1.0,
        host: str = "127.0.0.1",
        port: int = 0,
        log_dir: str | Path | None = None,
        faults: Faults | None = None,
        docker_image: str | None = None,
    ) -> None:
        """``docker_image``: run instances as containers of this local image (standing in for whatever image the
        client names) instead of local processes."""
        self.key = key or f"emu-{secrets.token_hex(16)}"
        self.id = f"emu-{secrets.token_hex(4)}"
        self.catalog = {o["id"]: o for o in make_catalog(offers, seed)}
        self.faults = faults or Faults()
        self.rate_scale = rate_scale
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="ppharness-vastai-emulator-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.events = EventLog(self.log_dir / "emulator.log")
        self.runner = DockerRunner(self.id, docker_image) if docker_image else ProcessRunner(self.id, self.log_dir)
        self.timeline = Timeline(delays, self.faults, self.runner, self.events.write)
        sample = next(iter(self.catalog.values()), None)
        self.offer_fields = frozenset(priced(sample, 0.0, False)) if sample is not None else frozenset()
        self.lock = self.timeline.lock
        self.instances: dict[int, EmuInstance] = {}
        self.history: dict[int, EmuInstance] = {}
        self.destroyed: set[int] = set()
        self.consumed: set[int] = set()
        self.creates = 0
        self.storm_replies = 0
        self.next_id = 9_000_000 + seed * 1000
        self.requests: deque[tuple[str, str, int]] = deque(maxlen=100_000)  # (method, path, status), oldest first
        self._last_call: dict[tuple[str, str], float] = {}
        self._stop = threading.Event()
        self._server = EmulatorServer((host, port), self)
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        if not isinstance(host, str):  # typeshed allows bytes here; a bound AF_INET socket names its host as str
            host = bytes(host).decode()
        return f"http://{host}:{port}"

    def start(self) -> Emulator:
        for target in (self._server.serve_forever, self._tick):
            t = threading.Thread(target=target, daemon=True, name=f"vastai-emulator-{target.__name__}")
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()
        with self.lock:
            for inst in list(self.instances.values()):
                self._destroy(inst)
        for t in self._threads:
            t.join(5)

    @classmethod
    def for_ci(cls, log_dir: str | Path | None = None, **options: Any) -> Emulator:
        """An emulator with a quick timeline and rate limits scaled by ``CI_RATE_SCALE`` (pace clients alike)."""
        return cls(delays=CI_DELAYS, rate_scale=CI_RATE_SCALE, log_dir=log_dir, **options)

    def __enter__(self) -> Emulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- what tests look at -------------------------------------------------------------------------------------

    def live_instances(self) -> list[dict[str, Any]]:
        """Every instance not destroyed, as the API shows it."""
        with self.lock:
            return [i.view(self.faults) for i in self.instances.values()]

    def node_log(self, instance_id: int) -> str:
        """What the instance's command printed (kept after it is destroyed)."""
        inst = self.history.get(instance_id)
        return self.runner.log(inst) if inst is not None else ""

    def log_text(self) -> str:
        """The emulator's own log so far (module docstring)."""
        return self.events.text()

    # --- internals ------------------------------------------------------------------------------------------------

    def _tick(self) -> None:
        while not self._stop.wait(0.02):
            with self.lock:
                now = time.time()
                for inst in list(self.instances.values()):
                    try:
                        self.timeline.advance(inst, now)
                    except Exception as exc:  # one broken instance must not stop every other's timeline
                        inst.actual_status, inst.status_msg = "unknown", f"emulator error: {type(exc).__name__}: {exc}"

    def _destroy(self, inst: EmuInstance) -> None:
        self.runner.stop(inst)
        self.timeline.withdraw(inst)
        if inst.reservation is not None:
            inst.reservation.release()
        inst.cur_state = "unloaded"
        self.instances.pop(inst.id, None)
        self.destroyed.add(inst.id)

    def new_instance(
        self, offer: dict[str, Any], body: dict[str, Any], env: dict[str, str], flags: list[str]
    ) -> EmuInstance:
        self.next_id += 7
        inst = EmuInstance(
            id=self.next_id,
            ordinal=self.creates,
            offer=offer,
            body=body,
            env=env,
            instance_key=secrets.token_hex(32),
            created_at=time.time(),
            label=body.get("label"),
            flags=flags,
            reservation=reserve_address(self.id, self.next_id),
        )
        if body.get("target_state") == "stopped":
            inst.intended_status = inst.cur_state = inst.next_state = inst.actual_status = "stopped"
        self.instances[inst.id] = self.history[inst.id] = inst
        self.consumed.add(offer["id"])
        command = " ".join(str(a) for a in body.get("args") or [])[-40:]
        self.events.write(
            f"create: instance {inst.id} from offer {offer['id']} ({offer['num_gpus']}x {offer['gpu_name']}), "
            f"{len(flags)} port(s) requested, runs …{command}"
        )
        return inst

    def dispatch(self, method: str, path: str, query: dict[str, str], headers: Message, body: Any, peer: str) -> Reply:
        route = next(((name, m) for verb, rx, name in ROUTES if verb == method and (m := rx.match(path))), None)
        if route is None:
            return Reply(404, {"success": False, "error": "not_found", "msg": f"no route for {method} {path}"})
        name, match = route
        identity = validate_key(
            self.key, headers.get("Authorization", ""), query.get("api_key"), peer, anonymous_ok=name == "search"
        )
        if identity is None:
            return Reply(401, {"success": False, "error": "auth_error", "msg": "Invalid user key"})
        if name == "legacy":
            return Reply(410, {"success": False, "error": "gone", "msg": "Use /api/v1/instances/ instead"})
        try:
            ident = path_id(match[1], "offer id" if name == "create" else "instance id") if match.lastindex else 0
        except BadRequest as exc:
            return Reply(400, {"success": False, "error": "invalid_request", "msg": str(exc)})
        injected = self._injected(name)
        if injected is not None:
            return injected
        limited = self._rate_limited(name, identity)
        if limited is not None:
            return limited
        with self.lock:
            return self._handle(name, ident, query, body)

    def _injected(self, endpoint: str) -> Reply | None:
        f = self.faults
        with self.lock:
            if f.resets > 0:
                f.resets -= 1
                return Reply(0, None)
            if f.server_errors:
                status = f.server_errors.pop(0)
                return Reply(
                    status,
                    "<html><body>Bad Gateway</body></html>"
                    if status == 502
                    else {"success": False, "error": "server_error", "msg": f"error {status}"},
                )
            if (
                f.storm_429 > 0
                and (f.storm_endpoints is None or endpoint in f.storm_endpoints)
                and self.creates >= f.storm_after_creates
            ):
                f.storm_429 -= 1
                self.storm_replies += 1
                return Reply(429, STORM_BODIES[(self.storm_replies - 1) % len(STORM_BODIES)])
            if f.search_quota and endpoint == "search":
                midnight = (int(time.time()) // 86400 + 1) * 86400
                return Reply(
                    429,
                    {"success": False, "error": "search_quota_exceeded", "msg": "Daily search quota exceeded"},
                    {"X-RateLimit-Reset": str(midnight)},
                )
        return None

    def _rate_limited(self, endpoint: str, identity: str) -> Reply | None:
        gap = RATE_LIMITS_S[endpoint] * self.rate_scale
        with self.lock:
            now = time.monotonic()
            last = self._last_call.get((endpoint, identity))
            if last is not None and now - last < gap * 0.5:
                return Reply(429, f"API requests too frequent: endpoint threshold={RATE_LIMITS_S[endpoint]}")
            self._last_call[(endpoint, identity)] = now
        return None

    def _handle(self, name: str, iid: int, query: dict[str, str], body: Any) -> Reply:
        """``iid``: the id in the route's path (an offer's for create, an instance's for show, manage and destroy)."""
        if name == "search":
            try:
                search = body if query.get("q") is None else parse_json(query["q"].encode(), "the q parameter")
            except BadRequest as exc:
                return Reply(400, {"success": False, "error": "invalid_request", "msg": str(exc)})
            self._log_search(search)
            return handle_search(self, search)
        if name == "create":
            return handle_create(self, iid, body)
        if name == "list":
            return handle_list(self, query)
        inst = self.instances.get(iid)
        if name == "show":
            if inst is None:
                return (
                    Reply(404, {"success": False, "error": "no_such_instance", "msg": f"Instance {iid} not found"})
                    if self.faults.gone_404
                    else Reply(200, {"instances": None})
                )
            return Reply(200, {"instances": inst.view(self.faults)})
        if inst is None:
            return Reply(404, {"success": False, "error": "no_such_instance", "msg": f"Instance {iid} not found"})
        if name == "manage":
            return handle_manage(self, inst, body)
        inst.destroy_attempts += 1
        if self.faults.destroy_fail < 0 or inst.destroy_attempts <= self.faults.destroy_fail:
            return Reply(
                self.faults.destroy_fail_status,
                {"success": False, "error": "server_error", "msg": "could not destroy, try again"},
            )
        self._destroy(inst)
        return Reply(200, {"success": True, "msg": f"destroying instance {iid}."})

    def _log_search(self, search: Any) -> None:
        """One line for the search, one per filter field it ignores (module docstring)."""
        if not isinstance(search, dict):
            self.events.write(f"search: the query is not a JSON object ({type(search).__name__})")
            return
        filters = {k: v for k, v in search.items() if k not in SEARCH_KEYS}
        options = {k: v for k, v in search.items() if k in SEARCH_KEYS}
        self.events.write(
            f"search: filters {json.dumps(filters, sort_keys=True)}, options {json.dumps(options, sort_keys=True)}"
        )
        for name, value in sorted(filters.items()):
            if name not in self.offer_fields:
                self.events.write(f"search: ignored filter field {name!r}: offers have no such field")
            elif not isinstance(value, dict):
                self.events.write(f"search: ignored filter field {name!r}: {value!r} is not an {{op: value}} object")


@dataclass(frozen=True)
class ApiTarget:
    """Where a test's vast.ai calls go, as the environment the client reads; ``emulator`` is None for vast.ai."""

    url: str
    key: str = field(repr=False)
    pace: float = 1.0
    emulator: Emulator | None = None

    @classmethod
    def of(cls, emu: Emulator) -> ApiTarget:
        """Clients pace at three times the emulator's scale: its limits bite at half the interval, so the margin
        absorbs a loaded machine's jitter."""
        return cls(emu.url, emu.key, emu.rate_scale * 3, emu)

    def env(self) -> dict[str, str]:
        return {"VAST_URL": self.url, "VAST_API_KEY": self.key, "PPHARNESS_VASTAI_PACE": str(self.pace)}


def parse_faults(specs: list[str]) -> Faults:
    """``ppharness vastai-emulator --fault`` switches (``name[=value]``; K counts creates from 1) as ``Faults``."""
    f = Faults()
    for spec in specs:
        name, _, value = spec.partition("=")
        try:
            if name == "offers-cap":
                f.offers_cap = int(value)
            elif name in (
                "reject-create",
                "vanish-offer",
                "stuck-loading",
                "oci-error",
                "outbid",
                "null-ssh-port",
                "leave-stopped",
            ):
                k = int(value)
                if name == "reject-create":
                    f.reject_create[k] = (400, "invalid_args", "error 400/3010: the host rejected this instance")
                else:
                    switches = {
                        "vanish-offer": f.vanish_offers,
                        "stuck-loading": f.stuck_loading,
                        "oci-error": f.oci_error,
                        "outbid": f.outbid,
                        "null-ssh-port": f.null_ssh_port,
                        "leave-stopped": f.leave_stopped,
                    }
                    switches[name].add(k)
            elif name == "fail-as":
                which, status = value.split(":")
                if status not in ("exited", "unknown", "offline"):
                    raise ValueError(status)
                f.fail_as[int(which)] = status
            elif name == "exit-after":
                which, seconds = value.split(":")
                f.exit_after_s[int(which)] = float(seconds)
            elif name in ("storm-429", "resets", "destroy-fail"):
                setattr(
                    f, {"storm-429": "storm_429", "resets": "resets", "destroy-fail": "destroy_fail"}[name], int(value)
                )
            elif name == "server-errors":
                f.server_errors = [int(x) for x in value.split(",")]
            elif name in ("search-quota", "gone-404") and not value:
                setattr(f, name.replace("-", "_"), True)
            else:
                raise ValueError(name)
        except ValueError as exc:
            raise ProviderError(f"--fault {spec!r}: not a fault switch this emulator knows (see --help)") from exc
    return f


def serve_forever(
    host: str = "127.0.0.1",
    port: int = 8765,
    seed: int = 0,
    offers: int = 64,
    delays: tuple[float, float, float] = (1.0, 2.0, 5.0),
    rate_scale: float = 1.0,
    key: str | None = None,
    fault_specs: list[str] | None = None,
    docker_image: str | None = None,
    announce: Callable[[str], None] = print,
) -> None:
    """Run an emulator until Ctrl-C or SIGTERM, then destroy every instance it holds."""
    import signal

    faults = parse_faults(fault_specs or [])

    def stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    emu = Emulator(
        key,
        seed=seed,
        offers=offers,
        delays=delays,
        rate_scale=rate_scale,
        host=host,
        port=port,
        faults=faults,
        docker_image=docker_image,
    ).start()
    announce(
        f"vast.ai emulator at {emu.url} ({len(emu.catalog)} offers, seed {seed}; node logs and emulator.log, its own, "
        f"in {emu.log_dir})"
    )
    announce(
        f"point ppharness at it:  VAST_URL={emu.url} pp-smoke-run --vastai --transport zmq --scenario "
        f"scenarios/acceptance-5stage-vastai.yaml   (or --vastai-url {emu.url})"
    )
    if key is None:
        announce(f"it accepts one API key, generated for this run: export VAST_API_KEY={emu.key}")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        emu.stop()
        print("vast.ai emulator stopped; every instance was destroyed", file=sys.stderr)
