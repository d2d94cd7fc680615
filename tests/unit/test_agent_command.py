"""Harness processes as agents (``agents/command.py``) on small shell and Python commands: the environment and
placeholders they get, exit codes, the deadline killing a whole process tree (a grandchild that ignores SIGTERM
included), cancellation killing it too, rewards read from the working directory; loaded by ``load_agent`` and run
in an agent process of the pool as in-process.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rollout_ledger.services.env_worker.agents import command as command_module
from rollout_ledger.services.env_worker.agents.command import CommandAgent, CommandResult
from rollout_ledger.services.env_worker.agents.pool import AgentPool
from rollout_ledger.services.env_worker.agents.run import AgentLoadError, AgentRun, RunEnd, load_agents, run_agent
from tests.helpers import until

HERE = "tests.unit.test_agent_command"
PY = sys.executable

DUMP_ENV = """
import json, os, sys
names = sys.argv[1:]
json.dump({"env": {k: os.environ.get(k) for k in names}, "cwd": os.getcwd(), "ppid": os.getppid(),
           "argv": sys.argv, "task_file": open(os.environ["ROLLOUT_TASK_FILE"]).read()},
          open("seen.json", "w"))
print("done")
"""

TREE = """
set -e
trap '' TERM
sleep 300 &
echo $! > "{mark}/grandchild.pid"
echo "$PWD" > "{mark}/workdir"
echo $$ > "{mark}/child.pid"
wait
"""
"""A shell that ignores SIGTERM and a grandchild (``sleep``): only SIGKILL of the group ends them both."""


def read_seen(task: dict[str, Any], result: CommandResult) -> dict[str, Any]:
    seen = json.loads((result.workdir / "seen.json").read_text())
    note = (result.workdir / "note.txt").read_text()
    return {"reward": 1.0, "answer": result.stdout.strip(), "info": {"seen": seen, "note": note,
                                                                     "home": str(result.home)}}


async def async_reward(task: dict[str, Any], result: CommandResult) -> float:
    return float((result.workdir / "out.txt").read_text().strip() == task["want"])


ENV_NAMES = ["OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "ROLLOUT_SESSION_URL",
             "ROLLOUT_SESSION_KEY", "ROLLOUT_TASK", "ROLLOUT_TASK_FILE", "HOME", "XDG_CONFIG_HOME", "PATH",
             "DATABASE_URL", "ROLLOUT_NATS_PASSWORD", "MY_SETTING", "ONLY_IF_PASSED"]

DUMPS = CommandAgent(argv=[PY, "-c", DUMP_ENV.replace("{", "{{").replace("}", "}}"),  # braces: literal
                           *ENV_NAMES, "--q={question}", "--n={n}"], reward=read_seen,
                     env={"MY_SETTING": "at {workdir} for {base_url}"}, files=lambda task: {"note.txt": task["note"]})
WRITES = CommandAgent(argv=["sh", "-c", 'echo "$1" > out.txt; echo "ppid $PPID"', "sh", "{want}"],
                      reward=async_reward)
FAILS = CommandAgent(argv=["sh", "-c", "echo partial; echo 'something broke' >&2; exit 3"])
TREE_AGENT = CommandAgent(argv=["sh", "-c", TREE], kill_grace_s=0.5)
AGENTS = f"dumps={HERE}:DUMPS,writes={HERE}:WRITES,tree={HERE}:TREE_AGENT"


def run(agent: str, timeout_s: float = 20.0, **task: Any) -> AgentRun:
    return AgentRun(agent=agent, task=task, base_url="http://127.0.0.1:9/sessions/ep-1/v1", api_key="sess-secret",
                    timeout_s=timeout_s)


def exists(*parts: str) -> bool:
    return Path(*parts).exists()


def gone(pid: int) -> bool:
    """``pid`` has exited (a zombie waiting for a reaper that is not us counts as exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


async def test_the_process_gets_the_session_and_the_task_not_the_workers_secrets(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgresql://secret@db/x")
    monkeypatch.setenv("ROLLOUT_NATS_PASSWORD", "hunter2")
    monkeypatch.setenv("ONLY_IF_PASSED", "yes")
    task = {"question": "Why {braces}?", "n": [1, 2], "note": "written before the start"}
    out = await DUMPS.run("dumps", run("dumps", **task))
    assert out.end is RunEnd.RETURNED and out.result is not None, out
    assert out.result.reward == 1.0 and out.result.answer == "done"
    info = out.result.info
    env, cwd = info["seen"]["env"], info["seen"]["cwd"]
    assert env["OPENAI_BASE_URL"] == env["ROLLOUT_SESSION_URL"] == "http://127.0.0.1:9/sessions/ep-1/v1"
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9/sessions/ep-1"
    assert env["OPENAI_API_KEY"] == env["ANTHROPIC_API_KEY"] == env["ROLLOUT_SESSION_KEY"] == "sess-secret"
    assert json.loads(env["ROLLOUT_TASK"]) == task and json.loads(info["seen"]["task_file"]) == task
    assert env["DATABASE_URL"] is None and env["ROLLOUT_NATS_PASSWORD"] is None and env["ONLY_IF_PASSED"] is None
    assert env["PATH"] == os.environ["PATH"]
    assert env["MY_SETTING"] == f"at {cwd} for http://127.0.0.1:9/sessions/ep-1/v1"
    assert env["HOME"] == info["home"] and env["XDG_CONFIG_HOME"] == f"{info['home']}/.config"
    assert env["HOME"] != os.environ.get("HOME") and Path(cwd).name == "work"
    assert info["seen"]["argv"][-2:] == ["--q=Why {braces}?", "--n=[1, 2]"]  # the task's text is not re-formatted
    assert info["note"] == "written before the start"
    assert info["command"]["exit_code"] == 0 and info["command"]["seconds"] > 0
    assert not exists(cwd) and not exists(info["home"])  # the episode's directory is removed

    passing = CommandAgent(argv=DUMPS.argv, reward=read_seen, files=DUMPS.files,
                           pass_env=(*command_module.PASS_ENV, "ONLY_IF_PASSED"), keep_workdir=True)
    kept = await passing.run("dumps", run("dumps", **task))
    assert kept.result is not None and kept.result.info["seen"]["env"]["ONLY_IF_PASSED"] == "yes"
    assert exists(kept.result.info["command"]["dir"], "work", "seen.json")
    shutil.rmtree(kept.result.info["command"]["dir"])


async def test_exit_codes_and_start_failures() -> None:
    failed = await FAILS.run("fails", run("fails"))
    assert failed.end is RunEnd.RAISED and failed.error == "exit code 3"
    assert "`sh -c 'echo partial;" in failed.message and "exited with code 3" in failed.message
    assert failed.message.endswith("its stderr ends:\nsomething broke")
    accepted = await CommandAgent(argv=FAILS.argv, ok_exit_codes=(0, 3)).run("fails", run("fails"))
    assert accepted.end is RunEnd.RETURNED and accepted.result is not None and accepted.result.reward == 0.0
    assert accepted.result.info == {"command": {"exit_code": 3, "seconds": accepted.result.info["command"]["seconds"]}}

    missing = await CommandAgent(argv=["/no/such/harness", "{prompt}"]).run("x", run("x", prompt="hi"))
    assert missing.end is RunEnd.RAISED and "could not start: FileNotFoundError: no executable" in missing.message
    no_field = await CommandAgent(argv=["true", "{prompt}"]).run("x", run("x", question="hi"))
    assert no_field.end is RunEnd.RAISED and "names {prompt}, which is neither a field of the task" in no_field.message
    escaping = await CommandAgent(argv=["true", "../{prompt}"], files=lambda t: {"../../x": "no"}).run(
        "x", run("x", prompt="p"))
    assert escaping.end is RunEnd.RAISED and "outside the working directory" in escaping.message
    with pytest.raises(TypeError, match="list of strings"):
        CommandAgent(argv="claude -p hi")  # type: ignore[arg-type]


async def test_rewards_read_the_workdir_sync_async_raising_invalid() -> None:
    good = await WRITES.run("writes", run("writes", want="42"))
    assert good.end is RunEnd.RETURNED and good.result is not None and good.result.reward == 1.0

    def broken(task: dict[str, Any], result: CommandResult) -> float:
        return float(result.stdout)

    raised = await CommandAgent(argv=WRITES.argv, reward=broken).run("w", run("w", want="1"))
    assert raised.end is RunEnd.RAISED and "its reward function raised ValueError" in raised.message
    assert "Traceback" in raised.message and "in broken" in raised.message
    invalid = await CommandAgent(argv=WRITES.argv, reward=lambda t, r: "yes").run("w", run("w", want="1"))
    assert invalid.end is RunEnd.INVALID and "returned str" in invalid.message


async def test_the_deadline_kills_the_whole_process_tree(tmp_path: Path) -> None:
    started = time.monotonic()
    out = await TREE_AGENT.run("tree", run("tree", timeout_s=1.0, mark=str(tmp_path)))
    took = time.monotonic() - started
    assert out.end is RunEnd.TIMEOUT and "SIGTERM, then SIGKILL after 0.5s" in out.message
    assert took < 1.0 + 0.5 + 1.5, took  # deadline, grace, and the reap
    child, grandchild = (int((tmp_path / f).read_text()) for f in ("child.pid", "grandchild.pid"))
    await until(lambda: gone(child) and gone(grandchild), 5, "the shell and its grandchild killed")


async def test_cancelling_the_run_kills_the_process_tree(tmp_path: Path) -> None:
    task = asyncio.create_task(TREE_AGENT.run("tree", run("tree", timeout_s=0, mark=str(tmp_path))))
    await until(lambda: (tmp_path / "child.pid").exists() and (tmp_path / "grandchild.pid").stat().st_size, 10,
                "the tree started")
    child, grandchild = (int((tmp_path / f).read_text()) for f in ("child.pid", "grandchild.pid"))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: gone(child) and gone(grandchild), 5, "the shell and its grandchild killed")


async def test_loaded_by_name_and_run_in_process_or_in_an_agent_process(tmp_path: Path) -> None:
    agents = load_agents(AGENTS)
    spec = agents["writes"]
    assert spec.command is WRITES and spec.function is None
    assert spec.advert("w")["description"].startswith("command sh -c")
    with pytest.raises(AgentLoadError, match="or a CommandAgent"):
        load_agents(f"x={HERE}:PY")

    http: Any = None  # a command needs no HTTP client
    here = await run_agent(spec, run("writes", want="7"), http)
    assert here.end is RunEnd.RETURNED and here.result is not None and here.result.reward == 1.0

    pool = await AgentPool(AGENTS, 1).start()
    try:
        (pid,) = pool.pids()
        there = await pool.run(run("dumps", question="q", n=1, note="n"))
        assert there.end is RunEnd.RETURNED and there.result is not None, there
        assert there.result.info["seen"]["ppid"] == pid  # started by the agent process
        timed_out = await pool.run(run("tree", timeout_s=0.5, mark=str(tmp_path)))
        assert timed_out.end is RunEnd.TIMEOUT and "SIGKILL" in timed_out.message
        child, grandchild = (int((tmp_path / f).read_text()) for f in ("child.pid", "grandchild.pid"))
        await until(lambda: gone(child) and gone(grandchild), 5, "the tree killed by the agent process")

        (tmp_path / "child.pid").unlink()
        cancelled = asyncio.create_task(pool.run(run("tree", timeout_s=0, mark=str(tmp_path))))
        await until(lambda: (tmp_path / "child.pid").exists(), 10, "the second tree started")  # after its grandchild
        child, grandchild = (int((tmp_path / f).read_text()) for f in ("child.pid", "grandchild.pid"))
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        await until(lambda: gone(child) and gone(grandchild), 5, "the tree of a cancelled run killed")
        assert pool.pids() == [pid]  # the agent process lives on

        if command_module._SETPRIV is None:
            return  # no setpriv: nothing kills a harness whose agent process is killed outright
        (tmp_path / "child.pid").unlink()
        lost = asyncio.create_task(pool.run(run("tree", timeout_s=0, mark=str(tmp_path))))
        await until(lambda: (tmp_path / "child.pid").exists(), 10, "the third tree started")
        child, grandchild = (int((tmp_path / f).read_text()) for f in ("child.pid", "grandchild.pid"))
        os.kill(pid, signal.SIGKILL)
        assert (await lost).end is RunEnd.LOST
        await until(lambda: gone(child), 5, "the harness killed with its agent process (pdeathsig)")
        assert not gone(grandchild)  # what the harness started is orphaned: the limit of pdeathsig
        os.kill(grandchild, signal.SIGKILL)
        shutil.rmtree(Path((tmp_path / "workdir").read_text().strip()).parent)  # nobody was left to remove it
    finally:
        await pool.stop()
