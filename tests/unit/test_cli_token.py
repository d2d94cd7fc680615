"""The CLI's bearer token: given, from ROLLOUT_API_TOKEN, or the one `rollout up` recorded for its scheduler."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from rollout_ledger.cli.client import (
    SchedulerClient,
    forget_local_stack,
    local_stack_file,
    resolve_token,
    save_local_stack,
)


@pytest.fixture(autouse=True)
def state_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.delenv("ROLLOUT_API_TOKEN", raising=False)
    return tmp_path


def test_the_local_stack_token_is_found_for_its_url_only(state_home: Path) -> None:
    path = save_local_stack("http://127.0.0.1:8000/", "up-token-0123456789")
    assert path == local_stack_file() and path.parent == state_home / "rollout-ledger"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert resolve_token("http://127.0.0.1:8000") == "up-token-0123456789"
    assert resolve_token("http://127.0.0.1:8001") is None
    client = SchedulerClient("http://127.0.0.1:8000")
    assert client.http.headers["Authorization"] == "Bearer up-token-0123456789"


def test_a_given_token_and_the_env_var_win(monkeypatch: pytest.MonkeyPatch) -> None:
    save_local_stack("http://127.0.0.1:8000", "up-token-0123456789")
    assert resolve_token("http://127.0.0.1:8000", "given-token-0123") == "given-token-0123"
    monkeypatch.setenv("ROLLOUT_API_TOKEN", "env-token-0123456")
    assert resolve_token("http://127.0.0.1:8000") == "env-token-0123456"
    assert SchedulerClient("http://elsewhere:1").http.headers["Authorization"] == "Bearer env-token-0123456"


def test_forget_removes_only_its_own_record() -> None:
    save_local_stack("http://127.0.0.1:8000", "up-token-0123456789")
    forget_local_stack("http://127.0.0.1:9999")
    assert local_stack_file().exists()
    forget_local_stack("http://127.0.0.1:8000")
    assert not local_stack_file().exists()
    forget_local_stack("http://127.0.0.1:8000")  # nothing left: no error
    assert resolve_token("http://127.0.0.1:8000") is None


def test_status_links_the_viewer_with_the_local_token_only(state_home: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`rollout status` ends with the batch's viewer link; the local stack's own token rides in the fragment (never
    sent to a server), a token the user gave never reaches the terminal."""
    from typer.testing import CliRunner

    from rollout_ledger.cli import main as cli
    from rollout_ledger.cli.client import viewer_link

    save_local_stack("http://127.0.0.1:8000", "up-token-0123456789")
    info = {"batch_id": "b1", "counts": {"completed": 2}, "mean_reward": 0.5, "num_trajectories": 2}
    monkeypatch.setattr(SchedulerClient, "batch", lambda self, batch_id: info)
    out = CliRunner().invoke(cli.app, ["status", "b1"]).output
    assert "viewer: http://127.0.0.1:8000/viewer/#/batch/b1?token=up-token-0123456789" in out
    out = CliRunner().invoke(cli.app, ["status", "b1", "--token", "secret-of-the-user"]).output
    assert "viewer: http://127.0.0.1:8000/viewer/#/batch/b1\n" in out and "secret-of-the-user" not in out
    out = CliRunner().invoke(cli.app, ["status", "b1", "--url", "http://elsewhere:8000"]).output
    assert "viewer: http://elsewhere:8000/viewer/#/batch/b1\n" in out and "up-token" not in out
    assert viewer_link("http://h:1/", "/episode/b.0.0") == "http://h:1/viewer/#/episode/b.0.0"
