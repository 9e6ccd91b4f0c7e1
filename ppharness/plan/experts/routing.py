"""Measured expert frequencies into a plan: a routing file (what ``ppharness plan probe --routing`` writes) and a
plan whose mixture-of-experts blocks carry its frequencies."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec

from ppharness.errors import PlanError
from ppharness.plan.lang.check import FREQUENCY_TOLERANCE
from ppharness.plan.lang.document import PlanDoc, with_id


def with_frequencies(doc: PlanDoc, freqs: Mapping[int, Sequence[float]], source: str = "routing") -> PlanDoc:
    """``doc`` with block L's expert frequencies set to ``freqs[L]`` (how often each routed expert is among a token's
    chosen ones, e.g. as a probe run measures them). Each list has one value per routed expert, each from 0 to 1,
    adding up to the block's ``active``; a PlanError naming ``source`` and the layer otherwise."""
    blocks = list(doc.model.blocks)
    for layer, values in sorted(freqs.items()):
        at = f"{source}: $.layers.{layer}"
        if not 0 <= layer < len(blocks):
            raise PlanError(f"{at}: the model has blocks 0 to {len(blocks) - 1} — name one of its blocks")
        x = blocks[layer].experts
        if x.count == 0:
            raise PlanError(f"{at}: block {layer} is dense — frequencies belong to mixture-of-experts blocks only")
        if len(values) != x.count:
            raise PlanError(
                f"{at}: {len(values)} frequencies for block {layer}'s {x.count} routed experts — give one per expert"
            )
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise PlanError(
                    f"{at}[{i}]: {str(v)[:40]} is not a frequency — a frequency is the share of tokens that choose "
                    "the expert, a number from 0 to 1"
                )
        total = math.fsum(values)
        if abs(total - x.active) > FREQUENCY_TOLERANCE * x.active:
            raise PlanError(
                f"{at}: the frequencies add up to {total:.6g} but each token chooses {x.active} experts — they add up "
                f"to {x.active}; scale them"
            )
        experts = msgspec.structs.replace(x, frequencies=tuple(float(v) for v in values))
        blocks[layer] = msgspec.structs.replace(blocks[layer], experts=experts)
    model = msgspec.structs.replace(doc.model, blocks=tuple(blocks))
    return with_id(msgspec.structs.replace(doc, model=model))


def load_routing(path: str | Path) -> dict[int, list[float]]:
    """A routing file: JSON ``{"layers": {"<block>": [frequency of each routed expert, ...]}}`` -> block ->
    frequencies (checked against a model by ``with_frequencies``)."""
    path = Path(path)
    try:
        raw = msgspec.json.decode(path.read_bytes())
    except OSError as exc:
        raise PlanError(f"{path}: cannot read the routing file ({exc.strerror})") from None
    except msgspec.DecodeError as exc:
        raise PlanError(f'{path}: not JSON ({exc}) — write {{"layers": {{"0": [0.25, 0.5, ...]}}}}') from None
    layers = raw.get("layers") if isinstance(raw, dict) else None
    if not isinstance(layers, dict) or set(raw) != {"layers"}:
        raise PlanError(f'{path}: $: a routing file is {{"layers": {{"<block>": [frequency per expert, ...]}}}}')
    out: dict[int, list[float]] = {}
    for key, values in layers.items():
        if not (isinstance(key, str) and re.fullmatch(r"[0-9]{1,9}", key)):
            raise PlanError(f"{path}: $.layers: {str(key)[:40]!r} is not a block number — key each list by its block")
        if not isinstance(values, list):
            raise PlanError(f"{path}: $.layers.{key}: a list of frequencies, one per routed expert")
        out[int(key)] = values
    return out
