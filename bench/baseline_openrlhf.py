"""Baseline for the pipeline benchmark: the single-process, non-durable design of OpenRLHF's agent executor.

Modelled on ../shared/reference/openrlhf_agent_func_openai_server_executor.py: an OpenAI-style HTTP server
inside the trainer process; each agent call sends the whole message history; the server re-renders the chat
template over the whole history and re-tokenises it, checks prefix stability against the session's previous
call, "generates" with a zero-cost engine and keeps token traces in memory. Nothing is durable.

It uses the same tokenizer and chat template as Rollout Ledger (rollout_ledger/shared/kit/chat.py) and the same
zero-cost responder as the fake engine, so the difference measured is the design, not the parts.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import numpy as np
import uvicorn
from fastapi import FastAPI

from rollout_ledger.services.inference_worker.fake_engine import FakeEngine
from rollout_ledger.shared.events import SamplingParams
from rollout_ledger.shared.kit.chat import load_chat_tokenizer

CLIENT_KEEPALIVE_S = 5.0
"""How long the client keeps an idle pooled connection (httpx's default)."""
SERVER_KEEPALIVE_S = 30
"""How long the server keeps an idle connection open: well past ``CLIENT_KEEPALIVE_S``, so the client always drops
an idle connection before the server closes it. With both at 5 s (uvicorn's and httpx's defaults) the client could
send a request on a connection in the loop iteration where the server's keep-alive timer closed it, and the run
died with ``httpx.ReadError`` (or ``RemoteProtocolError``): server and client share one event loop here, and the
longer its iterations (long histories re-rendered at 16+ turns, a busy machine) the wider that window."""


def build_app(model_dir: str) -> tuple[FastAPI, dict[str, list[dict[str, Any]]]]:
    tok = load_chat_tokenizer(model_dir)
    engine = FakeEngine(model_dir, tokenizer=tok)
    engine.eos_id = tok.eos_token_id
    traces: dict[str, list[dict[str, Any]]] = {}
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(body: dict[str, Any]) -> dict[str, Any]:
        session = body["session_id"]
        text = tok.render(body["messages"], add_generation_prompt=True)  # whole history, every call
        prompt_ids = tok.encode(text)
        prev = traces.setdefault(session, [])
        if prev:  # prefix-stability check of the reference (it asserts)
            full = np.concatenate([prev[-1]["prompt"], prev[-1]["completion"]])
            if not np.array_equal(prompt_ids[: len(full) - 1], full[: len(full) - 1]):
                raise RuntimeError("prefix break")
        gen = await engine.generate(f"{session}:{len(prev)}", prompt_ids, SamplingParams(max_tokens=body["max_tokens"]),
                                    body["max_tokens"])
        prev.append({"prompt": prompt_ids, "completion": gen.token_ids, "logprobs": gen.logprobs})
        content = tok.decode(gen.token_ids, skip_special_tokens=True)
        return {"choices": [{"message": {"role": "assistant", "content": content},
                             "finish_reason": str(gen.finish_reason)}]}

    return app, traces


async def _episode(client: httpx.AsyncClient, session: str, turns: int, max_tokens: int) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Let us talk for a while. Turn 1, go."}]
    for t in range(turns):
        resp = await client.post("/v1/chat/completions",
                                 json={"session_id": session, "messages": messages, "max_tokens": max_tokens})
        resp.raise_for_status()
        messages.append(resp.json()["choices"][0]["message"])
        messages.append({"role": "user", "content": f"Turn {t + 1} of {turns} done. Continue."})


async def run(model_dir: str, episodes: int, turns: int, max_tokens: int = 16, concurrency: int = 64) -> dict[str, Any]:
    app, traces = build_app(model_dir)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False,
                            timeout_keep_alive=SERVER_KEEPALIVE_S)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110 - uvicorn exposes no event for 'started'
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, client: httpx.AsyncClient) -> None:
        async with sem:
            await _episode(client, f"s{i}", turns, max_tokens)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency,
                          keepalive_expiry=CLIENT_KEEPALIVE_S)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=60) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, client) for i in range(episodes)))
        wall = time.perf_counter() - t0
    server.should_exit = True
    await task
    total = sum(len(v) for v in traces.values())
    return {"design": "openrlhf-style in-process server", "episodes": episodes, "turns_per_episode": turns,
            "turns": total, "wall_s": round(wall, 2), "turns_per_s": round(total / wall, 1)}


if __name__ == "__main__":
    import json
    import sys

    from rollout_ledger.shared.kit.settings import default_model_dir

    for t in (1, 8, 32):
        print(json.dumps(asyncio.run(run(str(default_model_dir()), max(1, 2000 // t), t))))
        sys.stdout.flush()
