"""Every message that crosses a process boundary, as frozen tagged msgspec structs.

The chain's four (InferenceRequest, StageActivation, NextToken, InferenceResponse) keep their names and fields; what
the harness needs besides them is added as further message types. Hidden states travel as raw little-endian bytes with
their shape and wire dtype (never JSON, never base64): see ``ppharness.wire.codec`` for framing and tensor packing.
"""

from __future__ import annotations

import typing
from typing import TypeAlias

import msgspec

PROTOCOL_VERSION = 1


# ``frozen`` is inherited at run time; every message repeats ``frozen=True`` because a type checker reads a Struct as a
# dataclass (PEP 681), and takes a subclass that does not say frozen as not frozen
class _Msg(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    pass


# --- the chain's messages ------------------------------------------------------------------------------------------


class InferenceRequest(_Msg, frozen=True):
    """Orchestrator -> stage 0: generate up to ``max_tokens`` tokens after ``prompt``."""

    reply_to: str
    prompt: str
    max_tokens: int
    request_id: str = ""
    stream: bool = False  # also send each token to reply_to as a StreamedToken when it is sampled
    digests: bool = True  # every stage keeps the digest of each hidden state it sends (a DigestRequest's answer)
    speculate: bool = True  # in a run that speculates: draft windows for it (False: windows of one row, greedy)


class StageActivation(_Msg, frozen=True):
    """Stage i -> stage i+1: the hidden state after stage i's blocks for ``seq_len`` positions from ``position``."""

    request_id: str
    position: int
    hidden: bytes  # raw little-endian, shape ``shape``, element type ``dtype``
    seq_len: int
    is_prefill: bool
    shape: tuple[int, ...]
    dtype: str  # wire dtype: "f16" | "bf16" | "f32"
    plan_id: str
    epoch: int = 0  # the run's membership epoch when it was sent: a replaced (fenced) node's older epoch is refused


class NextToken(_Msg, frozen=True):
    """Last stage -> stage 0: the sampled token at ``position``; ``done`` ends the request (an end-of-generation token
    or max_tokens)."""

    request_id: str
    token_id: int
    position: int
    done: bool
    plan_id: str
    epoch: int = 0


class ActivationRows(_Msg, frozen=True):
    """Stage i -> stage i+1, from a batched step: several requests' next decode position in one message. Row r of
    ``hidden`` (``shape`` (rows, 1, width)) is request ``request_ids[r]`` at ``positions[r]``.

    Speculative windows (``ppharness.run.stage.speculation``): consecutive rows of one request are its window, at
    consecutive positions; ``tokens[r]`` is the token row r computes on stage 0 (the last committed one, then the
    drafted ones) and ``trips[r]`` its window's number (each request numbers its windows from 1). Both are empty when
    the run does not speculate."""

    request_ids: list[str]
    positions: list[int]
    hidden: bytes  # raw little-endian, shape ``shape``, element type ``dtype``
    shape: tuple[int, ...]
    dtype: str
    plan_id: str
    epoch: int = 0
    tokens: list[int] = []
    trips: list[int] = []


class TokenRows(_Msg, frozen=True):
    """Last stage -> stage 0, from a batched step: a NextToken for each of several requests in one message."""

    request_ids: list[str]
    token_ids: list[int]
    positions: list[int]
    done: list[bool]
    plan_id: str
    epoch: int = 0


class InferenceResponse(_Msg, frozen=True):
    """Last stage -> ``reply_to``: the detokenized text and token ids, with timings from the stages."""

    request_id: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    # Wall-clock of the last stage, monotonic seconds relative to the moment it saw the prefill activation:
    # token_times[k] is when token k was sampled.
    token_times: list[float]
    finish_reason: str  # "eos" (an end-of-generation token ended it) | "length" (max_tokens did)
    stop_token_id: int | None = None  # the end-of-generation token that ended it, not in token_ids; None at max_tokens
    stop_token: str = ""  # that token's text ("<|eot_id|>"); "" at max_tokens
    # speculation (ppharness.run.stage.speculation): windows the last stage verified for it, tokens they drafted, drafts
    # accepted, and windows that rejected a draft (0 in a run that does not speculate)
    trips: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0
    window_drafts: list[int] = []  # each verified window's drafted tokens, in order
    window_accepted: list[int] = []  # and the drafts it accepted


# --- what the harness adds ----------------------------------------------------------------------------------------


class RequestOpen(_Msg, frozen=True):
    """Stage 0 -> down the chain, ahead of the prefill activation: what the last stage needs to finish the request.

    Forwarded hop by hop on the same ordered channel as the activations, so every stage sees it before the prefill.
    """

    request_id: str
    reply_to: str
    max_tokens: int
    prompt_tokens: int
    plan_id: str
    epoch: int = 0
    stream: bool = False  # the request's: the last stage streams each token to reply_to
    digests: bool = True  # the request's: each stage keeps its hidden states' digests


class RequestClose(_Msg, frozen=True):
    """Stage 0 -> down the chain to the last stage but one, once the last stage's ``done`` token came back: the
    request is over, its request slot is free. Sent on the same ordered channel as the RequestOpen that may reuse the
    slot next."""

    request_id: str
    plan_id: str
    epoch: int = 0


class Join(_Msg, frozen=True):
    """Node -> seed: I am stage ``stage`` of ``num_stages``, reachable at ``address``, under these names. A standby
    spare joins as stage -1, its one name ``spare:<device>``, until an Assign makes it a stage."""

    stage: int
    num_stages: int
    address: str
    names: list[str]
    run_label: str
    pid: int


class Members(_Msg, frozen=True):
    """Seed -> every node: the name directory (name -> transport address) once all stages joined; again, with a
    higher ``epoch``, after a spare replaced a dead stage (a node takes only a directory newer than the one it has)."""

    names: dict[str, str]
    epoch: int = 0


class Ready(_Msg, frozen=True):
    """Node -> seed: my slice is loaded and I serve requests."""

    stage: int
    params: int
    tied_params: int
    load_s: float
    rss_bytes: int


class Heartbeat(_Msg, frozen=True):
    """Node -> seed every few seconds (heartbeat membership engine): I am alive."""

    stage: int
    seq: int


class Shutdown(_Msg, frozen=True):
    """Seed -> node: stop serving and exit 0."""

    reason: str = ""


class Stopped(_Msg, frozen=True):
    """Node -> seed, answering Shutdown: what this stage did, just before it exits 0."""

    stage: int
    served: int
    peak_rss_bytes: int
    device_bytes: int = 0  # accelerator memory the stage's buffers hold (weights, KV cache, activations)


class Span(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One timed piece of a stage's work for token ``step`` (0 = prefill), on the stage's monotonic clock."""

    step: int
    name: str  # recv | deserialize | tokenize | compute | serialize | send
    t0_ns: int
    t1_ns: int
    nbytes: int = 0


class TraceRequest(_Msg, frozen=True):
    """Seed -> node: send me your spans for ``request_id``."""

    request_id: str


class TraceReport(_Msg, frozen=True):
    """Node -> seed: the spans a stage recorded for one request (empty when tracing is off)."""

    stage: int
    request_id: str
    spans: list[Span]


class DigestRequest(_Msg, frozen=True):
    """Seed -> node: send me the digests of the hidden states you sent for ``request_id``."""

    request_id: str


class DigestReport(_Msg, frozen=True):
    """Node -> seed: one digest per activation a stage sent for one request, in step order (step 0 = prefill); empty
    on the last stage, which sends no activation. ``ppharness.model.decode.exactness`` compares them with the unsplit
    model's."""

    stage: int
    request_id: str
    digests: list[bytes]


class ClockProbe(_Msg, frozen=True):
    """Seed -> node: a clock-offset probe, stamped with the seed's monotonic clock."""

    t_seed_ns: int


class ClockReply(_Msg, frozen=True):
    """Node -> seed: the probe's stamp echoed with the node's own monotonic clock at receipt."""

    stage: int
    t_seed_ns: int
    t_node_ns: int


class NetworkStart(_Msg, frozen=True):
    """Seed -> node, just before the request: the wall-clock time (Unix, ns) the network's timed events count from."""

    t0_unix_ns: int


# --- fault tolerance (policies retry and failover) -----------------------------------------------------------------


class Ack(_Msg, frozen=True):
    """Receiver -> sender: the message ``kind`` of ``request_id`` at ``position`` arrived (or arrived before: a
    duplicate is acknowledged again and otherwise dropped). ``kind`` names what is acknowledged: ``request``,
    ``open``, ``close``, ``activation``, ``token``, ``stream``, ``response``, ``replay`` or ``resume``."""

    kind: str
    request_id: str
    position: int
    plan_id: str


class StreamedToken(_Msg, frozen=True):
    """Last stage -> ``reply_to``, as each token is sampled (the final InferenceResponse still follows): what a
    client shows as it comes, and the token history a replacement of stage 0 is resumed from."""

    request_id: str
    token_id: int
    position: int
    done: bool
    plan_id: str
    first: int = 0  # the position of the request's first sampled token (where its stream starts)


class Replay(_Msg, frozen=True):
    """Stage i-1 -> the spare that replaced stage i: the request and every activation stage i-1 sent for it, in
    order, to rebuild the replaced range's KV cache by the same calls that built it (prefill, then one decode per
    position); only the last one's output travels on."""

    open: RequestOpen
    activations: list[StageActivation]
    epoch: int


class Resume(_Msg, frozen=True):
    """Seed -> the spare that replaced stage 0: the request and the tokens streamed so far, to replay through its
    blocks before it goes on from the last one."""

    request: InferenceRequest
    tokens: list[int]
    plan_id: str
    epoch: int


class Assign(_Msg, frozen=True):
    """Seed -> a standby spare: take over a dead stage. ``program`` is the stage's program (a JSON StagePlan, as a
    node's ``PLAN``); ``gossip_name`` the name it gossips under."""

    program: str
    gossip_name: str = ""


class Warm(_Msg, frozen=True):
    """Seed -> a standby spare: keep the slices of these stages loaded and compiled (``programs``: JSON StagePlans, as
    an Assign's; empty: the ones it holds) and their prefill compiled for these prompt ``lengths``, so that taking one
    of those stages over loads nothing and its replay compiles nothing."""

    programs: list[str] = []
    lengths: list[int] = []


class ExpertRequest(_Msg, frozen=True):
    """A MoE block's owner -> an expert node: rows of the block's normed hidden state (``hidden``: raw little-endian
    (R, D), wire dtype ``dtype``) and which expert each (row, expert) pair of ``pairs`` needs. Keyed like an
    activation by (request, position, layer): a copy is answered again, never computed twice."""

    request_id: str
    position: int
    layer: int
    pairs: list[tuple[int, int]]  # (row of ``hidden``, expert id), in the order the outputs come back
    hidden: bytes
    shape: tuple[int, ...]
    dtype: str
    plan_id: str
    epoch: int = 0


class ExpertResult(_Msg, frozen=True):
    """An expert node -> the block's owner: each pair's expert output, (len(pairs), D) in the request's order."""

    request_id: str
    position: int
    layer: int
    outputs: bytes
    shape: tuple[int, ...]
    dtype: str
    plan_id: str
    compute_ns: int = 0  # how long the expert node computed (for the trace)


class Error(_Msg, frozen=True):
    """Anyone -> seed / reply_to: a failure that ends the request or the run, in one line."""

    stage: int
    reason: str
    request_id: str = ""
    busy: bool = False  # the request was refused, not failed: stage 0 still serves another; sending it again may work


Message: TypeAlias = (
    InferenceRequest
    | StageActivation
    | NextToken
    | ActivationRows
    | TokenRows
    | InferenceResponse
    | RequestOpen
    | RequestClose
    | Join
    | Members
    | Ready
    | Heartbeat
    | Shutdown
    | Stopped
    | TraceRequest
    | TraceReport
    | DigestRequest
    | DigestReport
    | ClockProbe
    | ClockReply
    | NetworkStart
    | Ack
    | StreamedToken
    | Replay
    | Resume
    | Assign
    | Warm
    | ExpertRequest
    | ExpertResult
    | Error
)

MESSAGE_TYPES: tuple[type[Message], ...] = typing.get_args(Message)
