"""schemathesis over every operation of a real scheduler process (real NATS and Postgres), every check
(``--checks all``: no server error, status codes, content types, headers and bodies as the schema says, invalid
data rejected, valid data accepted, auth not ignored, unsupported methods refused), bounded and seeded.

All four phases (examples, coverage, fuzzing, stateful: links between operations inferred, so a created batch is
read and cancelled) with 10 examples per operation: about 700 cases in a minute or so. The >= 1,000-case run is
``python -m bench.rest_fuzz`` (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio

from bench.rest_fuzz import register_envs, run
from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.shared.kit import bus


async def test_schemathesis_finds_no_server_error_and_no_schema_violation(stack: Stack, nc: bus.NATS) -> None:
    await register_envs(nc.jetstream())
    url = stack.start("scheduler", ROLLOUT_API_READ_TOKEN="schemathesis-read-token-0123",
                      ROLLOUT_LOG_LEVEL="WARNING").url
    result = await asyncio.to_thread(run, url, stack.api_token, max_examples=10, seed=16, timeout_s=500)
    assert result.clean, result.output[-6000:]
    assert result.generated >= 500, result.output[-2000:]  # 720 with this seed
