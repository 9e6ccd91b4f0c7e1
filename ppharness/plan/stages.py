"""Deciding who runs what: a pure function from (blocks, stages, split points) to each stage's block range and names."""

from __future__ import annotations

import base64
import hashlib
import zlib
from dataclasses import dataclass
from typing import TypedDict, Unpack

import msgspec

from ppharness.errors import HarnessError, ScenarioError

ENTRY, EXIT = "pp-entry", "pp-exit"


def stage_name(i: int) -> str:
    return f"pp-stage-{i}"


def expert_node_name(j: int) -> str:
    """The name of the run's ``j``-th expert node."""
    return f"pp-experts-{j}"


def expert_name(layer: int, expert: int, replica: int = 0) -> str:
    """The directory name of the ``replica``-th holder of expert ``expert`` of block ``layer``."""
    base = f"moe-expert-{layer}-{expert}"
    return base if replica == 0 else f"{base}.r{replica}"


def names_of(index: int, num_stages: int) -> list[str]:
    """The names stage ``index`` registers: its own, plus pp-entry on the first and pp-exit on the last."""
    names = [stage_name(index)]
    if index == 0:
        names.append(ENTRY)
    if index == num_stages - 1:
        names.append(EXIT)
    return names


# how an even split of B blocks over N stages places the remainder B % N: "balanced" (the default) gives one more
# block to each of the first B % N stages (8 over 5: 2/2/2/1/1); "floor" is the SPEC's first rule, k = B // N blocks
# per stage and the last stage takes the rest (8 over 5: 1/1/1/1/4)
SPLIT_RULES = ("balanced", "floor")


def even_splits(blocks: int, num_stages: int, rule: str = "balanced") -> list[int]:
    """The split points of an even split of ``blocks`` over ``num_stages`` under ``rule`` (one of ``SPLIT_RULES``)."""
    if rule == "floor":
        k = blocks // num_stages
        return [k * i for i in range(1, num_stages)]
    if rule != "balanced":
        raise ScenarioError(f"stages.split_rule: unknown rule {rule!r} — expected one of: {', '.join(SPLIT_RULES)}")
    k, extra = divmod(blocks, num_stages)
    return [k * i + min(i, extra) for i in range(1, num_stages)]


class StagePlan(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one node needs to know about its part; travels to the node as the PLAN environment variable (JSON)."""

    plan_id: str
    stage: int
    num_stages: int
    lo: int
    hi: int
    wire_dtype: str = "f16"
    max_context: int = 256
    slots: int = 1  # requests served at once: a KV cache each (ppharness.run.stage)
    batched: bool = False  # one model call per step for every ready request (ppharness.model.layers.rows)
    max_batch: int = 0  # the most requests one batched step runs (0: every ready one)
    speculate: str = ""  # a draft name: the run decodes by speculative windows (ppharness.run.stage.speculation)
    windows: int = 1  # speculative windows a request keeps in flight
    queue: int = 64  # stage 0: requests waiting for a free slot before more are refused
    join_s: float = 120.0
    resolve_s: float = 60.0
    trace: bool = False
    # the compiled plan's program for this node: its node and device in the plan, the names it registers, and the
    # names its activations come from and go to ("" before the first and after the last stage)
    node: str = ""
    device: str = ""
    names: tuple[str, ...] = ()
    prev: str = ""
    next: str = ""
    # fault tolerance (ppharness.run.reliable): the run's policy and its retry timings; the membership epoch this
    # node starts in (above 0: a spare replacing a dead stage)
    fault_tolerance: str = "none"
    ack_timeout_s: float = 0.25
    retry_max_s: float = 2.0
    retry_budget_s: float = 300.0
    epoch: int = 0
    # mixture of experts (ppharness.run.node.experts): ``role`` experts for an expert node (off the loop: ``stage`` is
    # its member index after the loop's, ``lo``/``hi`` are empty); ``experts`` the routed experts the node computes
    # (layer -> ids; None on a stage: every expert of its blocks); ``owners`` an expert node's layer -> the name of the
    # stage that runs that block, the only member it answers for that layer
    role: str = "stage"
    experts: dict[int, tuple[int, ...]] | None = None
    owners: dict[int, str] = msgspec.field(default_factory=dict)
    # an expert node's replica number of each expert it holds that is not the first copy (layer -> {expert: k}): its
    # ``moe-expert-{layer}-{e}[.r{k}]`` names follow from ``experts`` and this, so the program stays small
    replicas: dict[int, dict[int, int]] = msgspec.field(default_factory=dict)

    @property
    def registers(self) -> list[str]:
        """The names this node registers: the program's (an expert node's also one per expert it holds), else the
        default names for its index (``names_of``)."""
        if not self.names:
            return names_of(self.stage, self.num_stages)
        names = list(self.names)
        if self.role == "experts":
            for layer, ids in sorted((self.experts or {}).items()):
                k = self.replicas.get(layer, {})
                names.extend(expert_name(layer, e, k.get(e, 0)) for e in ids)
        return names

    @property
    def first(self) -> bool:
        return self.stage == 0 and self.role == "stage"

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1 and self.role == "stage"


# a program longer than this travels compressed (``encode_program``): an expert node of a large model holds thousands
# of experts, and vast.ai takes at most 32 KiB of environment per instance
COMPRESS_OVER = 4096
ZLIB_PREFIX = "zlib:"
MAX_PROGRAM_BYTES = 16 << 20


def encode_program(plan: StagePlan) -> str:
    """A node's program as its PLAN environment variable: JSON, or ``zlib:`` and the base64 of the compressed JSON
    when it is long."""
    text = msgspec.json.encode(plan)
    if len(text) <= COMPRESS_OVER:
        return text.decode()
    return ZLIB_PREFIX + base64.b64encode(zlib.compress(text, 9)).decode()


def decode_program(text: str) -> StagePlan:
    """The inverse of ``encode_program`` (plain JSON too); a HarnessError names what is wrong. Decompression stops at
    ``MAX_PROGRAM_BYTES``, whatever the input claims."""
    try:
        if text.startswith(ZLIB_PREFIX):
            inflater = zlib.decompressobj()
            raw = inflater.decompress(base64.b64decode(text[len(ZLIB_PREFIX) :], validate=True), MAX_PROGRAM_BYTES)
            if inflater.unconsumed_tail or not inflater.eof:
                raise HarnessError(f"PLAN inflates past {MAX_PROGRAM_BYTES:,} bytes or is cut short")
            return msgspec.json.decode(raw, type=StagePlan)
        return msgspec.json.decode(text, type=StagePlan)
    except (ValueError, zlib.error, msgspec.DecodeError) as exc:
        raise HarnessError(f"PLAN is not a valid stage plan: {exc}") from exc


class StageSettings(TypedDict, total=False):
    """The run-wide fields of a StagePlan that ``Plan.stage`` takes as keywords (each defaults as in StagePlan)."""

    wire_dtype: str
    max_context: int
    slots: int
    batched: bool
    max_batch: int
    speculate: str
    windows: int
    queue: int
    join_s: float
    resolve_s: float
    trace: bool
    fault_tolerance: str
    ack_timeout_s: float
    retry_max_s: float
    retry_budget_s: float


@dataclass(frozen=True)
class Plan:
    plan_id: str
    ranges: tuple[tuple[int, int], ...]

    @property
    def num_stages(self) -> int:
        return len(self.ranges)

    def stage(self, i: int, **settings: Unpack[StageSettings]) -> StagePlan:
        lo, hi = self.ranges[i]
        return StagePlan(plan_id=self.plan_id, stage=i, num_stages=self.num_stages, lo=lo, hi=hi, **settings)


def make_plan(
    blocks: int,
    num_stages: int | None = None,
    splits: list[int] | None = None,
    model_id: str = "",
    split_rule: str = "balanced",
) -> Plan:
    """Block ranges for each stage: explicit ``splits`` (N-1 increasing cut points), or an even split of
    ``num_stages`` under ``split_rule`` (``SPLIT_RULES``)."""
    if splits is None:
        if num_stages is None or num_stages < 1:
            raise ScenarioError(f"stages: need a stage count of at least 1, got {num_stages}")
        if num_stages > blocks:
            raise ScenarioError(f"stages: {num_stages} stages but the model has {blocks} blocks; use at most {blocks}")
        splits = even_splits(blocks, num_stages, split_rule)
    cuts = [0, *splits, blocks]
    if any(a >= b for a, b in zip(cuts, cuts[1:])):
        raise ScenarioError(f"stages.splits: {splits} must be strictly increasing and inside (0, {blocks})")
    if num_stages is not None and num_stages != len(cuts) - 1:
        raise ScenarioError(f"stages: count {num_stages} disagrees with {len(splits)} split points")
    ranges = tuple(zip(cuts, cuts[1:]))
    plan_id = hashlib.sha256(f"{model_id}|{ranges}".encode()).hexdigest()[:12]
    return Plan(plan_id=plan_id, ranges=ranges)
