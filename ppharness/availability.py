"""Which test backends can run on this machine: plain functions returning a reason to skip, or None."""

from __future__ import annotations

import os
import shutil
import subprocess


def docker_reason() -> str | None:
    if shutil.which("docker") is None:
        return "the docker client is not installed (run .ci/setup or install Debian's docker.io)"
    try:
        r = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`docker info` failed: {exc}"
    if r.returncode != 0:
        return "no Docker daemon answers (start dockerd, e.g. via .ci/run)"
    return None


def gpu_reason() -> str | None:
    if not (os.environ.get("CUDA") or os.environ.get("DEV", "").upper() in ("CUDA", "NV")):
        return "no GPU device selected (set CUDA=1 on a machine with an NVIDIA GPU)"
    return None


def vastai_reason() -> str | None:
    return "the vast.ai provider is not part of this release yet"


def unavailable_reason(marker: str) -> str | None:
    """Why tests carrying ``marker`` cannot run here, or None when they can."""
    return {"docker": docker_reason, "gpu": gpu_reason, "vastai": vastai_reason}.get(marker, lambda: None)()
