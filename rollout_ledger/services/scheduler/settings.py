"""Settings of the scheduler service (environment variables ``ROLLOUT_<FIELD>``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator

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
    """Scheduler settings: API auth, request limits, batch limits, the outbox that republishes unpublished work
    items, and the staleness bound of admission."""

    api_token: SecretStr | None = None
    """Bearer token with the ``write`` scope (which includes ``read``): every POST needs it. Required unless
    ``ROLLOUT_API_AUTH=disabled``: the scheduler refuses to start without it. Placeholders are refused."""
    api_read_token: SecretStr | None = None
    """Bearer token with the ``read`` scope only: GETs of batches, episodes, envs and the policy; a POST with it is
    answered 403. Optional."""
    api_auth: Literal["required", "disabled"] = "required"
    """``required``: every API request needs a bearer token (401 without one); ``disabled``: the API is open to
    anyone who can reach it (an explicit opt-out for a throwaway local experiment, never a deployment)."""
    metrics_auth: Literal["open", "read"] = "open"
    """``/metrics`` open to scrapers (``open``) or behind a ``read`` bearer token (``read``). ``/healthz`` and
    ``/readyz`` are always open."""
    max_body_bytes: int = Field(10 * 1024 * 1024, ge=1024)
    """Largest request body; a larger one is answered with 413 from its Content-Length (or while it streams),
    before any of it is parsed."""
    max_json_depth: int = Field(32, ge=4, le=200)
    """Deepest nesting of arrays and objects in a request body (a deeper one is a 422)."""
    max_string_chars: int = Field(256 * 1024, ge=256)
    """Longest string (or object key) anywhere in a request body, in characters (a longer one is a 422)."""
    max_metadata_bytes: int = Field(64 * 1024, ge=256)
    """Largest JSON encoding of a batch's ``metadata``; a larger one is answered with 413 (it is returned by every
    GET of the batch)."""
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

    @field_validator("api_token", "api_read_token", mode="before")
    @classmethod
    def _refuse_placeholder(cls, value: object, info: ValidationInfo) -> object:
        env = f"ROLLOUT_{str(info.field_name).upper()}"
        if value is None:
            return None
        raw = value.get_secret_value() if isinstance(value, SecretStr) else str(value)
        raw = raw.strip()
        if raw == "":
            return None
        if raw.lower() in PLACEHOLDER_TOKENS or (raw.startswith("<") and raw.endswith(">")):
            raise ValueError(f"{env} is a placeholder; set a real secret or unset it")
        if len(raw) < MIN_TOKEN_LENGTH:
            raise ValueError(f"{env} is shorter than {MIN_TOKEN_LENGTH} characters")
        return raw

    @model_validator(mode="after")
    def _auth_configured(self) -> SchedulerSettings:
        if self.api_auth == "disabled":
            return self
        if self.api_token is None:
            raise ValueError("ROLLOUT_API_TOKEN is not set and ROLLOUT_API_AUTH is 'required': the API accepts no "
                             "unauthenticated request; set ROLLOUT_API_TOKEN (write scope; ROLLOUT_API_READ_TOKEN "
                             "for read-only clients), or ROLLOUT_API_AUTH=disabled for a throwaway local experiment")
        if self.api_read_token is not None and (
                self.api_read_token.get_secret_value() == self.api_token.get_secret_value()):
            raise ValueError("ROLLOUT_API_READ_TOKEN equals ROLLOUT_API_TOKEN: give the read scope its own secret")
        return self
