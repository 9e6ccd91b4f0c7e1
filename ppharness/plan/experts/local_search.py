"""The expert planner's starting placements and its local search.

Starting points: the programme's placement (``ppharness.plan.experts.problem``), a greedy one (every block's experts,
hottest first, each where it raises its block's proxy time the least), a regional one (where the nodes are in several
regions: each block's experts on the expert nodes in its owner's region) and the round-robin and uniform baselines
where they fit. From the best of them, for each expert, hottest first: move it to another node, copy it into spare
memory (``replicas``), drop a copy that does not help, swap it with one of the coldest experts (of any block) on
another node; a change is kept when the predicted time (on the same routings) goes down. Changes are tried in a fixed
order, at most ``max_evaluations`` of them, so that the answer depends on the input only, unless a time limit stops
the search first (the report says so).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ppharness.plan.experts.problem import Placed, Problem

MAX_EVALUATIONS = 20_000  # placements the local search predicts, at most
IMPROVEMENT = 1e-9  # a change is kept when it lowers the prediction by more than this share
Baseline = Literal["round-robin", "uniform"]


def greedy_placement(problem: Problem) -> Placed | None:
    """The experts of all blocks, hottest first, each on the node where it raises its block's proxy time (the slowest
    node's expected load and round trip) the least, among the nodes with room (ties: the first node); None when an
    expert finds no room."""
    left = np.asarray(problem.free, dtype=np.float64)
    load = {layer: np.zeros(problem.m) for layer in problem.moe}
    chance = {layer: np.zeros(problem.m) for layer in problem.moe}
    allowed = {layer: np.array([problem.allowed(layer, n) for n in range(problem.m)]) for layer in problem.moe}
    placement: Placed = {layer: [[] for _ in range(problem.count[layer])] for layer in problem.moe}
    columns = np.arange(problem.m)
    for layer, e in _items(problem):
        fan = problem.fan[layer]
        p = fan.p[e]
        remote = columns != fan.owner
        base = fan.c * load[layer] + fan.r * chance[layer]
        new = fan.c * (load[layer] + p) + fan.r * np.where(remote, np.maximum(chance[layer], p), chance[layer])
        # the slowest other node, for each candidate: the largest of base without the candidate
        order = np.argsort(-base, kind="stable")
        first, second = base[order[0]], base[order[1]] if problem.m > 1 else -math.inf
        others = np.where(columns == order[0], second, first)
        score = np.maximum(new, others)
        ok = allowed[layer] & (left >= problem.size[layer])
        if not ok.any():
            return None
        n = int(np.argmin(np.where(ok, score, math.inf)))
        load[layer][n] += p
        if n != fan.owner:
            chance[layer][n] = max(chance[layer][n], p)
        left[n] -= problem.size[layer]
        placement[layer][e] = [n]
    return placement


def _items(problem: Problem) -> list[tuple[int, int]]:
    """Every (block, expert), hottest first (ties: block, then expert)."""
    items = [(layer, e) for layer in problem.moe for e in range(problem.count[layer])]
    return sorted(items, key=lambda item: (-problem.fan[item[0]].p[item[1]], item))


def baseline_placement(problem: Problem, kind: Baseline) -> Placed:
    """Every expert on one expert node, ignoring frequencies and links: ``round-robin`` deals the experts of all
    blocks to the expert nodes in turn; ``uniform`` gives each expert node an equal run of each block's experts. With
    no expert device, every block keeps its experts on its owner."""
    first = len(problem.stages)
    k = problem.m - first
    placement: Placed = {}
    dealt = 0
    for layer in problem.moe:
        count = problem.count[layer]
        if k == 0:
            placement[layer] = [[problem.owner[layer]] for _ in range(count)]
            continue
        if kind == "round-robin":
            placement[layer] = [[first + (dealt + e) % k] for e in range(count)]
            dealt += count
        else:
            placement[layer] = [[first + e * k // count] for e in range(count)]
    return placement


def regional_placement(problem: Problem) -> Placed | None:
    """Each block's experts dealt in turn to the expert nodes in its owner's region: a start that pays no
    inter-region round trip. None when the candidates are all in one region or a block's region has no expert node."""
    first = len(problem.stages)
    regions = [d.region for d in problem.devices]
    if len(set(regions)) < 2:
        return None
    placement: Placed = {}
    for layer in problem.moe:
        local = [n for n in range(first, problem.m) if regions[n] == regions[problem.owner[layer]]]
        if not local:
            return None
        placement[layer] = [[local[e % len(local)]] for e in range(problem.count[layer])]
    return placement


SWAP_PARTNERS = 4  # the coldest experts on a node that the local search tries to swap a hotter one with


@dataclass
class Search:
    """First-improvement local search over placements (the module's docstring), on the predicted time."""

    problem: Problem
    replicas: bool
    deadline: float
    max_evaluations: int
    evaluations: int = 0
    accepted: int = 0
    stopped_by_time: bool = False

    def out_of_budget(self) -> bool:
        if self.evaluations >= self.max_evaluations:
            return True
        if time.monotonic() > self.deadline:
            self.stopped_by_time = True
            return True
        return False

    def run(self, placement: Placed) -> Placed:
        """Improve ``placement`` (in place) until no change helps or the budget is spent."""
        problem = self.problem
        self.placement = placement
        self.left = list(problem.free)
        for layer in problem.moe:
            for held in placement[layer]:
                for n in held:
                    self.left[n] -= problem.size[layer]
        self.values = {layer: problem.value(layer, placement[layer]) for layer in problem.moe}
        items = _items(problem)
        improved = True
        while improved and not self.out_of_budget():
            improved = False
            # each node's experts, coldest first, as the pass starts (swap partners; checked again when used)
            cold = [[item for item in reversed(items) if n in placement[item[0]][item[1]]] for n in range(problem.m)]
            for layer, e in items:
                if self.out_of_budget():
                    break
                improved |= self._item(layer, e, cold)
        return placement

    def _try(self, changes: dict[tuple[int, int], list[int]], keep_equal: bool = False) -> bool:
        """Apply ``changes`` ((block, expert) -> its new holders) when the predicted time of the blocks they touch
        goes down (or stays, with ``keep_equal``) and the memory allows; True when applied."""
        problem, placement = self.problem, self.placement
        delta = [0] * problem.m
        for (layer, e), held in changes.items():
            for n in held:
                delta[n] += problem.size[layer]
            for n in placement[layer][e]:
                delta[n] -= problem.size[layer]
        if any(d > room for d, room in zip(delta, self.left)):
            return False
        self.evaluations += 1
        trial = {layer: [list(h) for h in placement[layer]] for layer, _ in changes}
        for (layer, e), held in changes.items():
            trial[layer][e] = sorted(held)
        values = {layer: problem.value(layer, block) for layer, block in trial.items()}
        before = math.fsum(self.values[layer] for layer in trial)
        after = math.fsum(values.values())
        slack = IMPROVEMENT * before
        if not (after < before - slack or (keep_equal and after <= before + slack)):
            return False
        for layer, block in trial.items():
            placement[layer] = block
            self.values[layer] = values[layer]
        self.left = [room - d for room, d in zip(self.left, delta)]
        self.accepted += 1
        return True

    def _item(self, layer: int, e: int, cold: list[list[tuple[int, int]]]) -> bool:
        """Every change to (``layer``, ``e``): move it, copy it, drop a copy, swap it with a colder expert."""
        problem, m = self.problem, self.problem.m
        placement = self.placement
        hot = problem.fan[layer].p[e]
        changed = False
        targets = [b for b in range(m) if problem.allowed(layer, b)]
        for a in list(placement[layer][e]):
            for b in targets:
                held = placement[layer][e]
                if a in held and b not in held and self._try({(layer, e): [n for n in held if n != a] + [b]}):
                    changed = True
        if self.replicas:
            for b in targets:
                held = placement[layer][e]
                if b not in held and self._try({(layer, e): [*held, b]}):
                    changed = True
        for a in list(placement[layer][e]):
            held = placement[layer][e]
            if len(held) > 1 and self._try({(layer, e): [n for n in held if n != a]}, keep_equal=True):
                changed = True
        for a in list(placement[layer][e]):
            for b in targets:
                if b in placement[layer][e] or a not in placement[layer][e]:
                    continue
                partners = [
                    (other, f)
                    for other, f in cold[b]
                    if b in placement[other][f]
                    and a not in placement[other][f]
                    and (other, f) != (layer, e)
                    and problem.allowed(other, a)
                ]
                for other, f in partners[:SWAP_PARTNERS]:
                    if problem.fan[other].p[f] >= hot:
                        break
                    mine = [n for n in placement[layer][e] if n != a] + [b]
                    theirs = [n for n in placement[other][f] if n != b] + [a]
                    if self._try({(layer, e): mine, (other, f): theirs}):
                        changed = True
                        break
        return changed
