"""Real agent harnesses, unmodified, as episodes (``agents/command.py``, examples/harnesses/): Claude Code in print
mode on the Messages API, Codex CLI's ``codex exec`` on the Responses API, mini-swe-agent on Chat Completions;
through a real env-worker process and a real recorder on real NATS + Postgres, with a scripted policy answering
the turns: a tool call first (the harness runs it: a file appears in its working directory), then text; every turn
recorded token-exact, the second turn's context holding the tool's result.

Nothing may reach the internet: each harness runs with its own settings that turn off telemetry, update checks and
other traffic, and every proxy variable points at an egress trap (a TCP server that records each connection and
refuses it; ``NO_PROXY`` keeps the session on loopback direct), which must see no connection at all.

Last, a worker draining on SIGTERM kills the process group of a harness it cannot finish.

The scripted policy (tests/integration/test_tool_env.py) stands in for the inference workers: SmolLM2 would not make
these harnesses' tool calls, and Claude Code's first prompt (~12.4k tokens) exceeds its 8k context, so its worker's
``ROLLOUT_MAX_MODEL_LEN`` is raised; Codex (~6.8k) and mini-swe-agent (~1k) run within 8k. The npm harnesses come
from ``make harnesses``.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from examples.harnesses import npm
from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.services.envs.tools import format_call
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.chat import ChatTokenizer
from tests.helpers import AUTH, Sql, until, wait_for
from tests.integration.test_agents import check_segments
from tests.integration.test_env_worker import terminal_of, work_item
from tests.integration.test_pipeline import check_token_exact
from tests.integration.test_tool_env import ScriptedPolicy
from tests.unit.test_agent_command import gone

REPO = Path(__file__).resolve().parents[2]
PROXY_NAMES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


class EgressTrap:
    """What every proxy variable of a harness points at: records each connection attempt (the request line the
    client sent: ``CONNECT host:443 ...`` or ``GET http://...``) and refuses it with a 403."""

    def __init__(self) -> None:
        self.attempts: list[str] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> EgressTrap:
        self.server = await asyncio.start_server(self._on_connection, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.attempts.append("(connected)")
        index = len(self.attempts) - 1
        try:
            async with asyncio.timeout(5):
                line = await reader.readline()
            self.attempts[index] = line.decode(errors="replace").strip() or "(no request line)"
            writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    def env(self) -> dict[str, str]:
        url = f"http://127.0.0.1:{self.port}"
        out = {name: url for name in PROXY_NAMES} | {"NO_PROXY": "127.0.0.1,localhost"}
        return out | {k.lower(): v for k, v in out.items()}

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture
async def trap(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[EgressTrap]:
    """The egress trap, set as the proxy of every process the test starts (the env worker passes the proxy
    variables on to its harness processes)."""
    t = await EgressTrap().start()
    for name, value in t.env().items():
        monkeypatch.setenv(name, value)
    async with httpx.AsyncClient(proxy=t.env()["HTTP_PROXY"]) as client:  # the trap sees what goes through it
        refused = await client.get("http://egress-check.invalid/")
    assert refused.status_code == 403 and t.attempts == ["GET http://egress-check.invalid/ HTTP/1.1"]
    t.attempts.clear()
    yield t
    await t.stop()


@pytest.fixture
async def policy(nc: bus.NATS, model_dir: str) -> AsyncIterator[ScriptedPolicy]:
    p = ScriptedPolicy(nc, ChatTokenizer(model_dir))
    await p.start()
    yield p
    await p.stop()


@pytest.fixture
def sql(database_url: str) -> Iterator[Sql]:
    s = Sql(database_url)
    yield s
    s.close()


def harness_env(agents: str, **extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {"ROLLOUT_AGENTS": agents, "PYTHONPATH": path, "ROLLOUT_ENVS": "fixed-turns",
            "ROLLOUT_AGENT_TIMEOUT_S": "120", **extra}


async def run_episode(stack: Stack, nc: bus.NATS, policy: ScriptedPolicy, agent: str, task: dict[str, Any],
                      script: list[str], max_turns: int = 6) -> tuple[Any, Any]:
    """One episode of ``agent`` on ``task``, the policy answering turn t with ``script[t]``: its terminal event and
    its work item."""
    await asyncio.to_thread(stack.start, "recorder")
    url = (await asyncio.to_thread(stack.start, "scheduler")).url
    item = work_item(agent, task, max_turns=max_turns)
    policy.scripts[item.episode_id] = script
    resp = await asyncio.to_thread(httpx.post, f"{url}/v1/batches", headers=AUTH, timeout=30, json={
        "env": agent, "tasks": [task], "max_turns": max_turns, "batch_id": item.batch_id,
        "sampling": {"max_tokens": 256}})
    assert resp.status_code == 201, resp.text
    return await terminal_of(nc.jetstream(), item.episode_id, timeout_s=150), item


def recorded(sql: Sql, item: Any, tok: ChatTokenizer, turns: int) -> tuple[list[str], int]:
    """The episode's trajectory checked token-exact (one segment, ``turns`` turns, each generated from its segment
    so far): the decoded context of each turn, and the prompt's length."""
    wait_for(lambda: sql.scalar("select count(*) from trajectories where episode_id = :e", e=item.episode_id), 30,
             "the trajectory recorded")
    assert check_token_exact(sql, item.batch_id) == 1
    tr = check_segments(sql, item.episode_id)
    assert tr["num_segments"] == 1 and tr["num_turns"] == turns, tr
    ids = tr["token_ids"]
    return [tok.decode(ids[:start]) for start, _ in tr["action_ranges"]], tr["prompt_len"]


def installed(executable: str) -> None:
    assert Path(executable).is_file(), f"{executable} is missing: `make harnesses` installs it (npm ci)"


def check_offline(trap: EgressTrap) -> None:
    assert trap.attempts == [], f"the harness tried to reach the internet: {trap.attempts}"


async def test_mini_swe_agent_runs_a_bash_tool_and_is_recorded_token_exact(
        stack: Stack, nc: bus.NATS, policy: ScriptedPolicy, sql: Sql, trap: EgressTrap) -> None:
    agent = "mini=examples.harnesses.mini_swe_agent:MINI_SWE_AGENT"
    await asyncio.to_thread(stack.start, "env-worker", "env-worker",
                            **harness_env(agent, ROLLOUT_MAX_MODEL_LEN="8192", ROLLOUT_AGENT_PROCESSES="0"))
    task = {"prompt": "Write the word hello into the file answer.txt.", "path": "answer.txt", "expected": "hello"}
    call = {"command": "echo hello > answer.txt && cat answer.txt"}
    script = [f"I will write the file. {format_call('bash', call)}",
              format_call("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"})]
    end, item = await run_episode(stack, nc, policy, "mini", task, script)
    assert end.type == "episode.finished", end
    assert end.status == "completed" and end.num_turns == 2 and end.reward == 1.0, end
    assert end.info["answer"] == "hello" and end.info["agent_info"]["command"]["exit_code"] == 0
    contexts, prompt_len = recorded(sql, item, policy.tok, 2)
    assert prompt_len < 2048  # mini's prompt fits SmolLM2's context with room to work
    assert "Please solve this issue: Write the word hello into the file answer.txt." in contexts[0]
    assert '"name": "bash"' in contexts[0]  # mini's bash tool, rendered into the prompt
    # the harness ran the tool; its result is the second turn's context, verbatim as mini rendered it
    assert '<tool_response>\n{\n  "returncode": 0,\n  "output": "hello\\n"\n}\n</tool_response>' in contexts[1]
    check_offline(trap)


async def test_claude_code_runs_a_bash_tool_and_is_recorded_token_exact(
        stack: Stack, nc: bus.NATS, policy: ScriptedPolicy, sql: Sql, trap: EgressTrap) -> None:
    installed(npm.claude_executable())
    agent = "claude=examples.harnesses.claude_code:CLAUDE_CODE"
    await asyncio.to_thread(stack.start, "env-worker", "env-worker",
                            **harness_env(agent, ROLLOUT_MAX_MODEL_LEN="131072", ROLLOUT_AGENT_PROCESSES="1"))
    task = {"prompt": "Write the word hello into the file answer.txt.", "path": "answer.txt", "expected": "hello"}
    call = {"command": "echo hello > answer.txt && cat answer.txt", "description": "Write the file"}
    script = [f"I will write the file. {format_call('Bash', call)}", "Done: answer.txt holds hello."]
    end, item = await run_episode(stack, nc, policy, "claude", task, script)
    assert end.type == "episode.finished", end
    assert end.status == "completed" and end.num_turns == 2 and end.reward == 1.0, end
    contexts, prompt_len = recorded(sql, item, policy.tok, 2)
    assert prompt_len > 8192  # Claude Code's system prompt and tools: more than SmolLM2's context
    assert "Claude Code" in contexts[0] and '"name": "Bash"' in contexts[0]
    assert "Write the word hello into the file answer.txt." in contexts[0]
    assert contexts[1].endswith("<tool_response>\nhello\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert "x-anthropic-billing-header" not in contexts[0]  # CLAUDE_CODE_ATTRIBUTION_HEADER=0
    check_offline(trap)


async def test_codex_runs_a_shell_tool_and_is_recorded_token_exact(
        stack: Stack, nc: bus.NATS, policy: ScriptedPolicy, sql: Sql, trap: EgressTrap) -> None:
    installed(npm.codex_executable())
    agent = "codex=examples.harnesses.codex:CODEX"
    await asyncio.to_thread(stack.start, "env-worker", "env-worker",
                            **harness_env(agent, ROLLOUT_MAX_MODEL_LEN="8192", ROLLOUT_AGENT_PROCESSES="1"))
    task = {"prompt": "Write the word hello into the file answer.txt.", "path": "answer.txt", "expected": "hello"}
    call = {"cmd": "echo hello > answer.txt && cat answer.txt"}
    script = [f"I will write the file. {format_call('exec_command', call)}", "Done: answer.txt holds hello."]
    end, item = await run_episode(stack, nc, policy, "codex", task, script)
    assert end.type == "episode.finished", end
    assert end.status == "completed" and end.num_turns == 2 and end.reward == 1.0, end
    contexts, prompt_len = recorded(sql, item, policy.tok, 2)
    assert 4096 < prompt_len < 8192  # Codex's prompt and tools fit SmolLM2's 8k context (1.4k left to work in)
    assert "You are a coding agent running in the Codex CLI" in contexts[0] and '"name": "exec_command"' in contexts[0]
    assert "Write the word hello into the file answer.txt." in contexts[0]
    # Codex ran the command (the file is there: reward 1.0); its output is the second turn's context
    tool_result = contexts[1].rsplit("<tool_response>", 1)[1]
    assert "Process exited with code 0" in tool_result and tool_result.endswith("Output:\nhello\n\n</tool_response>"
                                                                                 "<|im_end|>\n<|im_start|>assistant\n")
    check_offline(trap)


async def test_a_draining_worker_kills_the_harness_processes_it_cannot_finish(
        stack: Stack, nc: bus.NATS, tmp_path: Path) -> None:
    """SIGTERM to an env worker: the harness (in a session of its own, so the signal does not reach it) runs on
    while the worker drains; the episode it could not finish is cancelled and the harness's whole process group is
    killed before the worker exits, in the worker (``agent_processes=0``) and in an agent process alike."""
    await asyncio.to_thread(stack.start, "recorder")
    url = (await asyncio.to_thread(stack.start, "scheduler")).url
    for processes in ("0", "1"):
        worker = await asyncio.to_thread(
            stack.start, "env-worker", f"env-worker-{processes}", **harness_env(
                "tree=tests.unit.test_agent_command:TREE_AGENT", ROLLOUT_AGENT_PROCESSES=processes,
                ROLLOUT_DRAIN_TIMEOUT_S="1"))
        mark = tmp_path / processes
        mark.mkdir()
        resp = await asyncio.to_thread(httpx.post, f"{url}/v1/batches", headers=AUTH, timeout=30, json={
            "env": "tree", "tasks": [{"mark": str(mark)}], "max_turns": 2})
        assert resp.status_code == 201, resp.text
        await until(lambda mark=mark: (mark / "child.pid").exists(), 30, "the harness started")
        child, grandchild = (int((mark / f).read_text()) for f in ("child.pid", "grandchild.pid"))
        worker.signal(signal.SIGTERM)
        await until(lambda worker=worker: not worker.alive, 30, "the worker drained and exited")
        assert gone(child) and gone(grandchild), (processes, worker.tail_log(30))
