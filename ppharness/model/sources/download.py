"""A model file fetched over http(s) within bounds: ``fetch(url, dest, limits)`` writes at most the expected size (a
scenario's ``model.size``, else the server's Content-Length) and never more than a cap, gives up when no byte arrives
for a while, and ends by the caller's deadline (a run's budget, a plan command's ``--download-time-limit``). Each bound
broken is a ``ModelError`` naming the URL, the bound and how to change it; a partial file is removed.

The cap is 64 GiB unless ``$PPHARNESS_DOWNLOAD_MAX`` says otherwise (``200GiB``, ``500M``, bytes); the stall timeout
is 60 s unless ``$PPHARNESS_DOWNLOAD_STALL_S`` says otherwise.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ppharness.errors import ModelError

DEFAULT_MAX_BYTES = 64 << 30
DEFAULT_STALL_S = 60.0
MAX_ENV, STALL_ENV = "PPHARNESS_DOWNLOAD_MAX", "PPHARNESS_DOWNLOAD_STALL_S"
_CONNECT_S = 30.0
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# what a run's deadline says to change when it runs out
BUDGET_FIX = "raise the budget (budget.total_s), or download the file first and point model.gguf at it"


def parse_size(text: str, where: str) -> int:
    """``64GiB``, ``500M``, ``1048576`` -> bytes (binary units); ``ModelError`` naming ``where`` otherwise."""
    m = _SIZE.match(text)
    if m is None or float(m.group(1)) <= 0:
        raise ModelError(f"{where}: {text!r} is not a size — write bytes or a size such as 64GiB or 500M")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


@dataclass(frozen=True)
class DownloadLimits:
    """The bounds of one download: the expected size (None: the server's Content-Length), the cap, the longest wait
    for a byte, when it must end (``time.monotonic()``; None: no deadline) and what to change when it runs out."""

    size: int | None = None
    max_bytes: int = DEFAULT_MAX_BYTES
    stall_s: float = DEFAULT_STALL_S
    deadline: float | None = None
    deadline_fix: str = BUDGET_FIX

    @staticmethod
    def from_env(
        size: int | None = None, deadline_s: float | None = None, deadline_fix: str = BUDGET_FIX
    ) -> DownloadLimits:
        """The limits ``$PPHARNESS_DOWNLOAD_MAX`` and ``$PPHARNESS_DOWNLOAD_STALL_S`` set (else the defaults), with
        ``size`` and a deadline ``deadline_s`` from now, whose error says ``deadline_fix``."""
        cap = os.environ.get(MAX_ENV)
        stall = os.environ.get(STALL_ENV)
        stall_s = DEFAULT_STALL_S
        if stall:
            try:
                stall_s = float(stall)
            except ValueError:
                stall_s = -1.0
            if not 0 < stall_s < float("inf"):
                raise ModelError(f"${STALL_ENV}: {stall!r} is not a number of seconds above 0 — unset it or fix it")
        return DownloadLimits(
            size=size,
            max_bytes=parse_size(cap, f"${MAX_ENV}") if cap else DEFAULT_MAX_BYTES,
            stall_s=stall_s,
            deadline=None if deadline_s is None else time.monotonic() + deadline_s,
            deadline_fix=deadline_fix,
        )


def fetch(url: str, dest: Path, limits: DownloadLimits, on_bytes: Callable[[int, int | None], None]) -> None:
    """Write the body of ``url`` to ``dest`` within ``limits``; ``on_bytes(n, total)`` after each piece. ``ModelError``
    for a failed request or a bound broken (``dest`` removed)."""
    import httpx

    def remaining() -> float:
        return float("inf") if limits.deadline is None else limits.deadline - time.monotonic()

    if remaining() <= 0:
        raise _deadline(url, 0, limits)
    wait = min(limits.stall_s, remaining())
    timeout = httpx.Timeout(min(_CONNECT_S, wait), read=wait)
    written = 0
    try:
        # identity: the bytes counted are the file's, never a compressed body that expands past the cap
        with (
            httpx.stream(
                "GET", url, follow_redirects=True, timeout=timeout, headers={"Accept-Encoding": "identity"}
            ) as r,
            open(dest, "wb") as f,
        ):
            r.raise_for_status()
            expected = _expected(url, r.headers.get("content-length"), limits)
            cap = expected if expected is not None else limits.max_bytes
            for chunk in r.iter_raw():
                written += len(chunk)
                if written > cap:
                    raise _too_long(url, written, expected, limits)
                f.write(chunk)
                on_bytes(len(chunk), expected)
                if remaining() <= 0:
                    raise _deadline(url, written, limits)
        if expected is not None and written != expected:
            raise ModelError(
                f"downloading {url}: the body ended after {written:,} of {expected:,} bytes — try again (a partial "
                "download is not kept)"
            )
    except httpx.TimeoutException as exc:
        dest.unlink(missing_ok=True)
        if remaining() <= 0:
            raise _deadline(url, written, limits) from exc
        raise ModelError(
            f"downloading {url} failed: no data for {wait:g} s after {written:,} bytes — the server stalled; try "
            f"again, or raise ${STALL_ENV}"
        ) from exc
    except httpx.HTTPError as exc:
        dest.unlink(missing_ok=True)
        raise ModelError(f"downloading {url} failed: {exc}") from exc
    except BaseException:
        dest.unlink(missing_ok=True)
        raise


def _expected(url: str, content_length: str | None, limits: DownloadLimits) -> int | None:
    """The body's size as the scenario and the server state it; ``ModelError`` when they disagree or it is above
    the cap."""
    announced = int(content_length) if content_length and content_length.isdigit() else None
    if limits.size is not None and announced is not None and announced != limits.size:
        raise ModelError(
            f"downloading {url}: the server sends {announced:,} bytes but the scenario's model.size is "
            f"{limits.size:,} — fix model.size or the URL"
        )
    expected = limits.size if limits.size is not None else announced
    if expected is not None and expected > limits.max_bytes:
        raise ModelError(
            f"downloading {url}: {expected:,} bytes is above the download cap of {limits.max_bytes:,} bytes — "
            f"raise it with ${MAX_ENV} (e.g. {MAX_ENV}=200GiB) if the model is meant to be that large"
        )
    return expected


def _too_long(url: str, written: int, expected: int | None, limits: DownloadLimits) -> ModelError:
    if expected is not None:
        return ModelError(
            f"downloading {url}: the server sent more than the {expected:,} bytes it announced (or the scenario's "
            "model.size) — the download was stopped; check the URL and model.size"
        )
    return ModelError(
        f"downloading {url}: more than the download cap of {limits.max_bytes:,} bytes with no size announced — "
        f"set the scenario's model.size, or raise ${MAX_ENV}"
    )


def _deadline(url: str, written: int, limits: DownloadLimits) -> ModelError:
    return ModelError(f"downloading {url}: the time allowed ran out after {written:,} bytes — {limits.deadline_fix}")
