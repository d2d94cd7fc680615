"""FastAPI dependencies of the scheduler routes: the app state, its clients, and bearer-token auth."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from rollout_ledger.services.scheduler.state import Resources, SchedulerState

_bearer = HTTPBearer(auto_error=False, description="ROLLOUT_API_TOKEN, required on mutating routes when set")


def get_state(request: Request) -> SchedulerState:
    state: SchedulerState = request.app.state.scheduler
    return state


StateDep = Annotated[SchedulerState, Depends(get_state)]


def get_resources(state: StateDep) -> Resources:
    if state.resources is None:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "scheduler is not connected yet (or is stopping)")
    return state.resources


ResourcesDep = Annotated[Resources, Depends(get_resources)]


def require_token(
    state: StateDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """401 unless the request carries ``Authorization: Bearer <ROLLOUT_API_TOKEN>`` (no-op when no token is set)."""
    expected = state.settings.api_token
    if expected is None:
        return
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "missing bearer token: send 'Authorization: Bearer <ROLLOUT_API_TOKEN>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not secrets.compare_digest(credentials.credentials.encode(), expected.get_secret_value().encode()):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "invalid bearer token", headers={"WWW-Authenticate": "Bearer"}
        )


AuthDep = Depends(require_token)
