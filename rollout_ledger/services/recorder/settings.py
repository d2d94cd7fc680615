"""Settings of the recorder service (environment variables ``ROLLOUT_<FIELD>``)."""

from __future__ import annotations

from pydantic import Field

from rollout_ledger.shared.kit.settings import ConsumerSettings, DatabaseSettings


class RecorderSettings(ConsumerSettings, DatabaseSettings):
    """How the recorder consumes the event stream and writes Postgres."""

    batch_size: int = Field(500, ge=1, le=10_000)
    """Events fetched and written per transaction at most."""
    retry_initial_s: float = Field(0.1, gt=0)
    """First backoff delay when Postgres cannot be reached."""
    retry_max_s: float = Field(5.0, gt=0)
    """Cap of the exponential backoff while Postgres is down."""
    assembly_retry_delay_s: float = Field(1.0, gt=0)
    """Nak delay of a terminal event whose turns or steps are not all stored yet."""
    assembly_max_deliveries: int = Field(300, ge=2)
    """After this many deliveries of a still-incomplete terminal event, give up: dead-letter it, mark the episode
    failed (class infra). With the default delay that is about five minutes of waiting."""
    advisory_batch_size: int = Field(50, ge=1)
    """Max-deliveries advisories handled per fetch."""
    pending_poll_s: float = Field(5.0, gt=0)
    """How often the consumer's ``num_pending`` is read into ``rollout_recorder_pending``."""
