"""The reward the example harnesses share: did the harness leave the file the task asks for, with the text it
asks for? (Harnesses compute no reward; a verifier reads what they left in their working directory.)

A task: ``{"prompt": "...", "path": "answer.txt", "expected": "hello"}`` (``files``: optional, written into the
working directory before the harness starts).
"""

from __future__ import annotations

from typing import Any

from rollout_ledger.services.env_worker.agents.command import CommandResult


def task_files(task: dict[str, Any]) -> dict[str, str]:
    """The files a task brings (``task["files"]``: relative path -> content)."""
    return dict(task.get("files") or {})


def file_reward(task: dict[str, Any], result: CommandResult) -> dict[str, Any]:
    """1.0 when ``task["path"]`` in the working directory holds ``task["expected"]`` (spaces around ignored)."""
    path = result.workdir / task["path"]
    found = path.read_text(errors="replace").strip() if path.is_file() else None
    return {"reward": float(found == str(task["expected"]).strip()), "answer": found,
            "info": {"file": task["path"], "found": found is not None}}
