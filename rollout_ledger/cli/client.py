"""The CLI's side of the scheduler's API: the client package's ``LedgerClient`` with progress bars and tables, and
the local stack's record (``rollout up`` writes it, every client reads it)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rollout_ledger.client.rest import (
    TERMINAL,
    LedgerClient,
    SchedulerError,
    local_stack_file,
    local_token,
    resolve_token,
)

__all__ = ["TERMINAL", "SchedulerClient", "SchedulerError", "forget_local_stack", "load_tasks", "local_stack_file",
           "local_token", "print_batch", "print_policy", "resolve_token", "save_local_stack", "viewer_link"]

def save_local_stack(url: str, token: str) -> Path:
    """Record the local stack's scheduler URL and token (readable by this user only)."""
    path = local_stack_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": url.rstrip("/"), "token": token}, f)
    os.replace(path.with_suffix(".tmp"), path)
    return path


def forget_local_stack(url: str) -> None:
    """Remove the record when it is this stack's (another stack may have written it since)."""
    path = local_stack_file()
    try:
        if json.loads(path.read_text()).get("url") == url.rstrip("/"):
            path.unlink()
    except (OSError, ValueError, AttributeError):
        return


def load_tasks(tasks_file: str | None, inline: list[str] | None, num_tasks: int) -> list[dict[str, Any]]:
    if tasks_file:
        lines = Path(tasks_file).read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]
    if inline:
        return [json.loads(t) for t in inline]
    return [{"seed": i} for i in range(num_tasks)]


def viewer_link(url: str, page: str, token: str | None = None) -> str:
    """The viewer's address of ``page`` (``/batch/<id>``, ``/episode/<id>``, ...). ``token`` travels in the
    fragment, which the browser never sends to a server: give it only for a local stack's own token."""
    base = f"{url.rstrip('/')}/viewer/#{page}"
    return f"{base}?token={token}" if token else base


class SchedulerClient(LedgerClient):
    """The client package's ``LedgerClient`` with the CLI's progress bars."""

    def follow(self, batch_id: str, poll_s: float = 0.5, console: Console | None = None,
               timeout_s: float | None = None) -> dict[str, Any]:
        """Poll the batch with a progress bar until every episode is terminal; return the last status."""
        return self.follow_all([batch_id], poll_s, console, timeout_s)[0]

    def follow_all(self, batch_ids: list[str], poll_s: float = 0.5, console: Console | None = None,
                   timeout_s: float | None = None, labels: list[str] | None = None) -> list[dict[str, Any]]:
        """Poll several batches, one progress bar each, until all are done; return their last statuses."""
        console = console or Console()
        start = time.monotonic()
        labels = labels or [f"batch {b}" for b in batch_ids]
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[detail]}"), TimeElapsedColumn(), console=console) as progress:
            infos = [self.batch(b) for b in batch_ids]
            bars = [progress.add_task(label, total=info["num_episodes"], detail="")
                    for label, info in zip(labels, infos, strict=True)]
            while True:
                details = []
                for bar, info in zip(bars, infos, strict=True):
                    counts = info["counts"]
                    detail = " ".join(f"{k}={v}" for k, v in counts.items() if v)
                    details.append(detail)
                    progress.update(bar, completed=sum(counts.get(s, 0) for s in TERMINAL), detail=detail)
                if all(info.get("done") for info in infos):
                    return infos
                if timeout_s is not None and time.monotonic() - start > timeout_s:
                    raise TimeoutError(f"batches {', '.join(batch_ids)} not done after {timeout_s}s: "
                                       f"{'; '.join(details)}")
                time.sleep(poll_s)
                infos = [info if info.get("done") else self.batch(b) for b, info in zip(batch_ids, infos, strict=True)]


def print_batch(info: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"batch {info['batch_id']}")
    table.add_column("status")
    table.add_column("episodes", justify="right")
    for status, n in info["counts"].items():
        table.add_row(status, str(n))
    console.print(table)
    console.print(f"mean reward: {info.get('mean_reward')}   trajectories: {info.get('num_trajectories')}")
    adm = info.get("admission")
    if adm:
        limit = f", limit {adm['limit']}" if adm.get("limit") is not None else ""
        console.print(f"admission: max_staleness {adm['max_staleness']}, announced version {adm['current_version']}, "
                      f"workers serve {adm['serving_version']}, admitted {adm['admitted']}{limit}, "
                      f"waiting {adm['waiting']}" + (f" (held: {adm['held']})" if adm.get("held") else ""))


def check_checkpoint(path: Path) -> list[str]:
    """What is missing from a checkpoint directory for an inference worker to load it (empty: nothing)."""
    if not path.is_dir():
        return [f"{path} is not a directory"]
    missing = [name for name in ("config.json",) if not (path / name).is_file()]
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    return [f"{path} has no {m}" for m in missing]


def print_policy(info: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    current = info.get("current")
    if current is None:
        console.print("no policy version announced yet: inference workers serve the weights they started with")
    else:
        console.print(f"current version {current['version']} ({current['mode']}): {current['checkpoint']}"
                      f"   announced {current['created_at']}")
    table = Table(title="inference workers")
    for col in ("worker", "serving", "version", "state", "engine", "error", "reported"):
        table.add_column(col)
    for w in info.get("workers", []):
        table.add_row(w["worker_id"], str(w["serving"]), str(w["version"]), w["state"], w["engine"],
                      w["error"][:60], w["reported_at"])
    console.print(table)
    in_flight = info.get("in_flight") or {}
    console.print("episodes in flight by version: "
                  + (", ".join(f"{v}: {n}" for v, n in in_flight.items()) if in_flight else "none"))
