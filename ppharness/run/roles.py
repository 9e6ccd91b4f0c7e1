"""Roles bound to keys: a message counts only from the member whose role sends it.

The transport authenticates its peers: the sender address a message arrives with is bound to the key it came with
(on ZeroMQ the address carries the CURVE key the message was authenticated with, on iroh the address is the node's
key), so a member can name no address but its own. What a message claims (``stage=4``, being the answer) is checked
against that address here:

- the orchestrator takes a response and a streamed token only from the address ``pp-exit`` holds in the seed's
  directory (or held before a failover replaced it), and an Error, Ready, Heartbeat, Stopped or report of member
  ``k`` only from the address member ``k`` holds now (a spare that replaced it holds it after
  ``Directory.replace``); anything else is dropped with a log line;
- a node takes the directory (``Members``) only from the seed (``SEED_ADDR``), and only one that names every address
  the node needs (``needed_names``); at start and after a failover alike.

A Join is the one message taken before the directory exists: it must name the address it came from
(``join_refusal``), and one address joins as one stage (``Directory``). Which stage a key was made for is not checked
(a transport's keys carry no stage): a member's key that joins first under another stage's index takes that index,
and the real node's Join then fails the run. Dropped messages are logged a bounded number of times (``DropLog``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ppharness.plan.stages import ENTRY, EXIT, StagePlan, stage_name
from ppharness.wire.messages import (
    ClockReply,
    DigestReport,
    Error,
    Heartbeat,
    InferenceResponse,
    Join,
    Members,
    Message,
    Ready,
    Stopped,
    StreamedToken,
    TraceReport,
)

if TYPE_CHECKING:
    from ppharness.run.cluster import Directory

MAX_DROP_LINES = 16  # dropped messages logged one line each; later ones are counted


def member_name(index: int, num_stages: int) -> str:
    """A member of the run as its lines name it: ``stage i`` on the loop, ``expert node k`` after it (an expert node's
    index follows the stages')."""
    return f"stage {index}" if index < num_stages else f"expert node {index - num_stages}"


class DropLog:
    """Log lines about dropped messages, bounded: the first ``limit`` in full, then a count at every power of ten, so
    a member that floods the run with forgeries cannot flood its log."""

    def __init__(self, log: Callable[[str], None], limit: int = MAX_DROP_LINES):
        self.log, self.limit = log, limit
        self.dropped = 0

    def __call__(self, line: str) -> None:
        self.dropped += 1
        n = self.dropped
        if n <= self.limit:
            self.log(line + ("" if n < self.limit else "; further drops are counted, not logged"))
        elif str(n).rstrip("0") == "1":
            self.log(f"{n} messages dropped so far (the first {self.limit} are logged above)")


EXIT_ROLE = -1  # the role of the answer (responses, streamed tokens): whichever stage pp-exit names


def claimed_role(msg: Message) -> int | None:
    """The member ``msg`` speaks for: its index (an Error, Ready, Heartbeat, Stopped or report of that member),
    ``EXIT_ROLE`` for the answer; None for a message checked where it is taken (a Join; an Ack, which the outbox
    settles only from where its message went)."""
    match msg:
        case InferenceResponse() | StreamedToken():
            return EXIT_ROLE
        case Error() | Ready() | Heartbeat() | Stopped() | ClockReply() | TraceReport() | DigestReport():
            return msg.stage
    return None


def holder(role: int, directory: Directory | None) -> str | None:
    """The address that holds ``role`` in the seed's directory now (None: nobody, or no directory yet)."""
    if directory is None:
        return None
    if role == EXIT_ROLE:
        return directory.names.get(EXIT)
    join = directory.joins.get(role)
    return join.address if join is not None else None


class Roles:
    """The orchestrator's check of every message against the role its sender holds (module docstring). ``directory``
    gives the seed's directory now (None before the nodes joined: then no member's message is taken)."""

    def __init__(self, directory: Callable[[], Directory | None], log: Callable[[str], None]):
        self.directory = directory
        self.drop = DropLog(log)
        # addresses that held pp-exit before a spare replaced them (``ppharness.run.failover``): a request they
        # finished before their replacement was ready has no other answer coming, so their answers still count
        self.former_exits: set[str] = set()

    def admits(self, sender: str, msg: Message) -> bool:
        """Whether ``msg`` came from the member whose role sends it; a message that did not is logged (bounded)."""
        role = claimed_role(msg)
        if role is None:
            return True
        directory = self.directory()
        address = holder(role, directory)
        if sender == address or (role == EXIT_ROLE and sender in self.former_exits):
            return True
        if role == EXIT_ROLE:
            who = "the exit stage (pp-exit)"
        else:
            who = member_name(role, directory.num_stages) if directory is not None else f"member {role}"
        held = f"its address is {address[:120]}" if address else "it has not joined"
        self.drop(f"warning: dropped {type(msg).__name__} from {sender[:120]}: only {who} sends it ({held})")
        return False

    def screen(self, sender: str, msg: Message) -> bool:
        """A session screen: True (taken out) for a message its sender's role does not send."""
        return not self.admits(sender, msg)


def join_refusal(sender: str, msg: Join) -> str:
    """Why a Join is not taken ('' when it is): it must name the address it came from, the one its key holds."""
    if msg.address == sender:
        return ""
    return (
        f"warning: ignored a Join of stage {msg.stage} from {sender[:120]} naming another address ({msg.address[:120]})"
    )


def needed_names(plan: StagePlan) -> list[str]:
    """The names a node cannot serve without: a stage's neighbours (as its program routes them), pp-entry and
    pp-exit; an expert node's owners (the stages whose blocks it answers for)."""
    if plan.role == "experts":
        return sorted(set(plan.owners.values()))
    names = [ENTRY, EXIT]
    if plan.stage > 0:
        names.append(plan.prev or stage_name(plan.stage - 1))
    if plan.stage < plan.num_stages - 1:
        names.append(plan.next or stage_name(plan.stage + 1))
    return names


def members_refusal(sender: str, msg: Members, seed: str, needed: list[str]) -> str:
    """Why a node does not take a directory ('' when it does): it is not the seed's, or it lacks a name the node
    needs."""
    if sender != seed:
        return f"dropped Members from {sender[:120]}: only the seed ({seed[:120]}) sends the directory"
    missing = [name for name in needed if name not in msg.names]
    if missing:
        return (
            f"refused the seed's directory of epoch {msg.epoch}: it names no address for {', '.join(missing)}, "
            "which this node needs"
        )
    return ""
