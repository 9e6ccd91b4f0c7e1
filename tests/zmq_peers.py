"""A plain pyzmq PUSH socket aimed at a ppharness ZeroMQ endpoint: how the tests play members, impostors and
strangers without going through ZmqTransport."""

from __future__ import annotations

import zmq
from zmq.utils import z85

from transports.zmq import split_address


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
