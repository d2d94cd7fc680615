"""A remote environment server you can copy: one environment ("reverse-word") over Rollout Ledger's actor protocol.

Run it, then point an env worker at it and submit a batch:

    python examples/remote_env/server.py --port 8100
    ROLLOUT_REMOTE_ENVS="reverse-word=http://127.0.0.1:8100" rollout up
    rollout submit --env remote:reverse-word --task '{"word": "ledger"}' --max-turns 3

The protocol (the one of interactor.py plus a reset that carries the task; see
rollout_ledger/services/envs/remote.py for the client):

    POST   /{env}/{env_id}/reset            {"task": {...}}      -> {"tools": null}
    GET    /{env}/{env_id}/get_task_prompt                        -> [messages]: the whole conversation so far
    POST   /{env}/{env_id}/step             {"action": "..."}    -> {"reward", "terminated", "truncated", "info"}
    DELETE /{env}/{env_id}                                        -> 204

Answer 4xx for requests that cannot succeed (unknown env or actor, a bad task): the worker fails the episode at
once. Answer 5xx (or drop the connection) for trouble that may pass: the worker retries with backoff. The
optional ``Rollout-Step`` header is the index of the step; answering a repeated index from a record makes a
retried step safe. Only FastAPI and uvicorn are needed.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Header, HTTPException
from pydantic import BaseModel

MAX_TRIES = 3


@dataclass
class ReverseWord:
    """Reply with the task's word reversed; three tries; reward 1.0 for a right answer."""

    word: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    answers: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False

    def __post_init__(self) -> None:
        self.messages.append({"role": "user", "content": f"Reverse the word '{self.word}'. Reply with the "
                                                         "reversed word only."})

    def step(self, action: str) -> dict[str, Any]:
        self.messages.append({"role": "assistant", "content": action})
        right = action.strip().strip(".'\"").lower() == self.word[::-1].lower()
        tries = len(self.answers) + 1
        answer = {"reward": 1.0 if right else 0.0, "terminated": right, "truncated": not right and tries >= MAX_TRIES,
                  "info": {"tries": tries, "expected": self.word[::-1]}}
        if not (answer["terminated"] or answer["truncated"]):
            self.messages.append({"role": "user", "content": "Not quite. Try again: the reversed word only."})
        self.done = bool(answer["terminated"] or answer["truncated"])
        self.answers.append(answer)
        return answer


class ResetBody(BaseModel):
    task: dict[str, Any] = {}


class StepBody(BaseModel):
    action: str


def create_app() -> FastAPI:
    app = FastAPI(title="reverse-word environment")
    actors: dict[str, ReverseWord] = {}

    def actor(env: str, env_id: str) -> ReverseWord:
        if env != "reverse-word":
            raise HTTPException(404, f"unknown env {env!r}")
        if env_id not in actors:
            raise HTTPException(404, f"no actor {env_id}")
        return actors[env_id]

    @app.get("/healthz")
    def healthz() -> dict[str, bool]:
        return {"alive": True}

    @app.post("/{env}/{env_id}/reset")
    def reset(env: str, env_id: str, body: ResetBody) -> dict[str, Any]:
        if env != "reverse-word":
            raise HTTPException(404, f"unknown env {env!r}")
        word = body.task.get("word")
        if not isinstance(word, str) or not word.isalpha():
            raise HTTPException(422, "task needs 'word': letters only")
        actors.setdefault(env_id, ReverseWord(word))
        return {"tools": None}

    @app.get("/{env}/{env_id}/get_task_prompt")
    def get_task_prompt(env: str, env_id: str) -> list[dict[str, Any]]:
        return actor(env, env_id).messages

    @app.post("/{env}/{env_id}/step")
    def step(env: str, env_id: str, body: StepBody,
             rollout_step: int | None = Header(None, alias="Rollout-Step")) -> dict[str, Any]:
        a = actor(env, env_id)
        if rollout_step is not None and rollout_step < len(a.answers):
            return a.answers[rollout_step]  # a retried step: the recorded answer
        if a.done:
            raise HTTPException(409, "the episode has ended")
        return a.step(body.action)

    @app.delete("/{env}/{env_id}", status_code=204)
    def close(env: str, env_id: str) -> None:
        actors.pop(env_id, None)

    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    args = parser.parse_args()
    uvicorn.run(create_app(), host=args.host, port=args.port, log_level="warning")
