"""Failover: a dead stage replaced by a spare device while the run goes on (policy ``failover``).

The spare starts in a new membership epoch (or a standby node on it takes the dead stage's program), joins, loads the
stage's blocks and reports Ready; every node then gets the new directory, the dead node's address is fenced off (a
paused node that comes back is not heard again), and the request in progress goes on: the stages replay to their new
neighbour themselves, and a new stage 0 is handed the request with the tokens streamed so far (``Resume``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from ppharness.errors import ClusterError, HarnessError, WaitTimedOut
from ppharness.model.gguf_file import GGUFFile
from ppharness.plan.stages import stage_name
from ppharness.run.seed.realise import gossip_name, replacement
from ppharness.run.seed.replan import Placed, stage_need, survivor
from ppharness.run.seed.roles import member_role
from ppharness.wire.messages import Ack, Assign, InferenceResponse, Join, Members, Message, Ready, StreamedToken, Warm

if TYPE_CHECKING:
    from collections.abc import Callable

    from ppharness.model.text.tokenizer import Tokenizer
    from ppharness.plan.lang.document import Device, PlanDoc
    from ppharness.plan.stages import StagePlan
    from ppharness.run.seed.client import Client
    from ppharness.run.seed.session import Death, OnMessage, Session
    from ppharness.seams.transport import JsonObject


@dataclass
class Recovery:
    """One dead stage replaced by a spare (policy failover), on the orchestrator's monotonic clock: when the death
    was detected, when the spare had loaded its blocks (Ready), and when the next token reached the client."""

    stage: int
    cause: str
    spare: str  # the device id
    epoch: int
    detected_at: float
    ready_at: float = 0.0
    load_s: float = 0.0  # the spare's own report: loading and compiling its blocks
    next_token_at: float | None = None  # None: no token came after it (the request had finished)
    replanned: bool = False  # no spare was left: the stage was re-placed on a surviving device

    @property
    def reload_s(self) -> float:
        """Detection to the spare's Ready: starting it, loading, compiling."""
        return self.ready_at - self.detected_at

    @property
    def replay_s(self) -> float | None:
        """The spare's Ready to the next token at the client: the replay and the token's way round (None: no token
        came after it)."""
        return self.next_token_at - self.ready_at if self.next_token_at is not None else None


WARM_ANSWER_S = 5.0  # a standby that has not answered a Warm by then is a failed spare


class SpareLost(ClusterError):
    """The spare coming up for a dead stage died too."""

    def __init__(self, death: Death) -> None:
        super().__init__(f"the spare for {stage_name(death.stage)} {death.cause}")
        self.death = death


def no_spare(err: ClusterError, used: int) -> ClusterError:
    err.add_note(
        f"no spare device is left to replace it (policy failover; {used} replacement(s) so far) — name more spares "
        "in the plan (placement.spares) or the scenario (fault_tolerance.spares)"
    )
    return err


def holdable(doc: PlanDoc, spare: Device, programs: list[StagePlan]) -> list[StagePlan]:
    """The stages a warm standby on ``spare`` holds: in stage order, each whose weights and KV cache
    (``ppharness.run.seed.replan.stage_need``) still fit in the device's memory (less its reserve) beside the ones
    before it."""
    room, held = spare.memory - spare.reserve, []
    for program in programs:
        need = stage_need(doc, program)
        if program.role == "stage" and program.experts is None and need <= room:
            held.append(program)
            room -= need
    return held


class Failover:
    """Replaces dead stages by the session's spares; the membership epoch, the fenced-off addresses and the
    recoveries so far. ``on_deaths`` is the session's death policy, ``fence`` one of its screens."""

    def __init__(self, session: Session, client: Client):
        self.session, self.client = session, client
        self.epoch = 0
        self.recoveries: list[Recovery] = []
        self.fenced: set[str] = set()  # addresses of replaced nodes
        # addresses that held pp-exit before a spare replaced them: their answers still count (``fence``; the
        # session's check of roles shares the set)
        self.former_exits: set[str] = session.roles.former_exits
        self._replacing = ""  # the instance id of the spare coming up, while one does
        self._tokenizer: Tokenizer | None = None
        self._bos: int | None = None
        self._warm_lengths: set[int] = set()  # prompt lengths the standbys have their prefill compiled for
        self.hosting: dict[int, Device] = {}  # the device of each stage that was replaced
        self.lost: set[str] = set()  # devices of replaced stages, not used again
        self._fenced_seen: set[str] = set()

    def fence(self, sender: str, msg: Message) -> bool:
        """A replaced node that came back: nothing it says counts (True: the message is taken out), but for the
        answer of a former exit stage. A last stage declared dead that was only slow can finish the request before
        its spare is ready; the stages before it then hold nothing to replay, so its answer (exact: the stages fed
        it the request's own activations) is the only one that will come."""
        if sender not in self.fenced:
            return False
        if sender in self.former_exits and isinstance(msg, InferenceResponse | StreamedToken):
            return False
        key = f"{sender}|{type(msg).__name__}"
        if key not in self._fenced_seen:
            self._fenced_seen.add(key)
            self.session.progress(f"fenced off a {type(msg).__name__} from a replaced node ({sender[:60]})")
        return True

    def warm(self, prompts: list[str] | None = None) -> None:
        """Warm every standby (``ppharness.run.node.standby``) and wait until each says it is: once the run is ready,
        with the programs of the stages its device can hold; before each request whose prompt length is new to
        them, with that length. The wait is part of being ready: a failover then loads nothing and its replay
        compiles nothing. A standby that does not answer within the ready budget is left cold, with a warning."""
        s = self.session
        if s.policy != "failover" or s.transport is None:
            return
        lengths: list[int] = []
        if prompts is not None:
            lengths = sorted({self._prompt_length(p) for p in prompts} - self._warm_lengths - {0})
            if not lengths:
                return
            self._warm_lengths.update(lengths)
        waiting: set[str] = set()
        at_stages = [j.address for j in s.directory.joins.values() if j.stage < s.plan.num_stages] if lengths else []
        for address in at_stages:  # the stages compile that length's prefill too: a fault never waits on it
            try:
                s.transport.send(address, Warm(lengths=lengths))
                waiting.add(address)
            except HarnessError as exc:
                s.progress(f"warning: could not warm {address[:60]}: {exc}")
        for device, sb in s.standbys.items():
            if not sb.address:
                continue
            programs: list[str] = []
            if prompts is None:
                spare = s.plan_doc.cluster.device(device)
                stages = [self._program(k, spare) for k in range(s.plan.num_stages)]
                programs = [msgspec.json.encode(p).decode() for p in holdable(s.plan_doc, spare, stages)]
            try:
                s.transport.send(sb.address, Warm(programs=programs, lengths=lengths))
                waiting.add(sb.address)
            except HarnessError as exc:  # a standby that cannot be reached is found out when it is needed
                s.progress(f"warning: could not warm the standby on {device}: {exc}")

        def warm() -> bool:  # a node replaced meanwhile is no longer waited for
            waiting.intersection_update(
                [sb.address for sb in s.standbys.values()] + [j.address for j in s.directory.joins.values()]
            )
            return not waiting

        answered: set[str] = set()

        def on_ack(sender: str, msg: Message) -> bool:
            if isinstance(msg, Ack) and msg.kind in ("warming", "warm"):
                answered.add(sender)
                if msg.kind == "warm":
                    waiting.discard(sender)
            return warm()

        if waiting:
            t0 = time.monotonic()
            waiting -= self._silent_standbys(on_ack, answered, warm)
            suffix = f" for prompts of {', '.join(map(str, lengths))} tokens" if lengths else ""
            what = ("the stages and " if lengths else "the ") + "standby spares to warm up" + suffix
            try:
                s.wait(on_ack, s.scenario.budget.ready_s, what, "warming the standbys", done=warm)
            except WaitTimedOut:
                s.progress(f"warning: {len(waiting)} node(s) did not warm up in time; they stay cold")
                return
            s.progress(
                f"{'stages and ' if lengths else ''}standby spare(s) warm{suffix} in {time.monotonic() - t0:.2f} s"
            )

    def _silent_standbys(self, on_ack: OnMessage, answered: set[str], warm: Callable[[], bool]) -> set[str]:
        """A standby answers a Warm at once (``Ack(kind="warming")``) and again when it is warm: one that has not
        answered within ``WARM_ANSWER_S`` is a failed spare, destroyed now and started afresh if a stage dies. The
        addresses of those destroyed."""
        s = self.session
        told = {sb.address: device for device, sb in s.standbys.items() if sb.address}
        try:
            s.wait(
                on_ack,
                WARM_ANSWER_S,
                "the standby spares to answer the warm-up",
                "warming the standbys",
                done=lambda: warm() or set(told) <= answered,
            )
        except WaitTimedOut:
            pass
        silent = set()
        for address, device in told.items():
            sb = s.standbys.get(device)
            if address in answered or sb is None or sb.address != address:
                continue
            silent.add(address)
            del s.standbys[device]
            s.retired.add(sb.instance.id)
            assert s.provider is not None
            s.provider.destroy(sb.instance)
            s.progress(
                f"warning: the standby on spare {device} did not answer its warm-up within {WARM_ANSWER_S:g} s; "
                "it is treated as failed (destroyed, and started afresh if a stage dies)"
            )
        return silent

    def _program(self, stage: int, spare: Device) -> StagePlan:
        s = self.session
        node = replacement(s.scenario, s.compiled, s.endpoints, stage, spare, self.epoch + 1, {}, s.trace_on)
        assert node.program is not None
        return node.program

    def _prompt_length(self, prompt: str) -> int:
        """The prompt's length in tokens as stage 0 counts it (its beginning-of-sequence token included); 0 when the
        model file has no tokenizer here."""
        s = self.session
        if self._tokenizer is None:
            gguf = GGUFFile(s.model_path)
            self._tokenizer, self._bos = gguf.tokenizer, gguf.config.bos_id
        return len(self._tokenizer.encode(prompt)) + (self._bos is not None)

    def token_arrived(self) -> None:
        """A new token reached the client: the first after a spare's Ready ends that recovery's replay."""
        for r in self.recoveries:
            if r.next_token_at is None and r.ready_at:
                r.next_token_at = time.monotonic()

    def on_deaths(self, deaths: list[Death], phase: str) -> list[Death]:
        """Deal with what it can of ``deaths``: a lost standby, a dead stage replaced (policy failover, once the run
        is ready); returns those that end the run."""
        for d in [d for d in deaths if d.stage < 0 and d.instance is not None]:
            if d.instance is not None and d.instance.id == self._replacing:
                raise SpareLost(d)
            self._standby_lost(d)
        deaths = [d for d in deaths if d.stage >= 0]
        if not deaths:
            return []
        if self.session.policy == "failover" and self.session.ready and not self._replacing:
            for death in deaths:
                self.replace(death, phase)
            return []
        if self._replacing:  # another death while a spare comes up waits for it, unless it is that spare's
            mine = [d for d in deaths if d.instance is not None and d.instance.id == self._replacing]
            if mine:
                raise SpareLost(mine[0])
            return []
        return deaths

    def _standby_lost(self, death: Death) -> None:
        """A standby spare exited before it was needed: its device is started afresh if a stage dies."""
        assert death.instance is not None
        self.session.retired.add(death.instance.id)
        for device, sb in list(self.session.standbys.items()):
            if sb.instance.id == death.instance.id:
                del self.session.standbys[device]
                self.session.progress(
                    f"warning: the standby on spare {device} {death.cause}; it is started afresh if needed"
                )

    def _survivor(self, death: Death, phase: str) -> tuple[Device, JsonObject]:
        """No spare is left: the surviving device that can hold the dead stage (``ppharness.run.seed.replan``) and a
        member identity the run kept for it; the run's error, with the reason, when there is none."""
        s = self.session
        assert s.provider is not None
        why = ""
        if not s.provider.colocates:
            why = f"the {s.provider.kind} provider cannot start a node beside another on a device"
        elif not s.scenario.fault_tolerance.replan:
            why = "the scenario says fault_tolerance.replan: false"
        elif not s.reserve_opts:
            why = "every member identity kept for re-placed stages is used"
        else:
            hosting = self._hosting()
            programs = {k: self._program(k, device) for k, device in hosting.items()}
            placed = survivor(s.plan_doc, programs, hosting, death.stage, self.lost | {hosting[death.stage].id})
            if isinstance(placed, Placed):
                return placed.device, s.reserve_opts.pop(0)
            why = placed
        err = no_spare(s.death_error(death, phase), len(self.recoveries))
        err.add_note(f"and the stage could not be re-placed on a surviving device: {why}")
        raise err

    def _hosting(self) -> dict[int, Device]:
        """The device each stage of the loop runs on now."""
        devices = self.session.compiled.devices
        return {k: self.hosting.get(k, devices[k]) for k in range(self.session.plan.num_stages)}

    def _send_members(self, address: str, members: Members) -> None:
        """A newer directory, resent until the node acknowledges it (failover is a reliable policy): a node that
        missed it would go on talking to the replaced one."""
        assert self.session.outbox is not None
        self.session.outbox.put(("members", address, members.epoch), address, members)

    def replace(self, death: Death, phase: str) -> None:
        """Replace the dead ``death.stage`` by the first spare device: start it in a new epoch, wait for its Join and
        Ready, hand every node the new directory (the dead node's address is fenced off), and resume the request in
        progress where the replaced stage was stage 0 (the others replay to their new neighbour themselves)."""
        s = self.session
        assert s.provider is not None and s.transport is not None and s.detector is not None
        stage, progress = death.stage, s.progress
        detected = time.monotonic()
        if s.spares:
            spare = s.spares.pop(0)
            opts, replanned = s.spare_opts[spare.id], False
        else:
            spare, opts = self._survivor(death, phase)
            replanned = True
        self.lost.add(self._hosting()[stage].id)
        self.epoch += 1
        epoch = self.epoch
        old = s.directory.joins[stage].address
        self.fenced.add(old)
        if stage == s.plan.num_stages - 1:
            self.former_exits.add(old)
        if death.instance is not None:
            s.retired.add(death.instance.id)
        s.detector.forget(stage)  # declared dead once; the spare is watched from its Join
        taker = f"surviving device {spare.id} (no spare left)" if replanned else f"spare {spare.id}"
        progress(
            f"failover: {stage_name(stage)} {death.cause} while {phase}; {taker} takes blocks "
            f"{list(s.plan.ranges[stage])} (epoch {epoch})"
        )
        recovery = Recovery(stage, death.cause, spare.id, epoch, detected_at=detected, replanned=replanned)
        s.identities.give(member_role(stage), opts)  # the stage's role is the spare's key's from now on
        node = replacement(s.scenario, s.compiled, s.endpoints, stage, spare, epoch, opts, s.trace_on)
        sb = None if replanned else s.standbys.pop(spare.id, None)
        try:
            if sb is not None and sb.address:  # the standby takes the stage's program
                assert node.program is not None
                program = msgspec.json.encode(node.program).decode()
                s.transport.send(sb.address, Assign(program=program, gossip_name=node.env.get("PP_GOSSIP_NAME", "")))
                inst = sb.instance
            else:  # no standby ready: the spare device gets a node of its own now
                if sb is not None:
                    s.retired.add(sb.instance.id)
                    s.provider.destroy(sb.instance)
                name = (  # a name no other node had
                    f"pp-replaced-{stage}-{epoch}"
                    if replanned
                    else f"pp-spare-{s.plan_doc.placement.spares.index(spare.id)}"
                )
                spec = s.provider.spec(name, node.env, **node.options)
                (inst,) = s.provider.provision([spec])
            self._replacing = inst.id
            s.stage_instances[stage], s.instance_stages[inst.id] = inst, stage
            joined: list[Join] = []

            def on_join(sender: str, msg: Message) -> bool:
                if (
                    isinstance(msg, Join)
                    and msg.stage == stage
                    and sender not in self.fenced
                    and s.join_ok(sender, msg)
                ):
                    joined.append(msg)
                return bool(joined)

            budget = s.scenario.budget
            s.wait(on_join, budget.join_s, f"the spare for {stage_name(stage)} to join", "replacing a stage")
            s.directory.replace(joined[0])
            s.detector.replace(stage, gossip_name(stage, epoch))  # watched from its Join on, as at the start
            members = Members(names=s.directory.names, epoch=epoch)
            self._send_members(joined[0].address, members)
            ready: list[Ready] = []

            def on_ready(sender: str, msg: Message) -> bool:
                if isinstance(msg, Ready) and sender == joined[0].address:
                    ready.append(msg)
                return bool(ready)

            what = f"the spare for {stage_name(stage)} to load (Ready)"
            s.wait(on_ready, budget.ready_s, what, "replacing a stage")
        except SpareLost as lost:  # the next spare, if any, replaces the one that died coming up
            self._replacing = ""
            progress(f"failover: the spare {spare.id} for {stage_name(stage)} {lost.death.cause} before it was ready")
            return self.replace(lost.death, "replacing a stage")
        finally:
            self._replacing = ""
        self.hosting[stage] = spare
        recovery.ready_at, recovery.load_s = time.monotonic(), ready[0].load_s
        s.reports[stage].load_s = ready[0].load_s
        for j in s.directory.joins.values():
            if j.stage != stage:
                self._send_members(j.address, members)
        if s.outbox is not None:
            s.outbox.redirect()
        self.recoveries.append(recovery)
        progress(
            f"failover: {stage_name(stage)} is back on {spare.id} after {recovery.reload_s:.2f} s "
            f"(loading {recovery.load_s:.2f} s); {len(s.spares)} spare(s) left"
        )
        if stage == 0:
            self.client.resume(epoch)
