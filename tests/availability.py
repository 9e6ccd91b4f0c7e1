"""Which test backends can run on this machine: plain functions returning a reason to skip, or None."""

from __future__ import annotations

import os
import socket


def docker_reason() -> str | None:
    """None when a Docker daemon answers the Docker SDK (what the docker provider uses), else why not."""
    try:
        import docker
    except ImportError:
        return "the Docker SDK for Python is not installed (pip install docker; `bash setup.sh` does)"
    host = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    if host.startswith(("unix://", "http+unix://")):  # the SDK leaves a failed connect's socket open: try it here
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            try:
                sock.connect(host.split("://", 1)[1])
            except OSError as exc:
                return (
                    f"no Docker daemon answers at {host} ({exc.strerror or exc}); install Debian's docker.io and "
                    "start dockerd: `bash docker/dockerd.sh` (what .ci/run does)"
                )
    try:
        probe = docker.from_env(version="1.41", timeout=10)  # a fixed API version: nothing is asked before ping
        try:
            probe.ping()
        finally:
            probe.close()
    except Exception as exc:  # the SDK raises DockerException, requests' and socket errors alike
        return (
            f"no Docker daemon answers ({type(exc).__name__}: {exc}); install Debian's docker.io and start "
            "dockerd: `bash docker/dockerd.sh` (what .ci/run does)"
        )
    return None


def in_ci() -> bool:
    """True when CI=true (or 1/yes) is set: then a missing required backend is a failure, not a skip."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def must_fail(marker: str) -> bool:
    """Whether tests carrying ``marker`` fail (rather than skip) when the backend is unavailable: docker in CI."""
    return marker == "docker" and in_ci()


def gpu_reason() -> str | None:
    if not (os.environ.get("CUDA") or os.environ.get("DEV", "").upper() in ("CUDA", "NV")):
        return "no GPU device selected (set CUDA=1 on a machine with an NVIDIA GPU)"
    return None


def vastai_reason(real: bool = False) -> str | None:
    """The vast.ai emulator runs anywhere (None); the real service (pytest --vastai-real) needs VAST_API_KEY."""
    if real and not os.environ.get("VAST_API_KEY", "").strip():
        return "--vastai-real needs a vast.ai API key in VAST_API_KEY"
    return None


def unavailable_reason(marker: str) -> str | None:
    """Why tests carrying ``marker`` cannot run here, or None when they can."""
    return {"docker": docker_reason, "gpu": gpu_reason, "vastai": vastai_reason}.get(marker, lambda: None)()
