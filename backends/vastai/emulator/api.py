"""The vast.ai emulator's endpoint logic: search, create, list and manage, with the contract's validations.

Each handler takes the emulator (holding its lock) and the decoded request, and returns a ``Reply``. Status codes and
error bodies follow shared/vastai-api.md: ``{"success": false, "error": <code>, "msg": <text>}``.
"""

from __future__ import annotations

import base64
import hmac
import shlex
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from backends.vastai.emulator.intake import BadRequest, parse_json, shown
from backends.vastai.emulator.state import matches, order_key, priced, sort_records

if TYPE_CHECKING:
    from backends.vastai.emulator.server import Emulator
    from backends.vastai.emulator.state import EmuInstance

SEARCH_KEYS = frozenset(
    {
        "order",
        "type",
        "limit",
        "allocated_storage",
        "disable_bundling",
        "target_reliability",
        "extra_ids",
        "has_avx",
        "template_id",
        "select_cols",
        "q",
    }
)
OFFER_TYPES = frozenset({"on-demand", "ondemand", "bid", "reserved"})
RUNTYPE_TOKENS = frozenset(
    {
        "ssh",
        "jupyter",
        "args",
        "ssh_proxy",
        "ssh_direct",
        "ssh_direc",
        "jupyter_proxy",
        "jupyter_direct",
        "jupyter_direc",
    }
)
COMPUTED_COLUMNS = frozenset({"dph_total", "duration", "ports", "public_ipaddr", "ssh_port"})
ENV_ENTRY_MAX, ENV_TOTAL_MAX, START_MAX = 256, 32768, 4096
DEFAULT_STORAGE_GB = 5.0
PAGE_MAX = 25


@dataclass
class Reply:
    """A status (0: drop the connection without answering), a JSON value or plain text, extra headers."""

    status: int
    body: object
    headers: dict[str, str] = field(default_factory=dict)


def _bad(status: int, error: str, msg: str) -> Reply:
    return Reply(status, {"success": False, "error": error, "msg": msg})


def validate_key(key: str, authorization: str, query_key: str | None, peer: str, anonymous_ok: bool) -> str | None:
    """The caller's rate-limit identity, or None when its key is wrong (or missing where one is needed)."""
    given = authorization[7:].strip() if authorization.lower().startswith("bearer ") else (query_key or "")
    if not given and not authorization:
        return f"ip:{peer}" if anonymous_ok else None
    return "key" if hmac.compare_digest(given.encode(), key.encode()) else None


def handle_search(emu: Emulator, body: Any) -> Reply:
    if not isinstance(body, dict):
        return _bad(400, "invalid_request", "the search query must be a JSON object")
    kind = body.get("type", "on-demand")
    if not isinstance(kind, str) or kind not in OFFER_TYPES:
        return _bad(400, "invalid_request", f"unknown offer type {shown(repr(kind))}")
    try:
        storage = float(body.get("allocated_storage") or DEFAULT_STORAGE_GB)
        limit = int(body["limit"]) if body.get("limit") is not None else 64
    except (TypeError, ValueError, OverflowError):
        return _bad(400, "invalid_request", "allocated_storage and limit must be finite numbers")
    filters = {k: v for k, v in body.items() if k not in SEARCH_KEYS and isinstance(v, dict)}
    for name, ops in filters.items():
        bad = [op for op in ops if op not in ("eq", "neq", "gt", "gte", "lt", "lte", "in", "notin")]
        if bad or any(op in ("in", "notin") and not isinstance(ops[op], list) for op in ops):
            return _bad(400, "invalid_request", f"bad filter on {shown(name)}: {shown(repr(ops))}")
    try:
        order = order_key(body.get("order") or [["score", "desc"]])
    except ValueError as exc:
        return _bad(400, "invalid_request", str(exc))
    offers = [
        priced({**o, "rented": o["rented"] or o["id"] in emu.consumed}, storage, kind == "bid")
        for o in emu.catalog.values()
    ]
    found = [o for o in offers if matches(o, filters)]
    found = sort_records(found, order)[: max(limit, 0)]
    if emu.faults.offers_cap is not None:
        found = found[: emu.faults.offers_cap]
    return Reply(200, {"offers": found})


def _parse_env(raw: Any) -> tuple[dict[str, str], list[str]] | str:
    """(variables, docker flags such as ``-p 8000:8000``) from the env object or docker-flag string, or an error."""
    if raw is None:
        return {}, []
    if isinstance(raw, str):
        pairs: dict[str, str] = {}
        try:
            tokens = shlex.split(raw)
        except ValueError:
            return "env as docker flags has an unclosed quote or a trailing backslash"
        for flag, value in zip(tokens[::2], tokens[1::2]):
            if flag == "-e" and "=" in value:
                k, v = value.split("=", 1)
                pairs[k] = v
            else:
                pairs[f"{flag} {value}"] = "1"
        raw = pairs
    if not isinstance(raw, dict):
        return "env must be an object of strings"
    env, flags, total = {}, [], 0
    for k, v in raw.items():
        if not isinstance(k, str) or not isinstance(v, str):
            return f"env entry {shown(repr(k))} must map a string to a string"
        if len(k) + len(v) > ENV_ENTRY_MAX:
            return f"env entry {shown(repr(k))} is {len(k) + len(v)} characters, over {ENV_ENTRY_MAX}"
        total += len(k) + len(v)
        if k.startswith("-"):
            flags.append(k if k.startswith("-p ") else f"{k} {v}")
        else:
            env[k] = v
    if total > ENV_TOTAL_MAX:
        return f"env is {total} characters, over {ENV_TOTAL_MAX}"
    return env, flags


def handle_create(emu: Emulator, offer_id: int, body: Any) -> Reply:
    emu.creates += 1
    ordinal, f = emu.creates, emu.faults
    if ordinal in f.reject_create:
        status, error, msg = f.reject_create[ordinal]
        return _bad(status, error, msg)
    if not isinstance(body, dict):
        return _bad(400, "invalid_args", "error 400/3001: the request body must be a JSON object")
    offer = emu.catalog.get(offer_id)
    if offer is None or offer["id"] in emu.consumed or offer["rented"] or ordinal in f.vanish_offers:
        status = 410 if body.get("cancel_unavail") else 404
        return _bad(
            status, "no_such_ask", f"error {status}/3603: no_such_ask  Instance type by id {offer_id} is not available."
        )
    problem = _validate_create(body)
    if problem:
        return _bad(400, "invalid_args", f"error 400/3002: {problem}")
    parsed = _parse_env(body.get("env"))
    if isinstance(parsed, str):
        return _bad(400, "invalid_args", f"error 400/3003: {parsed}")
    price = body.get("price")
    inst = emu.new_instance(offer, body, *parsed)
    if (price is not None and float(price) < offer["min_bid"]) or ordinal in f.leave_stopped:
        inst.intended_status = inst.cur_state = inst.next_state = inst.actual_status = "stopped"
        return Reply(
            200,
            {
                "success": False,
                "error": "invalid_price",
                "new_contract": inst.id,
                "msg": f"bid ${float(price or 0):.4f}/hr is under the minimum ${offer['min_bid']:.4f}/hr; "
                "the instance was created stopped",
            },
        )
    return Reply(200, {"success": True, "new_contract": inst.id, "instance_api_key": inst.instance_key})


def _validate_create(body: dict[str, Any]) -> str | None:
    image = body.get("image")
    if not body.get("template_hash_id") and (not isinstance(image, str) or not image):
        return "image is required (or template_hash_id)"
    if isinstance(image, str) and len(image) > 1024:
        return "image is longer than 1024 characters"
    disk = body.get("disk")
    if disk is not None and (not isinstance(disk, (int, float)) or disk < 8):
        return f"disk must be at least 8 GB, got {shown(repr(disk))}"
    label = body.get("label")
    if label is not None and (not isinstance(label, str) or len(label) > 256):
        return "label must be a string of at most 256 characters"
    price = body.get("price")
    if price is not None and (not isinstance(price, (int, float)) or not 0.001 <= price <= 128):
        return f"price must be between 0.001 and 128 $/hr, got {shown(repr(price))}"
    runtype = body.get("runtype")
    if runtype is not None and (not isinstance(runtype, str) or not set(runtype.split()) <= RUNTYPE_TOKENS):
        return f"unknown runtype {shown(repr(runtype))}"
    args = body.get("args")
    if args is not None and (not isinstance(args, list) or not all(isinstance(a, str) for a in args)):
        return "args must be a list of strings"
    size = sum(len(a) for a in args or []) + len(str(body.get("args_str") or "")) + len(str(body.get("onstart") or ""))
    if size > START_MAX:
        return f"args, args_str and onstart are {size} characters together, over {START_MAX}"
    if body.get("target_state") not in (None, "running", "stopped"):
        return "target_state must be running or stopped"
    return None


def handle_list(emu: Emulator, query: dict[str, str]) -> Reply:
    try:
        filters = parse_json((query.get("select_filters") or "{}").encode(), "select_filters")
        order = parse_json((query.get("order_by") or "[]").encode(), "order_by")
    except BadRequest as exc:
        return _bad(400, "invalid_request", str(exc))
    try:
        limit = min(int(query.get("limit") or PAGE_MAX), PAGE_MAX)
    except ValueError:
        return _bad(400, "invalid_request", "limit must be an integer")
    if not isinstance(filters, dict) or not isinstance(order, list):
        return _bad(400, "invalid_request", "select_filters must be an object and order_by a list")
    computed = sorted(set(filters) & COMPUTED_COLUMNS)
    if computed:
        return _bad(400, "invalid_request", f"cannot filter on computed column(s) {', '.join(computed)}")
    try:
        keys = order_key(order)
    except ValueError as exc:
        return _bad(400, "invalid_request", str(exc))
    views = [i.view(emu.faults) for i in emu.instances.values()]
    found = sort_records([v for v in views if matches(v, filters)], keys)
    start = 0
    if query.get("after_token"):
        try:
            last = int(base64.urlsafe_b64decode(query["after_token"].encode()).decode())
        except (ValueError, UnicodeDecodeError):
            return _bad(400, "invalid_request", "after_token is not a token this API gave")
        ids = [v["id"] for v in found]
        start = ids.index(last) + 1 if last in ids else next((k for k, i in enumerate(ids) if i > last), len(ids))
    page = found[start : start + limit]
    more = start + limit < len(found)
    counts: dict[str, int] = {}
    for v in views:
        counts[v["label"] or ""] = counts.get(v["label"] or "", 0) + 1
    token = base64.urlsafe_b64encode(str(page[-1]["id"]).encode()).decode() if more and page else None
    return Reply(
        200,
        {
            "success": True,
            "instances_found": len(page),
            "total_instances": len(found),
            "label_counts": counts,
            "next_token": token,
            "instances": page,
        },
    )


def handle_manage(emu: Emulator, inst: EmuInstance, body: Any) -> Reply:
    if not isinstance(body, dict) or not ({"state", "label"} & set(body)):
        return _bad(400, "invalid_args", 'expected {"state": "running"|"stopped"} or {"label": ...}')
    if "label" in body:
        if not isinstance(body["label"], str) or len(body["label"]) > 1024:
            return _bad(400, "invalid_args", "label must be a string of at most 1024 characters")
        inst.label = body["label"]
    state = body.get("state")
    if state == "stopped":
        emu.runner.stop(inst)
        inst.intended_status = inst.cur_state = inst.next_state = inst.actual_status = "stopped"
        inst.status_msg = "stopped by the user"
    elif state == "running":
        inst.intended_status = inst.cur_state = inst.next_state = "running"
        inst.actual_status, inst.created_at = None, time.time()
    elif state is not None:
        return _bad(400, "invalid_args", f"unknown state {shown(repr(state))}")
    return Reply(200, {"success": True})
