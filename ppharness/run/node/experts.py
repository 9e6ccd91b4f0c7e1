"""Expert parallelism at run time: a MoE block's owner fans its tokens out to expert nodes and gathers the results.

Names. An expert node registers ``pp-experts-{j}`` and, for every routed expert it computes, ``moe-expert-{layer}-{e}``
(the first holder in the plan's node order) or ``moe-expert-{layer}-{e}.r{k}`` (the k-th replica). A block's owner
reads who holds what from the directory alone.

The owner's side (``ExpertParallel``, a StageModel around a ModelSlice): at each MoE block the slice yields an
``ExpertCall``; each (row, expert) pair goes to the owner's own bank when it holds that expert, else to the holder with
the fewest pairs so far in this call (ties: the first replica). One ``ExpertRequest`` per distinct expert node goes out
at once, the local pairs are computed while they are away, and the owner then waits for every ``ExpertResult`` on the
stage's loop (``ppharness.run.loop``), nested in the step that computes: whatever else arrives meanwhile goes to the
stage, which only records it. The requests go through an outbox (``ppharness.run.reliable``) whose Ack is the
ExpertResult: unanswered after ``resend_s``, a request is sent again, the waits doubling (the key (request, position,
layer) makes the copy harmless); after ``timeout_s`` the step fails.

The expert node's side (``ExpertServer``): it answers an ``ExpertRequest`` only from the member that runs that block
(by the address the transport authenticated), only for experts it holds, and keeps its last answers so that a copy
is answered with the same bytes without computing again. Its answer says how long it computed; the owner's trace
records that beside the round trip, so that an expert node keeps no trace of its own.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import numpy.typing as npt

from ppharness.errors import CodecError, HarnessError, ModelError, WaitTimedOut
from ppharness.model.engine import hidden
from ppharness.run.loop import Loop
from ppharness.run.reliable import Key, Outbox, RetryPolicy
from ppharness.seams.transport import Received, Transport
from ppharness.trace.drops import DropLog, fingerprinted
from ppharness.trace.tracer import Tracer, now_ns
from ppharness.wire import codec
from ppharness.wire.messages import ExpertRequest, ExpertResult, Message

if TYPE_CHECKING:
    from tinygrad.tensor import Tensor

    from ppharness.model.engine.expert_bank import ExpertBank
    from ppharness.model.engine.slicing import ModelSlice
    from ppharness.model.gguf.config import ModelConfig
    from ppharness.model.layers.moe import ExpertCall

_EXPERT_NAME = re.compile(r"^moe-expert-(\d+)-(\d+)(?:\.r(\d+))?$")
ANSWERS_KEPT = 256  # an expert node's last answers, to answer a copy of a request again
RESEND_MAX_S = 8.0  # the longest an owner waits between two copies of a request


R = TypeVar("R")  # what a driven step returns


def holders_of(names: dict[str, str]) -> dict[tuple[int, int], list[str]]:
    """(layer, expert) -> the addresses holding it, first replica first, read from a directory."""
    found: dict[tuple[int, int], list[tuple[int, str]]] = {}
    for name, address in names.items():
        m = _EXPERT_NAME.match(name)
        if m:
            found.setdefault((int(m[1]), int(m[2])), []).append((int(m[3] or 0), address))
    return {key: [a for _, a in sorted(v)] for key, v in found.items()}


class ExpertParallel:
    """A stage's model whose MoE blocks send their routed experts to expert nodes (see the module's docstring).

    ``loop``: the stage's loop, which the gather waits on (nested in the step that computes) and whose timers resend
    the requests; a loop of its own over ``transport`` when none is given."""

    def __init__(
        self,
        model: ModelSlice,
        transport: Transport,
        names: dict[str, str],
        plan_id: str,
        wire_dtype: str = "f16",
        log: Callable[[str], None] = print,
        tracer: Tracer | None = None,
        resend_s: float = 1.0,
        timeout_s: float = 60.0,
        loop: Loop | None = None,
    ):
        self.model, self.transport, self.plan_id, self.wire_dtype = model, transport, plan_id, wire_dtype
        self.log, self.tracer, self.resend_s, self.timeout_s = log, tracer, resend_s, timeout_s
        self.loop = loop if loop is not None else Loop(transport, log)
        # resent after resend_s, doubling up to RESEND_MAX_S; the step fails after timeout_s (the wait's), not before
        retry = RetryPolicy(first_s=resend_s, min_s=resend_s, max_s=RESEND_MAX_S, budget_s=2 * timeout_s, jitter=0.0)
        self.outbox = Outbox(transport.send, lambda address: address, retry, on_resend=self._resending)
        self.loop.add_timer(self.outbox)
        self.request_id, self.step_index, self.epoch, self.layer = "", 0, 0, -1
        self.late = 0  # results that came after their step was done (copies of answered requests)
        self.holders: dict[tuple[int, int], list[str]] = {}
        self.node_of: dict[str, str] = {}
        self.set_directory(names)

    # --- StageModel -------------------------------------------------------------------------------------------------

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def max_context(self) -> int:
        return self.model.max_context

    @property
    def n_params(self) -> int:
        return self.model.n_params

    @property
    def tied_params(self) -> int:
        return self.model.tied_params

    @property
    def slots(self) -> int:
        return self.model.slots

    def prefill(self, x: list[int] | npt.NDArray[np.float16], slot: int = 0) -> npt.NDArray[np.float16] | int:
        return self._drive(self.model.prefill_step(x, slot), 0)

    def decode(
        self, x: list[int] | npt.NDArray[np.float16] | Tensor, position: int, slot: int = 0
    ) -> npt.NDArray[np.float16] | int:
        # a plan co-locates no stage that fans out to expert nodes; a device handle is taken all the same
        host = x.numpy() if hidden.left_on_device(x) else x
        if not 1 <= position < self.model.max_context:
            raise ModelError(f"position {position} is outside the context of {self.model.max_context}")
        if self.model.batched:
            return self.decode_rows([host], [position], [slot])[0]
        return self._drive(self.model.step(host, position, slot), position)

    def decode_rows(
        self,
        xs: Sequence[list[int] | npt.NDArray[np.float16]],
        positions: Sequence[int],
        slots: Sequence[int],
    ) -> list[npt.NDArray[np.float16] | int]:
        """A batched slice's ``decode_rows``, its expert calls fanned out: each expert node gets the batch's rows it
        holds experts for in one message per MoE block. The fan-out's key is the batch's first row (its request,
        from ``begin_step``, at its position)."""
        out: list[npt.NDArray[np.float16] | int] = self._drive(self.model.rows_step(xs, positions, slots), positions[0])
        return out

    def decode_window(
        self, xs: Sequence[list[int] | npt.NDArray[np.float16]], start: int, slot: int
    ) -> list[npt.NDArray[np.float16] | int]:
        """A batched slice's speculative window (``ppharness.run.stage.speculation``), its expert calls fanned out as a
        batch's are; keyed by the window's first position."""
        out: list[npt.NDArray[np.float16] | int] = self._drive(self.model.window_step(xs, start, slot), start)
        return out

    @property
    def batched(self) -> bool:
        return self.model.batched

    def begin_step(self, request_id: str, step: int) -> None:
        """What the stage is computing now: the request and the trace's step (keys and spans of the fan-out)."""
        self.request_id, self.step_index = request_id, step

    def set_directory(self, names: dict[str, str], epoch: int = 0) -> None:
        self.holders, self.epoch = holders_of(names), epoch
        self.node_of = {a: name for name, a in names.items() if name.startswith("pp-experts-")}

    # --- fan-out and gather -----------------------------------------------------------------------------------------

    def _drive(self, gen: Generator[ExpertCall, npt.NDArray[np.float16], R], position: int) -> R:
        try:
            call = next(gen)
            while True:
                call = gen.send(self._gather(call, position))
        except StopIteration as stop:
            out: R = stop.value
            return out

    def _assign(self, call: ExpertCall) -> tuple[list[tuple[int, int]], dict[str, list[tuple[int, int]]]]:
        """Each (row, slot) pair of the call -> computed here, or by which expert node (fewest pairs so far)."""
        local: list[tuple[int, int]] = []
        remote: dict[str, list[tuple[int, int]]] = {}
        bank = self.model.bank
        ids = call.routing.ids
        for t in range(ids.shape[0]):
            for j in range(ids.shape[1]):
                e = int(ids[t, j])
                if bank.holds(call.layer, e):
                    local.append((t, j))
                    continue
                holders = self.holders.get((call.layer, e))
                if not holders:
                    raise ModelError(
                        f"block {call.layer} routed a token to expert {e}, which neither this stage nor any expert "
                        "node of the directory holds"
                    )
                address = min(holders, key=lambda a: len(remote.get(a, ())))
                remote.setdefault(address, []).append((t, j))
        return local, remote

    def _gather(self, call: ExpertCall, position: int) -> npt.NDArray[np.float16]:
        t_start = now_ns()
        ids, dim = call.routing.ids, self.model.config.dim
        out = np.empty((*ids.shape, dim), dtype=np.float16)
        local, remote = self._assign(call)
        requests: dict[str, ExpertRequest] = {}
        slots: dict[str, list[tuple[int, int]]] = {}
        for address, pairs in remote.items():
            rows = sorted({t for t, _ in pairs})
            index = {t: i for i, t in enumerate(rows)}
            data, shape = codec.pack_hidden(call.hidden[rows], self.wire_dtype)
            requests[address] = ExpertRequest(
                request_id=self.request_id,
                position=position,
                layer=call.layer,
                pairs=[(index[t], int(ids[t, j])) for t, j in pairs],
                hidden=data,
                shape=shape,
                dtype=self.wire_dtype,
                plan_id=self.plan_id,
                epoch=self.epoch,
            )
            slots[address] = pairs
        self.layer = call.layer
        sent_ns: dict[str, int] = {}
        keys: dict[str, Key] = {}
        for address, req in requests.items():
            sent_ns[address] = now_ns()
            keys[address] = (f"experts {call.layer}", f"{self.request_id} to {address}", position)
            self.outbox.put(keys[address], address, req)
        t_sent = now_ns()
        if local:
            got = self.model.bank.run_pairs(call.layer, call.hidden, [(t, int(ids[t, j])) for t, j in local])
            for (t, j), y in zip(local, got):
                out[t, j] = y
        t_local = now_ns()
        self._wait(call.layer, position, keys, slots, out, sent_ns)
        if self.tracer:
            step, layer = self.step_index, call.layer
            self.tracer.add(step, f"fanout {layer}", t_start, t_sent, sum(len(r.hidden) for r in requests.values()))
            if local:
                self.tracer.add(step, f"local experts {layer}", t_sent, t_local)
            self.tracer.add(step, f"gather {layer}", t_local, now_ns())
        return out

    def _wait(
        self,
        layer: int,
        position: int,
        keys: dict[str, Key],
        slots: dict[str, list[tuple[int, int]]],
        out: npt.NDArray[np.float16],
        sent_ns: dict[str, int],
    ) -> None:
        """Wait on the loop for every expert node's ExpertResult (the outbox resends meanwhile); anything else that
        comes goes on to the wait this one is nested in (the stage's, which records it)."""
        pending = dict(keys)

        def take(sender: str, msg: Message, rx: Received | None) -> bool:
            if not isinstance(msg, ExpertResult):
                self.loop.forward(sender, msg, rx)
                return False
            if sender not in pending or (msg.request_id, msg.position, msg.layer, msg.plan_id) != (
                self.request_id,
                position,
                layer,
                self.plan_id,
            ):
                self.late += 1
                return False
            outputs = codec.unpack_tensor(msg.outputs, msg.shape, msg.dtype, f"experts of block {layer}")
            pairs = slots[sender]
            if outputs.shape != (len(pairs), out.shape[-1]):
                raise ModelError(
                    f"expert node {sender[:60]} answered block {layer} with shape {outputs.shape}, "
                    f"expected {(len(pairs), out.shape[-1])}"
                )
            for (t, j), y in zip(pairs, outputs, strict=True):
                out[t, j] = y
            self.outbox.settle(pending.pop(sender), sender)
            if self.tracer:  # the round trip, and within it the expert node's own compute (placed at its end)
                node, t1 = self.node_of.get(sender, "expert node"), now_ns()
                self.tracer.add(self.step_index, f"experts {layer} {node}", sent_ns[sender], t1)
                self.tracer.add(self.step_index, f"experts {layer} {node} compute", t1 - msg.compute_ns, t1)
            return not pending

        try:
            self.loop.wait(take, self.timeout_s, f"block {layer}'s experts", done=lambda: not pending)
        except WaitTimedOut:
            raise ModelError(
                f"expert node(s) {', '.join(a[:60] for a in pending)} did not answer block {layer}'s experts "
                f"within {self.timeout_s:g} s"
            ) from None
        finally:
            unanswered = set(pending.values())
            self.outbox.drop(lambda key, role: key not in unanswered)

    def _resending(self, key: Key, address: str) -> None:
        self.log(f"no answer from expert node {address[:60]} for block {self.layer} yet; sending again")


class ExpertServer:
    """An expert node: answers the ExpertRequests of the blocks' owners from its bank (module docstring)."""

    def __init__(
        self,
        bank: ExpertBank,
        transport: Transport,
        names: dict[str, str],
        owners: dict[int, str],
        plan_id: str,
        wire_dtype: str = "f16",
        log: Callable[[str], None] = print,
    ):
        self.bank, self.transport, self.plan_id, self.wire_dtype = bank, transport, plan_id, wire_dtype
        self.owner_names, self.log = owners, log
        self.drop = DropLog(lambda line: self.log(line))  # the log this server has when it drops
        self.answers: OrderedDict[tuple[str, int, int], ExpertResult] = OrderedDict()
        self.served = 0
        self.computed = 0
        self.digests: dict[str, list[bytes]] = {}
        self.owners: dict[int, str] = {}
        self.rejoin(names, 0)

    def rejoin(self, names: dict[str, str], epoch: int) -> None:
        self.owners = {layer: names[name] for layer, name in self.owner_names.items() if name in names}

    def handle(self, sender: str, msg: Message, rx: Received | None = None) -> None:
        if not isinstance(msg, ExpertRequest):
            self.drop(
                f"dropped unexpected {type(msg).__name__} from {fingerprinted(sender)}: an expert node answers experts",
                f"unexpected {type(msg).__name__}",
                sender,
            )
            return
        if msg.plan_id != self.plan_id:
            self.drop(
                f"dropped ExpertRequest of plan {msg.plan_id[:64]}, this node serves {self.plan_id}",
                "another plan",
                sender,
            )
            return
        if self.owners.get(msg.layer) != sender:
            self.drop(
                f"dropped ExpertRequest for block {msg.layer} from {fingerprinted(sender)}: only that block's stage "
                "sends it",
                "ExpertRequest not its role's",
                sender,
            )
            return
        key = (msg.request_id, msg.position, msg.layer)
        answer = self.answers.get(key)
        if answer is None:
            try:
                answer = self._compute(msg)
            except (CodecError, ModelError) as exc:
                self.drop(
                    f"refused ExpertRequest for block {msg.layer} from {fingerprinted(sender)}: {exc}",
                    "a bad ExpertRequest",
                    sender,
                )
                return
            self.answers[key] = answer
            while len(self.answers) > ANSWERS_KEPT:
                self.answers.popitem(last=False)
        self.served += 1
        try:
            self.transport.send(sender, answer)
        except HarnessError as exc:  # the owner sends its request again
            self.log(f"answering block {msg.layer}'s experts failed: {exc}")

    def _compute(self, msg: ExpertRequest) -> ExpertResult:
        t0 = now_ns()
        hidden = codec.unpack_tensor(msg.hidden, msg.shape, msg.dtype, f"ExpertRequest for block {msg.layer}")
        if hidden.ndim != 2 or hidden.shape[1] != self.bank.dim:
            raise ModelError(f"hidden rows of shape {hidden.shape}, expected (rows, {self.bank.dim})")
        for i, (row, _) in enumerate(msg.pairs):
            if not 0 <= row < hidden.shape[0]:
                raise ModelError(f"pair {i} names row {row} of {hidden.shape[0]}")
        out = self.bank.run_pairs(msg.layer, hidden, [(int(r), int(e)) for r, e in msg.pairs])
        self.computed += 1
        data, shape = codec.pack_hidden(out, self.wire_dtype)
        t1 = now_ns()
        return ExpertResult(
            request_id=msg.request_id,
            position=msg.position,
            layer=msg.layer,
            outputs=data,
            shape=shape,
            dtype=self.wire_dtype,
            plan_id=msg.plan_id,
            compute_ns=t1 - t0,
        )


def warm_bank(bank: ExpertBank) -> None:
    """Compile the bank's step before the first request: its first calls run uncompiled, the next is captured, and
    the captured step serves every expert the bank holds (the expert is a bound variable of it)."""
    held = bank.held()
    if not held:
        return
    layer = next(iter(held))
    row = np.zeros(bank.dim, dtype=np.float16)
    for _ in range(3):
        bank.run(layer, held[layer][0], row)
