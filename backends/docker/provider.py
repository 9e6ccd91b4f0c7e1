"""Local Docker: one container per stage from the node image, each with its own address on a bridge network.

Per run the provider creates a user-defined bridge network ``ppharness-<label>`` on a free /24 subnet (its gateway,
``.1``, is this machine's address on it: the orchestrator binds every interface and advertises the gateway), and one
container per stage at the fixed address ``.<10 + stage>``, started with ``PP_BIND_HOST=0.0.0.0`` and
``PP_ADVERTISE_HOST=<its address>``. The orchestrator and the containers reach each other only over that network, the
way they would reach remote hosts. The model file is bind-mounted read-only at ``/models/<file name>``; tinygrad's
compiled-kernel cache lives in the named volume ``ppharness-tinygrad-cache``, shared by every run on this machine
(as local processes share ``~/.cache/tinygrad``), so only the first run compiles every kernel with clang.

Guarantees:

- every container and the network carry the label ``ppharness.run=<label>`` (containers also ``ppharness.run.stage``);
  ``DockerProvider.reap(label)`` removes every container and network with that label (any ppharness run when None);
- ``provision`` returns once every container is running (or has already exited: the orchestrator's watchdog then
  fails the run with its last log lines); on any failure it removes what it created and raises ``ProvisionFailed``
  (``NotReady`` when a container does not reach the running state), with the affected container's last log lines;
- leaving the ``with`` block, on every path (exception, Ctrl-C, SIGTERM through the CLI), saves each container's
  output to ``<log_dir>/<stage name>.log`` and removes every container and then the network; a second Ctrl-C
  during that clean-up is deferred until it is done;
- Docker SDK exceptions surface as ``ppharness.errors`` types (``raise ... from``).

Settings (scenario ``provider.docker``, all optional): ``image`` (use this node image as is), ``base_image`` (build
``docker/Dockerfile`` on it instead of the local Debian base), ``subnet`` (the run network, IPv4, /28 or larger),
``cpus`` and ``memory`` (per-container limits, e.g. ``1.5`` and ``"1g"``). A plan device that is one GPU of a host
(``source.gpu``) gets that GPU of this machine (a device request; it needs the NVIDIA container runtime).
"""

from __future__ import annotations

import ipaddress
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import docker
import docker.errors
from docker.types import DeviceRequest, EndpointConfig, IPAMConfig, IPAMPool

from backends.docker.image import ensure_node_image
from backends.docker.network import client, daemon_problem, free_subnet, parse_subnet, remove_labelled
from backends.docker.settings import DockerSettings
from ppharness.errors import NotReady, ProviderError, ProvisionFailed
from ppharness.seams.provider import Instance, NodeAction, NodeSpec, Provider, Reaped

if TYPE_CHECKING:
    from ppharness.seams.transport import JsonObject

RUN_LABEL = "ppharness.run"
STAGE_LABEL = "ppharness.run.stage"
MODEL_DIR = "/models"
KERNEL_CACHE_VOLUME = "ppharness-tinygrad-cache"
KERNEL_CACHE_DIR = "/var/cache/ppharness-tinygrad"
FIRST_HOST = 10
RUNNING_TIMEOUT_S = 60.0
POLL_S = 0.1
LOG_TAIL = 20


def gpu_request(gpu: int | None) -> list[DeviceRequest] | None:
    """The container's GPU: the host's GPU ``gpu`` (the NVIDIA runtime shows it as the container's device 0), or
    none."""
    if gpu is None:
        return None
    return [DeviceRequest(device_ids=[str(gpu)], capabilities=[["gpu"]])]


def _log(text: str) -> None:
    print(f"docker: {text}", file=sys.stderr, flush=True)


def _explain(exc: BaseException) -> str:
    return str(getattr(exc, "explanation", None) or exc)


class DockerProvider(Provider[DockerSettings | None]):
    """One container per stage on a bridge network of its own (see the module's docstring); ``settings`` is the
    scenario's ``provider.docker``."""

    kind = "docker"
    signals_nodes = True
    own_networks = True  # a container with no network but its loopback

    def __init__(
        self, run_label: str, settings: DockerSettings | None = None, log_dir: str | os.PathLike[str] | None = None
    ):
        super().__init__(run_label, settings, log_dir)
        self.network_name = f"ppharness-{run_label}"
        self.image: str | None = None
        self.start_times: dict[str, float] = {}
        self._client: docker.DockerClient | None = None
        self._subnet: ipaddress.IPv4Network | None = None
        self._network_id: str | None = None
        self._model: tuple[str, str] | None = None
        self._exit_codes: dict[str, int] = {}
        self._dirty = False

    # --- settings and addresses -----------------------------------------------------------------------------------

    @property
    def docker(self) -> docker.DockerClient:
        if self._client is None:
            self._client = client()
        return self._client

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        """The run network's subnet: the ``subnet`` setting, else a free /24 (chosen once, created in provision)."""
        if self._subnet is None:
            wanted = self.settings.subnet if self.settings is not None else None
            self._subnet = parse_subnet(wanted) if wanted else free_subnet(self.docker)
        return self._subnet

    @property
    def gateway(self) -> str:
        """This machine's address on the run network (the nodes' route to the orchestrator)."""
        return str(self.subnet.network_address + 1)

    def address_of(self, index: int) -> str:
        """The fixed address of the ``index``-th container of the run."""
        host = self.subnet.network_address + FIRST_HOST + index
        if host >= self.subnet.broadcast_address:
            raise ProvisionFailed(f"subnet {self.subnet} has no address for container {index}: use a larger subnet")
        return str(host)

    # --- Provider hooks -------------------------------------------------------------------------------------------

    def node_model(self, source: str, local_path: str) -> str:
        """The container-side path of the model file, which ``provision`` bind-mounts read-only."""
        host_path = os.path.realpath(local_path)
        self._model = (host_path, f"{MODEL_DIR}/{os.path.basename(host_path)}")
        return self._model[1]

    def seed_transport_options(self, kind: str) -> JsonObject:
        """Bind every interface and advertise the run network's gateway (no options for the in-process memory kind)."""
        return {} if kind == "memory" else {"host": "0.0.0.0", "advertise_host": self.gateway}

    # --- provisioning ---------------------------------------------------------------------------------------------

    def provision(self, specs: list[NodeSpec]) -> list[Instance]:
        try:
            s = self.settings
            self.image = (s.image if s is not None else None) or ensure_node_image(
                self.docker, s.base_image if s is not None else None, _log
            )
            self._dirty = True
            self._create_network()
            started = [self._start(i, spec) for i, spec in enumerate(specs)]
            self._wait_running(started)
        except BaseException:
            with _signals_deferred():
                self._teardown()
            raise
        return started

    def _create_network(self) -> None:
        if self._network_id is not None:
            return
        pool = IPAMPool(subnet=str(self.subnet), gateway=self.gateway)
        try:
            net = self.docker.networks.create(
                self.network_name,
                driver="bridge",
                ipam=IPAMConfig(pool_configs=[pool]),
                labels={RUN_LABEL: self.run_label},
                check_duplicate=True,
            )
        except docker.errors.APIError as exc:
            raise ProvisionFailed(
                f"creating the network {self.network_name} ({self.subnet}) failed: {_explain(exc)}"
            ) from exc
        self._network_id = net.id
        _log(f"network {self.network_name}: {self.subnet}, this machine is {self.gateway}")

    def _start(self, index: int, spec: NodeSpec) -> Instance:
        address = self.address_of(index)
        name = f"{self.run_label}-{spec.name}"
        env = {
            **spec.env,
            "PP_RUN_LABEL": self.run_label,
            "PP_BIND_HOST": "0.0.0.0",
            "PP_ADVERTISE_HOST": address,
            "PYTHONUNBUFFERED": "1",
        }
        volumes = {KERNEL_CACHE_VOLUME: {"bind": KERNEL_CACHE_DIR, "mode": "rw"}}
        if self._model:
            volumes[self._model[0]] = {"bind": self._model[1], "mode": "ro"}
        env["CACHEDB"] = f"{KERNEL_CACHE_DIR}/cache.db"
        network: dict[str, Any] = {  # the SDK takes either a network with its config, or a network mode
            "network": self.network_name,
            "networking_config": {self.network_name: EndpointConfig(version="1.41", ipv4_address=address)},
        }
        if spec.own_network:  # no network but a loopback: the packet layer's bridges are the only way out
            network = {"network_mode": "none"}
            for key in ("PP_BIND_HOST", "PP_ADVERTISE_HOST"):
                env.pop(key)
            bridges = spec.env.get("PP_NETWORK_DIR", "")
            if bridges:
                volumes[bridges] = {"bind": bridges, "mode": "rw"}
        cpus, memory = (self.settings.cpus, self.settings.memory) if self.settings is not None else (None, None)
        cpus = spec.cpus or cpus  # the plan's device limits, else the run's
        mem_limit: int | str | None = spec.memory or memory
        image = spec.image or self.image
        assert image is not None, "provision() chooses the node image before it starts containers"
        try:
            container = self.docker.containers.create(
                image,
                command=["pp-node"],
                name=name,
                hostname=spec.name,
                environment=env,
                labels={RUN_LABEL: self.run_label, STAGE_LABEL: spec.env.get("STAGE", str(index))},
                volumes=volumes,
                init=True,
                **network,
                nano_cpus=int(cpus * 1e9) if cpus else None,
                mem_limit=mem_limit,
                device_requests=gpu_request(spec.gpu),
            )
        except docker.errors.DockerException as exc:
            raise ProvisionFailed(f"creating the container of {spec.name} failed: {_explain(exc)}") from exc
        assert container.id is not None, "the daemon gives every container it creates an id"
        inst = Instance(
            id=container.id[:12],
            name=spec.name,
            provider=self.kind,
            meta={
                "container": name,
                "address": address,
                "image": image,
                "log": str(self.node_log_dir() / f"{spec.name}.log"),
            },
        )
        self.instances.append(inst)
        try:
            container.start()
        except docker.errors.DockerException as exc:
            raise ProvisionFailed(f"starting the container of {spec.name} failed: {_explain(exc)}") from exc
        self.start_times[inst.id] = time.monotonic()
        _log(f"{spec.name}: container {name} ({inst.id}) at {address}")
        return inst

    def _wait_running(self, started: list[Instance]) -> None:
        """Until every container is running or exited (bounded); a container stuck before that raises NotReady."""
        deadline = time.monotonic() + RUNNING_TIMEOUT_S
        pending = {inst.id for inst in started}
        while pending:
            states = self._states()
            pending = {i for i in pending if states.get(i, ("missing", ""))[0] in ("created", "restarting")}
            if not pending:
                return
            if time.monotonic() > deadline:
                inst = next(inst for inst in started if inst.id in pending)
                err = NotReady(
                    f"{inst.name} ({inst.id}) is not running after {RUNNING_TIMEOUT_S:g} s (state {states[inst.id][0]})"
                )
                self._note_logs(err, inst)
                raise err
            time.sleep(POLL_S)

    # --- watching -------------------------------------------------------------------------------------------------

    def _states(self) -> dict[str, tuple[str, str]]:
        """(state, status text) of this run's containers by short id, in one API call."""
        try:
            rows = self.docker.api.containers(all=True, filters={"label": f"{RUN_LABEL}={self.run_label}"})
        except docker.errors.DockerException as exc:
            raise ProviderError(f"the Docker daemon stopped answering: {_explain(exc)}") from exc
        return {row["Id"][:12]: (row.get("State", ""), row.get("Status", "")) for row in rows}

    def exited(self) -> list[tuple[Instance, int]]:
        """Containers that stopped on their own (a container removed by someone else counts, with code -1)."""
        states = self._states() if len(self._exit_codes) < len(self.instances) else {}
        out = []
        for inst in self.instances:
            if inst.id not in self._exit_codes:
                state = states.get(inst.id, ("missing", ""))[0]
                if state not in ("exited", "dead", "missing"):
                    continue
                self._exit_codes[inst.id] = self._exit_code(inst) if state != "missing" else -1
            out.append((inst, self._exit_codes[inst.id]))
        return out

    def _exit_code(self, inst: Instance) -> int:
        try:
            return int(self.docker.api.inspect_container(inst.id)["State"]["ExitCode"])
        except docker.errors.NotFound:
            return -1
        except docker.errors.DockerException as exc:
            raise ProviderError(f"inspecting {inst.name} ({inst.id}) failed: {_explain(exc)}") from exc

    def wait_exited(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for every container to exit on its own; True when all did."""
        return self._wait_until(lambda: len(self.exited()) == len(self.instances), timeout, POLL_S)

    def logs(self, instance: Instance, lines: int = LOG_TAIL) -> str:
        """The container's last ``lines`` lines (stdout and stderr), or those of its saved log once removed."""
        try:
            raw = self.docker.api.logs(instance.id, stdout=True, stderr=True, tail=lines)
            return raw.decode("utf-8", "replace")
        except docker.errors.DockerException:
            try:
                return "".join(Path(instance.meta["log"]).read_text(errors="replace").splitlines(True)[-lines:])
            except OSError:
                return ""

    def _note_logs(self, err: BaseException, inst: Instance) -> None:
        tail = self.logs(inst, LOG_TAIL).rstrip()
        if tail:
            err.add_note(f"last lines of {inst.name}:\n{tail}")

    # --- teardown -------------------------------------------------------------------------------------------------

    def signal_node(self, instance: Instance, action: NodeAction) -> None:
        """pause / unpause (the cgroup freezer: every process of the container stops) or kill the container."""
        try:
            if action == "pause":
                self.docker.api.pause(instance.id)
            elif action == "resume":
                self.docker.api.unpause(instance.id)
            else:
                self.docker.api.kill(instance.id)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            raise ProviderError(f"{action} of {instance.name} ({instance.id}) failed: {_explain(exc)}") from exc

    def destroy(self, instance: Instance) -> None:
        """Save the container's output to its log file, then remove it (killing it if it runs). Idempotent."""
        try:
            raw = self.docker.api.logs(instance.id, stdout=True, stderr=True)
            Path(instance.meta["log"]).write_bytes(raw)
        except (docker.errors.DockerException, OSError):
            pass
        try:
            self.docker.api.remove_container(instance.id, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if "already in progress" not in _explain(exc):
                raise ProviderError(f"removing {instance.name} ({instance.id}) failed: {_explain(exc)}") from exc

    def destroy_all(self) -> list[str]:
        """Every container of the run (also one created but not yet recorded), then the network; one warning each
        for what could not be removed."""
        with _signals_deferred():
            try:
                return self._teardown()
            finally:
                if self._client is not None:
                    self._client.close()
                    self._client = None

    def _teardown(self) -> list[str]:
        if not self._dirty:
            return []
        warnings = super().destroy_all()
        try:
            swept = remove_labelled(self.docker, f"{RUN_LABEL}={self.run_label}")
        except docker.errors.DockerException as exc:
            swept = []
            warnings.append(f"removing the run's containers and network failed: {_explain(exc)}")
            print(f"warning: {warnings[-1]}", file=sys.stderr)
        containers = len(self.instances) + sum(x.what.startswith("container") for x in swept)
        _log(f"removed {containers} container(s) and the network {self.network_name}")
        self.instances, self._network_id, self._dirty = [], None, False
        return warnings

    @classmethod
    def reap(
        cls, label: str | None = None, select: Callable[[str], bool] | None = None, dry_run: bool = False
    ) -> list[Reaped]:
        """Remove every container and network labelled with ``label`` (any ppharness run when None) whose run label
        ``select`` accepts; ``dry_run`` only lists them. Nothing to do when no daemon answers."""
        if daemon_problem() is not None:
            return []
        c = client()
        try:
            return remove_labelled(c, f"{RUN_LABEL}={label}" if label else RUN_LABEL, RUN_LABEL, select, dry_run)
        finally:
            c.close()


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM arriving inside the block take effect when it ends (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        pending.append(signum)

    previous = {sig: signal.signal(sig, hold) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in pending[:1]:
            signal.raise_signal(signum)
