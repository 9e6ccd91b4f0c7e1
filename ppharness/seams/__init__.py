"""The seams the core is written against: ``Transport`` (how stages talk) and ``Provider`` (where stages run), and the
base of the scenario settings each implementation declares.

Implementations live in ``transports/`` and ``backends/`` and import these types; the core reaches them only through
``ppharness.registry``.
"""

from ppharness.seams.provider import Instance, NodeSpec, Provider
from ppharness.seams.settings import ProviderSettings, TransportSettings
from ppharness.seams.transport import Transport

__all__ = ["Instance", "NodeSpec", "Provider", "ProviderSettings", "Transport", "TransportSettings"]
