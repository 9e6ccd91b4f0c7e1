"""Co-located stages: several consecutive stages of a chain driven by one process, on one thread.

A plan may place consecutive stages on one device (``ppharness.plan.lang.check``); the run starts one ``pp-node`` for
them (``PP_GROUP``: each member's node contract, ``ppharness.run.seed.realise``). Every member keeps what a node of its
own has: its own endpoint of the run's transport (its own address and key, so the seed, the roles and membership see
the stages they always saw), its Join, Ready and Stopped, its trace and digests. What changes is the way between them:

- **the hand-over**: a member's messages to another member go through ``LocalEndpoint``, which puts the message
  object, and an activation's hidden state as a handle (``Received.tensor``), in the group's mail: no codec, no
  socket, no host copy where the value is on a device. A hop whose wire dtype is not ``f16`` is packed and unpacked
  all the same, so that the next stage gets the very bits a separate process would; a message to anyone else leaves
  by the member's own transport, packed there.
- **one loop**: ``GroupInbox`` turns the group's mail and every member's transport into one stream of messages, so
  one ``ppharness.run.loop.Loop`` runs every member's timers and steps: a decode token crosses the whole group in one
  turn of it, without waking another thread or process.

The members' set-up (join, load, the directory, Ready) runs phase by phase for all of them, since the seed sends its
directory once every member joined. A failure of any member ends the group: every member reports it and the process
exits 1, as a node does.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from ppharness.errors import HarnessError, PlanError, TransportTimeout
from ppharness.model.engine.slicing import ModelSlice
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.sources.files import resolve_model
from ppharness.network.clock import EventClock
from ppharness.plan.stages import StagePlan, decode_program
from ppharness.run.loop import Loop
from ppharness.run.node.env import GROUP_ENV, make_transport, read_network
from ppharness.run.node.env import node_log as _log
from ppharness.run.node.node import Node, Orphaned, Standing, node_loop
from ppharness.seams.transport import Received, Sent, Transport
from ppharness.trace.tracer import now_ns
from ppharness.wire import codec
from ppharness.wire.messages import Message

if TYPE_CHECKING:
    from ppharness.model.engine.hidden import Hidden

MAX_MEMBERS = 64
SLICE_S = 0.002  # the longest the loop waits on the first member's transport before it looks at the others'


class Mail:
    """The group's own mail: (member index, message as received), in the order members sent it."""

    def __init__(self) -> None:
        self.items: deque[tuple[int, Received]] = deque()
        self.addresses: dict[str, int] = {}  # a member's address -> its index

    def member_at(self, address: str) -> int | None:
        return self.addresses.get(address)


class LocalEndpoint(Transport):
    """A member's endpoint: its own transport for the world, the group's mail for the other members."""

    kind = "local"

    def __init__(self, inner: Transport, mail: Mail) -> None:
        self.inner, self.mail = inner, mail

    def start(self) -> str:
        address = self.inner.start()
        self.mail.addresses[address] = len(self.mail.addresses)
        return address

    @property
    def address(self) -> str:
        return self.inner.address

    def send(self, address: str, msg: Message, tensor: Hidden | None = None) -> Sent:
        """To a member: the message object and the handle, into the group's mail; to anyone else: packed and sent by
        the member's own transport."""
        member = self.mail.member_at(address)
        if member is None:
            return self.inner.send(address, msg, tensor)
        t0 = now_ns()
        if tensor is not None and (getattr(msg, "dtype", "") != "f16" or tensor.dtype != "float16"):
            # a wire dtype that rounds (or widens): the next stage gets what the codec would have given it
            msg, tensor = codec.decode(codec.encode(codec.attach(msg, tensor))), None
        self.mail.items.append((member, Received(self.address, msg, t0, t0, 0, tensor)))
        t1 = now_ns()
        return Sent(t0, t0, t1, 0)

    def send_frame(self, address: str, frame: bytes) -> None:
        self.inner.send_frame(address, frame)

    def recv_frame(self, timeout: float | None = None) -> tuple[str, bytes]:
        return self.inner.recv_frame(timeout)

    def receive(self, timeout: float | None = None) -> Received:
        return self.inner.receive(timeout)

    def close(self) -> None:
        self.inner.close()


class GroupInbox:
    """Every member's mail as one stream: the group's own first, then each member's transport (the first member's,
    which the chain's traffic into the group reaches, waited on; the others' looked at between waits).
    ``member`` is the index of the member the last message returned is for."""

    def __init__(self, mail: Mail, endpoints: list[LocalEndpoint]) -> None:
        self.mail, self.endpoints = mail, endpoints
        self.member = 0
        self._next = 1  # the member whose transport is looked at first, turn by turn

    def receive(self, timeout: float | None = None) -> Received:
        end = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while True:
            if self.mail.items:
                self.member, rx = self.mail.items.popleft()
                now = now_ns()  # the hand-over's cost, as a hop's: from its send until a member takes it
                return rx._replace(arrived_ns=now, decoded_ns=now)
            n = len(self.endpoints)
            for k in range(n - 1):
                i = 1 + (self._next - 1 + k) % (n - 1)
                try:
                    rx = self.endpoints[i].receive(0)
                except TransportTimeout:
                    continue
                self._next = 1 + i % (n - 1)
                self.member = i
                return rx
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise TransportTimeout("nothing arrived for the group's members")
            try:
                rx = self.endpoints[0].receive(SLICE_S if left is None else min(SLICE_S, left))
            except TransportTimeout:
                continue
            self.member = 0
            return rx


def read_group(env: dict[str, str]) -> list[tuple[StagePlan, dict[str, str]]]:
    """The members' programs and environments from ``PP_GROUP`` (consecutive stages of one plan)."""
    try:
        members = msgspec.json.decode(env[GROUP_ENV], type=list[dict[str, str]])
    except msgspec.DecodeError as exc:
        raise HarnessError(f"{GROUP_ENV} is not a JSON list of member environments: {exc}") from exc
    if not 0 < len(members) <= MAX_MEMBERS:
        raise HarnessError(f"{GROUP_ENV} names {len(members)} members; a group has 1 to {MAX_MEMBERS}")
    out = []
    for extra in members:
        member_env = {k: v for k, v in env.items() if k != GROUP_ENV} | extra
        plan = decode_program(member_env.get("PLAN", ""))
        out.append((plan, member_env))
    stages = [p.stage for p, _ in out]
    if stages != list(range(stages[0], stages[0] + len(stages))) or any(p.role != "stage" for p, _ in out):
        raise PlanError(f"{GROUP_ENV}: a group runs consecutive stages, not {stages}")
    return out


def serve_group(env: dict[str, str]) -> int:
    """Serve the co-located stages ``PP_GROUP`` names until each has had its Shutdown (0); any failure is reported
    by every member and ends the group (1)."""
    try:
        members = read_group(env)
    except HarnessError as exc:
        _log(env.get("STAGE", "group"), f"failed: {exc}")
        return 1
    label = f"{members[0][0].stage}-{members[-1][0].stage}"

    def log(text: str) -> None:
        _log(label, text)

    mail = Mail()
    nodes: list[Node] = []
    endpoints: list[LocalEndpoint] = []
    try:
        for plan, member_env in members:
            network = read_network(member_env)
            if network is not None and network.layer == "packet":
                raise HarnessError("co-located stages run on the message layer of the network emulation only")
            clock = EventClock()
            endpoint = LocalEndpoint(make_transport(member_env["TRANSPORT"], member_env, network, clock), mail)
            address = endpoint.start()
            endpoints.append(endpoint)
            nodes.append(Node(plan, member_env, Standing(endpoint, address, clock, None), _member_log(plan.stage)))
    except HarnessError as exc:
        log(f"failed: could not start the members' transports: {exc}")
        for endpoint in endpoints:
            endpoint.close()
        return 1
    try:
        return _run(nodes, GroupInbox(mail, endpoints), log)
    finally:
        for node in nodes:
            node.close()


def _member_log(stage: int) -> Callable[[str], None]:
    return lambda text: _log(stage, text)


def _run(nodes: list[Node], inbox: GroupInbox, log: Callable[[str], None]) -> int:
    """The members' phases in step (join, load, the directory and Ready), then one loop for all of them."""
    try:
        for node in nodes:
            node._join()
        shared = None if any(n.fault == "bad-model" for n in nodes) else GGUFFile(resolve_model(nodes[0].env["MODEL"]))
        loaded = []
        for node in nodes:
            node.gguf_file = shared
            loaded.append(node.load())
        for k, (node, got) in enumerate(zip(nodes, loaded, strict=True)):
            if k < len(nodes) - 1 and isinstance(got[0], ModelSlice) and not got[0].batched:
                # the next stage is here: its input stays on the device (ppharness.model.engine.hidden)
                got[0].device_out = True
            node.ready(*got)
        loop = Loop(inbox, log)
        loop.checks.extend(node_loop(nodes[0].transport, log, os.getppid()).checks)
        for node in nodes:
            loop.timers.extend(node.loop.timers)
            loop.workers.extend(node.loop.workers)
            loop.drain = max(loop.drain, node.loop.drain)
        down: set[int] = set()

        def dispatch(k: int, sender: str, msg: Message, rx: Received | None) -> bool:
            if k not in down and nodes[k]._on_message(sender, msg, rx):
                down.add(k)
                nodes[k].stopped()
            return len(down) == len(nodes)

        for k, node in enumerate(nodes):  # what came for a member while the others were still setting up
            early = list(node.loop.mail)
            node.loop.mail.clear()
            if any([dispatch(k, *item) for item in early]):
                return 0
        log(f"serving stages {', '.join(str(n.plan.stage) for n in nodes)} in one process")
        loop.wait(lambda *got: dispatch(inbox.member, *got), None, "a Shutdown from the orchestrator for every member")
        return 0
    except Orphaned:
        log("the process that started this node is gone; exiting")
        return 1
    except HarnessError as exc:
        for node in nodes:
            node.fail(exc)
        return 1
