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
  the node needs, at start and after a failover alike (``ppharness.run.node.members``).

A Join is the one message taken before the directory exists: it must name the address it came from, and come with
the key the seed made for the member it announces (``Identities``): a member cannot join as another stage, an expert
node or a standby spare, so a spare's Warm and Assign go only to the key made for that spare. Dropped messages go to
the process's one bounded drop log (``ppharness.trace.drops``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ppharness.plan.stages import EXIT
from ppharness.trace.drops import DropLog, fingerprinted
from ppharness.wire.messages import (
    ClockReply,
    DigestReport,
    Error,
    Heartbeat,
    InferenceResponse,
    Join,
    Message,
    Ready,
    Stopped,
    StreamedToken,
    TraceReport,
)

if TYPE_CHECKING:
    from ppharness.run.seed.directory import Directory
    from ppharness.seams.transport import JsonObject


def member_name(index: int, num_stages: int) -> str:
    """A member of the run as its lines name it: ``stage i`` on the loop, ``expert node k`` after it (an expert node's
    index follows the stages')."""
    return f"stage {index}" if index < num_stages else f"expert node {index - num_stages}"


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
        # addresses that held pp-exit before a spare replaced them (``ppharness.run.seed.failover``): a request they
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
        held = f"its address is {fingerprinted(address)}" if address else "it has not joined"
        line = f"warning: dropped {type(msg).__name__} from {fingerprinted(sender)}: only {who} sends it ({held})"
        self.drop(line, f"{type(msg).__name__} not its role's", sender)
        return False

    def screen(self, sender: str, msg: Message) -> bool:
        """A session screen: True (taken out) for a message its sender's role does not send."""
        return not self.admits(sender, msg)


def join_refusal(sender: str, msg: Join) -> str:
    """Why a Join is not taken ('' when it is): it must name the address it came from, the one its key holds."""
    if msg.address == sender:
        return ""
    return (
        f"warning: ignored a Join of stage {msg.stage} from {fingerprinted(sender)} naming another address "
        f"({fingerprinted(msg.address)})"
    )


def member_role(index: int) -> str:
    """The role a Join of member ``index`` (a stage, or an expert node after the stages) announces."""
    return f"member {index}"


def spare_role(device: str) -> str:
    """The role a standby spare's Join announces (its one name)."""
    return f"spare:{device}"


class Identities:
    """Which member each key of the run was made for: the seed makes one key per member (``plan_endpoints``) and
    records here which role it made it for (``give``); a Join then counts only from the key made for the member it
    announces, a stage, an expert node or a spare. A spare that takes over a stage takes that stage's role with its
    own key. A transport without identities (its endpoints share one process) binds nothing."""

    def __init__(
        self,
        identity: Callable[[JsonObject], str] = lambda opts: "",
        identity_of: Callable[[str], str] = lambda address: "",
    ):
        self.identity, self.identity_of = identity, identity_of  # the transport's (``Transport.identity``); none
        self.made: dict[str, str] = {}  # role -> the identity made for it

    def give(self, role: str, opts: JsonObject) -> None:
        """``role`` is the member whose endpoint has the transport options ``opts`` from now on."""
        identity = self.identity(opts)
        if identity:
            self.made[role] = identity

    def refusal(self, sender: str, msg: Join) -> str:
        """Why ``msg`` is not taken from ``sender`` ('' when it is): it names another address, or the key it came with
        is not the one made for the member it announces."""
        why = join_refusal(sender, msg)
        if why or not self.made:
            return why
        role = msg.names[0] if msg.stage < 0 and msg.names else member_role(msg.stage)  # a spare's name is its role
        shown = f"standby {role}" if msg.stage < 0 else f"stage {msg.stage}"
        want = self.made.get(role)
        if want is not None and self.identity_of(sender) == want:
            return ""
        made = "the run made no member for it" if want is None else "the run made another key for it"
        return f"warning: ignored a Join as {shown} from {fingerprinted(sender)}: {made}"
