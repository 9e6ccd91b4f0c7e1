"""A plain pyzmq PUSH socket aimed at a ppharness ZeroMQ endpoint: how the tests play members, impostors and
strangers without going through ZmqTransport; and the members of one run, started, for the tests to talk to."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import zmq
from zmq.utils import z85

from transports.zmq import ZmqTransport, split_address


@contextmanager
def run_members(count: int = 3) -> Iterator[list[ZmqTransport]]:
    """``count`` members of one run (``plan_endpoints``: each admits the others' keys), started; closed after."""
    members = [ZmqTransport(**opts) for opts in ZmqTransport.plan_endpoints(count, {})]
    for m in members:
        m.start()
    try:
        yield members
    finally:
        for m in members:
            m.close()


def raw_push(ctx: zmq.Context, address: str, secret: bytes | None) -> zmq.Socket:
    """A PUSH socket connected to ``address`` with CURVE key ``secret`` (z85), or with no security when None."""
    endpoint, key = split_address(address)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    if secret is not None:
        push.curve_secretkey = secret
        push.curve_publickey = zmq.curve_public(secret)
        push.curve_serverkey = z85.encode(bytes.fromhex(key))
    push.connect(endpoint)
    return push
