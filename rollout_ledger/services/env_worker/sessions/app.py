"""The session endpoint's HTTP app: ``/sessions/{episode_id}/v1/`` ``chat/completions``, ``responses`` and
``messages`` (each a dialect of ``dialects/``), ``models``, and the registry of the sessions open in this worker.

Served by the env worker on its own port (``session_port``), next to the ops server. Each session has a secret of
its own, made when it opens and handed to the agent as its API key: a call must carry it, as ``Authorization:
Bearer <secret>`` (what OpenAI SDKs send, and Anthropic's with an auth token) or ``x-api-key: <secret>`` (what
Anthropic SDKs and Claude Code send), or it is answered 401, so nothing but the episode's own agent can add a turn
to its trajectory. Every error is in the shape of the API the route speaks (OpenAI's ``{"error": {...}}``,
Anthropic's ``{"type": "error", "error": {...}}``), so SDKs raise their usual errors with our message.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, Protocol

import orjson
import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout_ledger.services.env_worker.sessions.dialects import chat_completions, messages, responses
from rollout_ledger.services.env_worker.sessions.session import AgentSession
from rollout_ledger.services.env_worker.sessions.turns import ApiError, TurnRequest, TurnResult
from rollout_ledger.shared.kit.logging import get_logger

log = get_logger(__name__)

PREFIX = "/sessions/{episode_id}/v1"


class Dialect(Protocol):
    """What the app needs of a dialect module (``dialects.chat_completions``, ``dialects.responses``,
    ``dialects.messages``)."""

    def parse(self, body: Any, memory: dict[str, Any]) -> tuple[TurnRequest, Any]: ...

    def response(self, result: TurnResult, req: Any, memory: dict[str, Any]) -> dict[str, Any]: ...

    def stream(self, result: TurnResult, req: Any, memory: dict[str, Any]) -> Iterator[bytes]: ...

    def error_body(self, exc: ApiError) -> dict[str, Any]: ...


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
        """The OpenAI ``base_url`` of an episode's session (Anthropic's ``base_url`` is this without ``/v1``)."""
        if not self.base_url:
            raise RuntimeError("the session server is not started")
        return f"{self.base_url}/sessions/{episode_id}/v1"

    def open(self, episode_id: str, session: AgentSession) -> str:
        """Serve ``session`` at the episode's URL; the secret its calls must carry (the agent's API key)."""
        secret = f"sess-{secrets.token_urlsafe(32)}"
        self._sessions[episode_id] = session
        self._secrets[episode_id] = secret
        return secret

    def close(self, episode_id: str) -> None:
        self._sessions.pop(episode_id, None)
        self._secrets.pop(episode_id, None)

    def get(self, episode_id: str, authorization: str | None, api_key: str | None = None) -> AgentSession:
        """The open session of ``episode_id`` when the request carries its secret (``authorization``: the
        ``Authorization`` header, ``api_key``: the ``x-api-key`` header): 404 when no such session is open, 401
        when the secret is missing or not this session's."""
        session = self._sessions.get(episode_id)
        if session is None:
            raise ApiError(404, f"no open session for episode {episode_id!r} in this worker "
                           "(unknown, or its episode has ended)", code="session_not_found", type_="not_found_error")
        scheme, _, bearer = (authorization or "").partition(" ")
        given = bearer.strip() if scheme.lower() == "bearer" else (api_key or "").strip()
        if not given or not hmac.compare_digest(given.encode(), self._secrets[episode_id].encode()):
            raise ApiError(401, "missing or wrong API key: a session is called with the api_key its agent was given "
                           "(each episode has its own)", code="invalid_api_key")
        return session

    def __len__(self) -> int:
        return len(self._sessions)


def _dialect_of(path: str) -> Dialect:
    """The dialect whose error shape a path's errors take."""
    if "/v1/messages" in path:
        return messages
    return chat_completions  # OpenAI's shape, which the Responses API shares


def session_app(registry: SessionRegistry) -> FastAPI:
    """The app serving every session of ``registry``."""
    app = FastAPI(title="rollout-ledger agent sessions (OpenAI- and Anthropic-compatible)", docs_url=None,
                  redoc_url=None)

    def session_of(episode_id: str, request: Request) -> AgentSession:
        return registry.get(episode_id, request.headers.get("authorization"), request.headers.get("x-api-key"))

    def error(request: Request, exc: ApiError) -> JSONResponse:
        # x-should-retry: false, which the OpenAI and Anthropic SDKs obey: their default retries (of a 409, a 5xx)
        # would only meet the same refusal, or count as another turn of the episode
        return JSONResponse(_dialect_of(request.url.path).error_body(exc), status_code=exc.status,
                            headers={"x-should-retry": "false"})

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(request, ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error(request, ApiError(400, str(exc.errors()[:1])))

    @app.get(PREFIX + "/models")
    async def models(episode_id: str, request: Request) -> dict[str, Any]:
        session_of(episode_id, request)
        return {"object": "list", "data": [{"id": registry.model_name, "object": "model", "created": 0,
                                            "owned_by": "rollout-ledger", "type": "model",
                                            "display_name": registry.model_name}],
                "has_more": False, "first_id": registry.model_name, "last_id": registry.model_name}

    @app.get(PREFIX + "/models/{model_id:path}")
    async def model(episode_id: str, model_id: str, request: Request) -> dict[str, Any]:
        session_of(episode_id, request)
        return {"id": model_id, "object": "model", "created": 0, "owned_by": "rollout-ledger", "type": "model",
                "display_name": model_id}

    @app.post(PREFIX + "/chat/completions")
    async def create_chat_completion(episode_id: str, request: Request) -> Response:
        return await _call(episode_id, request, chat_completions)

    @app.post(PREFIX + "/responses")
    async def create_response(episode_id: str, request: Request) -> Response:
        return await _call(episode_id, request, responses)

    @app.post(PREFIX + "/responses/compact")
    async def compact(episode_id: str, request: Request) -> Response:
        session_of(episode_id, request)
        raise ApiError(404, "responses/compact is not served: compaction would be a model call outside the episode's "
                       "turns; send the conversation (or previous_response_id) to /responses", code="not_supported",
                       type_="not_found_error")

    @app.get(PREFIX + "/responses/{response_id}")
    async def get_response(episode_id: str, response_id: str, request: Request) -> Response:
        session = session_of(episode_id, request)
        return Response(orjson.dumps(responses.retrieve(session.memory, response_id)), media_type="application/json")

    @app.delete(PREFIX + "/responses/{response_id}")
    async def delete_response(episode_id: str, response_id: str, request: Request) -> dict[str, Any]:
        session = session_of(episode_id, request)
        return responses.delete(session.memory, response_id)

    @app.post(PREFIX + "/messages")
    async def create_message(episode_id: str, request: Request) -> Response:
        return await _call(episode_id, request, messages)

    @app.post(PREFIX + "/messages/count_tokens")
    async def count_tokens(episode_id: str, request: Request) -> dict[str, Any]:
        session = session_of(episode_id, request)
        req, _ = messages.parse(await _json(request), session.memory, counting=True)
        return {"input_tokens": session.count_tokens(req)}

    async def _call(episode_id: str, request: Request, dialect: Dialect) -> Response:
        with structlog.contextvars.bound_contextvars(episode_id=episode_id):
            session = session_of(episode_id, request)
            turn_req, req = dialect.parse(await _json(request), session.memory)
            started = time.perf_counter()
            try:
                result = await session.complete(turn_req)
            except ApiError:
                raise
            except Exception as exc:  # a bug: answer in the API's shape and keep the worker going
                log.error("session.call_failed", error=f"{type(exc).__name__}: {exc}", exc_info=True)
                raise ApiError(500, f"internal error: {type(exc).__name__}: {exc}") from None
            log.debug("session.call", turn=result.extra.get("turn_index"), tokens=len(result.token_ids),
                      ms=round((time.perf_counter() - started) * 1000, 1))
            if not turn_req.stream:
                return Response(orjson.dumps(dialect.response(result, req, session.memory)),
                                media_type="application/json")
            events = dialect.stream(result, req, session.memory)

            async def body() -> AsyncIterator[bytes]:
                for event in events:
                    yield event

            return StreamingResponse(body(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


async def _json(request: Request) -> Any:
    try:
        return orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not JSON: {exc}") from None
