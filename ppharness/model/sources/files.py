"""A scenario's model as a local GGUF file: ``resolve_model(source)`` turns a synthetic spec, a local path or a URL into
a path, building a synthetic model (``ppharness.model.synthetic.writer``) or downloading a file once into the cache
directory. ``download_deadline`` bounds the downloads of callers that give no deadline of their own."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path

from ppharness.errors import ModelError
from ppharness.model.sources.download import DownloadLimits, fetch
from ppharness.model.synthetic.spec import SIMULATION_ONLY, ModelSpec, parse_synthetic
from ppharness.model.synthetic.writer import make_synthetic


def cache_dir() -> Path:
    """Where built and downloaded models live: $PPHARNESS_CACHE, else ~/.cache/ppharness."""
    return Path(os.environ.get("PPHARNESS_CACHE") or Path.home() / ".cache" / "ppharness")


def synthetic_path(spec: ModelSpec) -> Path:
    """The cached GGUF for ``spec``, built on first use."""
    path = cache_dir() / "models" / f"{spec.slug()}.gguf"
    if not path.exists():
        make_synthetic(spec, path)
    return path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


_BLOB_DIGEST = re.compile(r"/blobs/sha256:([0-9a-fA-F]{64})$")
_DEADLINE: ContextVar[tuple[float, str] | None] = ContextVar("download_deadline", default=None)


@contextlib.contextmanager
def download_deadline(seconds: float, fix: str) -> Iterator[None]:
    """Within it, each download that ``resolve_model`` is given no ``deadline_s`` for may take ``seconds``; the error
    when they run out says ``fix`` (the caller's knob, e.g. a command's flag)."""
    token = _DEADLINE.set((seconds, fix))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def download(url: str, sha256: str | None = None, progress: bool = True, limits: DownloadLimits | None = None) -> Path:
    """Download ``url`` once into the cache (resumable by re-running), check its sha256, return the path.

    A registry blob URL (``.../blobs/sha256:<digest>``, e.g. ollama's) names its own sha256, which is checked when
    ``sha256`` is not given. A download that nothing pins prints its sha256 (on stderr) so that it can be pinned.
    The download is bounded (``ppharness.model.sources.download``): its size by ``limits.size`` or the Content-Length
    and a cap, each read by a stall timeout, the whole by ``limits.deadline``; ``limits`` defaults to the environment's.
    """
    from tqdm import tqdm

    if sha256 is None and (m := _BLOB_DIGEST.search(url.split("?", 1)[0])):
        sha256 = m.group(1)
    name = re.sub(r"[^A-Za-z0-9._-]", "_", url.rsplit("/", 1)[-1]) or "model.gguf"
    path = cache_dir() / "downloads" / f"{hashlib.sha256(url.encode()).hexdigest()[:12]}-{name}"
    if limits is not None and limits.size is not None and path.exists() and path.stat().st_size != limits.size:
        path.unlink()  # a cached file of another size than the scenario's model.size is not the file it names
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f"{path.suffix}.{os.getpid()}.part")  # nodes sharing a cache download side by side
        with tqdm(unit="B", unit_scale=True, desc=name, disable=not progress) as bar:

            def on_bytes(n: int, total: int | None) -> None:
                if total is not None and bar.total != total:
                    bar.total = total
                bar.update(n)

            fetch(url, tmp, limits or DownloadLimits.from_env(), on_bytes)
        os.replace(tmp, path)
        if not sha256:
            print(
                f"downloaded {url} to {path}: {path.stat().st_size:,} bytes, sha256 {sha256_file(path)} "
                "(pin it with the scenario's model.sha256)",
                file=sys.stderr,
                flush=True,
            )
    if sha256:
        actual = sha256_file(path)
        if actual != sha256.lower():
            path.unlink()
            raise ModelError(f"{url}: sha256 {actual} does not match the expected {sha256}; the download was removed")
    return path


def resolve_model(
    source: str, sha256: str | None = None, *, size: int | None = None, deadline_s: float | None = None
) -> Path:
    """A model source -> a local GGUF path.

    ``source`` is ``synthetic:<preset>[,key=value...]`` (e.g. ``synthetic:tiny,blocks=4,seed=3``), a local path, or an
    http(s) URL (downloaded once with a progress bar, checked against ``sha256`` when given). ``size``: the file's
    size in bytes (a scenario's ``model.size``), which a download may not exceed and a file must have;
    ``deadline_s``: the seconds a download may take (the caller's budget; None: ``download_deadline``'s, if any).
    """
    if source.startswith("synthetic:"):
        preset = source.removeprefix("synthetic:").split(",")[0]
        if preset in SIMULATION_ONLY:
            raise ModelError(
                f"{source!r} is for the simulator only ({parse_synthetic(source).n_params / 1e9:.0f} B parameters): "
                "`ppharness plan simulate` and `plan make` take it; to run, use a preset that fits this machine"
            )
        return synthetic_path(parse_synthetic(source))
    if source.startswith(("http://", "https://")):
        given = _DEADLINE.get() if deadline_s is None else None
        limits = DownloadLimits.from_env(size, *given) if given else DownloadLimits.from_env(size, deadline_s)
        return download(source, sha256, limits=limits)
    path = Path(source).expanduser()
    if not path.is_file():
        raise ModelError(f"model file {path} does not exist")
    if size is not None and path.stat().st_size != size:
        raise ModelError(
            f"model file {path} is {path.stat().st_size:,} bytes, not the {size:,} of model.size — fix model.size, "
            "or point model.gguf at the right file"
        )
    if sha256 and sha256_file(path) != sha256.lower():
        raise ModelError(f"model file {path}: sha256 does not match the expected {sha256}")
    return path
