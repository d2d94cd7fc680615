"""The exporter CronJob's script: writes every batch whose episodes have all ended and that has no file yet.

Mounted from the ConfigMap ``exporter-script`` and run as ``python /etc/rollout/export_finished.py OUT_DIR
[FORMAT]`` with ``DATABASE_URL`` set; it calls the exporter (``rollout_ledger/services/exporter/export.py``) once per
batch, so a rerun after a crash writes only what is missing (``export_batch`` renames a finished ``.partial`` file).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from sqlalchemy import create_engine, func, select

from rollout_ledger.migrations.runner import sync_url
from rollout_ledger.services.exporter.export import FILE_FORMATS, export_batch
from rollout_ledger.shared.db import episodes
from rollout_ledger.shared.lifecycle import TERMINAL


def finished_batches(database_url: str) -> list[str]:
    """Batch ids none of whose episodes is still requested or running, oldest id first."""
    still_open = func.count().filter(episodes.c.status.notin_(sorted(s.value for s in TERMINAL)))
    query = select(episodes.c.batch_id).group_by(episodes.c.batch_id).having(still_open == 0)
    engine = create_engine(sync_url(database_url))
    try:
        with engine.connect() as conn:
            return sorted(str(row[0]) for row in conn.execute(query))
    finally:
        engine.dispose()


def export_new(database_url: str, out_dir: Path, file_format: str) -> list[Path]:
    """Export each finished batch that has no ``<batch_id>.<format>`` in ``out_dir``; the files written."""
    written = []
    for batch_id in finished_batches(database_url):
        if (out_dir / f"{batch_id}.{file_format}").exists():
            continue
        result = export_batch(database_url, batch_id, out_dir, file_format)
        print(f"exported {batch_id}: {result.records} trajectories -> {result.path}", flush=True)
        written.append(result.path)
    return written


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3) or (len(argv) == 3 and argv[2] not in FILE_FORMATS):
        print(f"usage: {argv[0]} OUT_DIR [{'|'.join(FILE_FORMATS)}]  (DATABASE_URL from the environment)")
        return 2
    written = export_new(os.environ["DATABASE_URL"], Path(argv[1]), argv[2] if len(argv) == 3 else "parquet")
    print(f"{len(written)} batches exported", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
