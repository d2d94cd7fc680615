"""The pipeline baseline's keep-alive ordering (bench/baseline_openrlhf.py): why its run died with httpx.ReadError.

The baseline serves and calls its HTTP server from one event loop. With uvicorn's and httpx's default keep-alive
(5 s both), a pooled connection could be handed to a request in the loop iteration where the server's keep-alive
timer closed it: the request then meets a closed socket (``ReadError`` on a reset, ``RemoteProtocolError`` on an
orderly close). ``_reuse_after_idle`` builds that moment on purpose: one long loop iteration (CPU-bound work, as
re-rendering long histories is) during which the server's timer falls due, then a request on the idle connection.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import uvicorn
from fastapi import FastAPI

from bench.baseline_openrlhf import CLIENT_KEEPALIVE_S, SERVER_KEEPALIVE_S
from tests.helpers import until


async def _reuse_after_idle(server_keepalive_s: int, client_keepalive_s: float) -> str:
    app = FastAPI()

    @app.post("/x")
    async def x() -> dict[str, str]:
        return {}

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           timeout_keep_alive=server_keepalive_s))
    task = asyncio.create_task(server.serve())
    await until(lambda: server.started, 10, "uvicorn to start", interval_s=0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                     limits=httpx.Limits(keepalive_expiry=client_keepalive_s)) as client:
            (await client.post("/x")).raise_for_status()  # the server's keep-alive timer starts here
            await asyncio.sleep(server_keepalive_s - 0.2)
            time.sleep(0.3)  # noqa: ASYNC251 - on purpose: one long loop iteration, the server timer falls due
            await asyncio.sleep(0)  # this request is queued ahead of the due timer in the next iteration
            (await client.post("/x")).raise_for_status()
            return "ok"
    except (httpx.ReadError, httpx.RemoteProtocolError) as exc:
        return type(exc).__name__
    finally:
        server.should_exit = True
        await task


def test_the_client_drops_an_idle_connection_before_the_server_closes_it() -> None:
    assert CLIENT_KEEPALIVE_S < SERVER_KEEPALIVE_S
    assert asyncio.run(_reuse_after_idle(server_keepalive_s=2, client_keepalive_s=1.0)) == "ok"


def test_a_client_that_outlives_the_server_keepalive_reuses_a_closing_connection() -> None:
    """The failure the ordering prevents (the server closes first): the request meets the closing socket."""
    assert asyncio.run(_reuse_after_idle(server_keepalive_s=1, client_keepalive_s=5.0)) in {
        "ReadError", "RemoteProtocolError"}
