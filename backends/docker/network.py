"""The docker provider's daemon connection, the run network's addresses and the label sweep.

``client`` connects to the daemon ``DOCKER_HOST`` (or the default socket) names, or raises ``ProvisionFailed``
saying how to start one; a probe that fails leaves no socket open.

``free_subnet`` picks a /24 of 10.213.0.0/16 that overlaps no Docker network and no route of this machine (from a
random start, so concurrent runs rarely try the same one; creating the network is what finally decides).
``remove_labelled`` removes containers (killing running ones), then networks, whose labels match a filter.
"""

from __future__ import annotations

import ipaddress
import os
import random
import socket
from collections.abc import Callable
from pathlib import Path

import docker
import docker.errors
import requests.exceptions

from ppharness.errors import ProvisionFailed
from ppharness.seams.provider import Reaped

SUBNET_POOL = ipaddress.IPv4Network("10.213.0.0/16")
PROBE_API = "1.41"  # Docker 20.10 (Debian bookworm's docker.io); later daemons serve it too


def _unix_socket_problem(timeout: float) -> str | None:
    """For a daemon on a unix socket (the default): why connecting to it fails, or None. The SDK leaves the socket of
    a failed connect open, so the refusal is found here first."""
    host = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    if not host.startswith(("unix://", "http+unix://")):
        return None
    path = host.split("://", 1)[1]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError as exc:
            return f"cannot connect to {path}: {exc.strerror or exc}"
    return None


def daemon_problem(timeout: float = 10.0) -> str | None:
    """None when a Docker daemon answers a ping, else what went wrong (the probe's sockets are closed either way)."""
    problem = _unix_socket_problem(timeout)
    if problem is not None:
        return problem
    try:
        # types-docker says ``timeout: int``; the SDK hands it to requests, which takes seconds as a float
        probe = docker.from_env(version=PROBE_API, timeout=timeout)  # type: ignore[arg-type]
    except docker.errors.DockerException as exc:
        return str(exc)
    try:
        probe.ping()
        return None
    except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        probe.close()


def client(timeout: float = 120.0) -> docker.DockerClient:
    """A client of the daemon (API version negotiated); ``ProvisionFailed`` when none answers."""
    problem = daemon_problem()
    if problem is not None:
        raise ProvisionFailed(
            f"no Docker daemon answers ({problem}); start one: `bash docker/dockerd.sh` (docs/docker.md)"
        )
    try:
        # types-docker says ``timeout: int``; the SDK hands it to requests, which takes seconds as a float
        return docker.from_env(timeout=timeout)  # type: ignore[arg-type]
    except docker.errors.DockerException as exc:
        raise ProvisionFailed(f"connecting to the Docker daemon failed: {exc}") from exc


def parse_subnet(text: str) -> ipaddress.IPv4Network:
    """The ``subnet`` setting as a network: IPv4, /28 or larger, host bits zero; ``ProvisionFailed`` otherwise."""
    try:
        net = ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        raise ProvisionFailed(f"provider.docker.subnet {text!r} is not a network: {exc}") from exc
    if not isinstance(net, ipaddress.IPv4Network) or net.prefixlen > 28:
        raise ProvisionFailed(f"provider.docker.subnet {text!r}: use an IPv4 network of /28 or larger")
    return net


def _host_networks() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks this machine routes (default route excluded), from /proc/net/route."""
    nets: list[ipaddress.IPv4Network] = []
    try:
        rows = Path("/proc/net/route").read_text().splitlines()[1:]
    except OSError:
        return nets
    for row in rows:
        f = row.split()
        if len(f) < 8 or f[1] == "00000000":
            continue
        dest, mask = (ipaddress.IPv4Address(int(x, 16).to_bytes(4, "little")) for x in (f[1], f[7]))
        nets.append(ipaddress.IPv4Network(f"{dest}/{mask}", strict=False))
    return nets


def free_subnet(c: docker.DockerClient) -> ipaddress.IPv4Network:
    """A /24 of 10.213.0.0/16 that overlaps no Docker network and no route of this machine (random start)."""
    taken: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = list(_host_networks())
    for net in c.api.networks():
        for cfg in (net.get("IPAM") or {}).get("Config") or []:
            try:
                taken.append(ipaddress.ip_network(cfg.get("Subnet", ""), strict=False))
            except ValueError:
                continue
    candidates = list(SUBNET_POOL.subnets(new_prefix=24))
    start = random.randrange(len(candidates))
    for net in candidates[start:] + candidates[:start]:
        if not any(net.overlaps(t) for t in taken if t.version == 4):
            return net
    raise ProvisionFailed(f"no free /24 left in {SUBNET_POOL} for the run network; `ppharness reap` old runs")


def remove_labelled(
    c: docker.DockerClient,
    label_filter: str,
    run_key: str = "ppharness.run",
    select: Callable[[str], bool] | None = None,
    dry_run: bool = False,
) -> list[Reaped]:
    """Remove the containers, then the networks, matching ``label_filter`` whose ``run_key`` label ``select``
    accepts (all when None); ``dry_run`` only lists them. Return what went (or would go)."""
    gone: list[Reaped] = []
    for row in c.api.containers(all=True, filters={"label": label_filter}):
        run = (row.get("Labels") or {}).get(run_key, "")
        if select is not None and not select(run):
            continue
        try:
            if not dry_run:
                c.api.remove_container(row["Id"], force=True, v=True)
            name = row["Names"][0].lstrip("/") if row.get("Names") else row["Id"][:12]
            gone.append(Reaped(f"container {name}", run))
        except docker.errors.NotFound:
            continue
    for net in c.api.networks(filters={"label": label_filter}):
        run = (net.get("Labels") or {}).get(run_key, "")
        if select is not None and not select(run):
            continue
        try:
            if not dry_run:
                c.api.remove_network(net["Id"])
            gone.append(Reaped(f"network {net['Name']}", run))
        except docker.errors.NotFound:
            continue
    return gone
