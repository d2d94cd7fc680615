"""The session endpoint's HTTP app: ``/sessions/{episode_id}/v1/chat/completions`` and ``/v1/models``, and the
registry of the sessions open in this worker.

Served by the env worker on its own port (``session_port``), next to the ops server. Each session has a secret of
its own, made when it opens and handed to the agent as its client's ``api_key``: a call must carry it
(``Authorization: Bearer <secret>``, what every OpenAI SDK sends) or it is answered 401, so nothing but the episode's
own agent can add a turn to its trajectory. Every error is in the OpenAI shape, so SDKs raise their usual
``BadRequestError`` / ``NotFoundError`` / ``AuthenticationError`` with our message (the Responses API, what the
OpenAI Agents SDK uses unless given its chat-completions model, is a 404 saying so).
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout_ledger.services.env_worker.sessions.mapping import DONE, sse
from rollout_ledger.services.env_worker.sessions.protocol import ApiError, parse_request
from rollout_ledger.services.env_worker.sessions.session import AgentSession
from rollout_ledger.shared.kit.logging import get_logger

log = get_logger(__name__)

PREFIX = "/sessions/{episode_id}/v1"


class SessionRegistry:
    """The sessions of the episodes running in this worker, by episode id, and the URL they are served at."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        """The id ``/v1/models`` lists (the policy's directory name)."""
        self.base_url = ""
        """``http://host:port`` of the session server (set once it is bound)."""
        self._sessions: dict[str, AgentSession] = {}
        self._secrets: dict[str, str] = {}

    def url(self, episode_id: str) -> str:
        """The OpenAI ``base_url`` of an episode's session."""
        if not self.base_url:
            raise RuntimeError("the session server is not started")
        return f"{self.base_url}/sessions/{episode_id}/v1"

    def open(self, episode_id: str, session: AgentSession) -> str:
        """Serve ``session`` at the episode's URL; the secret its calls must carry (the agent's ``api_key``)."""
        secret = f"sess-{secrets.token_urlsafe(32)}"
        self._sessions[episode_id] = session
        self._secrets[episode_id] = secret
        return secret

    def close(self, episode_id: str) -> None:
        self._sessions.pop(episode_id, None)
        self._secrets.pop(episode_id, None)

    def get(self, episode_id: str, authorization: str | None) -> AgentSession:
        """The open session of ``episode_id`` when ``authorization`` (the request's header) carries its secret:
        404 when no such session is open, 401 when the secret is missing or not this session's."""
        session = self._sessions.get(episode_id)
        if session is None:
            raise ApiError(404, f"no open session for episode {episode_id!r} in this worker "
                           "(unknown, or its episode has ended)", code="session_not_found", type_="not_found_error")
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                  self._secrets[episode_id].encode()):
            raise ApiError(401, "missing or wrong API key: a session is called with the api_key its agent was given "
                           "(each episode has its own)", code="invalid_api_key")
        return session

    def __len__(self) -> int:
        return len(self._sessions)


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def session_app(registry: SessionRegistry) -> FastAPI:
    """The app serving every session of ``registry``."""
    app = FastAPI(title="rollout-ledger agent sessions (OpenAI-compatible)", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(ApiError(400, str(exc.errors()[:1])))

    @app.get(PREFIX + "/models")
    async def models(episode_id: str, request: Request) -> dict[str, Any]:
        registry.get(episode_id, request.headers.get("authorization"))
        return {"object": "list", "data": [{"id": registry.model_name, "object": "model", "created": 0,
                                            "owned_by": "rollout-ledger"}]}

    @app.get(PREFIX + "/models/{model_id:path}")
    async def model(episode_id: str, model_id: str, request: Request) -> dict[str, Any]:
        registry.get(episode_id, request.headers.get("authorization"))
        return {"id": model_id, "object": "model", "created": 0, "owned_by": "rollout-ledger"}

    @app.api_route(PREFIX + "/responses", methods=["GET", "POST"])
    @app.api_route(PREFIX + "/responses/{rest:path}", methods=["GET", "POST", "DELETE"])
    async def responses(episode_id: str) -> Response:
        raise ApiError(404, "this endpoint serves chat completions, not the Responses API: with the OpenAI Agents "
                       "SDK give the agent OpenAIChatCompletionsModel(model=..., openai_client=client); with "
                       "LangChain leave use_responses_api off", code="responses_api_not_supported",
                       type_="not_found_error")

    @app.post(PREFIX + "/chat/completions")
    async def chat_completions(episode_id: str, request: Request) -> Response:
        with structlog.contextvars.bound_contextvars(episode_id=episode_id):
            return await _chat(episode_id, request)

    async def _chat(episode_id: str, request: Request) -> Response:
        session = registry.get(episode_id, request.headers.get("authorization"))
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"the request body is not JSON: {exc}") from None
        req = parse_request(body)
        started = time.perf_counter()
        try:
            completion = await session.complete(req)
        except ApiError:
            raise
        except Exception as exc:  # a bug: answer in the OpenAI shape and keep the worker going
            log.error("session.call_failed", error=f"{type(exc).__name__}: {exc}",
                      exc_info=True)
            raise ApiError(500, f"internal error: {type(exc).__name__}: {exc}") from None
        log.debug("session.call", turn=completion.extra.get("turn_index"),
                  tokens=len(completion.token_ids), ms=round((time.perf_counter() - started) * 1000, 1))
        if not req.stream:
            return Response(orjson.dumps(completion.response()), media_type="application/json")

        async def events() -> AsyncIterator[bytes]:
            for chunk in completion.chunks(req.include_usage):
                yield sse(chunk)
            yield DONE

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app
