"""An agent process: runs the env worker's agent functions, many episodes at once on one event loop, for the
worker that started it (``pool``), over a socket it inherited.

Frames both ways are a 4-byte big-endian length and an orjson object. The worker sends ``{"op": "run", "id",
"run": AgentRun}`` and ``{"op": "cancel", "id"}``; the process answers ``{"op": "ready", "pid"}`` once its agents
are imported, then ``{"op": "done", "id", "outcome": RunOutcome}`` per run (a cancelled run answers nothing).
Every episode's ``AsyncOpenAI`` shares the process's one ``httpx.AsyncClient``. The deadline of a run is enforced
here (its task is cancelled, its requests with it). The process ignores SIGINT and SIGTERM, which its worker's
process group receives: the worker drains its episodes first, then closes the socket, and the process exits at
end of file. Agents' stdout and stderr are the worker's.

Run as ``python -m rollout_ledger.services.env_worker.agents.process --fd N --agents name=mod:fn,...``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import struct
from typing import Any

import orjson

from rollout_ledger.services.env_worker.agents.run import (
    AgentRun,
    AgentSpec,
    load_agents,
    run_agent,
    shared_http_client,
)

HEADER = struct.Struct(">I")
MAX_FRAME = 64 * 2**20
"""Largest frame accepted (a task or a result beyond this is a protocol error)."""


class FrameError(ConnectionError):
    """A frame on the agent-process socket is malformed or too large."""


def frame(message: dict[str, Any]) -> bytes:
    body = orjson.dumps(message, default=str, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)
    return HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """The next message, or None at end of file."""
    try:
        head = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError:
        return None
    (size,) = HEADER.unpack(head)
    if size > MAX_FRAME:
        raise FrameError(f"frame of {size} bytes")
    try:
        body = await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        return None
    message = orjson.loads(body)
    if not isinstance(message, dict):
        raise FrameError("a frame is not an object")
    return message


class AgentServer:
    """The runs of one agent process."""

    def __init__(self, agents: dict[str, AgentSpec], writer: asyncio.StreamWriter) -> None:
        self.agents = agents
        self.writer = writer
        self.http = shared_http_client()
        self.tasks: dict[int, asyncio.Task[None]] = {}

    async def serve(self, reader: asyncio.StreamReader) -> None:
        self.writer.write(frame({"op": "ready", "pid": os.getpid()}))
        await self.writer.drain()
        try:
            while (message := await read_frame(reader)) is not None:
                op, rid = message.get("op"), int(message.get("id", -1))
                if op == "run":
                    task = asyncio.create_task(self._run(rid, AgentRun.from_wire(message["run"])))
                    self.tasks[rid] = task
                    task.add_done_callback(lambda _, rid=rid: self.tasks.pop(rid, None))  # type: ignore[misc]
                elif op == "cancel" and rid in self.tasks:
                    self.tasks[rid].cancel()
        finally:
            for task in list(self.tasks.values()):
                task.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
            await self.http.shutdown()

    async def _run(self, rid: int, run: AgentRun) -> None:
        spec = self.agents[run.agent]
        outcome = await run_agent(spec, run, self.http)
        self.writer.write(frame({"op": "done", "id": rid, "outcome": outcome.wire()}))
        with contextlib.suppress(ConnectionError):
            await self.writer.drain()


async def serve(fd: int, agents: str) -> None:
    specs = load_agents(agents)
    sock = socket.socket(fileno=fd)
    reader, writer = await asyncio.open_connection(sock=sock, limit=MAX_FRAME)
    try:
        await AgentServer(specs, writer).serve(reader)
    finally:
        writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="the socket inherited from the worker")
    parser.add_argument("--agents", required=True, help="ROLLOUT_AGENTS of the worker")
    args = parser.parse_args()
    for sig in (signal.SIGINT, signal.SIGTERM):  # the worker ends this process by closing the socket
        signal.signal(sig, signal.SIG_IGN)
    asyncio.run(serve(args.fd, args.agents))


if __name__ == "__main__":
    main()
