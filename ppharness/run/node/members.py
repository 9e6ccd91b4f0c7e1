"""A node learns the run's name directory (``Members``) from the seed, and only from the seed.

The seed hands out the directory (``ppharness.run.seed.directory``) once every member joined, and again after a
failover. A node takes it only from the seed's address (``SEED_ADDR``: the transport authenticated the sender), and
only one that names every address the node needs (``needed_names``): a stage's neighbours as its program routes them,
``pp-entry`` and ``pp-exit``; an expert node's owners. Anything else is refused with a line in the process's drop log
(``ppharness.trace.drops``); what else arrives while the node waits is kept for its next wait.
"""

from __future__ import annotations

from collections.abc import Callable

from ppharness.plan.stages import ENTRY, EXIT, StagePlan, stage_name
from ppharness.run.loop import Loop
from ppharness.seams.transport import Received
from ppharness.trace.drops import DropLog
from ppharness.wire.messages import Members, Message


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


def resolve_members(
    loop: Loop, timeout: float, seed: str, needed: list[str], log: Callable[[str], None]
) -> dict[str, str]:
    """Wait (bounded) for the seed's Members naming every one of ``needed``; a Members from anyone else, or one that
    lacks a needed name, is refused with a log line (bounded). What else comes meanwhile is kept, in order, for the
    node's next wait."""
    found: dict[str, str] = {}
    early: list[tuple[str, Message, Received | None]] = []
    refused = DropLog(log)

    def on_message(sender: str, msg: Message, rx: Received | None) -> bool:
        if isinstance(msg, Members):
            refusal = members_refusal(sender, msg, seed, needed)
            if refusal:
                refused(refusal)
                return False
            found.update(msg.names)
            return True
        early.append((sender, msg, rx))
        return False

    loop.wait(on_message, timeout, "the cluster's name directory (Members) from the seed")
    for sender, msg, rx in early:
        loop.push(sender, msg, rx)
    return found
