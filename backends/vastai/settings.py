"""The vastai provider's section of a scenario (``provider.vastai``), checked when the scenario is read. Light to
import: no HTTP client."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from ppharness.document.explain import FieldError
from ppharness.seams.settings import Minutes, PositiveInt, ProviderSettings, Seconds


class VastaiSettings(ProviderSettings, frozen=True):
    """Settings of the ``vastai`` provider: the offer search (one instance per node, cheapest match first: GPU model
    or models as the API spells them, GPUs per instance, GPU RAM in GB, $/hour per instance, reliability 0-1, CUDA
    version, direct ports; a plan device's ``source.offer`` replaces any of these for its own node),
    ``max_total_dph``, the cap on the whole plan's $/hour, the node image and disk, container ports to open
    (``7000`` or ``7000/udp``; each node also opens its own, from ``node_port``), the status poll interval (at least
    10 s against vast.ai itself) and the minutes the printed cost estimate assumes. The API's address and key never
    come from a file: ``VAST_URL``/``--vastai-url``, ``VAST_API_KEY``/``--api-key``."""

    always = True  # a vastai run always rents by these: at their defaults when the scenario has no provider.vastai
    # what a plan device's source.offer may set: its own search (ppharness.seams.settings.ProviderSettings.for_device)
    device_fields = ("gpu_name", "num_gpus", "min_gpu_ram_gb", "max_dph", "min_reliability", "min_cuda", "direct_ports")

    gpu_name: str | tuple[str, ...] | None = None
    num_gpus: PositiveInt = 1
    min_gpu_ram_gb: Annotated[float, Meta(ge=0, le=4096)] = 0.0
    max_dph: Annotated[float, Meta(gt=0, le=1000)] = 1.0
    max_total_dph: Annotated[float, Meta(gt=0, le=10000)] = 5.0
    min_reliability: Annotated[float, Meta(ge=0, le=1)] = 0.95
    min_cuda: Annotated[float, Meta(ge=0, le=100)] | None = None
    direct_ports: Annotated[int, Meta(ge=0, le=65535)] = 0
    ports: tuple[
        Annotated[str, Meta(pattern=r"^[0-9]{1,5}(/(tcp|udp))?$", description="1..65535, /tcp or /udp")], ...
    ] = ()
    # the container port node k of the run binds: node_port + k (each requested as -p P:P and reached through the
    # public port vast.ai maps it to)
    node_port: Annotated[int, Meta(ge=1024, le=65000)] = 7100
    image: Annotated[str, Meta(min_length=1, max_length=1024)] = "ppharness-node:latest"
    disk_gb: Annotated[int, Meta(ge=8, le=1 << 20)] = 16
    poll_s: Seconds = 10.0
    estimate_minutes: Minutes = 30.0

    @property
    def gpu_names(self) -> tuple[str, ...]:
        """The GPU models as the API spells them: ``RTX_4090`` (the vastai CLI's form) is sent as ``RTX 4090``."""
        names = (self.gpu_name,) if isinstance(self.gpu_name, str) else tuple(self.gpu_name or ())
        return tuple(n.replace("_", " ") for n in names)

    def __post_init__(self) -> None:
        for i, port in enumerate(self.ports):
            number = int(port.partition("/")[0])
            if not 1 <= number <= 65535:
                raise FieldError(
                    f"ports[{i}]",
                    f"port {number} is outside 1..65535 — use a port number from 1 to 65535, e.g. '7000' or '7000/udp'",
                )
