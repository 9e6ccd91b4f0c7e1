"""What the packet layer's bridge (``ppharness.network.bridge``) is made of: one directed link's shaper and counters,
socket tuning, and datagrams read with the kernel's arrival time.

A datagram's delay counts from when the kernel received it (``recv_stamped``), not from when the bridge's thread got
round to reading it: on a busy machine the thread may wake a millisecond late, and that lateness would otherwise add
to every configured delay; partitions are judged at that arrival too. Sending is only as punctual as the thread's
wake-ups: on an idle machine a fraction of a millisecond late, on a busy one (other processes on every core) up to a
few milliseconds at times. ``ppharness bench wan --calibrate`` measures it.
"""

from __future__ import annotations

import platform
import socket
import struct
import sys
import time
from typing import Any

MAX_DATAGRAM = 65_535
MAX_QUEUED = 65_536  # datagrams waiting for their due time
MAX_QUEUED_BYTES = 64 * 2**20
SOCKET_BUFFER = 4 * 2**20  # asked of the kernel for every socket (it caps this at net.core.[rw]mem_max)
RECV_BURST = 256  # datagrams read from one socket per wake-up before due sends get their turn
FD_SETSIZE = 1024  # select() takes descriptors below this only

Address = tuple[Any, ...]  # a socket address: (host, port), or (host, port, flowinfo, scope_id) for IPv6


def tune(sock: socket.socket) -> None:
    """Ask for large buffers, so that bursts wait in the kernel rather than vanish, and for receive timestamps (best
    effort)."""
    enable_timestamps(sock)
    set_buffers(sock)


def set_buffers(sock: socket.socket, size: int = SOCKET_BUFFER) -> None:
    """Ask for ``size`` bytes of receive and send buffer (best effort)."""
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, size)
        except OSError:
            pass


# --- kernel receive timestamps ------------------------------------------------------------------------------------
# Linux stamps each datagram when asked (SO_TIMESTAMPNS, wall clock, ns); Python's socket module does not name the
# option, so it is used where its number is known (the asm-generic value) and checked on the first datagram. Elsewhere,
# or if the kernel sends no stamp, the time of the read stands in.

_SO_TIMESTAMPNS = 35  # asm-generic (x86, arm, arm64, riscv, powerpc, s390); alpha, mips, parisc and sparc differ
_TIMESPEC = struct.Struct("@ll")
_ANCILLARY = socket.CMSG_SPACE(_TIMESPEC.size)
_STAMPS = sys.platform == "linux" and platform.machine().lower() in {
    "x86_64",
    "amd64",
    "i386",
    "i686",
    "aarch64",
    "arm64",
    "armv7l",
    "riscv64",
    "ppc64le",
    "ppc64",
    "s390x",
}
_MAX_STAMP_AGE_S = 1.0  # a stamp older than this (a stepped wall clock) is not believed


def enable_timestamps(sock: socket.socket) -> bool:
    """Ask the kernel to stamp every datagram ``sock`` receives; whether it agreed."""
    if not _STAMPS:
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    return True


def recv_stamped(sock: socket.socket, bufsize: int = MAX_DATAGRAM) -> tuple[bytes, Address, float]:
    """One datagram, its source, and when it arrived on ``time.monotonic()``'s clock: the kernel's stamp where
    ``enable_timestamps`` was called (and the kernel gave one), else now. Raises what ``recvmsg`` raises."""
    payload, ancillary, _, addr = sock.recvmsg(bufsize, _ANCILLARY)
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS and len(data) == _TIMESPEC.size:
            sec, nsec = _TIMESPEC.unpack(data)
            # wall clock first, then monotonic: a pause between the two reads makes the arrival later, never earlier
            age = (time.time_ns() - (sec * 1_000_000_000 + nsec)) / 1e9
            now = time.monotonic()
            if 0.0 <= age <= _MAX_STAMP_AGE_S:
                return payload, addr, now - age
            return payload, addr, now
    return payload, addr, time.monotonic()
