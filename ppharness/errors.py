"""The one error tree of ppharness.

    HarnessError
    ├── CodecError            a frame or message could not be decoded (malformed, truncated, oversized, wrong version)
    ├── TransportError
    │   ├── ConnectFailed     the peer's address could not be reached or bound
    │   ├── PeerClosed        the peer closed its side
    │   ├── TransportClosed   *we* closed this transport and then used it
    │   └── TransportTimeout  nothing arrived within the bounded wait
    ├── ProviderError
    │   ├── ProvisionFailed   an instance could not be created or started
    │   └── NotReady          an instance did not become ready in time
    ├── ClusterError          a member never joined, a name never resolved, a member died
    ├── ModelError            a model file is missing, malformed or unsupported
    ├── ScenarioError         a scenario file is invalid (names the file, the field and the fix)
    │   └── PlanError         a plan or cluster file is invalid, or no plan fits (names the path and the fix)
    └── StageError            a stage reported a failure while serving a request

Messages name the stage, the peer and the value involved. Implementations translate their library's exceptions into
this tree at the boundary (``raise ... from exc``) so callers never see pyzmq or iroh types.
"""

from __future__ import annotations


class HarnessError(Exception):
    """Base of every error ppharness raises on purpose."""


class CodecError(HarnessError):
    pass


class TransportError(HarnessError):
    pass


class ConnectFailed(TransportError):
    pass


class PeerClosed(TransportError):
    pass


class TransportClosed(TransportError):
    pass


class TransportTimeout(TransportError):
    pass


class ProviderError(HarnessError):
    pass


class ProvisionFailed(ProviderError):
    pass


class NotReady(ProviderError):
    pass


class ClusterError(HarnessError):
    pass


class WaitTimedOut(ClusterError):
    """A bounded wait for messages ended with nothing that answered it."""


class ModelError(HarnessError):
    pass


class ScenarioError(HarnessError):
    pass


class PlanError(ScenarioError):
    pass


class StageError(HarnessError):
    pass


class StageBusy(StageError):
    """Stage 0 refused a request because it still serves another (its last token may still be on the way)."""
