"""FastAPI dependencies of the scheduler routes: the app state, its clients, and bearer-token auth by scope."""

from __future__ import annotations

import secrets
from enum import StrEnum
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from rollout_ledger.services.scheduler.settings import SchedulerSettings
from rollout_ledger.services.scheduler.state import Resources, SchedulerState

_bearer = HTTPBearer(
    auto_error=False,
    description="ROLLOUT_API_TOKEN (scopes read and write) or ROLLOUT_API_READ_TOKEN (scope read); every route of "
                "/v1 needs one (401 without, 403 for a read token on a write)",
)


class Scope(StrEnum):
    """What a bearer token lets its holder do."""

    READ = "read"
    """GET batches, episodes, trajectories, envs, the policy (and /metrics with ROLLOUT_METRICS_AUTH=read)."""
    WRITE = "write"
    """POST: submit and cancel batches, announce policy versions; includes ``read``."""


def get_state(request: Request) -> SchedulerState:
    state: SchedulerState = request.app.state.scheduler
    return state


StateDep = Annotated[SchedulerState, Depends(get_state)]


def get_resources(state: StateDep) -> Resources:
    if state.resources is None:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "scheduler is not connected yet (or is stopping)")
    return state.resources


ResourcesDep = Annotated[Resources, Depends(get_resources)]


def _matches(given: str, expected: object) -> bool:
    secret = getattr(expected, "get_secret_value", None)
    return secret is not None and secrets.compare_digest(given.encode(), str(secret()).encode())


def scopes_of(settings: SchedulerSettings, authorization: str | None) -> set[Scope] | None:
    """The scopes an ``Authorization`` header grants; None when it grants nothing (missing, malformed, unknown).

    With ``ROLLOUT_API_AUTH=disabled`` every request has every scope."""
    if settings.api_auth == "disabled":
        return {Scope.READ, Scope.WRITE}
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    if _matches(token, settings.api_token):
        return {Scope.READ, Scope.WRITE}
    if _matches(token, settings.api_read_token):
        return {Scope.READ}
    return None


def check_scope(settings: SchedulerSettings, authorization: str | None, needed: Scope) -> None:
    """401 without a known bearer token, 403 when the token lacks ``needed``."""
    granted = scopes_of(settings, authorization)
    if granted is None:
        what = "missing bearer token" if not authorization else "invalid bearer token"
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            f"{what}: send 'Authorization: Bearer <token>' (ROLLOUT_API_TOKEN, or ROLLOUT_API_READ_TOKEN for reads)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if needed not in granted:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, f"this token has the scopes {sorted(granted)}; this route needs '{needed}'"
        )


def _authorization(credentials: HTTPAuthorizationCredentials | None) -> str | None:
    return f"{credentials.scheme} {credentials.credentials}" if credentials is not None else None


def require_read(
    state: StateDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """401 unless the request carries a token with the ``read`` scope."""
    check_scope(state.settings, _authorization(credentials), Scope.READ)


def require_write(
    state: StateDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """401 unless the request carries a token; 403 unless that token has the ``write`` scope."""
    check_scope(state.settings, _authorization(credentials), Scope.WRITE)


ReadDep = Depends(require_read)
WriteDep = Depends(require_write)
