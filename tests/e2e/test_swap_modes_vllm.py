"""Live policy updates through the whole pipeline on real vLLM (issue 15, "Tests"): a vLLM inference worker, an env
worker, a recorder and a scheduler as real processes, on a NATS and a Postgres of this module's own (the package's
in-process vLLM worker follows announcements on the session's NATS and would load these checkpoints into the shared
engine). While multi-turn batches run, perturbed checkpoints (the model re-saved with its final norm scaled: every
logit changes, no shape does) are pushed in each mode:

- ``drain`` (an episode-level drain): the episodes running at the push finish on the old weights, the next ones
  start on the new version; no episode spans two versions;
- ``abort``: the turns in flight are cut and generated again on the new weights: episodes that span both versions
  exist, each turn recorded with the version that generated it (never going backwards within an episode);
- ``keep``: the turns in flight are cut and continued on the new weights: they keep the ids the old version sampled
  (their logprobs are transformers' under the old weights) and the rest is sampled by the new one (transformers'
  under the new weights); nothing is generated twice and no episode is aborted;
- a checkpoint of another architecture (``vocab_size`` changed) is refused; the old version keeps serving;
- an inference worker SIGKILLed (with its process group: the engine core dies with it) while it loads a version
  comes back, a new process, serving that version, and the batch completes;
- admission: a batch with ``max_staleness`` 0 submitted right after a push waits while the worker serves the old
  version and starts once it serves the new one;
- the worker process drains on SIGTERM and exits 0, its engine core with it (the e2e suite's only other vLLM
  processes are the session engine and the trainer demos' stacks).

For every version, every kept turn's stored logprobs are transformers' under THAT version's weights (float32, the
audit's recomputation; and not those of the version before it), and every batch is token-exact in SQL.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import pytest

from rollout_ledger.cli.stack.servers import LocalInfra
from rollout_ledger.cli.stack.supervisor import ServiceProcess, Stack
from rollout_ledger.services.exporter.audit import load_model, recompute
from tests.e2e.conftest import E2E_DTYPE, ENGINE_START_TIMEOUT_S, require_vllm
from tests.e2e.test_live_weights_vllm import perturbed
from tests.helpers import API_TOKEN, AUTH, Sql, metric, wait_for
from tests.integration.test_pipeline import check_token_exact

pytestmark = pytest.mark.e2e

WORKER = "vllm-swap"
MAX_MODEL_LEN = 2048
TOLERANCE = 5e-4
"""Per turn, the largest |stored vLLM logprob - transformers' under the turn's version| accepted (both float32;
measured here: max ~2-5e-5, tests/e2e/test_pipeline_vllm.py)."""
CHANGED = 10 * TOLERANCE
"""Per version, the largest |Δ| against the weights of the version before it is above this: the weights changed."""
SAMPLING = {"temperature": 1.0, "max_tokens": 8}
LOAD_BEGINS = re.compile(r"Loading safetensors checkpoint shards:\s+0%")
"""vLLM's progress line as it begins reading a checkpoint (at start and at each load), in the worker's log."""


@dataclass
class Run:
    """The module's stack and what it has pushed so far."""

    stack: Stack
    url: str
    sql: Sql
    model_dir: str
    root: Path
    worker: ServiceProcess | None = None
    checkpoints: dict[int, str] = field(default_factory=dict)
    """Version -> its weights (0: the model the worker starts with)."""
    served: list[int] = field(default_factory=lambda: [0])
    """The versions the worker has served, in order."""
    measured: dict[int, float] = field(default_factory=dict)
    """Version -> the largest per-token |Δlogprob| seen on its turns."""
    models: dict[int, Any] = field(default_factory=dict)
    """Version -> its weights in transformers (float32), the last few used."""

    def model(self, version: int) -> Any:
        if version not in self.models:
            while len(self.models) >= 3:
                del self.models[next(iter(self.models))]
            self.models[version] = load_model(self.checkpoints[version])
        return self.models[version]

    @property
    def inf(self) -> ServiceProcess:
        assert self.worker is not None
        return self.worker

    def start_worker(self) -> ServiceProcess:
        self.worker = self.stack.start(
            "inference-worker", name=WORKER, wait=False, ROLLOUT_ENGINE="vllm", ROLLOUT_VLLM_DTYPE=E2E_DTYPE,
            ROLLOUT_VLLM_MAX_MODEL_LEN=str(MAX_MODEL_LEN), ROLLOUT_POLICY_REPORT_S="1",
            ROLLOUT_REQUEST_TIMEOUT_S="300")
        self.worker.wait_ready(timeout_s=ENGINE_START_TIMEOUT_S)
        return self.worker

    def report(self) -> dict[str, Any] | None:
        for w in httpx.get(f"{self.url}/v1/policy", headers=AUTH, timeout=10).json()["workers"]:
            if w["worker_id"] == WORKER:
                return dict(w)
        return None

    def until_state(self, version: int, state: str, timeout_s: float = 120) -> dict[str, Any]:
        def reached() -> dict[str, Any]:
            w = self.report()
            return w if w is not None and w["version"] == version and w["state"] == state else {}

        return wait_for(reached, timeout_s, f"{WORKER} to report {state} for version {version}", interval_s=0.05)

    def push(self, version: int, checkpoint: Path, mode: str) -> None:
        r = httpx.post(f"{self.url}/v1/policy/versions", headers=AUTH, timeout=10,
                       json={"version": version, "checkpoint": str(checkpoint), "mode": mode})
        assert r.status_code == 201, r.text

    def checkpoint(self, version: int, scale: float) -> Path:
        path = perturbed(self.model_dir, self.root / f"v{version}", scale)
        self.checkpoints[version] = str(path)
        return path

    def submit(self, tasks: list[dict[str, Any]], max_turns: int, sampling: dict[str, Any] | None = None,
               **extra: Any) -> str:
        return str(self.submitted(tasks, max_turns, sampling, **extra)["batch_id"])

    def submitted(self, tasks: list[dict[str, Any]], max_turns: int, sampling: dict[str, Any] | None = None,
                  **extra: Any) -> dict[str, Any]:
        r = httpx.post(f"{self.url}/v1/batches", headers=AUTH, timeout=30, json={
            "env": "fixed-turns", "tasks": tasks, "group_size": 2, "max_turns": max_turns,
            "sampling": sampling or SAMPLING, **extra})
        assert r.status_code == 201, r.text
        return dict(r.json())

    def turns(self, batch_id: str) -> int:
        return int(self.sql.scalar("select count(*) from turns t join episodes e on e.id = t.episode_id "
                                   "where e.batch_id = :b", b=batch_id))

    def wait_done(self, batch_id: str, timeout_s: float = 240) -> None:
        def done() -> bool:
            return bool(httpx.get(f"{self.url}/v1/batches/{batch_id}", headers=AUTH, timeout=10).json()["done"])

        wait_for(done, timeout_s, f"batch {batch_id} to finish", interval_s=0.25)
        statuses = {r["status"] for r in self.sql.rows(
            "select distinct status from episodes where batch_id = :b", b=batch_id)}
        assert statuses == {"completed"}, statuses


@pytest.fixture(scope="module")
def run(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """NATS and Postgres of this module's own, migrated; the four services as processes, vLLM serving version 0."""
    require_vllm()
    from rollout_ledger.cli.modelstore import fetch
    from rollout_ledger.migrations.runner import upgrade

    fetch(Path(model_dir), with_weights=True)
    root = tmp_path_factory.mktemp("swap-modes")
    with LocalInfra(nats_url="", database_url="") as infra:
        upgrade(infra.database_url)
        with Stack(infra.nats_url, infra.database_url, root / "logs", env={"ROLLOUT_MODEL": model_dir},
                   api_token=API_TOKEN) as stack:
            # 4 episodes at a time; patient with an inference worker that is down (restarting after a kill): a
            # turn is tried again for ~6 minutes
            stack.start("env-worker", ROLLOUT_MAX_MODEL_LEN=str(MAX_MODEL_LEN), ROLLOUT_CONCURRENCY="4",
                        ROLLOUT_POLICY_REPORT_S="1", ROLLOUT_INFERENCE_MAX_TRIES="400",
                        ROLLOUT_INFERENCE_BACKOFF_MAX_S="1")
            stack.start("recorder")
            url = stack.start("scheduler").url
            sql = Sql(infra.database_url)
            state = Run(stack, url, sql, model_dir, root, checkpoints={0: model_dir})
            try:
                state.start_worker()
                assert state.until_state(0, "serving", timeout_s=30)["serving"] == 0
                yield state
            finally:
                sql.close()
                print(f"\nmax |Δlogprob| per version (vLLM vs transformers, float32): {state.measured}")


@pytest.fixture(autouse=True)
def logs_on_failure(run: Run, request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        for proc in run.stack.procs:
            print(f"\n===== {proc.name} (pid {proc.proc.pid if proc.proc else None}) log =====\n"
                  f"{proc.tail_log(60)}")


def last_line(proc: ServiceProcess, event: str) -> str:
    """The last line of the process's log that names ``event`` (for a failure's message)."""
    lines = [line for line in proc.log_path.read_text(errors="replace").splitlines() if event in line]
    return lines[-1] if lines else f"no {event} in {proc.log_path}"


def check_versions(run: Run, batch_id: str) -> dict[int, int]:
    """Every kept turn's version is its trajectory's action version, never lower than the turn before it in its
    episode, and its stored logprobs are transformers' under that version's weights (and, over the version's turns,
    not those of the version served before it). Returns the kept turns per version."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # beside the engine's threads on 2 cores: one thread is ~8x faster than two
    try:
        return _check_versions(run, batch_id)
    finally:
        torch.set_num_threads(threads)


def _check_versions(run: Run, batch_id: str) -> dict[int, int]:
    trajs = run.sql.rows("select episode_id, attempt, token_ids, logprobs, segments, action_ranges, action_versions "
                         "from trajectories where batch_id = :b", b=batch_id)
    counts: dict[int, int] = {}
    apart: dict[int, float] = {}
    for tr in trajs:
        kept = []  # the version of each run of each kept turn (one run per turn unless a keep swap cut it)
        for r in run.sql.rows(
                "select t.weight_version, t.version_runs from steps s join turns t on t.event_id = s.turn_event_id "
                "where s.episode_id = :e and s.attempt = :a and not s.superseded order by s.turn_index",
                e=tr["episode_id"], a=tr["attempt"]):
            kept += [v for _, v in r["version_runs"]] if r["version_runs"] else [r["weight_version"]]
        assert kept == list(tr["action_versions"]), "each action range carries its run's version"
        assert kept == sorted(kept), f"versions go backwards within episode {tr['episode_id']}: {kept}"
        ids = np.asarray(tr["token_ids"], dtype=np.int64)
        segments = [list(s) for s in tr["segments"]]
        for version in sorted(set(kept)):
            ranges = [tr["action_ranges"][i] for i, v in enumerate(kept) if v == version]
            positions = np.concatenate([np.arange(start, end) for start, end in ranges])
            stored = np.asarray(tr["logprobs"], dtype=np.float64)[positions]
            delta = np.abs(recompute(run.model(version), ids, segments, positions) - stored)
            assert not np.isnan(delta).any(), f"a turn of {tr['episode_id']} lies outside its segments"
            at = 0
            for start, end in ranges:
                gap = float(delta[at:at + end - start].max())
                at += end - start
                assert gap < TOLERANCE, (f"the turn at [{start}, {end}) of episode {tr['episode_id']} (version "
                                         f"{version}): stored logprobs vs transformers under version {version}: "
                                         f"max |Δ| {gap}")
                run.measured[version] = max(run.measured.get(version, 0.0), gap)
            counts[version] = counts.get(version, 0) + len(ranges)
            before = run.served.index(version)
            if before > 0:
                other = recompute(run.model(run.served[before - 1]), ids, segments, positions)
                apart[version] = max(apart.get(version, 0.0), float(np.abs(other - stored).max()))
    for version, far in apart.items():
        assert far > CHANGED, f"version {version}'s turns are as close to the weights of the version before: {far}"
    return counts


def test_drain_lets_running_episodes_finish_then_serves_the_new_version(run: Run) -> None:
    v1 = run.checkpoint(1, 1.5)
    batch = run.submit([{"turns": 2}] * 4, max_turns=2)  # 8 episodes, 4 at a time (the env worker's concurrency)
    wait_for(lambda: run.turns(batch) >= 2, 120, "turns on version 0")
    run.push(1, v1, "drain")
    run.until_state(1, "serving")
    swapped = time.time()
    run.served.append(1)
    run.wait_done(batch)
    assert check_token_exact(run.sql, batch) == 8
    late = run.sql.scalar("select count(*) from turns t join episodes e on e.id = t.episode_id where e.batch_id = :b "
                          "and t.weight_version < 1 and t.produced_at > to_timestamp(:t)", b=batch, t=swapped)
    assert late == 0, "once version 1 serves, no turn is generated on version 0"
    counts = check_versions(run, batch)
    assert set(counts) == {0, 1}, counts
    spans = run.sql.rows("select episode_id, min_version, max_version from v_trajectory_versions "
                         "where batch_id = :b and mixed_versions", b=batch)
    assert spans == [], "drain: the episodes running at the push finish on version 0, no episode spans 0 and 1"


def test_abort_cuts_turns_in_flight_and_generates_them_again_on_the_new_version(run: Run) -> None:
    regenerated = metric(run.inf.url, "rollout_inference_regenerated_total")
    v2 = run.checkpoint(2, 0.7)
    batch = run.submit([{"turns": 3}] * 2, max_turns=3, sampling={"temperature": 1.0, "max_tokens": 32})
    wait_for(lambda: run.turns(batch) >= 4, 120, "turns on version 1")
    wait_for(lambda: metric(run.inf.url, "rollout_inference_inflight") > 0, 60, "generations in flight")
    run.push(2, v2, "abort")
    run.until_state(2, "serving")
    run.served.append(2)
    run.wait_done(batch)
    assert check_token_exact(run.sql, batch) == 4
    assert metric(run.inf.url, "rollout_inference_regenerated_total") > regenerated, \
        "the abort cut generations in flight (generated again on version 2)"
    counts = check_versions(run, batch)
    assert set(counts) == {1, 2}, counts
    spans = run.sql.rows("select min_version, max_version, version_span, mixed_versions from v_trajectory_versions "
                         "where batch_id = :b", b=batch)
    mixed = [s for s in spans if s["mixed_versions"]]
    assert mixed, "episodes running across the abort swap span versions 1 and 2"
    assert all((s["min_version"], s["max_version"], s["version_span"]) == (1, 2, 1) for s in mixed)


def test_keep_continues_the_turns_in_flight_on_the_new_version(run: Run) -> None:
    regenerated = metric(run.inf.url, "rollout_inference_regenerated_total")
    lost = metric(run.inf.url, "rollout_swap_tokens_total", {"fate": "lost"})  # the abort's, before
    v3 = run.checkpoint(3, 1.1)
    # 4 episodes, all running at once (the env worker's concurrency), of turns of exactly 256 ids (min_tokens =
    # max_tokens: no early end of turn), several seconds of decoding even on a fast CPU; the 4 turns of a wave run in
    # lockstep. The push goes out once every first turn is recorded and a second turn has been in the engine for a
    # third of the time a first turn took: it has sampled ids (version 2's) and has about two thirds of its decoding
    # left, so the swap cuts it mid-way, on a slow machine or a fast one. A fixed reading does not hold on every
    # machine: "in the engine for 0.25 s" read a second turn still queued or prefilling on a CPU 4x slower (the cut
    # kept 0 ids), and "in the engine" alone could read a first turn about to end. (With more episodes than the
    # concurrency, "every first turn recorded" would wait for a second wave of episodes: three turns of decoding.)
    batch = run.submit([{"turns": 2, "topic": "lighthouses"}] * 2, max_turns=2,
                       sampling={"temperature": 1.0, "max_tokens": 256, "min_tokens": 256})

    def second_turns_a_third_through() -> bool:
        first = run.sql.rows("select t.generate_ms from turns t join episodes e on e.id = t.episode_id "
                             "where e.batch_id = :b and t.turn_index = 0", b=batch)
        if len(first) < 4:
            return False
        a_third_s = min(float(r["generate_ms"]) for r in first) / 1000 / 3
        return metric(run.inf.url, "rollout_inference_oldest_generation_seconds") >= a_third_s

    # the bound of a batch phase here (as ``wait_done``'s): one wave of 4 x 256 ids took 35 s beside two busy cores
    wait_for(second_turns_a_third_through, 240,
             "every first turn recorded and a second turn in the engine for a third of a first turn's time",
             interval_s=0.02)
    run.push(3, v3, "keep")
    run.until_state(3, "serving")
    run.served.append(3)
    run.wait_done(batch)  # every episode completed: none aborted by the update
    assert check_token_exact(run.sql, batch) == 4
    assert metric(run.inf.url, "rollout_inference_regenerated_total") == regenerated, "nothing generated twice"
    assert metric(run.inf.url, "rollout_swap_tokens_total", {"fate": "lost"}) == lost, "no sampled id discarded"
    assert metric(run.inf.url, "rollout_swap_tokens_total", {"fate": "kept"}) > 0, \
        f"the cut kept no id: {last_line(run.inf, 'weights.abort_running')}"
    straddled = run.sql.rows("select t.version_runs, cardinality(t.token_ids) as n from turns t join episodes e "
                             "on e.id = t.episode_id where e.batch_id = :b and t.version_runs is not null", b=batch)
    assert straddled, "turns in flight at the swap span versions 2 and 3"
    for t in straddled:
        (a, v_old), (b, v_new) = t["version_runs"]
        assert (a, v_old, v_new) == (0, 2, 3) and 0 < b < t["n"], t
    # per run: the ids before the swap carry version 2's logprobs, those after it version 3's (check_versions
    # recomputes every action range under its own version, and checks that 3's differ from 2's)
    counts = check_versions(run, batch)
    assert set(counts) == {2, 3}, counts


def test_a_checkpoint_of_another_architecture_is_refused_while_the_old_version_serves(run: Run) -> None:
    batch = run.submit([{"turns": 2}] * 2, max_turns=2)
    wait_for(lambda: run.turns(batch) >= 1, 120, "turns on version 3")
    bad = run.root / "v4"
    bad.mkdir()
    for path in Path(run.model_dir).iterdir():
        if path.name != "config.json":
            (bad / path.name).symlink_to(path)
    config = json.loads((Path(run.model_dir) / "config.json").read_text())
    config["vocab_size"] = int(config["vocab_size"]) + 64
    (bad / "config.json").write_text(json.dumps(config))
    run.push(4, bad, "drain")
    refused = run.until_state(4, "failed")
    assert refused["serving"] == 3 and "vocab_size" in refused["error"], refused
    assert run.inf.alive and metric(run.inf.url, "rollout_weight_version") == 3
    run.wait_done(batch)
    assert check_token_exact(run.sql, batch) == 4
    assert check_versions(run, batch) == {3: 8}, "every turn on version 3: the refused version never served"


def test_a_worker_killed_while_loading_comes_back_serving_the_version(run: Run) -> None:
    v5 = run.checkpoint(5, 1.25)
    batch = run.submit([{"turns": 2}] * 2, max_turns=2, sampling={"temperature": 1.0, "max_tokens": 16})
    wait_for(lambda: run.turns(batch) >= 1, 120, "turns on version 3")
    killed = run.inf
    loads = len(LOAD_BEGINS.findall(killed.log_path.read_text(errors="replace")))
    run.push(5, v5, "abort")  # abort: the load begins at once
    wait_for(lambda: len(LOAD_BEGINS.findall(killed.log_path.read_text(errors="replace"))) > loads, 60,
             "vLLM to begin loading version 5's safetensors", interval_s=0.02)
    engine = killed.descendants()
    assert engine, "the vLLM worker runs its engine core as a child process"
    killed.kill()
    events = _events(killed)
    assert not [e for e in events if e.get("event") == "vllm.weights_loaded" and e.get("checkpoint", "").endswith(
        "/v5")], "killed during the load (before vLLM had loaded version 5)"
    left = [p for p in engine if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert left == [], f"the engine core died with its worker: {left}"
    assert run.until_state(5, "loading", timeout_s=5)["serving"] == 3, "its last report: loading 5, serving 3"
    again = run.start_worker()  # a new process under the same worker id: loads the announced version at start
    assert again is not killed and again.proc is not None and killed.proc is not None
    assert again.proc.pid != killed.proc.pid
    assert run.until_state(5, "serving", timeout_s=30)["serving"] == 5
    assert metric(again.url, "rollout_weight_version") == 5
    run.served.append(5)
    run.wait_done(batch)
    assert check_token_exact(run.sql, batch) == 4
    counts = check_versions(run, batch)
    assert counts.get(5, 0) > 0 and set(counts) <= {3, 5}, counts


def test_admission_holds_a_bounded_batch_until_the_worker_serves_the_pushed_version(run: Run) -> None:
    """Staleness bounded at admission on the real pipeline: a batch with max_staleness 0 submitted right after a
    push waits (no work item) while the worker still serves the old version, and starts once it serves the new
    one: every turn of it on the new version."""
    current = httpx.get(f"{run.url}/v1/policy", headers=AUTH, timeout=10).json()["current"]
    version = int(current["version"]) + 1 if current else 1
    ckpt = run.checkpoint(version, 1.3)
    running = run.submit([{"turns": 4}] * 2, max_turns=4)  # unbounded: its running episodes hold the drain
    wait_for(lambda: run.turns(running) >= 2, 120, "the unbounded batch running")
    run.push(version, ckpt, "drain")
    created = run.submitted([{"turns": 1}] * 2, max_turns=1, max_staleness=0)
    bounded = str(created["batch_id"])
    assert (created["num_published"], created["num_waiting"]) == (0, 4), "held: the worker serves the old version"
    shown = httpx.get(f"{run.url}/v1/batches/{bounded}", headers=AUTH, timeout=10).json()
    assert shown["counts"]["waiting"] == 4
    assert f"behind the announced {version}" in shown["admission"]["held"], shown["admission"]
    assert run.until_state(version, "serving")["serving"] == version
    run.served.append(version)
    run.wait_done(bounded)
    run.wait_done(running)
    admitted = {r["v"] for r in run.sql.rows("select distinct admitted_version as v from episodes "
                                             "where batch_id = :b", b=bounded)}
    assert admitted == {version}, "released by the version's advance"
    assert check_token_exact(run.sql, bounded) == 4
    assert set(check_versions(run, bounded)) == {version}, "a bounded episode never started on the older weights"


def test_the_worker_process_drains_on_sigterm_and_exits_0(run: Run) -> None:
    """``rollout serve inference-worker`` on vLLM (this module's worker: it served every batch above) drains on
    SIGTERM and exits 0, its engine core with it. (Last in the module: the worker does not come back.)"""
    worker = run.inf
    engine = worker.descendants()
    assert engine, "the vLLM worker runs its engine core as a child process"
    worker.signal(signal.SIGTERM)
    assert worker.proc is not None
    assert worker.proc.wait(60) == 0, worker.tail_log(40)
    assert any(e.get("event") == "service.stopped" for e in _events(worker)), worker.tail_log(40)
    # vLLM's process manager kills its engine core on the way out, and multiprocessing's helper exits once its
    # parent's pipe closes: each ends after the worker's own exit, not before it
    wait_for(lambda: not _still_running(engine), 30,
             f"the engine core's processes {[p.pid for p in engine]} to stop with their worker")


def _still_running(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``procs`` alive and not zombies (a zombie has exited and waits for its new parent to reap it)."""
    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.NoSuchProcess:
            pass
    return left


def _events(proc: ServiceProcess) -> list[dict[str, Any]]:
    """The JSON log lines of ``proc``'s log (vLLM's own lines are skipped)."""
    events = []
    for line in proc.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    return events
