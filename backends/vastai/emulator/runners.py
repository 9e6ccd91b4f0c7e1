"""How the vast.ai emulator runs an instance's container: a local process group, or a Docker container.

Both run what vast.ai would: for runtype ``args``, ``onstart`` as the entrypoint and ``args`` as its arguments; for
the other runtypes ``sh -c onstart``. Both give the command the environment entries the client sent plus what vast.ai
sets in a container: ``CONTAINER_API_KEY``, ``CONTAINER_ID``, ``VAST_CONTAINERLABEL``, ``PUBLIC_IPADDR`` (padded with
whitespace, as vast.ai's) and ``VAST_TCP_PORT_<P>`` / ``VAST_UDP_PORT_<P>`` (the public port of each published
container port P), plus ``PP_VASTAI_EMULATOR``; and nothing secret.

``PP_BIND_HOST`` is the instance's own address (``network.reserve_address``), whatever the client sent (for every
node of a ``pp-host`` instance too: the provider gives them one bind host, an entry they share): the emulator has no
network namespace per container, and this address stands in for the container's own interface, which a node binds
with ``0.0.0.0`` on vast.ai. So two instances binding the same container port never collide, and others reach what
a node binds as they do on vast.ai: at the public address through the published ports (and, as on one host's
loopback, at its own address).

- ``ProcessRunner`` (CI): on top of this process's environment less anything named like a key, token, secret or
  password, with the interpreter's directory first on ``PATH`` so ``pp-node`` is found; output to a log file.
- ``DockerRunner``: a container of a local image (the node image stands in for the one the client named) on the
  host's network, so loopback addresses work as they do for a process; it sees only the client's entries and the
  image's own environment. Containers carry ``ppharness.run=<label>`` (the docker reaper finds them) and
  ``ppharness.vastai-emulator=<emulator id>``.

``stop`` kills the instance's command and everything it started, and waits for it.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from backends.vastai.emulator.network import platform_env

if TYPE_CHECKING:
    from docker.models.containers import Container

    from backends.vastai.emulator.state import EmuInstance

EMULATOR_VAR = "PP_VASTAI_EMULATOR"
BIND_HOST_VAR = "PP_BIND_HOST"
CHECK_S = 0.5
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.I)


def container_argv(inst: EmuInstance) -> list[str]:
    """The command the container runs: ``onstart`` as entrypoint plus ``args`` (runtype args), else ``sh -c``."""
    body = inst.body
    if "args" in inst.runtype.split():
        argv = [
            *shlex.split(str(body.get("onstart") or "")),
            *[str(a) for a in body.get("args") or []],
            *shlex.split(str(body.get("args_str") or "")),
        ]
        return argv or ["pp-node"]
    return ["/bin/sh", "-c", str(body.get("onstart") or "sleep infinity")]


def instance_extras(inst: EmuInstance, emulator_id: str) -> dict[str, str]:
    """What the platform adds to the client's entries (module docstring); these win over the client's."""
    return {
        "CONTAINER_API_KEY": inst.instance_key,
        "CONTAINER_ID": str(inst.id),
        "VAST_CONTAINERLABEL": f"C.{inst.id}",
        **platform_env(inst.forwarders),
        BIND_HOST_VAR: inst.address,
        EMULATOR_VAR: emulator_id,
    }


def node_environment(client_env: dict[str, str], extra: dict[str, str]) -> dict[str, str]:
    """A local process's environment: this one less anything secret-looking, the interpreter's directory first on
    PATH (for ``pp-node``), then the client's entries and ``extra``."""
    base = {k: v for k, v in os.environ.items() if not _SECRET_NAME.search(k) and not k.startswith("PYTEST_")}
    base["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), base.get("PATH", "/usr/bin:/bin")])
    return {**base, **client_env, **extra, "PYTHONUNBUFFERED": "1"}


def _process(inst: EmuInstance) -> subprocess.Popen[bytes] | None:
    """The process a ``ProcessRunner`` started for ``inst`` (None when it is not running)."""
    handle = inst.handle
    assert handle is None or isinstance(handle, subprocess.Popen), "a ProcessRunner's handles are processes"
    return handle


def _container(inst: EmuInstance) -> Container | None:
    """The container a ``DockerRunner`` started for ``inst`` (None when it is not running)."""
    from docker.models.containers import Container

    handle = inst.handle
    assert handle is None or isinstance(handle, Container), "a DockerRunner's handles are containers"
    return handle


class ProcessRunner:
    name = "process"

    def __init__(self, emulator_id: str, log_dir: Path) -> None:
        self.emulator_id, self.log_dir = emulator_id, log_dir

    def start(self, inst: EmuInstance) -> None:
        path = self.log_dir / f"instance-{inst.id}.log"
        env = node_environment(inst.env, instance_extras(inst, self.emulator_id))
        with open(path, "ab") as log:
            try:
                inst.handle = subprocess.Popen(
                    container_argv(inst),
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    cwd=self.log_dir,
                )
            except OSError as exc:
                log.write(f"cannot start the container's command: {exc}\n".encode())
                inst.handle = None

    def exit_code(self, inst: EmuInstance) -> int | None:
        """None while the command runs; its exit code once it ended (1 when it never started)."""
        proc = _process(inst)
        return proc.poll() if proc is not None else 1

    def stop(self, inst: EmuInstance, grace_s: float = 3.0) -> None:
        proc, inst.handle = _process(inst), None
        if proc is None or proc.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(grace_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def log(self, inst: EmuInstance) -> str:
        path = self.log_dir / f"instance-{inst.id}.log"
        return path.read_text(errors="replace") if path.exists() else ""


class DockerRunner:
    name = "docker"

    def __init__(self, emulator_id: str, image: str) -> None:
        import docker

        self.emulator_id, self.image = emulator_id, image
        self.docker = docker.from_env(timeout=60)
        self._logs: dict[int, str] = {}
        self._checked: dict[int, float] = {}

    def start(self, inst: EmuInstance) -> None:
        import docker.errors

        argv = container_argv(inst)
        env = {**inst.env, **instance_extras(inst, self.emulator_id)}
        try:
            inst.handle = self.docker.containers.run(
                self.image,
                entrypoint=argv[:1],
                command=argv[1:],
                environment=env,
                network_mode="host",
                init=True,
                detach=True,
                name=f"vastai-emu-{self.emulator_id}-{inst.id}",
                labels={
                    "ppharness.run": inst.env.get("PP_RUN_LABEL", ""),
                    "ppharness.vastai-emulator": self.emulator_id,
                },
            )
        except docker.errors.DockerException as exc:
            self._logs[inst.id] = f"cannot start the container: {exc}\n"
            inst.handle = None

    def exit_code(self, inst: EmuInstance) -> int | None:
        """As ProcessRunner's, asking the daemon at most every ``CHECK_S`` per instance."""
        import docker.errors

        container = _container(inst)
        if container is None:
            return 1
        now = time.monotonic()
        if now - self._checked.get(inst.id, -1e9) < CHECK_S:
            return None
        self._checked[inst.id] = now
        try:
            container.reload()
        except docker.errors.DockerException:
            return 1
        if container.status in ("exited", "dead"):
            return int(container.attrs["State"]["ExitCode"])
        return None

    def stop(self, inst: EmuInstance, grace_s: float = 3.0) -> None:
        import docker.errors

        container, inst.handle = _container(inst), None
        if container is None:
            return
        try:
            self._logs[inst.id] = container.logs().decode(errors="replace")
            container.remove(force=True)
        except docker.errors.DockerException:
            pass

    def log(self, inst: EmuInstance) -> str:
        import docker.errors

        container = _container(inst)
        if container is not None:
            try:
                return container.logs().decode(errors="replace")
            except docker.errors.DockerException:
                return ""
        return self._logs.get(inst.id, "")
