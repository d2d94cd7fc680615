"""Settings of the scheduler service (environment variables ``ROLLOUT_<FIELD>``)."""

from __future__ import annotations

from pydantic import Field, SecretStr, field_validator

from rollout_ledger.shared.kit.settings import DatabaseSettings

PLACEHOLDER_TOKENS = frozenset(
    {
        "changeme", "change-me", "change_me", "changeit", "replaceme", "replace-me", "replace_me", "secret",
        "password", "token", "api-token", "api_token", "apitoken", "todo", "xxx", "xxxx", "example", "default",
        "test", "none", "null", "your-token", "your_token", "yourtoken", "<token>", "...",
    }
)
"""Values of ROLLOUT_API_TOKEN that are obviously copied from an example and never a real secret."""

MIN_TOKEN_LENGTH = 8


class SchedulerSettings(DatabaseSettings):
    """Scheduler settings: API auth, batch limits, the outbox that republishes unpublished work items, and the
    staleness bound of admission."""

    api_token: SecretStr | None = None
    """Bearer token required on mutating routes (POST); unset means the API is open. Placeholders are refused."""
    max_batch_episodes: int = Field(10000, ge=1)
    """Largest batch accepted (tasks x group_size); a larger one is answered with 413."""
    max_task_bytes: int = Field(256 * 1024, ge=1024)
    """Largest JSON encoding of one task; a task above it is answered with 413 (it must fit in a work item)."""
    require_registered_env: bool = True
    """Reject batches whose env no env worker has registered in the KV bucket ``rl_envs``."""
    republish_interval_s: float = Field(5.0, gt=0)
    """How often the outbox looks for stored episodes whose work item never reached the work queue."""
    republish_grace_s: float = Field(10.0, ge=0)
    """The outbox leaves episodes younger than this to the request that created them (it publishes them itself)."""
    republish_limit: int = Field(1000, ge=1)
    """Episodes the outbox republishes per database transaction."""
    publish_chunk: int = Field(1000, ge=1)
    """Work items published (with ``publish_async``) before their ``published_at`` is stored."""
    publish_timeout_s: float = Field(30.0, gt=0)
    """How long one chunk of publishes may wait for the stream's acks."""
    max_staleness: int | None = Field(None, ge=0)
    """Deployment default of a batch's ``max_staleness`` k (a batch's own value wins): its episodes start only while
    (announced policy version - the lowest version a live inference worker serves) <= k. Unset: batches without
    their own bound start at once."""
    admission_interval_s: float = Field(1.0, gt=0)
    """How often admission looks at batches with waiting episodes (it also runs when a version is announced, a
    worker reports and a bounded batch is stored)."""
    nats_initial_wait_s: float = Field(30.0, gt=0)
    """How long the first NATS connection is retried at start before the service gives up."""

    @field_validator("api_token", mode="before")
    @classmethod
    def _refuse_placeholder(cls, value: object) -> object:
        if value is None:
            return None
        raw = value.get_secret_value() if isinstance(value, SecretStr) else str(value)
        raw = raw.strip()
        if raw == "":
            return None
        if raw.lower() in PLACEHOLDER_TOKENS or (raw.startswith("<") and raw.endswith(">")):
            raise ValueError("ROLLOUT_API_TOKEN is a placeholder; set a real secret or unset it")
        if len(raw) < MIN_TOKEN_LENGTH:
            raise ValueError(f"ROLLOUT_API_TOKEN is shorter than {MIN_TOKEN_LENGTH} characters")
        return raw
