"""Settings of the training exporter: `rollout export` and `rollout rescore` (env vars ``ROLLOUT_<FIELD>``)."""

from __future__ import annotations

from pydantic import Field, field_validator

from rollout_ledger.client.source import CHUNK
from rollout_ledger.shared.kit.settings import BaseServiceSettings, normalize_database_url


class ExporterSettings(BaseServiceSettings):
    """How the exporter reads Postgres."""

    export_database_url: str | None = None
    """DSN the exporter reads with; point it at the read-only role ``rollout_reader`` (docs/sql.md). Unset:
    ``DATABASE_URL``. `rollout rescore` writes scores and always uses ``DATABASE_URL``."""
    export_batch_size: int = Field(256, ge=1, le=100_000)
    """Feed entries per consumer read (`--consumer`): bounds a delivery file and the reader's memory."""
    export_chunk: int = Field(CHUNK, ge=1, le=100_000)
    """Rows a one-shot export maps and writes at a time (cut across the driver's ~4 MiB batches): memory is bounded
    by this, the driver's batch and the row group, not by the export's size."""
    export_row_group_mb: int = Field(16, ge=1, le=4096)
    """Parquet row group size of a one-shot export, in MiB of Arrow data (memory holds about three groups). A row
    group per 500-row chunk made files twice as large (the token columns' dictionary and pages restart with every
    group) and slower to write and read. The groups still queued when the last row is read are encoded after it on
    one core: at 32 MiB that tail was ~0.3 s of a 100,000-trajectory export; 16 MiB halves it for ~3% more file
    (docs/benchmarks.md)."""
    export_poll_s: float = Field(1.0, gt=0)
    """With `--follow`, how long to wait before reading again when nothing was new."""
    export_stall_s: float = Field(300.0, gt=0)
    """With `--follow` and ``ROLLOUT_HTTP_PORT`` set, ``/healthz`` answers 503 once no read has finished for this
    long (a hung read or connection: the kubelet restarts the pod)."""

    @field_validator("export_database_url")
    @classmethod
    def _normalize_export_db(cls, v: str | None) -> str | None:
        return normalize_database_url(v) if v else None

    def reader_url(self) -> str:
        return self.export_database_url or self.database_url
