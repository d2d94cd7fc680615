"""verl's training data for the ledger: a Parquet file of prompts whose ``extra_info.ledger_task`` is the ledger task
(JSON text: Parquet keeps text of differing tasks apart), as ``RLHFDataset`` reads it.

    python examples/verl/make_data.py /data/ledger-train.parquet 256
"""

from __future__ import annotations

import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq


def main() -> None:
    path, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 256
    rows = [{"prompt": [{"role": "user", "content": f"guess-number task {i}"}], "data_source": "rollout_ledger",
             "agent_name": "rollout_ledger", "reward_model": {"style": "rule", "ground_truth": ""},
             "extra_info": {"index": i, "ledger_task": json.dumps({"seed": i})}} for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    print(f"{n} prompts -> {path}")


if __name__ == "__main__":
    main()
