"""The docker provider's section of a scenario (``provider.docker``), checked when the scenario is read. Light to
import: no Docker SDK."""

from __future__ import annotations

import ipaddress
from typing import Annotated

from msgspec import Meta

from ppharness.document.explain import FieldError, show
from ppharness.seams.settings import ProviderSettings


class DockerSettings(ProviderSettings, frozen=True):
    """Settings of the ``docker`` provider, all optional. ``image``: run this node image as is (no build);
    ``base_image``: build ``docker/Dockerfile`` on this image (e.g. ``python:3.11-slim-bookworm``, pulled by the daemon)
    instead of the Debian base built locally; ``subnet``: the run network (default: a free /24 of 10.213.0.0/16;
    IPv4, /28 or larger, host bits zero); ``cpus`` and ``memory``: limits per container (``memory`` as Docker writes
    it: ``512m``, ``2g``)."""

    image: Annotated[str, Meta(min_length=1)] | None = None
    base_image: Annotated[str, Meta(min_length=1)] | None = None
    subnet: Annotated[str, Meta(min_length=1, max_length=64, description="IPv4 network, /28 or larger")] | None = None
    cpus: Annotated[float, Meta(gt=0, le=1024)] | None = None
    memory: Annotated[str, Meta(pattern=r"^[0-9]{1,15}[bkmgBKMG]?$")] | None = None

    def __post_init__(self) -> None:
        if self.image is not None and self.base_image is not None:
            raise FieldError(
                "base_image", "base_image applies only when the image is built, and image is given — keep one of them"
            )
        if self.subnet is not None:
            _check_subnet(self.subnet)


def _check_subnet(text: str) -> None:
    """The same rule as the provider's (``backends.docker.network.parse_subnet``): an IPv4 network, host bits zero,
    /28 or larger."""
    example = "e.g. 10.213.5.0/24"
    try:
        net = ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise FieldError(
            "subnet", f"{show(text)} is not an IP network — write an IPv4 network as address/prefix, {example}"
        ) from None
    if not isinstance(net, ipaddress.IPv4Network):
        raise FieldError("subnet", f"{show(text)} is an IPv6 network — the run network is IPv4, {example}")
    try:
        ipaddress.ip_network(text, strict=True)
    except ValueError:
        raise FieldError("subnet", f"{show(text)} has host bits set — use the network's address: {net}") from None
    if net.prefixlen > 28:
        raise FieldError(
            "subnet",
            f"{show(text)} is a /{net.prefixlen}, too small for a run — use /28 or larger "
            f"(prefix length 28 or less), {example}",
        )
