"""The node image, built locally and cached by content: no registry is needed.

Two layers of caching, each a tag that is a hash of what goes in:

- the base, ``ppharness-base:bookworm-<hash>``: a minimal Debian root filesystem with python3, venv and clang, made by
  ``docker/build-base.sh`` (debootstrap + ``docker import``); the hash covers that script, ``docker/base-packages.txt``
  and the suite. A user with internet may name any base instead (``base_image``, e.g. ``python:3.11-slim-bookworm``).
- the node image, ``ppharness-node:<hash>``: ``docker/Dockerfile`` on that base with the project installed from the
  working tree; the hash covers the base's name, the Dockerfile, ``requirements.lock`` and every project file
  that goes into the image (``pyproject.toml``, ``README.md``, the ``ppharness``, ``transports`` and ``backends``
  packages), so an edit rebuilds it and an unchanged tree builds nothing.

Guarantees: ``ensure_node_image`` returns a tag that exists in the daemon, or raises ``ProvisionFailed`` with the last
lines of the failed build attached as a note; concurrent callers on one machine build each tag once (a file lock);
progress lines for the slow parts go to ``log``.

``python -m backends.docker.image [--base-image IMAGE]`` builds (or finds) the image and prints its tag.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import docker
import docker.errors

from backends.docker.network import client as connect
from ppharness.errors import ProvisionFailed

ROOT = Path(__file__).resolve().parents[2]  # the repository: backends/docker/image.py
DOCKER_DIR = ROOT / "docker"
SUITE = "bookworm"
BASE_REPO = "ppharness-base"
NODE_REPO = "ppharness-node"
IMAGE_LABEL = "ppharness.image"
PROJECT_FILES = ("pyproject.toml", "README.md")
PROJECT_DIRS = ("ppharness", "transports", "backends")
HOST_CA_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")
TAIL_LINES = 30
KEEP_NODE_IMAGES = 3

Log = Callable[[str], None]


def _stderr(text: str) -> None:
    print(f"docker: {text}", file=sys.stderr, flush=True)


def _digest(parts: list[tuple[str, bytes]]) -> str:
    h = hashlib.sha256()
    for name, data in parts:
        h.update(name.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return h.hexdigest()[:16]


def base_tag() -> str:
    """The content tag of the Debian base: changes exactly when its script, package list or suite change."""
    files = [DOCKER_DIR / "build-base.sh", DOCKER_DIR / "base-packages.txt"]
    return f"{BASE_REPO}:{SUITE}-{_digest([('suite', SUITE.encode())] + [(p.name, p.read_bytes()) for p in files])}"


def project_files() -> list[str]:
    """The project files the image installs, relative to the repository root, sorted (caches and hidden files out)."""
    found = [name for name in PROJECT_FILES if (ROOT / name).is_file()]
    for top in PROJECT_DIRS:
        for dirpath, dirnames, filenames in os.walk(ROOT / top):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
            rel = Path(dirpath).relative_to(ROOT)
            found += [str(rel / f) for f in filenames if not f.startswith(".") and not f.endswith((".pyc", ".pyo"))]
    return sorted(found)


def _image_files() -> list[str]:
    """Everything of the repository the Dockerfile copies (the context less the CA files)."""
    return ["docker/Dockerfile", "requirements.lock", "docker/ca/README.md", *project_files()]


def node_tag(base: str) -> str:
    """The content tag of the node image on ``base``: changes when the base's name or any copied file changes."""
    return f"{NODE_REPO}:{_digest([('base', base.encode())] + [(f, (ROOT / f).read_bytes()) for f in _image_files()])}"


def image_exists(client: docker.DockerClient, tag: str) -> bool:
    try:
        client.images.get(tag)
        return True
    except docker.errors.ImageNotFound:
        return False


@contextmanager
def _build_lock() -> Iterator[None]:
    """One image build at a time on this machine (other processes wait here, then find the image built)."""
    lock_dir = Path(os.environ.get("PPHARNESS_CACHE") or Path.home() / ".cache" / "ppharness")
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / "docker-build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_base(client: docker.DockerClient, log: Log = _stderr) -> str:
    """The Debian base image's tag, built by ``docker/build-base.sh`` when missing (minutes, once per machine)."""
    tag = base_tag()
    if image_exists(client, tag):
        return tag
    log(f"building the base image {tag} from Debian packages (debootstrap; a few minutes, once per machine)")
    t0 = time.monotonic()
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    cmd = ["bash", str(DOCKER_DIR / "build-base.sh"), tag, SUITE]
    try:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, errors="replace"
        )
    except OSError as exc:
        raise ProvisionFailed(f"cannot run {' '.join(cmd)}: {exc}") from exc
    with proc:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                tail.append(line.rstrip())
                log(line.rstrip().removeprefix("build-base: "))
        finally:
            if proc.poll() is None:
                proc.terminate()
        rc = proc.wait()
    if rc != 0 or not image_exists(client, tag):
        err = ProvisionFailed(
            f"building the base image {tag} failed (exit code {rc}); run `bash docker/build-base.sh {tag}` to see why"
        )
        err.add_note("last lines of the base build:\n" + "\n".join(tail))
        raise err
    log(f"base image {tag} built in {time.monotonic() - t0:.0f} s")
    prune_images(client, BASE_REPO, tag, 1)
    return tag


def host_ca_bundle() -> Path | None:
    """This machine's CA bundle (what pip here trusts): ``PIP_CERT`` when set, else the system bundle."""
    for candidate in (os.environ.get("PIP_CERT"), *HOST_CA_BUNDLES):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def build_context() -> io.BytesIO:
    """The build context as an uncompressed tar: the Dockerfile's inputs plus this machine's CA bundle for pip."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for rel in _image_files():
            tar.add(str(ROOT / rel), arcname=rel, recursive=False)
        ca = host_ca_bundle()
        if ca is not None:
            tar.add(str(ca), arcname="docker/ca/host.pem")
    buf.seek(0)
    return buf


def _build(client: docker.DockerClient, tag: str, base: str, log: Log) -> None:
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    t0 = time.monotonic()
    error: str | None = None
    try:
        stream = client.api.build(
            fileobj=build_context(),
            custom_context=True,
            dockerfile="docker/Dockerfile",
            tag=tag,
            rm=True,
            forcerm=True,
            buildargs={"BASE_IMAGE": base},
            network_mode="host",
            decode=True,
            labels={IMAGE_LABEL: "node", "ppharness.base": base},
        )
        for chunk in stream:
            if "error" in chunk:
                error = str(chunk.get("errorDetail", {}).get("message") or chunk["error"]).strip()
                tail.append(error)
                continue
            for line in str(chunk.get("stream", "")).splitlines():
                line = line.rstrip()
                if not line:
                    continue
                tail.append(line)
                if line.startswith(("Step ", "Installed ", "Successfully installed", "Successfully built")):
                    log(f"  [{time.monotonic() - t0:5.0f}s] {line[:150]}")
    except docker.errors.DockerException as exc:
        err = ProvisionFailed(f"building the node image {tag} failed: {getattr(exc, 'explanation', None) or exc}")
        err.add_note("last lines of the build:\n" + "\n".join(tail))
        raise err from exc
    if error is not None or not image_exists(client, tag):
        err = ProvisionFailed(f"building the node image {tag} failed: {error or 'no image was produced'}")
        err.add_note("last lines of the build:\n" + "\n".join(tail))
        raise err


def ensure_node_image(client: docker.DockerClient, base_image: str | None = None, log: Log = _stderr) -> str:
    """The node image's tag for the working tree, built when no image of that content exists.

    ``base_image``: the image to build on (pulled by the daemon if it is not local); None builds the Debian base
    locally first. Raises ``ProvisionFailed`` (with the build's last lines as a note) when a build fails.
    """
    base = base_image or base_tag()
    tag = node_tag(base)
    if image_exists(client, tag):
        return tag
    with _build_lock():
        if image_exists(client, tag):
            return tag
        if base_image is None:
            ensure_base(client, log)
        log(f"building the node image {tag} on {base} (the project from this tree; pip from PyPI)")
        t0 = time.monotonic()
        _build(client, tag, base, log)
        log(f"node image {tag} built in {time.monotonic() - t0:.0f} s")
        prune_images(client, NODE_REPO, tag, KEEP_NODE_IMAGES)
    return tag


def prune_images(client: docker.DockerClient, repo: str, keep: str, newest: int) -> list[str]:
    """Untag or remove ``repo`` images older than the ``newest`` ones, never ``keep``, never one that a container or a
    newer image still uses (the daemon refuses those); return the tags removed."""
    images = sorted(client.images.list(name=repo), key=lambda im: im.attrs.get("Created", ""), reverse=True)
    removed = []
    for image in images[newest:]:
        for tag in image.tags:
            if tag == keep or not tag.startswith(f"{repo}:"):
                continue
            try:
                client.images.remove(tag)
                removed.append(tag)
            except docker.errors.APIError:
                continue
    return removed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m backends.docker.image", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--base-image",
        default=None,
        help="build on this image (e.g. python:3.11-slim-bookworm) instead of the local Debian base",
    )
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    try:
        daemon = connect()
        try:
            tag = ensure_node_image(daemon, args.base_image)
        finally:
            daemon.close()
    except ProvisionFailed as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        for note in getattr(exc, "__notes__", []):
            print(note, file=sys.stderr)
        sys.exit(1)
    _stderr(f"node image ready in {time.monotonic() - t0:.1f} s")
    print(tag)


if __name__ == "__main__":
    main()
