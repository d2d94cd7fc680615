"""The trainers' one stack: the GRPO closed loop and the TRL runs train, one after the other, on a single
``rollout demo`` stack on vLLM (float32), started once for this folder and stopped at its end.

Each run starts where the previous one left the ledger, as a user's next run would: the GRPO example resumes
from the version the workers serve, and TRL's adapter first publishes the weights TRL starts from
(``sync_start``). So the tests assert relative to the version the ledger served when they began
(``served_version``), and read only their own batches.

The stack has NATS and Postgres of its own (private servers), never the session's: the e2e package's in-process
vLLM worker follows the policy announcements on the session NATS and would load the trainers' checkpoints too.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.e2e.conftest import E2E_DTYPE, require_vllm

if TYPE_CHECKING:
    from rollout_ledger.cli.stack.devstack import DevStack


@pytest.fixture(scope="package")
def trainer_stack(model_dir: str) -> Iterator[DevStack]:
    """``rollout demo``'s stack on vLLM with private servers, shared by every trainer test of this folder."""
    from rollout_ledger.cli.modelstore import fetch
    from rollout_ledger.cli.stack.devstack import DevStack

    require_vllm()
    fetch(Path(model_dir), with_weights=True)
    with pytest.MonkeyPatch.context() as mp:
        for name in ("NATS_URL", "DATABASE_URL"):  # private servers of its own (module docstring)
            mp.delenv(name, raising=False)
        mp.setenv("ROLLOUT_MODEL", model_dir)
        with DevStack(scheduler_port=None, engine="vllm", echo=print,
                      extra_env={"ROLLOUT_VLLM_DTYPE": E2E_DTYPE}) as stack:
            yield stack


@pytest.fixture
def trainer_env(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer processes load the model of the stack's workers (version 0)."""
    monkeypatch.setenv("ROLLOUT_MODEL", model_dir)


def served_version(stack: DevStack) -> tuple[int, str | None]:
    """The version the stack's workers serve now (0 before any trainer published one) and its checkpoint (None for
    version 0: the model the workers started with)."""
    policy = httpx.get(f"{stack.scheduler_url}/v1/policy", timeout=30,
                       headers={"Authorization": f"Bearer {stack.api_token}"}).json()
    current = policy.get("current")
    if not current:
        return 0, None
    return int(current["version"]), str(current["checkpoint"])
