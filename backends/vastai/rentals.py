"""What a run rents on vast.ai, as the plan says: one instance per node, or one per host for a plan's GPUs of one
machine, each searched for with its device's own offer filter.

Pure functions of the node specs and the scenario's ``provider.vastai`` settings, tested without a server:

- ``rentals``: the instances to rent. Nodes whose devices share ``source.host`` are one instance (its offer's
  ``num_gpus`` GPUs, a node per GPU, ``pp-host`` starting them); any other node is an instance of its own. Each
  instance's search is the scenario's settings with its device's ``source.offer`` applied
  (``ProviderSettings.for_device``); instances with equal searches are found by one search.
- ``instance_env``: the node (or the host's nodes, in ``ppharness.run.node.host``'s encoding) with what each node
  needs on a rented machine: its own container port ``PP_PORT`` (``node_port`` + its index in the run), requested as
  ``-p P:P`` (udp for iroh) so that vast.ai maps it to a public port the node reads from ``VAST_TCP_PORT_<P>`` /
  ``VAST_UDP_PORT_<P>`` and advertises with ``PUBLIC_IPADDR``; ``PP_BIND_HOST=0.0.0.0``; ``CUDA_VISIBLE_DEVICES`` for
  a GPU of a host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from backends.vastai.offers import NODE_COMMAND
from backends.vastai.settings import VastaiSettings
from ppharness.document.explain import FieldError
from ppharness.errors import ProvisionFailed
from ppharness.plan.stages import decode_program
from ppharness.run.node.host import host_env
from ppharness.seams.provider import NodeSpec

HOST_COMMAND = "pp-host"
WILDCARD = "0.0.0.0"


@dataclass
class Rental:
    """One instance to rent: the nodes it runs, the search it comes from and the container ports it opens."""

    name: str  # the node's name, or ``host <id>``
    specs: list[NodeSpec]
    settings: VastaiSettings
    ports: dict[str, int] = field(default_factory=dict)  # node name -> its container port

    @property
    def command(self) -> str:
        return HOST_COMMAND if len(self.specs) > 1 else NODE_COMMAND

    @property
    def search_key(self) -> bytes:
        """Rentals with the same key are found by one search."""
        return msgspec.json.encode(self.settings)

    def describe(self) -> str:
        if len(self.specs) == 1:
            return self.specs[0].name
        return f"{self.name} ({', '.join(s.name for s in self.specs)})"


def rentals(specs: list[NodeSpec], settings: VastaiSettings) -> list[Rental]:
    """The instances ``specs`` need, in the order their first node appears (module docstring)."""
    out: list[Rental] = []
    hosts: dict[str, Rental] = {}
    for index, spec in enumerate(specs):
        try:
            searched = settings.for_device(spec.offer) if spec.offer else settings
        except FieldError as exc:
            raise ProvisionFailed(f"{spec.name}: its device's offer field {exc.field}: {exc}") from None
        if spec.host is not None and spec.host in hosts:
            rental = hosts[spec.host]
            if rental.settings != searched:
                raise ProvisionFailed(
                    f"{spec.name}: host {spec.host!r} is one machine, but its devices ask for different offers"
                )
            rental.specs.append(spec)
        else:
            name = spec.name if spec.host is None else f"host {spec.host}"
            rental = Rental(name, [spec], searched)
            out.append(rental)
            if spec.host is not None:
                hosts[spec.host] = rental
        rental.ports[spec.name] = settings.node_port + index
    for rental in out:
        gpus = [s.gpu for s in rental.specs if s.gpu is not None]
        if gpus and max(gpus) >= rental.settings.num_gpus:
            raise ProvisionFailed(
                f"{rental.describe()}: GPU {max(gpus)} on an offer of {rental.settings.num_gpus} GPU(s) — raise the "
                "device's offer num_gpus"
            )
    return out


def node_env(spec: NodeSpec, port: int) -> dict[str, str]:
    """One node's environment on a rented machine (module docstring)."""
    env = {**spec.env, "PP_PORT": str(port), "PP_BIND_HOST": WILDCARD}
    if spec.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(spec.gpu)
    return env


def instance_env(rental: Rental, extra: dict[str, str]) -> dict[str, str]:
    """The instance's environment: its node's (``extra`` added), or its host's nodes' in ``pp-host``'s encoding, each
    node's program as plain JSON there (the host's entries are compressed together, and programs compressed one by
    one would not compress again)."""
    envs = [node_env(s, rental.ports[s.name]) | extra for s in rental.specs]
    if len(envs) == 1:
        return envs[0]
    for env in envs:
        if "PLAN" in env:
            env["PLAN"] = msgspec.json.encode(decode_program(env["PLAN"])).decode()
    return host_env(envs)


def port_requests(rental: Rental) -> tuple[str, ...]:
    """The container ports the instance opens: the scenario's, then each node's (``P`` or ``P/udp`` for iroh)."""
    own = [
        f"{rental.ports[s.name]}/udp" if s.env.get("TRANSPORT") == "iroh" else str(rental.ports[s.name])
        for s in rental.specs
    ]
    return tuple(dict.fromkeys([*rental.settings.ports, *own]))
