"""The Provider seam: where stages run.

A provider turns node specs (environment, resources, image) into running instances of the one node entry point
(``pp-node``), and takes them down again. Every instance carries the run's label so a reaper can find leftovers.
Used as a context manager: whatever happens inside the ``with``, every instance it created is destroyed on the way out
(any path that allocates an instance also destroys it).
"""

from __future__ import annotations

import abc
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, ClassVar, Generic, Literal, Self, TypedDict, TypeVar, Unpack, cast

from ppharness.errors import ProviderError
from ppharness.seams.settings import MAX_SECONDS, ProviderSettings

if TYPE_CHECKING:
    from ppharness.seams.transport import JsonObject

NodeAction = Literal["pause", "resume", "kill"]

# the scenario's settings section for a provider kind (``provider.<kind>``), or None when the scenario has none
SettingsT = TypeVar("SettingsT", bound=ProviderSettings | None)


LOGS_FOLDER = "ppharness-logs"
KEEP_LOGS = 20  # kept log folders of failed runs, newest first
LOGS_STALE_S = MAX_SECONDS  # no run lasts longer (a budget is at most a day): an older folder is no live run's


def prune_kept_logs(parent: Path, keep: int = KEEP_LOGS, stale_s: float = LOGS_STALE_S) -> list[Path]:
    """Remove the folders under ``parent`` beyond the newest ``keep`` that were last changed over ``stale_s`` seconds
    ago (the kept logs of runs long over); what was removed."""
    try:
        folders = sorted((p for p in parent.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return []
    now, gone = time.time(), []
    for folder in folders[keep:]:
        try:
            if now - folder.stat().st_mtime > stale_s:
                shutil.rmtree(folder, ignore_errors=True)
                gone.append(folder)
        except OSError:
            continue
    return gone


@dataclass(frozen=True)
class NodeSpec:
    """One node to start: its name (``pp-stage-3``) and the node contract's environment (STAGE, NUM_STAGES, ...)."""

    name: str
    env: dict[str, str]
    image: str = ""
    gpus: int = 0
    # in a network namespace of its own, reachable only through the packet layer's bridges (ppharness.network)
    own_network: bool = False
    # the node's own limits, where the provider can set them (docker: CPU quota and memory limit), from its device
    cpus: float | None = None
    memory: int | None = None
    # the plan's machine: nodes with the same ``host`` run on one machine, each on its own ``gpu`` there
    host: str | None = None
    gpu: int | None = None
    # the device's own offer search (vast.ai), in the provider's settings' words (ProviderSettings.for_device)
    offer: dict[str, str] | None = None


class NodeOptions(TypedDict, total=False):
    """What ``Provider.spec`` takes besides a node's name and environment: NodeSpec's optional fields."""

    image: str
    gpus: int
    own_network: bool
    cpus: float | None
    memory: int | None
    host: str | None
    gpu: int | None
    offer: dict[str, str] | None


@dataclass
class Instance:
    """A provider's handle on one running node."""

    id: str
    name: str
    provider: str
    meta: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Reaped:
    """One resource a reaper destroyed (or would destroy): what it is (``process 4242``, ``container 1f2e...``) and
    the run whose label it carries."""

    what: str
    run_label: str

    def __str__(self) -> str:
        return f"{self.what} (run {self.run_label})"


class Provider(abc.ABC, Generic[SettingsT]):
    """Start nodes, watch them, read their logs, destroy them. ``run_label`` tags everything it creates.

    ``SettingsT`` is the type of the scenario section the provider kind reads (``Provider[VastaiSettings]``), declared
    beside the provider and named in ``ppharness.registry``. The class attributes below say what a kind can do; a
    scenario that asks its provider for what it cannot do is refused before anything starts."""

    kind: ClassVar[str] = "abstract"
    # whether the orchestrator and the nodes reach each other over UDP on the addresses they advertise (SWIM gossip
    # works); otherwise membership falls back to heartbeats over the transport
    gossip_reachable: ClassVar[bool] = False
    # whether ``signal_node`` can pause, resume and kill a node (a network event's orders)
    signals_nodes: ClassVar[bool] = False
    # whether a node can run in a network namespace of its own (``NodeSpec.own_network``): the packet layer
    own_networks: ClassVar[bool] = False
    # whether a node can be started beside another on a device the run already uses (a lost stage re-placed on a
    # surviving device); a kind whose every node is a rented machine of its own cannot
    colocates: ClassVar[bool] = True

    def __init__(
        self, run_label: str, settings: SettingsT | None = None, log_dir: str | os.PathLike[str] | None = None
    ) -> None:
        """``settings``: the scenario's section for this provider kind (``provider.<kind>``), or None. ``log_dir``:
        where a provider that keeps its nodes' output on this machine writes it (see ``node_log_dir``)."""
        self.run_label = run_label
        # as SettingsT: a kind whose section may be absent says so in its SettingsT (Provider[LocalSettings | None]);
        # a kind that needs it refuses None when it is built (Provider[VastaiSettings])
        self.settings: SettingsT = cast("SettingsT", settings)
        self.instances: list[Instance] = []
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self._owns_log_dir = False

    def node_log_dir(self) -> Path:
        """The folder for the nodes' output on this machine: the one given, else a folder of this provider's own under
        ``<temporary directory>/ppharness-logs/``, removed when the run ends well and kept (and named) when it does
        not. Kept folders do not pile up: ``prune_kept_logs`` removes all but the newest ``KEEP_LOGS`` of those older
        than a run's longest budget."""
        if self._log_dir is None:
            parent = Path(tempfile.gettempdir()) / LOGS_FOLDER
            parent.mkdir(exist_ok=True)
            prune_kept_logs(parent)
            self._log_dir = Path(tempfile.mkdtemp(prefix=f"{self.run_label}-", dir=parent))
            self._owns_log_dir = True
        return self._log_dir

    def node_model(self, source: str, local_path: str) -> str:
        """What a node's MODEL should say: by default the file the orchestrator resolved; a provider whose nodes
        cannot see this machine's files returns the source (a URL or ``synthetic:`` spec) or a mounted path."""
        return local_path

    def seed_transport_options(self, kind: str) -> JsonObject:
        """Extra options for the orchestrator's own endpoint so that this provider's nodes can reach it (e.g. bind
        on all interfaces and advertise a bridge address). By default none: nodes run on this machine."""
        return {}

    def spec(self, name: str, env: dict[str, str], **settings: Unpack[NodeOptions]) -> NodeSpec:
        """A NodeSpec for this provider (callers outside ``backends`` build specs through here)."""
        return NodeSpec(name=name, env=env, **settings)

    @abc.abstractmethod
    def provision(self, specs: list[NodeSpec]) -> list[Instance]:
        """Create and start one instance per spec; raise ProvisionFailed (after cleaning up what it started)."""

    @abc.abstractmethod
    def exited(self) -> list[tuple[Instance, int]]:
        """Instances that stopped on their own so far, with their exit codes. Cheap: called in every wait loop."""

    @abc.abstractmethod
    def logs(self, instance: Instance, lines: int = 20) -> str:
        """The last ``lines`` lines of the instance's output."""

    def signal_node(self, instance: Instance, action: NodeAction) -> None:
        """A network event's orders: ``pause`` stops the node where it is (SIGSTOP), ``resume`` lets it go on
        (SIGCONT), ``kill`` ends it at once (SIGKILL). A provider that cannot raises ProviderError (a scenario asks
        only providers that can: ``signals_nodes``)."""
        raise ProviderError(f"the {self.kind} provider cannot {action} a node")

    @abc.abstractmethod
    def destroy(self, instance: Instance) -> None:
        """Stop and remove one instance. Idempotent: destroying a gone instance is not an error."""

    def wait_exited(self, timeout: float) -> bool:
        """After Shutdown: wait up to ``timeout`` seconds for every node to exit on its own; True when all did. A
        provider that cannot watch that cheaply answers False at once (``destroy`` stops the nodes either way)."""
        return False

    def _wait_until(self, done: Callable[[], bool], timeout: float, poll_s: float = 0.05) -> bool:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
        return True

    @classmethod
    @abc.abstractmethod
    def reap(
        cls, label: str | None = None, select: Callable[[str], bool] | None = None, dry_run: bool = False
    ) -> list[Reaped]:
        """Destroy every resource carrying ``label`` (any ppharness label when None) whose run label ``select``
        accepts (all when None); ``dry_run`` destroys nothing. Return what was (or would be) destroyed."""

    def destroy_all(self) -> list[str]:
        """Destroy every instance this provider created; returns one warning per instance that failed to go."""
        warnings = []
        for inst in reversed(self.instances):
            try:
                self.destroy(inst)
            except Exception as exc:  # keep destroying the others; report every failure
                warnings.append(f"destroying {inst.name} ({inst.id}) failed: {exc}")
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)
        return warnings

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        warnings = self.destroy_all()
        self._tidy_logs(failed=exc_type is not None or bool(warnings))
        if warnings and exc_type is None:
            raise ProviderError(f"{len(warnings)} instance(s) could not be destroyed: {'; '.join(warnings)}")

    def _tidy_logs(self, failed: bool) -> None:
        """A log folder this provider made for itself goes when the run ended well, and stays, named, when not (a
        folder the caller gave is the caller's)."""
        if self._log_dir is None or not self._owns_log_dir:
            return
        if failed:
            print(f"the nodes' logs are kept in {self._log_dir}", file=sys.stderr)
        else:
            shutil.rmtree(self._log_dir, ignore_errors=True)
