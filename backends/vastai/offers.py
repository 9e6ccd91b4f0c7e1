"""What to rent and how to ask for it: the offer query, the choice of offers, the printed plan and the create body.

Pure functions of the scenario's ``provider.vastai`` settings (``backends.vastai.settings.VastaiSettings``), so
they are tested without any server.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from backends.vastai.settings import VastaiSettings
from ppharness.errors import ProvisionFailed

if TYPE_CHECKING:
    from backends.vastai.rentals import Rental

ENV_ENTRY_MAX = 256  # characters per env entry, name and value together (shared/vastai-api.md §3)
ENV_TOTAL_MAX = 32768
ARGS_TOTAL_MAX = 4096
CHUNK = 200
LABEL_MAX = 60  # dstack's bound; the API allows 256
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PORT = re.compile(r"^(\d{1,5})(/(tcp|udp))?$")
NODE_COMMAND = "pp-node"


def offer_query(s: VastaiSettings, count: int) -> dict[str, Any]:
    """The search body: the scenario's constraints, vastai's default filters, cheapest first, on-demand prices for
    ``s.disk_gb`` of storage. RAM is in MB on the wire (GB x 1000, as the vastai CLI sends it)."""
    q: dict[str, Any] = {
        "verified": {"eq": True},
        "external": {"eq": False},
        "rentable": {"eq": True},
        "rented": {"eq": False},
        "num_gpus": {"eq": s.num_gpus},
        "dph_total": {"lte": s.max_dph},
        "reliability": {"gte": s.min_reliability},
        "order": [["dph_total", "asc"]],
        "type": "on-demand",
        "limit": max(64, 4 * count),
        "allocated_storage": float(s.disk_gb),
    }
    names = s.gpu_names
    if names:
        q["gpu_name"] = {"eq": names[0]} if isinstance(s.gpu_name, str) else {"in": list(names)}
    if s.min_gpu_ram_gb:
        q["gpu_ram"] = {"gte": s.min_gpu_ram_gb * 1000}
    if s.min_cuda is not None:
        q["cuda_max_good"] = {"gte": s.min_cuda}
    if s.direct_ports:
        q["direct_port_count"] = {"gte": s.direct_ports}
    return q


def offer_matches(offer: dict[str, Any], s: VastaiSettings) -> bool:
    """The constraints checked again on our side: the catalog is cached and a server may ignore a filter."""
    names = s.gpu_names
    try:
        return (
            not offer.get("rented")
            and offer.get("rentable", True) is not False
            and int(offer["num_gpus"]) == s.num_gpus
            and float(offer["dph_total"]) <= s.max_dph
            and float(offer.get("reliability") or 0) >= s.min_reliability
            and (not names or offer.get("gpu_name") in names)
            and float(offer.get("gpu_ram") or 0) >= s.min_gpu_ram_gb * 1000
            and (s.min_cuda is None or float(offer.get("cuda_max_good") or 0) >= s.min_cuda)
            and int(offer.get("direct_port_count") or 0) >= s.direct_ports
        )
    except (KeyError, TypeError, ValueError):
        return False


def describe_constraints(s: VastaiSettings) -> str:
    parts = [
        f"{s.num_gpus}x {' or '.join(s.gpu_names) or 'any GPU'}",
        f"<= ${s.max_dph:.3f}/hr",
        f"reliability >= {s.min_reliability}",
    ]
    if s.min_gpu_ram_gb:
        parts.append(f">= {s.min_gpu_ram_gb:g} GB GPU RAM")
    if s.min_cuda is not None:
        parts.append(f"CUDA >= {s.min_cuda:g}")
    if s.direct_ports:
        parts.append(f">= {s.direct_ports} direct ports")
    return ", ".join(parts)


@dataclass(frozen=True)
class RentalPlan:
    """The offers to rent (one per stage, cheapest first) and the spares to fall back on when one vanishes."""

    chosen: list[dict[str, Any]]
    spares: list[dict[str, Any]]

    @property
    def total_dph(self) -> float:
        return sum(float(o["dph_total"]) for o in self.chosen)


def choose_offers(
    offers: list[dict[str, Any]], s: VastaiSettings, count: int, names: list[str] | None = None
) -> RentalPlan:
    """The ``count`` cheapest matching offers; ProvisionFailed when fewer match or they exceed ``max_total_dph``.
    ``names``: what the offers are for (the message names them)."""
    usable = sorted(
        (o for o in offers if offer_matches(o, s)),
        key=lambda o: (float(o["dph_total"]), -float(o.get("reliability") or 0), int(o["id"])),
    )
    if len(usable) < count:
        wanted = f"{count} (for {', '.join(names)})" if names else f"{count} (one per stage)"
        raise ProvisionFailed(
            f"only {len(usable)} vast.ai offer(s) match {describe_constraints(s)}, but the run "
            f"needs {wanted}; nothing was rented — relax provider.vastai (or the plan devices' offers) or use "
            "fewer stages"
        )
    plan = RentalPlan(usable[:count], usable[count:])
    if plan.total_dph > s.max_total_dph:
        raise ProvisionFailed(
            f"the {count} cheapest matching offers cost ${plan.total_dph:.3f}/hr together, over "
            f"provider.vastai.max_total_dph ${s.max_total_dph:.3f}/hr; nothing was rented"
        )
    return plan


def offer_line(name: str, o: dict[str, Any]) -> str:
    return (
        f"  {name:<11} offer {o['id']:<9} {o.get('num_gpus')}x {o.get('gpu_name')} "
        f"{float(o.get('gpu_ram') or 0) / 1000:.0f} GB  ${float(o['dph_total']):.3f}/hr  "
        f"reliability {float(o.get('reliability') or 0):.3f}  {o.get('geolocation') or '?'}"
    )


def rental_lines(wanted: list[Rental], chosen: list[dict[str, Any]], s: VastaiSettings, run_label: str) -> list[str]:
    """The plan as printed before anything is rented: each instance, the search it came from and what it runs."""
    lines = [
        f"vast.ai plan for run {run_label}: {len(wanted)} instance(s) of {s.image}, cheapest matching offers first"
    ]
    searches: dict[bytes, int] = {}
    for rental, offer in zip(wanted, chosen):
        k = searches.setdefault(rental.search_key, len(searches) + 1)
        lines.append(offer_line(rental.describe(), offer) + f"  [search {k}]")
    for key, k in searches.items():
        settings = next(r.settings for r in wanted if r.search_key == key)
        lines.append(f"  search {k}: {describe_constraints(settings)}")
    return lines + [_total_line(sum(float(o["dph_total"]) for o in chosen), s)]


def _total_line(total: float, s: VastaiSettings) -> str:
    hours = s.estimate_minutes / 60
    return (
        f"  total ${total:.3f}/hr (cap ${s.max_total_dph:.3f}/hr); estimated "
        f"${total * hours:.2f} for {s.estimate_minutes:g} min (boot plus the run's budget); "
        "storage is billed from creation, GPU time from 'running'"
    )


def encode_env(
    env: dict[str, str], ports: tuple[str, ...] = (), command: str = NODE_COMMAND
) -> tuple[dict[str, str], str]:
    """The create body's ``env`` object and the shell script the instance runs.

    A value too long for one env entry is split into ``NAME__0``, ``NAME__1``, ... and the script joins the parts
    back into ``NAME`` before it ``exec``s ``command``, so the node sees exactly ``env``. Ports become the API's
    ``"-p P:P[/udp]": "1"`` entries.
    """
    out: dict[str, str] = {}
    joins = []
    for name, value in env.items():
        if not _NAME.match(name):
            raise ProvisionFailed(f"environment variable name {name!r} cannot be passed to a vast.ai instance")
        if len(name) + len(value) <= ENV_ENTRY_MAX:
            out[name] = value
            continue
        parts = [value[i : i + CHUNK] for i in range(0, len(value), CHUNK)]
        out.update({f"{name}__{j}": part for j, part in enumerate(parts)})
        joins.append(f'export {name}="' + "".join(f"${{{name}__{j}}}" for j in range(len(parts))) + '"')
    for port in ports:
        m = _PORT.match(port)
        if not m:
            raise ProvisionFailed(f"provider.vastai.ports: {port!r} is not PORT or PORT/udp")
        out[f"-p {m[1]}:{m[1]}" + ("/udp" if m[3] == "udp" else "")] = "1"
    total = sum(len(k) + len(v) for k, v in out.items())
    if total > ENV_TOTAL_MAX:
        raise ProvisionFailed(f"the node environment is {total} characters, over vast.ai's {ENV_TOTAL_MAX}")
    script = "; ".join([*joins, f"exec {command}"])
    return out, script


def create_body(
    s: VastaiSettings,
    image: str,
    label: str,
    env: dict[str, str],
    ports: tuple[str, ...] | None = None,
    command: str = NODE_COMMAND,
) -> dict[str, Any]:
    """``PUT /api/v0/asks/{id}/``'s body: the image's ENTRYPOINT replaced by ``/bin/sh`` (runtype ``args``, where
    ``onstart`` is the entrypoint) running the script that starts ``command`` (``pp-node``, or ``pp-host`` for
    several nodes), so the instance exits when the node does and its ``actual_status`` shows it. ``ports``: the
    container ports to open (default: the scenario's)."""
    if len(label) > LABEL_MAX:
        raise ProvisionFailed(f"run label {label!r} is longer than {LABEL_MAX} characters")
    env_obj, script = encode_env(env, tuple(s.ports) if ports is None else ports, command)
    args = ["-c", script]
    if sum(map(len, args)) + len("/bin/sh") > ARGS_TOTAL_MAX:
        raise ProvisionFailed(f"the start command is over vast.ai's {ARGS_TOTAL_MAX} characters")
    return {
        "client_id": "me",
        "image": image,
        "disk": s.disk_gb,
        "label": label,
        "env": env_obj,
        "runtype": "args",
        "onstart": "/bin/sh",
        "args": args,
    }
