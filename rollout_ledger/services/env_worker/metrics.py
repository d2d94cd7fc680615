"""The env worker's Prometheus metrics, in a registry of its own (built by ``build_metrics``)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_PAUSE_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)


@dataclass(frozen=True)
class EnvWorkerMetrics:
    """Every metric the env worker exports."""

    registry: CollectorRegistry
    episodes_in_flight: Gauge
    turn_latency: Histogram
    episodes_total: Counter
    inference_retries: Counter
    env_step_seconds: Histogram
    cancelled_batches: Gauge
    remote_env_retries: Counter
    attempts_retried: Counter
    work_items_parked: Counter
    work_items_fenced: Counter
    work_items_held: Gauge
    policy_paused: Gauge
    policy_pause_seconds: Histogram
    policy_episode_drain_seconds: Histogram
    policy_pause_timeouts: Counter
    resumed_attempts: Counter
    turns_reused: Counter
    turns_regenerated: Counter

    def resumed(self, mode: str, reused: int, regenerated: int) -> None:
        """Count one attempt after the first: how it resumed, the recorded turns it carried over and the turns
        generated before that it generates again (the "completed work reused after restart" figure)."""
        self.resumed_attempts.labels(mode=mode).inc()
        self.turns_reused.labels(mode=mode).inc(reused)
        self.turns_regenerated.labels(mode=mode).inc(regenerated)


def build_metrics(registry: CollectorRegistry | None = None) -> EnvWorkerMetrics:
    registry = registry or CollectorRegistry()
    return EnvWorkerMetrics(
        registry=registry,
        episodes_in_flight=Gauge("rollout_episodes_in_flight", "Episodes this env worker is running",
                                 registry=registry),
        turn_latency=Histogram("rollout_turn_latency_seconds", "Inference request to reply, per successful try",
                               buckets=_LATENCY_BUCKETS, registry=registry),
        episodes_total=Counter("rollout_episodes_total", "Episodes ended by this worker, by terminal status",
                               ["status"], registry=registry),
        inference_retries=Counter("rollout_inference_retries_total", "Inference tries after the first",
                                  registry=registry),
        env_step_seconds=Histogram("rollout_env_step_seconds", "Time in env.step",
                                   buckets=_LATENCY_BUCKETS, registry=registry),
        cancelled_batches=Gauge("rollout_cancelled_batches", "Cancelled batch ids this worker knows of",
                                registry=registry),
        remote_env_retries=Counter("rollout_remote_env_retries_total",
                                   "Requests to remote env actors retried after a transport error or a 5xx",
                                   registry=registry),
        attempts_retried=Counter("rollout_attempts_retried_total",
                                 "Failed episode attempts given another attempt, by failure class",
                                 ["failure_class"], registry=registry),
        work_items_parked=Counter("rollout_work_items_parked_total",
                                  "Work items of a newer contract major handed back for an upgraded worker",
                                  registry=registry),
        work_items_fenced=Counter("rollout_work_items_fenced_total",
                                  "Deliveries of a work item whose episode a live lease holder was running (after a "
                                  "NATS restart): held, not run again", registry=registry),
        work_items_held=Gauge("rollout_work_items_held", "Work items this worker holds unacked: episodes running, "
                              "waiting for the policy gate or for their lease", registry=registry),
        policy_paused=Gauge("rollout_policy_paused", "1 while this worker starts no new episode for a policy version "
                            "announced in mode drain", registry=registry),
        policy_pause_seconds=Histogram("rollout_policy_pause_seconds", "Time new episodes were held back for a "
                                       "policy version (drain), per pause", buckets=_PAUSE_BUCKETS, registry=registry),
        policy_episode_drain_seconds=Histogram("rollout_policy_episode_drain_seconds", "Time from holding new "
                                               "episodes back to the last running one ending, per pause",
                                               buckets=_PAUSE_BUCKETS, registry=registry),
        policy_pause_timeouts=Counter("rollout_policy_pause_timeouts", "Pauses ended by policy_drain_timeout_s while "
                                      "a live inference worker did not serve the version yet", registry=registry),
        resumed_attempts=Counter("rollout_resumed_attempts_total", "Episode attempts after the first, by how they "
                                 "resumed (replay, snapshot, agent_replay, restart)", ["mode"], registry=registry),
        turns_reused=Counter("rollout_resume_turns_reused_total", "Recorded turns carried over by a later attempt "
                             "instead of being generated again", ["mode"], registry=registry),
        turns_regenerated=Counter("rollout_resume_turns_regenerated_total", "Turns an earlier attempt had generated "
                                  "that a later attempt generates again (in flight at the crash, or every turn of a "
                                  "restart)", ["mode"], registry=registry),
    )
