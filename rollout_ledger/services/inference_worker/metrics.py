"""Prometheus metrics of the inference worker, in a registry of its own (built per worker, never global)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

OUTCOMES = ("ok", "bad_request", "newer_contract", "overloaded", "aborted", "engine_error", "bus_error",
            "internal_error", "resent")
"""Values of the ``outcome`` label of ``rollout_inference_requests_total``."""


@dataclass(frozen=True)
class InferenceMetrics:
    """The worker's metrics; ``create`` registers them in ``registry``."""

    registry: CollectorRegistry
    requests: Counter
    inflight: Gauge
    prompt_tokens: Counter
    generated_tokens: Counter
    cached_tokens: Counter
    generate_seconds: Histogram
    queue_seconds: Histogram
    outcome: dict[str, Counter]
    """``requests`` per outcome, bound once (``labels()`` is a dict lookup and a lock per call)."""
    regenerated: Counter
    weight_version: Gauge
    swap_seconds: Histogram
    episode_drain_seconds: Histogram
    episode_drain_timeouts: Counter
    unrecorded: Counter
    swap_tokens: Counter
    oldest_generation: Gauge
    """Sampled ids of generations a swap cut, by what became of them (``kept``: continued on the new weights,
    mode keep; ``lost``: generated again from the start, mode abort or a drain past its timeout)."""
    """Requests answered without publishing their turn (``record=False`` or a non-policy pool)."""

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> InferenceMetrics:
        reg = registry if registry is not None else CollectorRegistry()
        requests = Counter("rollout_inference_requests", "Turn requests by outcome.", ["outcome"], registry=reg)
        return cls(
            registry=reg,
            requests=requests,
            inflight=Gauge("rollout_inference_inflight", "Requests being served now.", registry=reg),
            prompt_tokens=Counter("rollout_prompt_tokens", "Prompt tokens of served requests.", registry=reg),
            generated_tokens=Counter("rollout_generated_tokens", "Tokens sampled.", registry=reg),
            cached_tokens=Counter("rollout_cached_tokens", "Prompt tokens served from the prefix cache.", registry=reg),
            generate_seconds=Histogram(
                "rollout_generate_seconds", "Time in the engine per request.", buckets=_LATENCY_BUCKETS, registry=reg
            ),
            queue_seconds=Histogram(
                "rollout_queue_seconds", "Time from receipt to the engine starting the request.",
                buckets=_LATENCY_BUCKETS, registry=reg,
            ),
            outcome={outcome: requests.labels(outcome) for outcome in OUTCOMES},
            regenerated=Counter("rollout_inference_regenerated", "Generations a weight swap (mode abort) cut and "
                                "generated again on the new weights.", registry=reg),
            weight_version=Gauge("rollout_weight_version", "The policy version this worker serves.", registry=reg),
            swap_seconds=Histogram("rollout_weight_swap_seconds", "Time a weight swap held new generations back "
                                   "(drain or abort, then load).", buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
                                   registry=reg),
            episode_drain_seconds=Histogram(
                "rollout_episode_drain_seconds", "Time a drain swap waited for the env workers' episodes to finish "
                "(new episodes held back) before it began.", buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
                registry=reg),
            episode_drain_timeouts=Counter(
                "rollout_episode_drain_timeouts", "Drain swaps that stopped waiting for the env workers' episodes "
                "(episode_drain_timeout_s) and drained turns only.", registry=reg),
            unrecorded=Counter(
                "rollout_inference_unrecorded", "Requests answered without recording a turn: an environment's own "
                "generations (a simulated user) and every request of a non-policy pool.", registry=reg),
            swap_tokens=Counter(
                "rollout_swap_tokens", "Ids sampled by generations a weight swap cut: kept (mode keep, continued on "
                "the new weights) or lost (mode abort or a drain past its timeout: generated again).", ["fate"],
                registry=reg),
            oldest_generation=Gauge(
                "rollout_inference_oldest_generation_seconds", "Seconds the longest-running generation in the engine "
                "has been running (0 when none): a stuck or very long generation shows here.", registry=reg),
        )
