"""``LedgerClient``: the scheduler's REST API for a trainer or a script (submit batches, wait for them, announce a
policy version and wait until it is served), with no progress bars and nothing of the services.

    from rollout_ledger.client import LedgerClient

    ledger = LedgerClient("http://scheduler:8000")            # token: ROLLOUT_API_TOKEN, or the local stack's
    created = ledger.submit(env="arithmetic", tasks=[{"seed": 1}], group_size=4)
    ledger.wait_batch(created["batch_id"])
    ledger.publish_version(7, "/ckpt/step-7", mode="drain")   # returns once every inference worker serves 7
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import httpx

from rollout_ledger.shared.lifecycle import TERMINAL as TERMINAL  # the statuses that end an episode (re-exported)


class SchedulerError(RuntimeError):
    """The scheduler answered with an error (or not in time); the message is its explanation."""


def local_stack_file() -> Path:
    """Where ``rollout up`` / ``rollout demo`` leave their scheduler's URL and token for clients (mode 0600)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "rollout-ledger" / "local-stack.json"


def local_stack() -> dict[str, str] | None:
    """The local stack's ``{"url", "token"}`` (None when no local stack runs or its record is unreadable)."""
    try:
        saved = json.loads(local_stack_file().read_text())
    except (OSError, ValueError):
        return None
    if isinstance(saved, dict) and isinstance(saved.get("url"), str) and isinstance(saved.get("token"), str):
        return {"url": saved["url"], "token": saved["token"]}
    return None


def local_token(url: str) -> str | None:
    """The token ``rollout up`` / ``rollout demo`` recorded for ``url`` (None when ``url`` is not that stack's)."""
    saved = local_stack()
    return saved["token"] if saved is not None and saved["url"] == url.rstrip("/") else None


def resolve_token(url: str, token: str | None = None) -> str | None:
    """The bearer token for ``url``: the one given, else ``ROLLOUT_API_TOKEN``, else the local stack's when ``url``
    is its scheduler, else none."""
    if token:
        return token
    if os.environ.get("ROLLOUT_API_TOKEN"):
        return os.environ["ROLLOUT_API_TOKEN"]
    return local_token(url)


class LedgerClient:
    """The scheduler's API over HTTP, with the bearer token of ``resolve_token``."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        token = resolve_token(self.url, token)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> LedgerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check(self, resp: httpx.Response) -> Any:
        if resp.status_code >= 400:
            try:
                detail = resp.json().get("detail", resp.text)
            except (ValueError, AttributeError):
                detail = resp.text
            raise SchedulerError(f"{resp.request.method} {resp.request.url.path} -> {resp.status_code}: {detail}")
        return resp.json()

    # --- batches -------------------------------------------------------------------------------------------------

    def submit(self, **body: Any) -> dict[str, Any]:
        """``POST /v1/batches`` (fields as in docs/api.md; ``None`` values are left out)."""
        body = {k: v for k, v in body.items() if v is not None}
        created: dict[str, Any] = self._check(self.http.post("/v1/batches", json=body))
        return created

    def batch(self, batch_id: str) -> dict[str, Any]:
        """``GET /v1/batches/{id}``: counts by status, ``done``, rewards, admission."""
        info: dict[str, Any] = self._check(self.http.get(f"/v1/batches/{batch_id}"))
        return info

    def cancel(self, batch_id: str) -> dict[str, Any]:
        info: dict[str, Any] = self._check(self.http.post(f"/v1/batches/{batch_id}/cancel"))
        return info

    def wait_batch(self, batch_id: str, timeout_s: float | None = None, poll_s: float = 0.25) -> dict[str, Any]:
        """Poll until every episode of the batch is terminal; its last status (``SchedulerError`` past
        ``timeout_s``)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            info = self.batch(batch_id)
            if info.get("done"):
                return info
            if deadline is not None and time.monotonic() > deadline:
                raise SchedulerError(f"batch {batch_id} not done after {timeout_s}s: {info.get('counts')}")
            time.sleep(poll_s)

    # --- policy versions -----------------------------------------------------------------------------------------

    def policy(self) -> dict[str, Any]:
        """``GET /v1/policy``: the announced version and each inference worker's report."""
        info: dict[str, Any] = self._check(self.http.get("/v1/policy"))
        return info

    def announce_version(self, **body: Any) -> dict[str, Any]:
        """``POST /v1/policy/versions`` (version, checkpoint, mode, notes)."""
        info: dict[str, Any] = self._check(self.http.post("/v1/policy/versions", json=body))
        return info

    def served_by_all(self, version: int) -> bool:
        """Whether every inference worker reporting (at least one) serves ``version``; ``SchedulerError`` when one
        failed to load it."""
        workers = self.policy()["workers"]
        failed = [w for w in workers if w["version"] == version and w["state"] == "failed"]
        if failed:
            raise SchedulerError(f"inference worker {failed[0]['worker_id']} failed to load version {version}: "
                                 f"{failed[0]['error']}")
        return bool(workers) and all(int(w["serving"]) >= version for w in workers)

    def wait_served(self, version: int, timeout_s: float | None = None, poll_s: float = 0.1) -> None:
        """Until every inference worker serves ``version`` (or newer)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.served_by_all(version):
            if deadline is not None and time.monotonic() > deadline:
                workers = self.policy()["workers"]
                raise SchedulerError(f"version {version} not served by every worker after {timeout_s}s: "
                                     + ", ".join(f"{w['worker_id']} serves {w['serving']} ({w['state']})"
                                                 for w in workers))
            time.sleep(poll_s)

    def publish_version(self, version: int, checkpoint: str | Path, mode: str = "drain", notes: str = "",
                        timeout_s: float | None = 600.0) -> float:
        """Announce ``checkpoint`` as ``version`` and wait until every inference worker serves it; the seconds it
        took."""
        began = time.monotonic()
        self.announce_version(version=version, checkpoint=str(checkpoint), mode=mode, notes=notes)
        self.wait_served(version, timeout_s)
        return time.monotonic() - began
