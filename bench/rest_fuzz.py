"""schemathesis against a real scheduler process (private NATS and Postgres): every operation, every check, seeded.

``python -m bench.rest_fuzz [--max-examples N] [--seed S]`` prints one JSON line: cases generated, passed,
failures, the phases and the time. The CI test (tests/integration/test_rest_schemathesis.py) runs ``run`` with
10 examples per operation.

The scheduler gets a write token (schemathesis sends it) and a read token; envs ``arithmetic`` (the schema's
example) and ``echo`` are registered in ``rl_envs`` so that valid requests reach the database and the work queue.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rollout_ledger.shared.events import dumps
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.subjects import ENVS_BUCKET

CONFIG = Path(__file__).resolve().parents[1] / "tests" / "integration" / "schemathesis.toml"
"""Which statuses a schema-valid request may get besides 2xx (400 and 413: what JSON Schema cannot state)."""
ENVS = ("arithmetic", "echo")
ALL_PHASES = "examples,coverage,fuzzing,stateful"


@dataclass(frozen=True)
class FuzzResult:
    """What one schemathesis run found."""

    returncode: int
    generated: int
    passed: int
    failures: int
    seconds: float
    phases: str
    max_examples: int
    seed: int
    output: str

    @property
    def clean(self) -> bool:
        """Every generated case passed every check (no server error, no schema violation)."""
        return self.returncode == 0 and self.failures == 0 and self.generated > 0 and self.passed == self.generated


async def register_envs(js: bus.JetStreamContext) -> None:
    """The envs the schema's examples name, as an env worker registers them."""
    kv = await js.key_value(ENVS_BUCKET)
    for name in ENVS:
        await kv.put(name, dumps({"name": name, "description": f"{name} (registered by bench.rest_fuzz)"}))


def run(url: str, token: str, *, max_examples: int, seed: int, phases: str = ALL_PHASES, workers: int = 1,
        timeout_s: float = 1800) -> FuzzResult:
    """``schemathesis run {url}/openapi.json --checks all`` with the write token; the parsed summary."""
    exe = Path(sys.executable).with_name("schemathesis")
    cmd = [str(exe), "--config-file", str(CONFIG), "--no-color", "run", f"{url}/openapi.json", "--checks", "all",
           "--max-examples", str(max_examples), "--seed", str(seed), "--phases", phases, "--workers", str(workers),
           "--generation-database", "none", "--header", f"Authorization: Bearer {token}"]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    out = proc.stdout + proc.stderr
    counts = re.search(r"(\d+) generated, (?:(\d+) passed|(\d+) found (\d+) unique failures)", out)
    generated = int(counts.group(1)) if counts else 0
    passed = int(counts.group(2)) if counts and counts.group(2) else 0
    failures = int(counts.group(4)) if counts and counts.group(4) else (0 if proc.returncode == 0 else -1)
    return FuzzResult(proc.returncode, generated, passed, failures, round(time.monotonic() - started, 1), phases,
                      max_examples, seed, out)


async def _main(args: argparse.Namespace) -> FuzzResult:
    from rollout_ledger.cli.stack.servers import LocalInfra
    from rollout_ledger.cli.stack.supervisor import Stack
    from rollout_ledger.migrations.runner import upgrade

    infra = LocalInfra()
    infra.start()
    try:
        upgrade(infra.database_url)
        nc = await bus.connect(infra.nats_url, name="bench-rest-fuzz")
        await bus.ensure_topology(nc.jetstream(), 1)
        await register_envs(nc.jetstream())
        await nc.close()
        with Stack(infra.nats_url, infra.database_url, infra.root / "logs") as stack:
            url = stack.start("scheduler", ROLLOUT_API_READ_TOKEN="bench-read-token-0123456789",
                              ROLLOUT_LOG_LEVEL="WARNING").url
            return await asyncio.to_thread(run, url, stack.api_token, max_examples=args.max_examples,
                                           seed=args.seed, phases=args.phases, workers=args.workers)
    finally:
        infra.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-examples", type=int, default=25, help="cases per operation and phase")
    p.add_argument("--seed", type=int, default=16)
    p.add_argument("--phases", default=ALL_PHASES)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--show", action="store_true", help="print schemathesis' own report too")
    args = p.parse_args()
    result = asyncio.run(_main(args))
    if args.show or not result.clean:
        print(result.output, file=sys.stderr)
    print(json.dumps({k: v for k, v in asdict(result).items() if k != "output"} | {"clean": result.clean}))
    sys.exit(0 if result.clean else 1)


if __name__ == "__main__":
    main()
