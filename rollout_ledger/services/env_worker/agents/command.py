"""A harness process as an agent: a command line (Claude Code, Codex, mini-swe-agent, any CLI) run once per episode
with its environment pointed at the episode's session, and its exit, deadline and kill handled as an agent
function's are.

Registered as a function is (``ROLLOUT_AGENTS="claude=mypkg.harnesses:claude_code"``, the attribute a
``CommandAgent``), it runs where agent functions run: in an agent process of the pool, or on the worker's event
loop (``agent_processes=0``); either way it is an ``asyncio`` subprocess, so it blocks nothing.

Design note. One run (``CommandAgent.run``):

1. a fresh directory per episode (``tempfile``), holding ``work/`` (the process's working directory unless ``cwd``
   names one, with ``files(task)`` written into it), ``home/`` (its ``HOME`` and XDG directories, so a harness
   reads no user's configuration and keeps no state across episodes) and ``task.json``;
2. the environment: the names of ``pass_env`` copied from the worker's, then the session under the names each SDK
   or CLI reads (``SESSION_ENV``), then ``env`` (placeholders substituted; it wins);
3. ``argv`` with the task's fields substituted (``{prompt}``) and ``PLACEHOLDERS``, started in a session (process
   group) of its own, stdin ``/dev/null``, stdout and stderr captured (their last ``max_output_bytes`` each);
   the worker's SIGTERM (sent to its process group) does not reach it: the worker drains its episodes, and one
   still running when the drain ends is cancelled, which kills its group. Where ``setpriv`` exists the process is
   also started with ``--pdeathsig KILL``, so it dies with the process that started it even when that one is
   killed outright (what it started itself is then orphaned, and ends on its own);
4. the end: past the run's deadline the whole group gets SIGTERM, then SIGKILL after ``kill_grace_s`` (``timeout``);
   the run cancelled (its episode cancelled, the worker draining): the same, then the cancellation goes on; an
   exit code outside ``ok_exit_codes``: ``raised``, with the command and the end of its stderr; any process the
   harness left in its group is killed once it exits;
5. ``reward(task, CommandResult)``, sync (in a thread) or async, within what is left of the deadline: a number or
   a dict with ``reward`` (and ``info``, ``answer``), as an agent function returns. Harnesses compute no reward:
   the verifier reads their output and the files they wrote (``CommandResult.workdir``);
6. the directory is removed (``keep_workdir``: kept, its path in the result's info).

A process that starts a session of its own (``setsid``) leaves the group and is not killed with it; sandbox
harnesses that must be contained completely (containers, cgroups) run inside one, started by ``argv``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import shlex
import shutil
import signal
import string
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_ledger.services.env_worker.agents.outcome import (
    REASON_CHARS,
    AgentResult,
    AgentRun,
    RunEnd,
    RunOutcome,
    agent_result,
)

PASS_ENV = ("PATH", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "TERM", "TMPDIR",
            "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS",
            "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "all_proxy", "no_proxy")
"""What a harness process gets of the worker's environment by default: enough to find programs and speak TLS
through the site's proxy, none of the worker's own settings or secrets (``ROLLOUT_*``, ``DATABASE_URL``, NATS
credentials)."""

PLACEHOLDERS = ("workdir", "home", "base_url", "anthropic_base_url", "python")
"""Names ``argv``, ``env`` and ``cwd`` may use beside the task's fields (these win over a task field of the same
name): the working directory, the process's ``HOME``, the session's OpenAI base URL (``.../v1``) and Anthropic
base URL (without ``/v1``), and the worker's Python (``sys.executable``, to run harnesses installed beside it).
``{{`` and ``}}`` are literal braces."""

TASK_ENV_MAX = 64 * 1024
"""``ROLLOUT_TASK`` is set when the task's JSON is at most this long (an environment string is limited to 128 KiB
on Linux); ``ROLLOUT_TASK_FILE`` always names the file holding it."""

STDERR_TAIL = 1200
"""Characters of stderr quoted in the reason of a failed run."""

RewardFunction = Callable[[dict[str, Any], "CommandResult"], Any]
"""``reward(task, result) -> float | dict`` (or a coroutine function returning one)."""


@dataclass(frozen=True)
class CommandResult:
    """What one harness process did: what ``reward`` gets."""

    command: list[str]
    """The argv run, placeholders substituted."""
    exit_code: int
    """Its exit status (negative: killed by that signal)."""
    stdout: str
    """Its standard output (the last ``max_output_bytes``, decoded as UTF-8 with replacement)."""
    stderr: str
    """Its standard error (likewise)."""
    workdir: Path
    """Its working directory: the files it wrote are there until ``reward`` returns."""
    home: Path
    """Its ``HOME`` (harnesses keep their transcripts and logs there: Claude Code under ``.claude/``)."""
    seconds: float
    """From start to exit."""


@dataclass(frozen=True)
class CommandAgent:
    """An agent that is a command line: one process per episode, pointed at the episode's session.

    Every model call the process makes on that session (Chat Completions, Responses or Messages) is a turn of the
    episode, recorded token-exact, whatever the harness (see ``sessions``).
    """

    argv: Sequence[str]
    """The command, each item formatted with the task's fields and ``PLACEHOLDERS`` (``["claude", "-p",
    "{prompt}"]``); a task field that is not a string is substituted as JSON."""
    reward: RewardFunction | None = None
    """``reward(task, result)``: the episode's reward from what the process did (None: 0.0)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Environment variables set last (formatted as ``argv``): the harness's own settings (telemetry off, its
    provider) or overrides of the session's names."""
    files: Callable[[dict[str, Any]], Mapping[str, str | bytes]] | None = None
    """``files(task)``: relative paths and contents written into the working directory before the start (the
    repository a task is about, a test the verifier runs)."""
    cwd: str | None = None
    """The working directory (formatted as ``argv``); None: ``work/`` of the episode's fresh directory."""
    isolated_home: bool = True
    """``HOME`` and the XDG directories of each episode are its own (under its fresh directory)."""
    pass_env: Sequence[str] = PASS_ENV
    """Names copied from the worker's environment when set there."""
    ok_exit_codes: Sequence[int] = (0,)
    """Exit codes that mean the harness finished (another is a failure of the agent: ``raised``)."""
    kill_grace_s: float = 2.0
    """Between SIGTERM and SIGKILL of the process group (keep it under the agent pool's ``GRACE_S``)."""
    max_output_bytes: int = 4 * 2**20
    """Bytes of stdout and of stderr kept (their last ones)."""
    keep_workdir: bool = False
    """Keep each episode's directory (its path is in the episode's ``agent_info``); for debugging."""
    description: str = ""
    """What the ``rl_envs`` advert says of the agent."""

    def __post_init__(self) -> None:
        if isinstance(self.argv, str) or not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise TypeError("CommandAgent.argv must be a non-empty list of strings (use shlex.split for a line)")
        if self.reward is not None and not callable(self.reward):
            raise TypeError("CommandAgent.reward must be callable: reward(task, result) -> float | dict")

    def summary(self) -> str:
        return self.description or f"command {shlex.join(self.argv)}"[:200]

    async def run(self, name: str, run: AgentRun) -> RunOutcome:
        """One episode's process, from its fresh directory to its reward; cancellation kills its group and goes on."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + run.timeout_s if run.timeout_s > 0 else None
        root = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix=f"rollout-{name}-"))
        try:
            try:
                argv, cwd, env, home = await asyncio.to_thread(self._prepare, root, run)
            except Exception as exc:  # the task's fields, files(task) or the directory: the agent's failure
                return _raised(name, f"preparing its command failed: {type(exc).__name__}: {exc}")
            ran = await _execute(argv, cwd, env, deadline, self.kill_grace_s, self.max_output_bytes)
            if ran.start_error is not None:
                return _raised(name, f"`{_shown(argv)}` could not start: {ran.start_error}")
            if ran.timed_out:
                return RunOutcome(RunEnd.TIMEOUT, message=f"`{_shown(argv)}` (pid {ran.pid}): its process group "
                                  f"got SIGTERM, then SIGKILL after {self.kill_grace_s:g}s")
            result = CommandResult(command=argv, exit_code=ran.code, stdout=ran.stdout, stderr=ran.stderr,
                                   workdir=cwd, home=home, seconds=ran.seconds)
            if ran.code not in self.ok_exit_codes:
                how = f"was killed by signal {-ran.code}" if ran.code < 0 else f"exited with code {ran.code}"
                tail = ran.stderr[-STDERR_TAIL:].strip() or "(empty)"
                return _raised(name, f"`{_shown(argv)}` {how} after {ran.seconds:.1f}s; its stderr ends:\n{tail}",
                               error=f"exit code {ran.code}")
            return await self._reward(name, run.task, result, deadline, root)
        finally:
            if not self.keep_workdir:
                await asyncio.shield(asyncio.to_thread(shutil.rmtree, root, True))

    def _prepare(self, root: Path, run: AgentRun) -> tuple[list[str], Path, dict[str, str], Path]:
        """The argv, working directory, environment and home of ``run`` (files written, directories made)."""
        home = root / "home" if self.isolated_home else Path(os.environ.get("HOME") or root / "home")
        work = root / "work"
        for d in (work, home):
            d.mkdir(parents=True, exist_ok=True)
        anthropic = run.base_url.removesuffix("/").removesuffix("/v1")
        fields = {k: v if isinstance(v, str) else json.dumps(v) for k, v in run.task.items()}
        fields |= {"workdir": str(work), "home": str(home), "base_url": run.base_url,
                   "anthropic_base_url": anthropic, "python": sys.executable}
        cwd = Path(_format(self.cwd, fields, "cwd")) if self.cwd is not None else work
        fields["workdir"] = str(cwd)
        if self.files is not None:
            for rel, content in self.files(run.task).items():
                path = (cwd / rel).resolve()
                if not path.is_relative_to(cwd.resolve()):
                    raise ValueError(f"files(task) names {rel!r}, outside the working directory")
                path.parent.mkdir(parents=True, exist_ok=True)
                if isinstance(content, bytes):
                    path.write_bytes(content)
                else:
                    path.write_text(content)
        task_json = json.dumps(run.task)
        (root / "task.json").write_text(task_json)
        env = {k: os.environ[k] for k in self.pass_env if k in os.environ}
        if self.isolated_home:
            env |= {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
                    "XDG_CACHE_HOME": str(home / ".cache"), "XDG_DATA_HOME": str(home / ".local/share"),
                    "XDG_STATE_HOME": str(home / ".local/state")}
        elif "HOME" in os.environ:
            env["HOME"] = os.environ["HOME"]
        env |= session_env(run.base_url, run.api_key)
        env["ROLLOUT_TASK_FILE"] = str(root / "task.json")
        if len(task_json) <= TASK_ENV_MAX:
            env["ROLLOUT_TASK"] = task_json
        env |= {k: _format(v, fields, f"env {k}") for k, v in self.env.items()}
        argv = [_format(a, fields, "argv") for a in self.argv]
        return argv, cwd, env, home

    async def _reward(self, name: str, task: dict[str, Any], result: CommandResult, deadline: float | None,
                      root: Path) -> RunOutcome:
        extra: dict[str, Any] = {"exit_code": result.exit_code, "seconds": round(result.seconds, 3)}
        if self.keep_workdir:
            extra["dir"] = str(root)
        if self.reward is None:
            return RunOutcome(RunEnd.RETURNED, AgentResult(0.0, {"command": extra}))
        timeout = asyncio.timeout_at(deadline)
        try:
            async with timeout:
                if inspect.iscoroutinefunction(self.reward):
                    value = await self.reward(task, result)
                else:
                    value = await asyncio.to_thread(self.reward, task, result)
        except TimeoutError as exc:
            if timeout.expired():
                return RunOutcome(RunEnd.TIMEOUT, message="its reward function ran past the deadline")
            return _raised(name, f"its reward function raised {type(exc).__name__}: {exc}", exc=exc)
        except Exception as exc:  # the user's verifier: any exception is the agent's failure
            return _raised(name, f"its reward function raised {type(exc).__name__}: {exc}", exc=exc)
        try:
            got = agent_result(value)
        except ValueError as exc:
            return RunOutcome(RunEnd.INVALID, message=f"agent {name}: its reward function: {exc}")
        return RunOutcome(RunEnd.RETURNED, AgentResult(got.reward, {"command": extra, **got.info}, got.answer))


def session_env(base_url: str, api_key: str) -> dict[str, str]:
    """The session under the names each SDK and CLI reads: OpenAI's (``OPENAI_BASE_URL``: ``.../v1``), Anthropic's
    (``ANTHROPIC_BASE_URL``: without ``/v1``; the key is sent as ``x-api-key``, which the session accepts) and
    ours (``ROLLOUT_SESSION_URL``: the OpenAI base URL, ``ROLLOUT_SESSION_KEY``)."""
    return {"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key,
            "ANTHROPIC_BASE_URL": base_url.removesuffix("/").removesuffix("/v1"), "ANTHROPIC_API_KEY": api_key,
            "ROLLOUT_SESSION_URL": base_url, "ROLLOUT_SESSION_KEY": api_key}


def _format(template: str, fields: Mapping[str, str], where: str) -> str:
    try:
        return string.Formatter().vformat(template, (), dict(fields))
    except KeyError as exc:
        raise KeyError(f"{where} {template!r} names {{{exc.args[0]}}}, which is neither a field of the task nor one "
                       f"of {', '.join(PLACEHOLDERS)}") from None
    except (ValueError, IndexError) as exc:
        raise ValueError(f"{where} {template!r}: {exc} (write literal braces as {{{{ and }}}})") from None


def _shown(argv: list[str], limit: int = 300) -> str:
    line = shlex.join(argv)
    return line if len(line) <= limit else line[:limit] + "…"


def _raised(name: str, what: str, error: str = "", exc: BaseException | None = None) -> RunOutcome:
    message = f"agent {name}: {what}"
    if exc is not None:
        tb = "".join(traceback.format_exception(exc))
        room = REASON_CHARS - len(message) - 1
        message = f"{message}\n{tb[-room:]}" if room > 0 else message
    return RunOutcome(RunEnd.RAISED, message=message[:REASON_CHARS], error=(error or what)[:500])


@dataclass
class _Ran:
    pid: int = 0
    code: int = 0
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    timed_out: bool = False
    start_error: str | None = None


_SETPRIV = shutil.which("setpriv") if sys.platform == "linux" else None
"""util-linux ``setpriv``: starts the process with ``--pdeathsig KILL`` (it dies with the process that started it)."""


async def _execute(argv: list[str], cwd: Path, env: dict[str, str], deadline: float | None, grace_s: float,
                   max_bytes: int) -> _Ran:
    """Run ``argv`` in a process group of its own until it exits or ``deadline`` passes (then kill the group)."""
    ran = _Ran()
    program = _program(argv[0], cwd, env.get("PATH"))
    if program is None:
        ran.start_error = f"FileNotFoundError: no executable {argv[0]!r} (PATH {env.get('PATH')!r})"
        return ran
    command = [_SETPRIV, "--pdeathsig", "KILL", "--", program, *argv[1:]] if _SETPRIV else [program, *argv[1:]]
    started = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            *command, cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True)
    except OSError as exc:
        ran.start_error = f"{type(exc).__name__}: {exc}"
        return ran
    ran.pid = proc.pid
    assert proc.stdout is not None and proc.stderr is not None
    out, err = bytearray(), bytearray()
    readers = [asyncio.create_task(_drain(proc.stdout, out, max_bytes)),
               asyncio.create_task(_drain(proc.stderr, err, max_bytes))]
    try:
        timeout = asyncio.timeout_at(deadline)
        try:
            async with timeout:
                ran.code = await proc.wait()
        except TimeoutError:
            if not timeout.expired():
                raise
            ran.timed_out = True
            await _terminate(proc, grace_s)
    except BaseException:  # cancelled (the episode, the worker's drain): no process outlives its run
        await _terminate(proc, grace_s)
        raise
    finally:
        _killpg(proc.pid, signal.SIGKILL)  # what it left behind in its group
        with contextlib.suppress(TimeoutError):  # a process that left the group may hold the pipes open
            async with asyncio.timeout(1.0):
                await asyncio.shield(asyncio.gather(*readers, return_exceptions=True))
        for reader in readers:
            reader.cancel()
    ran.seconds = time.monotonic() - started
    ran.code = proc.returncode if proc.returncode is not None else ran.code
    ran.stdout = out.decode("utf-8", "replace")
    ran.stderr = err.decode("utf-8", "replace")
    return ran


def _program(name: str, cwd: Path, path: str | None) -> str | None:
    """The executable ``name`` names (on ``path`` when it has no slash; else relative to ``cwd``), or None."""
    if "/" not in name:
        return shutil.which(name, path=path)
    full = cwd / name
    return str(full) if full.is_file() and os.access(full, os.X_OK) else None


async def _terminate(proc: asyncio.subprocess.Process, grace_s: float) -> None:
    """SIGTERM to the group, SIGKILL after ``grace_s`` (at once when cancelled while waiting), and reap."""
    _killpg(proc.pid, signal.SIGTERM)
    try:
        async with asyncio.timeout(grace_s):
            await asyncio.shield(proc.wait())
    except TimeoutError:
        pass
    finally:
        _killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(grace_s):
            await asyncio.shield(proc.wait())


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def _drain(stream: asyncio.StreamReader, into: bytearray, max_bytes: int) -> None:
    """Read ``stream`` to its end, keeping its last ``max_bytes``."""
    while chunk := await stream.read(65536):
        into += chunk
        if len(into) > 2 * max_bytes:
            del into[:-max_bytes]
    if len(into) > max_bytes:
        del into[:-max_bytes]
