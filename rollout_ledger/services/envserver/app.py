"""The reference environment server's HTTP app: the remote actor protocol over an ``ActorTable``.

Routes (see ``services/envs/remote.py`` for the client side and the shapes):
``POST /{env}/{env_id}/reset``, ``GET /{env}/{env_id}/get_task_prompt``, ``POST /{env}/{env_id}/step``,
``DELETE /{env}/{env_id}``, plus ``GET /envs`` (what it serves), ``GET /stats`` (requests seen, by kind and
status class) and ``/healthz``.

Status codes: 404 unknown env or actor; 422 a malformed body or a task the env refuses (``TaskError``); 409 a
request that does not fit the actor's state; 500 the environment's code raised (the client retries a 5xx).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Header, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from rollout_ledger.services.envs.base import TaskError
from rollout_ledger.services.envs.registry import UnknownEnvError
from rollout_ledger.services.envserver.actors import ActorConflict, ActorNotFound, ActorTable
from rollout_ledger.shared.kit.logging import get_logger

log = get_logger(__name__)

STEP_HEADER = "Rollout-Step"


class ResetBody(BaseModel):
    """``POST /{env}/{env_id}/reset``."""

    model_config = ConfigDict(extra="ignore")

    task: dict[str, Any] = Field(default_factory=dict)
    """The task handed to the environment's ``reset``."""


class StepBody(BaseModel):
    """``POST /{env}/{env_id}/step`` (interactor.py's body)."""

    model_config = ConfigDict(extra="ignore")

    action: str
    """The assistant's text."""


class EnvCodeError(Exception):
    """The environment's own code raised while serving a request (answered 500, which clients retry)."""

    def __init__(self, what: str, env: str, env_id: str, exc: Exception) -> None:
        super().__init__(f"{what}: {type(exc).__name__}: {exc}")
        self.env, self.env_id = env, env_id


def _kind(path: str, method: str) -> str:
    last = path.rstrip("/").rsplit("/", 1)[-1]
    if method == "DELETE":
        return "close"
    return last if last in ("reset", "step", "get_task_prompt") else "other"


def create_app(table: ActorTable) -> FastAPI:
    """The server's app over ``table`` (the caller owns the table: tests may build one of their own)."""
    app = FastAPI(title="rollout-ledger reference environment server", docs_url="/docs", redoc_url=None)
    stats: Counter[str] = Counter()
    app.state.table = table
    app.state.stats = stats

    @app.middleware("http")
    async def count(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        response = await call_next(request)
        kind = _kind(request.url.path, request.method)
        if kind != "other":
            stats[kind] += 1
            stats[f"{kind}.{response.status_code // 100}xx"] += 1
        return response

    @app.exception_handler(UnknownEnvError)
    async def unknown_env(_: Request, exc: UnknownEnvError) -> JSONResponse:
        return JSONResponse({"detail": f"unknown env {exc.args[0]!r}; served: {', '.join(table.envs.names())}"},
                            status_code=404)

    @app.exception_handler(ActorNotFound)
    async def no_actor(_: Request, exc: ActorNotFound) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(ActorConflict)
    async def conflict(_: Request, exc: ActorConflict) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(TaskError)
    async def bad_task(_: Request, exc: TaskError) -> JSONResponse:
        return JSONResponse({"detail": f"bad task: {exc}"}, status_code=422)

    @app.exception_handler(EnvCodeError)
    async def env_code(_: Request, exc: EnvCodeError) -> JSONResponse:
        log.warning("envserver.env_error", env=exc.env, env_id=exc.env_id, error=str(exc))
        return JSONResponse({"detail": str(exc)}, status_code=500)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"alive": True, "actors": len(table)}

    @app.get("/envs")
    async def envs() -> dict[str, Any]:
        return {"envs": [{"name": s.name, "description": s.description, "multi_turn": s.multi_turn,
                          "example_task": s.example_task} for s in table.envs.specs()]}

    @app.get("/stats")
    async def get_stats() -> dict[str, int]:
        return dict(stats)

    @app.post("/{env}/{env_id}/reset")
    async def reset(env: str, env_id: str, body: ResetBody) -> dict[str, Any]:
        try:
            actor = await table.reset(env, env_id, body.task)
        except (UnknownEnvError, TaskError, ActorConflict):
            raise
        except Exception as exc:  # the environment's code
            raise EnvCodeError("reset", env, env_id, exc) from exc
        return {"tools": actor.tools}

    @app.get("/{env}/{env_id}/get_task_prompt")
    async def get_task_prompt(env: str, env_id: str) -> list[dict[str, Any]]:
        actor = await table.get(env, env_id)
        return actor.messages

    @app.post("/{env}/{env_id}/step")
    async def step(env: str, env_id: str, body: StepBody,
                   rollout_step: int | None = Header(None, alias=STEP_HEADER, ge=0)) -> dict[str, Any]:
        actor = await table.get(env, env_id)
        try:
            return await table.step(actor, body.action, rollout_step)
        except ActorConflict:
            raise
        except Exception as exc:  # the environment's code
            raise EnvCodeError("step", env, env_id, exc) from exc

    @app.delete("/{env}/{env_id}", status_code=204)
    async def close(env: str, env_id: str) -> Response:
        found = await table.close(env, env_id)
        return Response(status_code=204 if found else 404)

    return app


