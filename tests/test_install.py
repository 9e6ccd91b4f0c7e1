"""The install is reproducible: requirements.lock pins (with hashes) everything pyproject.toml asks for, within its
ranges, and setup.sh and the node image install from that same lock with the same installer version."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"


def _locked() -> dict[str, list[tuple[Requirement, str]]]:
    """Every pin of the lock (a package may be pinned once per Python version range), with its entry's text."""
    text = LOCK.read_text(encoding="utf-8")
    pins: dict[str, list[tuple[Requirement, str]]] = {}
    for entry in re.split(r"\n(?=[A-Za-z0-9])", text):
        first = entry.split("\\", 1)[0].strip()
        if not first or first.startswith("#"):
            continue
        req = Requirement(first)
        pins.setdefault(canonicalize_name(req.name), []).append((req, entry))
    return pins


def _wanted() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in [*project["dependencies"], *extras["test"], *extras["bench"]]]


def test_every_requirement_is_pinned_within_its_range() -> None:
    pins = _locked()
    for want in _wanted():
        if want.marker is not None and not want.marker.evaluate():
            continue
        here = [
            req for req, _ in pins.get(canonicalize_name(want.name), []) if req.marker is None or req.marker.evaluate()
        ]
        assert len(here) == 1, f"{want.name}: {len(here)} pins apply here; run `bash setup.sh --lock`"
        (pin,) = here
        (spec,) = pin.specifier
        assert spec.operator == "==", pin
        assert want.specifier.contains(spec.version, prereleases=True), (
            f"requirements.lock pins {pin.name} {spec.version}, outside pyproject.toml's {want}; "
            "run `bash setup.sh --lock`"
        )


def test_every_pin_carries_hashes() -> None:
    unhashed = [str(req) for pins in _locked().values() for req, entry in pins if "--hash=sha256:" not in entry]
    assert not unhashed, f"pinned without a hash in requirements.lock: {unhashed}"


def test_the_image_installs_the_lock_with_setups_uv() -> None:
    from backends.docker.image import _image_files

    dockerfile = (ROOT / "docker" / "Dockerfile").read_text(encoding="utf-8")
    setup = (ROOT / "setup.sh").read_text(encoding="utf-8")
    assert "requirements.lock" in _image_files()  # the image's content tag changes with the lock
    assert re.search(r"^COPY requirements\.lock ", dockerfile, re.M)
    image_uv = re.search(r"^ARG UV_VERSION=(\S+)$", dockerfile, re.M)
    setup_uv = re.search(r"^UV_VERSION=(\S+)$", setup, re.M)
    assert image_uv and setup_uv and image_uv[1] == setup_uv[1]
