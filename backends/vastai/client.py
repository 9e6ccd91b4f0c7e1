"""A small vast.ai REST client on httpx: the API subset of shared/vastai-api.md, nothing more.

Guarantees:
- The API key travels only in the ``Authorization: Bearer`` header. It is held in an ``ApiKey`` whose ``repr`` and
  ``str`` are masked, is never put in a URL, and never appears in an exception this module raises (errors name the
  method, the path, the HTTP status, the API's ``error`` code and ``msg``).
- Requests are paced per endpoint (the contract's minimum intervals, scaled by ``pace``) and retried with exponential
  backoff (tenacity) on 429, 502, 503 and 504 only, plus connection failures where a retry cannot act twice: never a
  daily search-quota 429, never any other status. A numeric ``Retry-After`` of at most 60 s is waited out; a longer
  one ends the retries at once.
- Every failure is a ``VastApiError`` (a ProviderError) raised ``from`` the library's exception.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Generator, Mapping
from typing import Any, NoReturn

import httpx
import tenacity

from ppharness.errors import ProviderError

DEFAULT_URL = "https://console.vast.ai"
KEY_VAR, URL_VAR = "VAST_API_KEY", "VAST_URL"
TRANSIENT_STATUS = frozenset({429, 502, 503, 504})
GONE_ERRORS = frozenset({"no_such_instance", "not_found"})
# Minimum seconds between two calls of one endpoint (shared/vastai-api.md §1; search: 10 requests/min per IP).
MIN_INTERVAL_S = {"search": 6.0, "create": 4.5, "show": 2.0, "destroy": 3.0, "manage": 1.0, "list": 1.0}
LIST_PAGE_LIMIT = 25
MAX_RETRY_AFTER_S = 60.0
MAX_PAGES = 400


class ApiKey:
    """A vast.ai API key. ``repr``/``str`` are masked and it refuses to be pickled; ``reveal()`` gives the value."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        value = (value or "").strip()
        if not value:
            raise ProviderError("the vast.ai API key is empty: pass --api-key or set VAST_API_KEY")
        self._value = value

    def reveal(self) -> str:
        return self._value

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ApiKey | None:
        """The key in ``VAST_API_KEY``, or None when it is unset or empty."""
        value = (env if env is not None else os.environ).get(KEY_VAR, "")
        return cls(value) if value.strip() else None

    def __repr__(self) -> str:
        return "ApiKey('********')"

    __str__ = __repr__

    def __reduce__(self) -> NoReturn:
        raise TypeError("an ApiKey cannot be pickled")


class _BearerAuth(httpx.Auth):
    """Adds the bearer header at send time, so the key lives in no client-wide header table."""

    def __init__(self, key: ApiKey) -> None:
        self._key = key

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = f"Bearer {self._key.reveal()}"
        yield request


class VastApiError(ProviderError):
    """A vast.ai reply that is not a success, or no reply at all (``status`` 0)."""

    def __init__(
        self,
        what: str,
        status: int = 0,
        error: str = "",
        msg: str = "",
        new_contract: int | None = None,
        reset_at: float | None = None,
    ) -> None:
        detail = " ".join(p for p in (f"HTTP {status}" if status else "", error, f"({msg})" if msg else "") if p)
        super().__init__(f"{what}: {detail}" if detail else what)
        self.status, self.error, self.msg, self.new_contract, self.reset_at = status, error, msg, new_contract, reset_at

    @property
    def gone(self) -> bool:
        """The instance or offer no longer exists (destroy treats this as done)."""
        return self.status == 404 or self.error in GONE_ERRORS


def api_url(env: Mapping[str, str] | None = None) -> str:
    """The API's base URL: ``VAST_URL`` when set (as the vastai SDK reads it), else https://console.vast.ai."""
    return ((env if env is not None else os.environ).get(URL_VAR) or DEFAULT_URL).rstrip("/")


def reply_body(resp: httpx.Response) -> Any:
    """The reply's JSON, or None when the body is not JSON (429s are often plain text)."""
    try:
        return resp.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def _error_of(what: str, resp: httpx.Response) -> VastApiError:
    body = reply_body(resp)
    if isinstance(body, dict):
        error = str(body.get("error") or "")
        msg = str(body.get("msg") or body.get("message") or body.get("detail") or "")
        contract = body.get("new_contract")
    else:
        error, msg, contract = "", resp.text.strip()[:300], None
    reset = resp.headers.get("X-RateLimit-Reset")
    return VastApiError(
        what,
        resp.status_code,
        error,
        msg,
        contract if isinstance(contract, int) else None,
        float(reset) if reset and reset.replace(".", "", 1).isdigit() else None,
    )


def _retry_after(resp: httpx.Response) -> float | None:
    after = resp.headers.get("Retry-After", "")
    return float(after) if after.replace(".", "", 1).isdigit() else None


def _not_worth_waiting(resp: httpx.Response) -> bool:
    """The daily search quota is spent, or the server asks for more than a minute's wait: give up at once."""
    body = reply_body(resp)
    quota = resp.status_code == 429 and isinstance(body, dict) and body.get("error") == "search_quota_exceeded"
    after = _retry_after(resp)
    return quota or (after is not None and after > MAX_RETRY_AFTER_S)


class VastClient:
    """One API identity at one base URL. Thread-safe pacing; use as a context manager or call ``close()``."""

    def __init__(
        self,
        key: ApiKey,
        base_url: str = DEFAULT_URL,
        *,
        pace: float = 1.0,
        attempts: int = 6,
        timeout_s: float = 30.0,
        sleep: Callable[[float], None] = time.sleep,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not isinstance(key, ApiKey):
            raise TypeError("VastClient needs an ApiKey")
        self.base_url, self.pace, self.attempts, self._sleep = base_url.rstrip("/"), pace, attempts, sleep
        self._http = httpx.Client(
            base_url=self.base_url,
            auth=_BearerAuth(key),
            timeout=timeout_s,
            transport=transport,
            headers={"User-Agent": "ppharness-vastai/0.1", "Accept": "application/json"},
        )
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"VastClient({self.base_url!r})"

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> VastClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the endpoints ------------------------------------------------------------------------------------------

    def search_offers(self, query: dict[str, Any]) -> list[dict[str, Any]]:
        """``POST /api/v0/bundles/``: the offers matching ``query`` (the API's filter grammar), in the API's order."""
        what = "searching offers (POST /api/v0/bundles/)"
        resp = self._call("search", "POST", "/api/v0/bundles/", what, json=query)
        if not resp.headers.get("Content-Type", "").startswith("application/json"):
            raise VastApiError(what, resp.status_code, "", f"reply is {resp.headers.get('Content-Type')!r}, not JSON")
        offers = (reply_body(resp) or {}).get("offers")
        if not isinstance(offers, list):
            raise VastApiError(what, resp.status_code, "", "reply has no 'offers' list")
        return offers

    def create_instance(self, offer_id: int, body: dict[str, Any]) -> int:
        """``PUT /api/v0/asks/{offer_id}/``: the new instance's id. A reply without ``success`` raises, carrying any
        ``new_contract`` it names (an instance that exists anyway and must be destroyed)."""
        what = f"creating an instance from offer {offer_id} (PUT /api/v0/asks/{offer_id}/)"
        resp = self._call("create", "PUT", f"/api/v0/asks/{offer_id}/", what, json=body, idempotent=False)
        data = reply_body(resp)
        if (
            not isinstance(data, dict)
            or data.get("success") is not True
            or not isinstance(data.get("new_contract"), int)
        ):
            raise _error_of(what, resp)
        return int(data["new_contract"])

    def show_instance(self, instance_id: int) -> dict[str, Any] | None:
        """``GET /api/v0/instances/{id}/``: the instance, or None when it is gone (``instances: null`` or 404)."""
        what = f"showing instance {instance_id}"
        resp = self._call(
            "show", "GET", f"/api/v0/instances/{instance_id}/", what, params={"owner": "me"}, ok_statuses=(200, 404)
        )
        if resp.status_code == 404:
            err = _error_of(what, resp)
            if err.gone:
                return None
            raise err
        inst = (reply_body(resp) or {}).get("instances")
        return inst if isinstance(inst, dict) else None

    def list_instances(self, select_filters: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """``GET /api/v1/instances/``, every page (keyset cursor ``next_token``), ordered by id."""
        out: list[dict[str, Any]] = []
        token: str | None = None
        for _ in range(MAX_PAGES):
            params = {"order_by": json.dumps([{"col": "id", "dir": "asc"}]), "limit": str(LIST_PAGE_LIMIT)}
            if select_filters:
                params["select_filters"] = json.dumps(select_filters)
            if token:
                params["after_token"] = token
            data = reply_body(self._call("list", "GET", "/api/v1/instances/", "listing instances", params=params))
            if not isinstance(data, dict) or not isinstance(data.get("instances"), list):
                raise VastApiError("listing instances", 200, "", "reply has no 'instances' list")
            out += data["instances"]
            token = data.get("next_token") or None
            if not token:
                return out
        raise VastApiError("listing instances", 200, "", f"more than {MAX_PAGES} pages")

    def destroy_instance(self, instance_id: int) -> bool:
        """``DELETE /api/v0/instances/{id}/``: True when destroyed now, False when it was already gone (404,
        ``no_such_instance`` or ``not_found``)."""
        what = f"destroying instance {instance_id}"
        resp = self._call(
            "destroy", "DELETE", f"/api/v0/instances/{instance_id}/", what, json={}, ok_statuses=(200, 404)
        )
        data = reply_body(resp)
        if resp.status_code == 200 and isinstance(data, dict) and data.get("success") is True:
            return True
        err = _error_of(what, resp)
        if err.gone:
            return False
        raise err

    def manage_instance(self, instance_id: int, body: dict[str, Any]) -> None:
        """``PUT /api/v0/instances/{id}/`` with ``{"state": ...}`` or ``{"label": ...}``."""
        what = f"changing instance {instance_id}"
        resp = self._call("manage", "PUT", f"/api/v0/instances/{instance_id}/", what, json=body)
        data = reply_body(resp)
        if not isinstance(data, dict) or data.get("success") is not True:
            raise _error_of(what, resp)

    # --- pacing, retries, error mapping -------------------------------------------------------------------------

    def _wait_turn(self, endpoint: str) -> None:
        with self._lock:
            gap = MIN_INTERVAL_S.get(endpoint, 1.0) * self.pace
            due = self._last.get(endpoint, -1e9) + gap
            now = time.monotonic()
            if due > now:
                self._sleep(due - now)
            self._last[endpoint] = time.monotonic()

    def _backoff(self, state: tenacity.RetryCallState) -> float:
        if state.outcome is not None and not state.outcome.failed:
            after = _retry_after(state.outcome.result())
            if after is not None:
                return after
        return min(0.5 * 2.0 ** (state.attempt_number - 1), 30.0) * self.pace

    def _call(
        self,
        endpoint: str,
        method: str,
        path: str,
        what: str,
        *,
        json: Any = None,
        params: dict[str, str] | None = None,
        idempotent: bool = True,
        ok_statuses: tuple[int, ...] = (200,),
    ) -> httpx.Response:
        """One request, paced and retried; a reply whose status is not in ``ok_statuses`` raises VastApiError."""
        retry_exc = httpx.TransportError if idempotent else (httpx.ConnectError, httpx.ConnectTimeout)

        def should_retry(state: tenacity.RetryCallState) -> bool:
            assert state.outcome is not None
            if state.outcome.failed:
                return isinstance(state.outcome.exception(), retry_exc)
            resp = state.outcome.result()
            return resp.status_code in TRANSIENT_STATUS and not _not_worth_waiting(resp)

        def attempt() -> httpx.Response:
            self._wait_turn(endpoint)
            return self._http.request(method, path, json=json, params=params)

        def last_outcome(state: tenacity.RetryCallState) -> httpx.Response:
            assert state.outcome is not None
            resp: httpx.Response = state.outcome.result()  # the last reply, or the last exception raised again
            return resp

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.attempts),
            wait=self._backoff,
            retry=should_retry,
            sleep=self._sleep,
            retry_error_callback=last_outcome,
        )
        try:
            resp = retrying(attempt)
        except httpx.HTTPError as exc:
            raise VastApiError(f"{what}: no reply from {self.base_url} ({type(exc).__name__}: {exc})") from exc
        if resp.status_code not in ok_statuses:
            raise _error_of(what, resp)
        return resp
