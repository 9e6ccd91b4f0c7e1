"""The seams the core is written against: ``Transport`` (how stages talk) and ``Provider`` (where stages run).

Implementations live in ``transports/`` and ``backends/`` and import these types; the core reaches them only through
``ppharness.registry``.
"""

from ppharness.seams.provider import Instance, NodeSpec, Provider
from ppharness.seams.transport import Transport

__all__ = ["Instance", "NodeSpec", "Provider", "Transport"]
