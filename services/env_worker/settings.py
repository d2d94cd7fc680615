"""Settings of the env worker (environment variables ``ROLLOUT_<FIELD>``)."""

from __future__ import annotations

from pydantic import Field

from rollout_ledger.shared.settings import BaseServiceSettings


class EnvWorkerSettings(BaseServiceSettings):
    """How many episodes run at once, the work queue's ack policy, context and inference budgets."""

    concurrency: int = Field(64, ge=1)
    """Episodes in flight in this process; the worker fetches only as many work items as it has free slots."""
    ack_wait_s: float = Field(30.0, gt=0)
    """Work items are redelivered after this long without progress (the worker reports progress every third)."""
    max_deliver: int = Field(3, ge=1)
    """Deliveries of one work item before NATS gives up on it (the recorder then marks it failed: infra)."""
    max_ack_pending: int = Field(20000, ge=1)
    """Unacknowledged work items the consumer allows across all env workers."""
    fetch_batch: int = Field(64, ge=1)
    """Work items fetched per pull at most (also bounded by free slots)."""
    fetch_timeout_s: float = Field(1.0, gt=0)
    """How long one pull waits for work."""
    max_model_len: int = Field(2048, ge=16)
    """Context length of the policy: a turn gets ``min(sampling.max_tokens, room left)`` new tokens; no room
    left truncates the episode (stop reason ``context_length``)."""
    inference_request_timeout_s: float = Field(120.0, gt=0)
    """One inference try gives up after this long without a reply (a dead worker is noticed sooner)."""
    inference_max_tries: int = Field(3, ge=1)
    """Tries per turn (each may go to another worker) before the episode fails with class ``inference``."""
    inference_backoff_s: float = Field(0.2, ge=0)
    """Pause before the second try; doubled before each further try."""
    inference_backoff_max_s: float = Field(2.0, ge=0)
    """Longest pause between tries."""
    heartbeat_timeout_s: float = Field(3.0, gt=0)
    """An inference worker without a heartbeat for this long is dead: its waiting requests fail over."""
    inference_discovery_s: float = Field(1.5, ge=0)
    """At start, how long to listen for inference heartbeats before taking work (turns sent to ``INFER_ANY``
    cannot be failed over as precisely as turns sent to a known worker)."""
    publish_timeout_s: float = Field(10.0, gt=0)
    """How long the worker waits for the event stream to acknowledge an episode's events."""
    chat_template: str = ""
    """Path of a Jinja chat template used instead of the model's own (for example a reasoning template that
    rewrites earlier turns: such turns start new segments); empty: the model's template."""
    envs: str = ""
    """Comma-separated environment names this worker runs and registers; empty means all built-ins."""

    def env_names(self) -> list[str]:
        return [name.strip() for name in self.envs.split(",") if name.strip()]
