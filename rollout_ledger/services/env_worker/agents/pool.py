"""The env worker's pool of agent processes (``agent_processes`` of them): where its agent functions run, so
agent code uses other cores than the worker's and a crash of agent code does not take the worker down.

Design note. Only the agent function moves: each episode's session (its transcript, its turns, its events) stays
in the worker, and the agent process gets the session's URL, secret and task (``AgentRun``), so every turn is
token-exact and durable exactly as in-process. A run goes to the live process with the fewest runs; each process
runs any number of runs on its own event loop with one shared HTTP client (``process``).

- Deadline: the process cancels a run at its ``timeout_s`` and answers ``timeout``. A process that has not
  answered ``GRACE_S`` later is stuck (blocking code in an agent holds its event loop): the run ends ``timeout``
  and the process is killed, and its other runs end ``lost``.
- Death: a process that exits (crash, ``os._exit``, OOM kill) ends its runs ``lost`` (the episodes fail with class
  ``agent``, retried within ``retry_agent``; their recorded turns stay, superseded by the next attempt) and is
  started again (after ``RESTART_BACKOFF_S``, doubled while it keeps dying within ``STABLE_S`` of its start).
- Cancellation: a run whose awaiting episode is cancelled is cancelled in its process.
- Stop: the sockets are closed (each process exits at end of file), stragglers are killed after ``STOP_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import socket
import sys
import time

from rollout_ledger.services.env_worker.agents.process import frame, read_frame
from rollout_ledger.services.env_worker.agents.run import AgentRun, RunEnd, RunOutcome
from rollout_ledger.shared.kit.logging import get_logger

log = get_logger(__name__)

REAP_GRACE_S = 2.0
"""How long a process whose socket closed may take to exit on its own before it is killed."""
GRACE_S = 5.0
"""How long past a run's deadline its process may take to answer before it is deemed stuck and killed."""
START_TIMEOUT_S = 120.0
"""How long a new process may take to import the agents and report ready."""
RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 10.0
STABLE_S = 30.0
"""A process that lived this long restarts after the first backoff again."""
STOP_S = 5.0
NO_PROCESS_WAIT_S = 30.0
"""How long a run waits for a live process (all of them restarting) before it ends ``lost``."""


class AgentProcessError(RuntimeError):
    """An agent process could not be started (its agents do not import there, or it died at start)."""


class AgentProcess:
    """One agent process and its runs in flight."""

    def __init__(self, index: int, agents: str) -> None:
        self.index = index
        self.agents = agents
        self.proc: asyncio.subprocess.Process | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.pending: dict[int, asyncio.Future[RunOutcome]] = {}
        self.started_at = 0.0
        self.alive = False
        self.reader_task: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    async def start(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "rollout_ledger.services.env_worker.agents.process",
                "--fd", str(theirs.fileno()), "--agents", self.agents, pass_fds=(theirs.fileno(),),
                stdin=asyncio.subprocess.DEVNULL)
        finally:
            theirs.close()
        reader, self.writer = await asyncio.open_connection(sock=ours, limit=2**26)
        self.started_at = time.monotonic()
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                ready = await read_frame(reader)
        except TimeoutError:
            ready = None
        if ready is None or ready.get("op") != "ready":
            await self.kill()
            code = None if self.proc is None else self.proc.returncode
            raise AgentProcessError(f"agent process {self.index} did not start (exit code {code}; its output is in "
                                    "this worker's log)")
        self.alive = True
        self.reader_task = asyncio.create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while (message := await read_frame(reader)) is not None:
                if message.get("op") == "done":
                    future = self.pending.pop(int(message["id"]), None)
                    if future is not None and not future.done():
                        future.set_result(RunOutcome.from_wire(message["outcome"]))
        except (ConnectionError, ValueError) as exc:
            log.error("agent_process.protocol_error", index=self.index, error=f"{type(exc).__name__}: {exc}")
        finally:
            self.alive = False
            await self._reap()

    async def _reap(self) -> None:
        """The process is gone (or its socket is): end its runs ``lost``, saying how it ended."""
        code = None
        if self.proc is not None:
            try:  # its socket closed: it is exiting, or broken
                async with asyncio.timeout(REAP_GRACE_S):
                    code = await asyncio.shield(self.proc.wait())
            except TimeoutError:
                await self.kill()
                code = self.proc.returncode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        pending, self.pending = self.pending, {}
        if pending:
            log.warning("agent_process.died", index=self.index, pid=self.pid, exit=code, runs=len(pending))
        for future in pending.values():
            if not future.done():
                future.set_result(RunOutcome(RunEnd.LOST, message=f"the agent process (pid {self.pid}) running it "
                                             f"{how} before the agent returned"))

    def submit(self, rid: int, run: AgentRun) -> asyncio.Future[RunOutcome]:
        future: asyncio.Future[RunOutcome] = asyncio.get_running_loop().create_future()
        if not self.alive or self.writer is None:  # the pool picks live processes; this is a guard
            future.set_result(RunOutcome(RunEnd.LOST, message=f"the agent process (pid {self.pid}) is gone"))
            return future
        self.pending[rid] = future
        self.writer.write(frame({"op": "run", "id": rid, "run": run.wire()}))
        return future

    def cancel(self, rid: int) -> None:
        self.pending.pop(rid, None)
        if self.alive and self.writer is not None:
            self.writer.write(frame({"op": "cancel", "id": rid}))

    async def kill(self) -> None:
        """SIGKILL and wait. Not ``Process.kill()``: its ``Popen.poll()`` reaps a child that has just exited before
        asyncio's child watcher does, which then reports the exit status as 255 (lost)."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)  # not reaped before returncode is set: the pid is still ours
            await self.proc.wait()

    async def stop(self) -> None:
        """Close the socket (the process exits at end of file); kill it after ``STOP_S``."""
        if self.writer is not None:
            self.writer.close()
        if self.proc is not None:
            try:
                async with asyncio.timeout(STOP_S):
                    await self.proc.wait()
            except TimeoutError:
                await self.kill()
        if self.reader_task is not None:
            await asyncio.gather(self.reader_task, return_exceptions=True)


class AgentPool:
    """``size`` agent processes running ``agents`` (a ``ROLLOUT_AGENTS`` value), restarted when they die."""

    def __init__(self, agents: str, size: int) -> None:
        self.agents = agents
        self.procs = [AgentProcess(i, agents) for i in range(size)]
        self._ids = itertools.count()
        self._restarts: set[asyncio.Task[None]] = set()
        self._live = asyncio.Event()
        self._stopping = False
        self.restarts = 0
        """Processes started again after dying (for tests and logs)."""

    async def start(self) -> AgentPool:
        try:
            await asyncio.gather(*(p.start() for p in self.procs))
        except BaseException:
            await self.stop()
            raise
        for p in self.procs:
            self._watch(p)
        self._live.set()
        log.info("agent_pool.ready", processes=len(self.procs), pids=self.pids())
        return self

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.alive and p.pid is not None]

    def _watch(self, p: AgentProcess) -> None:
        assert p.reader_task is not None
        p.reader_task.add_done_callback(lambda _: self._died(p))

    def _died(self, p: AgentProcess) -> None:
        if self._stopping:
            return
        if not any(q.alive for q in self.procs):
            self._live.clear()
        task = asyncio.get_running_loop().create_task(self._restart(p))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _restart(self, old: AgentProcess) -> None:
        backoff = RESTART_BACKOFF_S
        lived = time.monotonic() - old.started_at
        if lived < STABLE_S:
            backoff = min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** min(self.restarts, 5))
        while not self._stopping:
            await asyncio.sleep(backoff)
            fresh = AgentProcess(old.index, self.agents)
            try:
                await fresh.start()
            except AgentProcessError as exc:
                log.error("agent_process.restart_failed", index=old.index, error=str(exc))
                backoff = min(RESTART_BACKOFF_MAX_S, backoff * 2)
                continue
            if self._stopping:
                await fresh.stop()
                return
            self.procs[old.index] = fresh
            self._watch(fresh)
            self.restarts += 1
            self._live.set()
            log.info("agent_process.restarted", index=old.index, pid=fresh.pid)
            return

    async def _pick(self) -> AgentProcess | None:
        if not any(p.alive for p in self.procs):
            try:
                async with asyncio.timeout(NO_PROCESS_WAIT_S):
                    while not any(p.alive for p in self.procs):
                        self._live.clear()
                        await self._live.wait()
            except TimeoutError:
                return None
        return min((p for p in self.procs if p.alive), key=lambda p: len(p.pending))

    async def run(self, run: AgentRun) -> RunOutcome:
        """Run ``run`` in the least busy live process (cancelling the caller cancels the run there)."""
        proc = await self._pick()
        if proc is None:
            return RunOutcome(RunEnd.LOST, message=f"no agent process was running for {NO_PROCESS_WAIT_S:g}s")
        rid = next(self._ids)
        future = proc.submit(rid, run)
        deadline = run.timeout_s + GRACE_S if run.timeout_s > 0 else None
        try:
            async with asyncio.timeout(deadline):
                return await asyncio.shield(future)
        except TimeoutError:
            log.error("agent_process.stuck", index=proc.index, pid=proc.pid, timeout_s=run.timeout_s)
            proc.pending.pop(rid, None)
            await proc.kill()  # its event loop is blocked: the reader notices the exit and restarts it
            return RunOutcome(RunEnd.TIMEOUT, message=f"its agent process (pid {proc.pid}) did not cancel it within "
                              f"{GRACE_S:g}s (blocking code holds its event loop) and was killed")
        except asyncio.CancelledError:
            proc.cancel(rid)
            raise

    async def stop(self) -> None:
        self._stopping = True
        for task in list(self._restarts):
            task.cancel()
        await asyncio.gather(*self._restarts, return_exceptions=True)
        await asyncio.gather(*(p.stop() for p in self.procs), return_exceptions=True)
