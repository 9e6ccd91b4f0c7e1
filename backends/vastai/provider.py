"""vast.ai: one rented instance per node (per host for a plan's GPUs of one machine), running the node image's
``pp-node`` (``pp-host`` for a host's nodes), each found with its plan device's own offer filter
(``backends.vastai.rentals``).

Guarantees (docs/vastai.md's failure table):
- Fewer matching offers than a search needs, or a plan over ``max_total_dph``: ProvisionFailed before anything is
  rented. Each distinct search is made once; no offer is chosen twice.
- The plan (offers, $/hr each, total, estimated cost) is printed before the first create.
- A failed create destroys every instance already created (and any the failed reply names); an offer that vanished
  between search and create is replaced by the next cheapest spare within the caps.
- Instances are polled (the v1 list, filtered by the run's label: one call for all of them) at most ``MAX_POLLS`` times
  until all run; one that fails or never runs is NotReady, after everything is destroyed.
- ``exited()`` reads the same list, at most once per ``poll_s`` (10 s at least against vast.ai itself).
- Leaving the provider destroys every instance it created and then every instance still carrying the run's label;
  one that cannot be destroyed is reported with the ``ppharness reap`` command that removes it later.
- The API key comes from ``VAST_API_KEY`` (``pp-smoke-run --api-key`` puts it there) and the API's address from
  ``VAST_URL``; neither the key nor anything derived from it reaches the instances.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from backends.vastai.client import ApiKey, VastApiError, VastClient, api_url
from backends.vastai.offers import choose_offers, create_body, offer_query, rental_lines
from backends.vastai.rentals import Rental, instance_env, port_requests, rentals
from backends.vastai.settings import VastaiSettings
from ppharness.errors import NotReady, ProviderError, ProvisionFailed
from ppharness.seams.provider import Instance, NodeSpec, Provider, Reaped

MAX_POLLS = 60
REAL_MIN_POLL_S = 10.0
PACE_VAR = "PPHARNESS_VASTAI_PACE"
IMAGE_VAR = "PPHARNESS_VASTAI_IMAGE"
LABEL_VAR = "PP_RUN_LABEL"
FAILED_STATUS = frozenset({"exited", "unknown", "offline", "stopped", "frozen"})
GONE_STATUS = frozenset({"destroyed", "terminated"})
ERROR_WORDS = ("oci runtime", "permission denied", "traceback", "exception", "error", "failed")
WATCH_FAILURES_MAX = 3
UNLISTED_GRACE = 3


def is_vast_host(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    return host == "vast.ai" or host.endswith(".vast.ai")


def client_from_env() -> VastClient | None:
    """A client for ``VAST_URL`` with ``VAST_API_KEY``, or None without a key. ``PPHARNESS_VASTAI_PACE`` scales the
    pacing and backoff (for emulators; never below 1 against vast.ai)."""
    key = ApiKey.from_env()
    if key is None:
        return None
    url = api_url()
    try:
        pace = float(os.environ.get(PACE_VAR) or 1.0)
    except ValueError as exc:
        raise ProviderError(f"{PACE_VAR} must be a number") from exc
    return VastClient(key, url, pace=max(pace, 1.0) if is_vast_host(url) else max(pace, 0.0))


def failure_of(rec: dict[str, Any] | None) -> str | None:
    """Why an instance record means the instance will never serve (None while it may still run or runs)."""
    if rec is None:
        return "it is no longer listed (destroyed or lost)"
    actual, msg = rec.get("actual_status"), str(rec.get("status_msg") or "")
    if actual in FAILED_STATUS:
        return f"actual_status is {actual!r}" + (f": {msg}" if msg else "")
    if rec.get("cur_state") == rec.get("intended_status") == rec.get("next_state") == "stopped":
        return "it was stopped (outbid or stopped by the host)"
    if actual != "running" and any(w in msg.lower() for w in ERROR_WORDS):
        return f"status {actual!r}: {msg}"
    return None


def is_running(rec: dict[str, Any]) -> bool:
    return rec.get("actual_status") == "running" and rec.get("intended_status", "running") == "running"


def is_gone(rec: dict[str, Any]) -> bool:
    return rec.get("cur_state") == "unloaded" or rec.get("actual_status") in GONE_STATUS


def describe(rec: dict[str, Any] | None) -> str:
    if rec is None:
        return "not listed"
    return (
        f"actual_status={rec.get('actual_status')!r} intended_status={rec.get('intended_status')!r} "
        f"cur_state={rec.get('cur_state')!r} status_msg={rec.get('status_msg')!r}"
    )


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class VastaiProvider(Provider[VastaiSettings]):
    kind = "vastai"
    colocates = False  # every node is an instance rented for it: a second one means renting again

    def __init__(
        self,
        run_label: str,
        settings: VastaiSettings | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        client: VastClient | None = None,
    ):
        """``settings``: the scenario's ``provider.vastai`` (``backends.vastai.settings.VastaiSettings``)."""
        if settings is None:
            raise ProviderError("the vastai provider needs the scenario's provider.vastai settings")
        super().__init__(run_label, settings, log_dir)
        client = client or client_from_env()
        if client is None:
            raise ProviderError("no vast.ai API key: pass --api-key or set VAST_API_KEY")
        self.client = client
        self.poll_s = max(settings.poll_s, REAL_MIN_POLL_S) if is_vast_host(self.client.base_url) else settings.poll_s
        self.image = os.environ.get(IMAGE_VAR) or settings.image
        self._records: dict[int, dict[str, Any]] = {}
        self._destroyed: set[int] = set()
        self._polled_at = -1e9
        self._watch_failures = 0
        self._total_dph = 0.0
        self._orphans: set[int] = set()
        self._seen: set[int] = set()

    def node_model(self, source: str, local_path: str) -> str:
        """A rented machine cannot read this machine's files: the source itself (a ``synthetic:`` spec, which the
        node builds deterministically, or an http(s) URL it downloads)."""
        if source.startswith(("synthetic:", "http://", "https://")):
            return source
        raise ProvisionFailed(
            f"vast.ai nodes cannot read {local_path} on this machine: give model.gguf as an "
            "http(s) URL, or use a synthetic model"
        )

    # --- provisioning --------------------------------------------------------------------------------------------

    def provision(self, specs: list[NodeSpec]) -> list[Instance]:
        wanted = rentals(specs, self.settings)
        try:
            chosen, spares = self._choose(wanted)
        except VastApiError as exc:
            raise ProvisionFailed(f"vast.ai offer search failed; nothing was rented: {exc}") from exc
        if is_vast_host(self.client.base_url) and "/" not in self.image:
            raise ProvisionFailed(
                f"the node image {self.image!r} is a local tag vast.ai cannot pull: push "
                "docker/Dockerfile's image to a registry and set provider.vastai.image or "
                f"{IMAGE_VAR} (docs/vastai.md); nothing was rented"
            )
        for line in rental_lines(wanted, chosen, self.settings, self.run_label):
            _say(line)
        self._total_dph = sum(float(o["dph_total"]) for o in chosen)
        try:
            for i, (rental, offer) in enumerate(zip(wanted, chosen)):
                self._create(rental, offer, spares[rental.search_key], f"{i + 1}/{len(wanted)}")
            self._wait_running()
        except ProviderError as exc:
            warnings = self.destroy_all()
            done = (
                f"destroyed the {len(self.instances)} instance(s) already created"
                if not warnings
                else f"destroying what was created failed: {'; '.join(warnings)}"
            )
            raise (NotReady if isinstance(exc, NotReady) else ProvisionFailed)(f"{exc}; {done}") from exc
        return list(self.instances)

    def _choose(self, wanted: list[Rental]) -> tuple[list[dict[str, Any]], dict[bytes, list[dict[str, Any]]]]:
        """An offer per rental, one search per distinct search (an offer is never chosen twice), and each search's
        spares; ProvisionFailed when a search has too few matches or the whole plan costs over max_total_dph."""
        groups: dict[bytes, list[int]] = {}
        for i, rental in enumerate(wanted):
            groups.setdefault(rental.search_key, []).append(i)
        chosen: list[dict[str, Any]] = [{} for _ in wanted]
        spares: dict[bytes, list[dict[str, Any]]] = {}
        taken: set[int] = set()
        for key, members in groups.items():
            s = wanted[members[0]].settings
            offers = [o for o in self.client.search_offers(offer_query(s, len(members))) if int(o["id"]) not in taken]
            plan = choose_offers(offers, s, len(members), [wanted[i].describe() for i in members])
            for i, offer in zip(members, plan.chosen):
                chosen[i] = offer
                taken.add(int(offer["id"]))
            spares[key] = list(plan.spares)
        total = sum(float(o["dph_total"]) for o in chosen)
        if total > self.settings.max_total_dph:
            raise ProvisionFailed(
                f"the {len(chosen)} instance(s) the plan needs cost ${total:.3f}/hr together, over "
                f"provider.vastai.max_total_dph ${self.settings.max_total_dph:.3f}/hr; nothing was rented"
            )
        return chosen, spares

    def _create(self, rental: Rental, offer: dict[str, Any], spares: list[dict[str, Any]], which: str) -> None:
        env = instance_env(rental, {LABEL_VAR: self.run_label})
        image = rental.specs[0].image or self.image
        body = create_body(rental.settings, image, self.run_label, env, port_requests(rental), rental.command)
        while True:
            try:
                iid = self.client.create_instance(int(offer["id"]), body)
                break
            except VastApiError as exc:
                if exc.new_contract is not None:
                    self._discard(exc.new_contract, rental.describe(), offer)
                if exc.error == "no_such_ask" and spares:
                    replacement = spares.pop(0)
                    total = self._total_dph + float(replacement["dph_total"]) - float(offer["dph_total"])
                    if total <= self.settings.max_total_dph:
                        _say(
                            f"  offer {offer['id']} is gone; {rental.describe()} takes offer {replacement['id']} "
                            f"(${float(replacement['dph_total']):.3f}/hr) instead"
                        )
                        offer, self._total_dph = replacement, total
                        continue
                raise ProvisionFailed(f"creating instance {which} ({rental.describe()}) failed: {exc}") from exc
        for spec in rental.specs:
            inst = self._adopt(iid, spec.name, offer)
            if len(rental.specs) > 1:
                inst.meta["host"] = rental.name
            inst.meta["container_port"] = str(rental.ports[spec.name])

    def _adopt(self, iid: int, name: str, offer: dict[str, Any]) -> Instance:
        inst = Instance(
            id=str(iid),
            name=name,
            provider=self.kind,
            meta={
                "offer": str(offer["id"]),
                "dph_total": f"{float(offer['dph_total']):.4f}",
                "gpu": f"{offer.get('num_gpus')}x {offer.get('gpu_name')}",
            },
        )
        self.instances.append(inst)
        return inst

    def _discard(self, iid: int, name: str, offer: dict[str, Any]) -> None:
        """An instance a failed create left behind: destroyed now, or kept (unwatched) for destroy_all to retry."""
        try:
            self.client.destroy_instance(iid)
            self._destroyed.add(iid)
        except VastApiError:
            self._orphans.add(iid)
            self._adopt(iid, f"{name} (failed create)", offer)

    def _list_mine(self) -> dict[int, dict[str, Any]]:
        recs = self.client.list_instances({"label": {"eq": self.run_label}})
        found = {int(r["id"]): r for r in recs if "id" in r}
        self._seen.update(found)
        return found

    def _watched(self) -> list[Instance]:
        return [i for i in self.instances if int(i.id) not in self._destroyed and int(i.id) not in self._orphans]

    def _failure(self, iid: int, polls: int) -> str | None:
        """Why instance ``iid`` will not serve, by the last list; one not listed yet is given ``UNLISTED_GRACE``
        polls to appear (a new instance may show up in the list late)."""
        rec = self._records.get(iid)
        if rec is None and iid not in self._seen and polls < UNLISTED_GRACE:
            return None
        return failure_of(rec)

    def _wait_running(self) -> None:
        pending: dict[int, list[Instance]] = {}
        for inst in self._watched():  # a host's nodes share their instance
            pending.setdefault(int(inst.id), []).append(inst)
        for poll in range(MAX_POLLS):
            self._records = self._list_mine()
            self._polled_at = time.monotonic()
            for iid, insts in list(pending.items()):
                rec = self._records.get(iid)
                why = self._failure(iid, poll + 1)
                if why is not None:
                    raise NotReady(f"vast.ai instance {iid} ({_names(insts)}) will not run: {why}")
                if rec is not None and is_running(rec):
                    for inst in insts:
                        inst.meta.update(_addresses(rec))
                    del pending[iid]
            if not pending:
                return
            if poll < MAX_POLLS - 1:
                time.sleep(self.poll_s)
        stuck = ", ".join(f"{iid} ({_names(i)}: {describe(self._records.get(iid))})" for iid, i in pending.items())
        raise NotReady(f"vast.ai instance(s) not running after {MAX_POLLS} polls {self.poll_s:g} s apart: {stuck}")

    # --- watching ------------------------------------------------------------------------------------------------

    def exited(self) -> list[tuple[Instance, int]]:
        """Instances that stopped serving (exited, lost, stopped, gone), as exit code 1: the API reports no code."""
        live = self._watched()
        if live and time.monotonic() - self._polled_at >= self.poll_s:
            self._polled_at = time.monotonic()
            try:
                self._records = self._list_mine()
                self._watch_failures = 0
            except VastApiError as exc:
                self._watch_failures += 1
                if self._watch_failures >= WATCH_FAILURES_MAX:
                    raise ProviderError(f"cannot watch the vast.ai instances: {exc}") from exc
                return []
        return [(i, 1) for i in live if self._failure(int(i.id), UNLISTED_GRACE) is not None]

    def logs(self, instance: Instance, lines: int = 20) -> str:
        """What the API says of the instance (its container log is not part of the API subset used here)."""
        rec = self._records.get(int(instance.id))
        why = failure_of(rec)
        return f"vast.ai instance {instance.id}: {describe(rec)}" + (f" ({why})" if why else "") + "\n"

    # --- teardown ------------------------------------------------------------------------------------------------

    def destroy(self, instance: Instance) -> None:
        iid = int(instance.id)
        if iid in self._destroyed:
            return
        try:
            self.client.destroy_instance(iid)
        except VastApiError as exc:
            raise ProviderError(
                f"{exc}; it is still billed: run `ppharness reap --provider vastai --label "
                f"{self.run_label}` once the API accepts it"
            ) from exc
        self._destroyed.add(iid)

    def destroy_all(self) -> list[str]:
        """Destroy what this provider created, then anything else carrying the run's label (a create whose reply was
        lost); one warning per instance that is still there."""
        warnings = super().destroy_all()
        try:
            left = [r for r in self._list_mine().values() if int(r["id"]) not in self._destroyed and not is_gone(r)]
        except VastApiError as exc:
            left, warnings = [], warnings + [f"listing run {self.run_label}'s instances failed: {exc}"]
        for rec in left:
            try:
                self.destroy(Instance(id=str(rec["id"]), name=f"instance {rec['id']}", provider=self.kind))
            except ProviderError as exc:
                warnings.append(f"destroying instance {rec['id']} failed: {exc}")
                _say(f"warning: {warnings[-1]}")
        return warnings

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            self.client.close()

    @classmethod
    def reap(
        cls, label: str | None = None, select: Callable[[str], bool] | None = None, dry_run: bool = False
    ) -> list[Reaped]:
        """Destroy the instances labelled ``label`` (every instance a ppharness run started, recognised by its
        ``PP_RUN_LABEL`` environment entry, when None) whose run label ``select`` accepts; ``dry_run`` only lists
        them. Without ``VAST_API_KEY`` there is nothing to reach."""
        client = client_from_env()
        if client is None:
            _say("vastai: VAST_API_KEY is not set; no vast.ai instances were looked for")
            return []
        with client:
            try:
                recs = client.list_instances({"label": {"eq": label}} if label else None)
                victims = [
                    r
                    for r in recs
                    if not is_gone(r)
                    and (label or _run_label_of(r))
                    and (select is None or select(_run_label_of(r) or str(r.get("label") or "")))
                ]
                for rec in victims if not dry_run else []:
                    client.destroy_instance(int(rec["id"]))
            except VastApiError as exc:
                raise ProviderError(f"reaping vast.ai instances at {client.base_url} failed: {exc}") from exc
        return [
            Reaped(
                f"instance {r['id']} (${float(r.get('dph_total') or 0):.3f}/hr)",
                _run_label_of(r) or str(r.get("label") or ""),
            )
            for r in victims
        ]


def _run_label_of(rec: dict[str, Any]) -> str | None:
    env = rec.get("extra_env") or []
    pairs = env.items() if isinstance(env, dict) else (p for p in env if isinstance(p, (list, tuple)) and len(p) == 2)
    return next((str(v) for k, v in pairs if k == LABEL_VAR), None)


def _names(insts: list[Instance]) -> str:
    return ", ".join(i.name for i in insts)


def _addresses(rec: dict[str, Any]) -> dict[str, str]:
    ports = rec.get("ports") or {}
    return {
        "public_ipaddr": str(rec.get("public_ipaddr") or "").strip(),
        "machine_id": str(rec.get("machine_id")),
        "ssh": f"{rec.get('ssh_host')}:{rec.get('ssh_port')}",
        "ports": ",".join(sorted(ports)),
    }
