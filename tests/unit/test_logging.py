"""One log stream: structlog events and the stdlib records of libraries (uvicorn, vLLM, nats-py) come out as the same
JSON lines, with the bound episode/batch context."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def _run(code: str) -> list[dict[str, object]]:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60,
                          check=True)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    return [json.loads(ln) for ln in lines]  # every line is JSON: nothing plain in the stream


def test_library_records_are_json_lines_with_the_bound_context() -> None:
    records = _run("""
        import logging, structlog, uvicorn
        from rollout_ledger.shared.kit.logging import configure_logging, get_logger
        configure_logging("INFO", "json", service="recorder")
        structlog.contextvars.bind_contextvars(episode_id="b.0.0", batch_id="b")
        get_logger("ours").info("ours.event", n=1)
        logging.getLogger("nats.aio.client").warning("nats says %s", "hello")
        logging.getLogger("uvicorn.error").error("uvicorn broke")
        logging.getLogger("vllm.engine").warning("vllm warns")
        logging.getLogger("httpx").info("below the library floor: not shown")
        uvicorn.Config(app=None, log_config=None)  # as rollout_ledger/shared/kit/runtime does
        logging.getLogger("uvicorn.error").warning("still ours after uvicorn's config")
    """)
    events = {r["event"]: r for r in records}
    assert set(events) == {"ours.event", "nats says hello", "uvicorn broke", "vllm warns",
                           "still ours after uvicorn's config"}
    for record in records:
        assert record["service"] == "recorder" and record["episode_id"] == "b.0.0" and record["batch_id"] == "b"
        assert "timestamp" in record and "level" in record
    assert events["nats says hello"]["logger"] == "nats.aio.client"
    assert events["uvicorn broke"]["level"] == "error"


def test_configuring_twice_keeps_one_handler() -> None:
    (record,) = _run("""
        import logging
        from rollout_ledger.shared.kit.logging import configure_logging
        configure_logging("INFO", "json")
        configure_logging("INFO", "json")
        logging.getLogger("x").warning("handlers=%d", len(logging.getLogger().handlers))
    """)
    assert record["event"] == "handlers=1"
