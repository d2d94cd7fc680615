"""The one lifecycle of every service (rollout_ledger/shared/kit/service.py): ``run_main`` exits with the service's
code, or 2 naming a bad setting; ``ServiceScope`` serves the ops routes while open and closes what the service
registered in reverse order, after marking it draining."""

from __future__ import annotations

import httpx
import pytest

from rollout_ledger.shared.kit.runtime import Health, Shutdown
from rollout_ledger.shared.kit.service import BAD_SETTINGS_EXIT, ServiceScope, run_main
from rollout_ledger.shared.kit.settings import BaseServiceSettings


async def test_the_scope_serves_ops_routes_and_closes_in_reverse_order() -> None:
    from prometheus_client import CollectorRegistry

    health = Health()
    health.ready = True
    closed: list[str] = []

    async def close(what: str) -> None:
        closed.append(what)

    settings = BaseServiceSettings(http_port=0)
    async with ServiceScope("test-service", settings, health, CollectorRegistry()) as scope:
        scope.on_close(close, "first opened")
        scope.on_close(close, "last opened")
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"http://127.0.0.1:{scope.http.port}/readyz")).status_code == 200
    assert closed == ["last opened", "first opened"]
    assert health.draining and not health.ready


def test_run_main_exits_with_the_services_code(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[BaseServiceSettings, Shutdown]] = []

    async def run(settings: BaseServiceSettings, shutdown: Shutdown) -> int:
        seen.append((settings, shutdown))
        return 3

    monkeypatch.setenv("ROLLOUT_WORKER_ID", "w-1")
    with pytest.raises(SystemExit) as done:
        run_main("test-service", BaseServiceSettings, run)
    assert done.value.code == 3 and seen[0][0].worker_id == "w-1" and not seen[0][1].requested


def test_a_bad_setting_exits_2_naming_the_field_not_the_value(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    async def run(settings: BaseServiceSettings, shutdown: Shutdown) -> None:
        raise AssertionError("never reached")

    monkeypatch.setenv("ROLLOUT_NATS_CONNECT_TIMEOUT_S", "hunter2")
    with pytest.raises(SystemExit) as done:
        run_main("test-service", BaseServiceSettings, run)
    out = capsys.readouterr()
    logged = out.out + out.err
    assert done.value.code == BAD_SETTINGS_EXIT
    assert "service.bad_settings" in logged and "nats_connect_timeout_s" in logged and "hunter2" not in logged
