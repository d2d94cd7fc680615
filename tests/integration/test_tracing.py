"""One episode, one trace: the real service processes export their spans over OTLP/HTTP to a receiver this test runs
(rollout_ledger/cli/stack/otlp_sink.py, decoding the protobuf ``ExportTraceServiceRequest``s), on real NATS and
Postgres.

Proves, per episode: the trace starts at the scheduler's publish of the work item, holds spans of all four services,
the env worker's attempt is the child of that publish, every turn of the attempt, every generation of a turn (its
context carried in the request's headers), and the recorder's writes join from the events' headers; a retried
attempt stays in the episode's trace; the env worker's log lines carry the trace id; and work items without trace
headers (a producer with tracing off, as an older release) run as before, their trace starting at the env worker.
"""

from __future__ import annotations

import json
from collections import Counter

from rollout_ledger.cli.stack.otlp_sink import OtlpSink, SpanRecord
from rollout_ledger.cli.stack.supervisor import ServiceProcess, Stack
from tests.helpers import Sql, wait_for
from tests.integration.test_pipeline import submit_and_wait

SERVICES = {"scheduler", "env-worker", "inference-worker", "recorder"}


def _of_episode(sink: OtlpSink, episode_id: str) -> list[SpanRecord]:
    return [s for s in sink.spans() if s.attributes.get("rollout.episode_id") == episode_id]


def _trace_of(sink: OtlpSink, episode_id: str, services: set[str], recorded_events: int,
              generations: int = 0) -> list[SpanRecord]:
    """The episode's trace once the spans of ``services``, recorder writes of ``recorded_events`` events and
    ``generations`` generation spans have arrived, and every span's parent with them (the services export every
    100 ms, each on its own clock: a turn's span can arrive before the attempt's, which ends later, and the inference
    worker's generations of one episode can come in several exports)."""

    def complete() -> list[SpanRecord] | None:
        ids = {s.trace_id for s in _of_episode(sink, episode_id)}
        if len(ids) != 1:
            return None
        spans = sink.traces()[ids.pop()]
        written = sum(int(s.attributes.get("rollout.ack", 0)) for s in spans if s.name == "recorder.write")
        present = {s.span_id for s in spans}
        closed = all(not s.parent_span_id or s.parent_span_id in present for s in spans)
        generated = sum(s.name == "generation" for s in spans)
        arrived = {s.service for s in spans} >= services and written >= recorded_events and generated >= generations
        return spans if closed and arrived else None

    return wait_for(complete, 30, f"the trace of {episode_id} from {sorted(services)}")


def _check_attempt(spans: list[SpanRecord], attempt: SpanRecord, turns: int) -> None:
    """The attempt's turns, env calls and generations: children where they belong, one generation per turn."""
    children = [s for s in spans if s.parent_span_id == attempt.span_id]
    turn_spans = {s.span_id: s for s in children if s.name == "turn"}
    assert len(turn_spans) == turns
    assert sorted(s.attributes["rollout.turn_index"] for s in turn_spans.values()) == list(range(turns))
    assert sum(s.name == "env.reset" for s in children) == 1
    assert sum(s.name == "env.step" for s in children) == turns
    assert {(s.name, s.service) for s in children} <= {
        ("turn", "env-worker"), ("env.reset", "env-worker"), ("env.step", "env-worker"), ("recorder.write", "recorder")}
    generations = [s for s in spans if s.name == "generation" and s.parent_span_id in turn_spans]
    assert len(generations) == turns
    for gen in generations:
        assert gen.service == "inference-worker" and gen.kind == "SPAN_KIND_SERVER"
        assert gen.attributes["rollout.turn_index"] == turn_spans[gen.parent_span_id].attributes["rollout.turn_index"]
        assert gen.start_ns >= turn_spans[gen.parent_span_id].start_ns


def _log_lines(proc: ServiceProcess, event: str) -> list[dict[str, object]]:
    out = []
    for line in proc.log_path.read_text(errors="replace").splitlines():
        if f'"{event}"' in line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def test_one_episode_one_trace_across_the_four_services(stack: Stack, database_url: str) -> None:
    with OtlpSink() as sink:
        env = {"ROLLOUT_TRACING_ENDPOINT": sink.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100",
               "ROLLOUT_EPISODE_TIMEOUT_S": "5", "ROLLOUT_RETRY_TIMEOUT": "1"}
        stack.start("inference-worker", ROLLOUT_ENGINE="fake", **env)
        worker = stack.start("env-worker", **env)
        stack.start("recorder", **env)
        scheduler = stack.start("scheduler", **env)

        info = submit_and_wait(scheduler.url, timeout_s=90, env="fixed-turns", tasks=[{"turns": 3}, {"turns": 2}],
                               group_size=2, max_turns=4, sampling={"max_tokens": 8})
        counts = info["counts"]
        assert isinstance(counts, dict) and counts.get("completed") == 4
        batch_id = str(info["batch_id"])
        sql = Sql(database_url)
        try:
            episodes = {r["episode_id"]: r["num_turns"]
                        for r in sql.rows("select episode_id, num_turns from trajectories where batch_id = :b",
                                          b=batch_id)}
        finally:
            sql.close()
        assert sorted(episodes.values()) == [2, 2, 3, 3]
        end_lines = {str(line.get("episode_id")): line for line in _log_lines(worker, "episode.end")}

        for episode_id, turns in episodes.items():
            spans = _trace_of(sink, episode_id, SERVICES, recorded_events=2 * turns + 2, generations=turns)
            assert {s.service for s in spans} == SERVICES
            trace_id = spans[0].trace_id
            assert all(s.trace_id == trace_id for s in _of_episode(sink, episode_id)), "one episode, one trace"
            roots = [s for s in spans if not s.parent_span_id]
            assert [(r.name, r.service) for r in roots] == [("episode.publish", "scheduler")]
            attempts = [s for s in spans if s.name == "episode"]
            assert len(attempts) == 1 and attempts[0].parent_span_id == roots[0].span_id
            assert attempts[0].service == "env-worker" and attempts[0].attributes["rollout.status"] == "completed"
            _check_attempt(spans, attempts[0], turns)
            by_id = {s.span_id: s for s in spans}
            writes = [s for s in spans if s.name == "recorder.write"]
            assert writes and all(w.service == "recorder" and w.parent_span_id in by_id for w in writes)
            assert {by_id[w.parent_span_id].name for w in writes} <= {"episode", "generation"}
            # every event of the episode was written under its trace: started, turns, steps, finished
            assert sum(int(w.attributes.get("rollout.ack", 0)) for w in writes) >= 2 * turns + 2
            assert end_lines[episode_id]["trace_id"] == trace_id  # the worker's log line names the trace

        # a retried attempt (its deadline passed; retryable, one more allowed) continues the episode's trace
        info = submit_and_wait(scheduler.url, timeout_s=90, env="fixed-turns", tasks=[{"turns": 2, "step_delay_s": 30}],
                               group_size=1, max_turns=2, sampling={"max_tokens": 8})
        retried = f"{info['batch_id']}.0.0"

        def two_attempts() -> list[SpanRecord] | None:
            spans = _of_episode(sink, retried)
            return spans if sum(s.name == "episode" for s in spans) == 2 else None

        wait_for(two_attempts, 30, "both attempts' spans")
        spans = _trace_of(sink, retried, SERVICES, recorded_events=2)
        first, second = sorted((s for s in spans if s.name == "episode"), key=lambda s: s.attributes["rollout.attempt"])
        assert (first.attributes["rollout.status"], second.attributes["rollout.status"]) == ("retried", "failed")
        assert first.parent_span_id == next(s.span_id for s in spans if s.name == "episode.publish")
        assert second.parent_span_id == first.span_id
        assert {s.trace_id for s in _of_episode(sink, retried)} == {first.trace_id}

        # a producer without tracing (an older release): work items without trace headers run as before, and the
        # trace starts at the env worker
        scheduler.stop()
        old = stack.start("scheduler", name="scheduler-untraced", ROLLOUT_TRACING_ENDPOINT="")
        info = submit_and_wait(old.url, timeout_s=90, env="fixed-turns", tasks=[{"turns": 2}], group_size=2,
                               max_turns=2, sampling={"max_tokens": 8})
        counts = info["counts"]
        assert isinstance(counts, dict) and counts.get("completed") == 2
        for group in range(2):
            episode_id = f"{info['batch_id']}.0.{group}"
            spans = _trace_of(sink, episode_id, SERVICES - {"scheduler"}, recorded_events=6, generations=2)
            assert not any(s.service == "scheduler" for s in spans)
            roots = [s for s in spans if not s.parent_span_id]
            assert [(r.name, r.service) for r in roots] == [("episode", "env-worker")]
            _check_attempt(spans, roots[0], 2)
        assert sink.rejected == 0
        kinds = Counter(s.name for s in sink.spans())
        assert kinds["episode.publish"] == 5 and kinds["generation"] >= 14
