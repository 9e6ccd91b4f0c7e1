"""Local processes: one ``pp-node`` subprocess per stage on this machine.

Each node runs in its own session (so a Ctrl-C at the terminal reaches only the orchestrator, which then destroys the
nodes in order) with ``PP_RUN_LABEL`` in its environment; the reaper finds leftovers by that variable in
``/proc/<pid>/environ``. Output goes to one log file per node under the run directory.

A node inherits only what it reads (``node_environment``): the system's basics, the interpreter's, tinygrad's and the
GPU drivers', and the harness's own ``PP_*``/``PPHARNESS_*``; everything else this process holds (an API key, a cloud
token) stays here. The node contract's entries come from the spec.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from typing import Annotated

from msgspec import Meta

from ppharness.errors import ProvisionFailed
from ppharness.seams.provider import Instance, NodeAction, NodeSpec, Provider, Reaped
from ppharness.seams.settings import ProviderSettings

LABEL_VAR = "PP_RUN_LABEL"
STOP_GRACE_S = 5.0
# a node with a network of its own: a new user namespace (this user as its root, so it may configure its network)
# and a new network namespace with only a loopback, from util-linux's unshare; no privilege is needed
NETNS_PREFIX = ["unshare", "--user", "--map-root-user", "--net", "--"]


# environment variables by which a user picks tinygrad's device; without one, tinygrad probes every backend it knows
DEVICE_VARS = ("DEV", "CPU", "CUDA", "NV", "AMD", "METAL", "GPU", "CL", "LLVM", "CLANG", "WEBGPU", "QCOM")


# what a node inherits from this process: these names, and names with these prefixes
INHERITED = frozenset(
    {
        *("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TERM", "TZ", "TMPDIR", "TMP", "TEMP"),
        *("VIRTUAL_ENV", "LD_LIBRARY_PATH", "LD_PRELOAD", "SSL_CERT_FILE", "SSL_CERT_DIR", "OMP_NUM_THREADS"),
        *("XDG_CACHE_HOME", "XDG_RUNTIME_DIR", "CC", "CXX", "CACHEDB", "CACHELEVEL", "DEBUG", "JIT", "IMAGE"),
        *("NOOPT", "HALF", "FLOAT16", "DEFAULT_FLOAT", "TC", "TC_OPT", "TRANSCENDENTAL", "THREADS", "PROFILE", "VIZ"),
        *("ALLOW_DEVICE_USAGE", "ALLOW_TF32", "SPLIT_REDUCEOP", "PARALLEL", "IGNORE_BEAM_CACHE", "PTX", "NVCC"),
        *DEVICE_VARS,
    }
)
INHERITED_PREFIXES: tuple[str, ...] = (
    *("LC_", "PYTHON", "PP_", "PPHARNESS_", "BEAM", "JIT_", "CUDA", "NV_", "NVIDIA_", "AMD_", "HIP_", "ROCM_", "HSA_"),
    *("HCQ", "METAL_", "CPU_", "LLVM", "QCOM_", "WEBGPU_", "CL_", "GPU_", "OPENBLAS_"),
)


def node_environment(spec_env: dict[str, str], parent: Mapping[str, str] = os.environ) -> dict[str, str]:
    """A node's environment: what it reads of ``parent`` (this process's environment; ``INHERITED``), the device
    picked for it, then the spec's entries."""
    inherited = {k: v for k, v in parent.items() if k in INHERITED or k.startswith(INHERITED_PREFIXES)}
    return {**inherited, **device_env(), **spec_env}


@cache
def device_env() -> dict[str, str]:
    """tinygrad's device for nodes on this machine, chosen once here (the device this process, and so the oracle,
    computes on): each node would otherwise probe every backend as it starts, about 2 s of a small model's 4 s load,
    which is also what a spare replacing a dead stage waits for. Empty when the user picked the device."""
    if any(os.environ.get(k) for k in DEVICE_VARS):
        return {}
    from tinygrad.device import Device

    return {"DEV": str(Device.DEFAULT)}


class LocalSettings(ProviderSettings, frozen=True):
    """Settings of the ``local`` provider. ``fail_destroy`` is a fault switch for failure-mode tests: destroying
    these stages' processes reports an error and leaves them running (for ``ppharness reap`` to find)."""

    fail_destroy: tuple[Annotated[int, Meta(ge=0)], ...] = ()


def node_command() -> list[str]:
    """The node entry point for this interpreter (``pp-node`` is the same module)."""
    return [sys.executable, "-m", "ppharness.run.node.main"]


class LocalProvider(Provider[LocalSettings | None]):
    """One ``pp-node`` process per stage on this machine; ``settings`` is the scenario's ``provider.local``."""

    kind = "local"
    gossip_reachable = True  # nodes and orchestrator share loopback: SWIM over UDP works
    signals_nodes = True
    own_networks = True  # unshare: a user and a network namespace per node

    def __init__(
        self, run_label: str, settings: LocalSettings | None = None, log_dir: str | os.PathLike[str] | None = None
    ):
        super().__init__(run_label, settings, log_dir)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    def provision(self, specs: list[NodeSpec]) -> list[Instance]:
        started: list[Instance] = []
        for spec in specs:
            log_path = self.node_log_dir() / f"{spec.name}.log"
            env = {**node_environment(spec.env), LABEL_VAR: self.run_label, "PYTHONUNBUFFERED": "1"}
            if spec.gpu is not None:  # a GPU of this host: the node sees that one only, as its device 0
                env["CUDA_VISIBLE_DEVICES"] = str(spec.gpu)
            try:
                with open(log_path, "wb") as log:
                    proc = subprocess.Popen(
                        (NETNS_PREFIX if spec.own_network else []) + node_command(),
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
            except OSError as exc:
                raise ProvisionFailed(f"starting {spec.name} failed: {exc}") from exc
            inst = Instance(id=str(proc.pid), name=spec.name, provider=self.kind, meta={"log": str(log_path)})
            self._procs[inst.id] = proc
            self.instances.append(inst)
            started.append(inst)
        return started

    def exited(self) -> list[tuple[Instance, int]]:
        out: list[tuple[Instance, int]] = []
        for inst in self.instances:
            proc = self._procs.get(inst.id)
            if proc is not None and (rc := proc.poll()) is not None:
                out.append((inst, rc))
        return out

    def logs(self, instance: Instance, lines: int = 20) -> str:
        try:
            with open(instance.meta["log"], errors="replace") as f:
                return "".join(deque(f, maxlen=lines))
        except OSError:
            return ""

    def wait_exited(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for every node to exit on its own; True when all did."""
        return self._wait_until(lambda: all(p.poll() is not None for p in self._procs.values()), timeout)

    def signal_node(self, instance: Instance, action: NodeAction) -> None:
        proc = self._procs.get(instance.id)
        if proc is None or proc.poll() is not None:
            return
        _kill_group(proc.pid, {"pause": signal.SIGSTOP, "resume": signal.SIGCONT, "kill": signal.SIGKILL}[action])

    def destroy(self, instance: Instance) -> None:
        if self._fails_destroy(instance):
            raise ProvisionFailed(
                f"destroy of {instance.name} (pid {instance.id}) failed: injected by "
                "provider.local.fail_destroy; `ppharness reap` removes it"
            )
        proc = self._procs.get(instance.id)
        if proc is None or proc.poll() is not None:
            return
        _kill_group(proc.pid, signal.SIGTERM)
        _kill_group(proc.pid, signal.SIGCONT)  # a stopped process handles SIGTERM only once it runs again
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid, signal.SIGKILL)
            proc.wait(STOP_GRACE_S)

    def _fails_destroy(self, instance: Instance) -> bool:
        stages = self.settings.fail_destroy if self.settings is not None else ()
        return any(instance.name == f"pp-stage-{s}" for s in stages)

    @classmethod
    def labelled(cls, label: str | None = None) -> list[int]:
        """Live processes carrying ``label`` (any ppharness label when None), without touching them."""
        return labelled_pids(label)

    @classmethod
    def reap(
        cls, label: str | None = None, select: Callable[[str], bool] | None = None, dry_run: bool = False
    ) -> list[Reaped]:
        victims = [(pid, lbl) for pid, lbl in labelled_nodes(label) if select is None or select(lbl)]
        for pid, _ in victims if not dry_run else []:
            _kill_group(pid, signal.SIGKILL)
        return [Reaped(f"process {pid}", lbl) for pid, lbl in victims]


def _kill_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        os.kill(pid, sig)


def labelled_pids(label: str | None = None) -> list[int]:
    """Live pp-node processes of this user carrying PP_RUN_LABEL (equal to ``label`` when given)."""
    return [pid for pid, _ in labelled_nodes(label)]


def _is_node(cmdline: bytes) -> bool:
    """Whether a command line runs the node entry point (``pp-node`` or ``python -m ppharness.run.node.main``)."""
    args = cmdline.split(b"\0")
    return any(a.endswith(b"pp-node") for a in args[:3]) or b"ppharness.run.node.main" in args[:4]


def labelled_nodes(label: str | None = None) -> list[tuple[int, str]]:
    """(pid, run label) of every live pp-node process of this user whose environment carries PP_RUN_LABEL (equal
    to ``label`` when given). A process that merely has the variable (a shell, an editor) is not a node."""
    prefix = f"{LABEL_VAR}=".encode()
    out: list[tuple[int, str]] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        found = next((v[len(prefix) :].decode("utf-8", "replace") for v in env if v.startswith(prefix)), None)
        if state != "Z" and found is not None and (label is None or found == label) and _is_node(cmdline):
            out.append((int(entry.name), found))
    return sorted(out)
