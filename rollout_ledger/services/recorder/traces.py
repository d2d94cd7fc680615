"""The recorder's part of each episode's trace: one span per episode and batch, covering the batch's write.

A batch holds the events of many episodes, each event carrying in its headers the trace context of the span that
published it (an attempt's, a generation's). A span has one parent, so the recorder groups a batch's events by
trace: for each trace, a ``recorder.write`` span, a child of the context of the episode's first event in the batch,
from the fetch to the settlement of the batch, counting the episode's events and what became of them. Events
without a trace context (tracing off upstream, older producers, hostile headers) are written as always, untraced.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from nats.aio.msg import Msg

from rollout_ledger.shared.kit.tracing import Context, Tracing, trace_id_of

from .recording import Action, BatchOutcome, Delivery


@dataclass
class _TraceGroup:
    """A batch's messages of one trace."""

    parent: Context
    indices: list[int] = field(default_factory=list)


@dataclass
class BatchTraces:
    """The traces a fetched batch belongs to, from its messages' headers (empty when tracing is off)."""

    tracing: Tracing
    start_ns: int
    groups: dict[str, _TraceGroup] = field(default_factory=dict)

    @classmethod
    def of(cls, tracing: Tracing, msgs: Sequence[Msg], start_ns: int) -> BatchTraces:
        traces = cls(tracing, start_ns)
        if not tracing.enabled:
            return traces
        for i, msg in enumerate(msgs):
            parent = tracing.extract(msg.headers)
            trace_id = trace_id_of(parent, sampled_only=True) if parent is not None else None
            if parent is None or trace_id is None:
                continue  # no trace context, or a trace not sampled: nothing to join
            group = traces.groups.get(trace_id)
            if group is None:
                group = traces.groups[trace_id] = _TraceGroup(parent)
            group.indices.append(i)
        return traces

    def record(self, batch: Sequence[Delivery], outcome: BatchOutcome | None) -> None:
        """One ``recorder.write`` span per trace; an error when the batch was not stored (a shutdown gave up) or one
        of the trace's events was dead-lettered."""
        for group in self.groups.values():
            events = [batch[i].event for i in group.indices]
            episode = next((e.episode_id for e in events if e is not None), "")
            types = sorted({str(e.type) for e in events if e is not None})
            attributes: dict[str, object] = {
                "rollout.episode_id": episode, "rollout.events": len(group.indices),
                "rollout.event_types": types, "rollout.batch_size": len(batch),
                "messaging.delivery_count": max(batch[i].deliveries for i in group.indices),
            }
            error: str | None = None
            if outcome is None:
                error = "not stored: the recorder stopped while the store was unreachable (redelivered)"
            else:
                actions = Counter(str(outcome.actions[i]) for i in group.indices)
                attributes.update({f"rollout.{action}": n for action, n in actions.items()})
                if actions.get(Action.TERM):
                    error = f"{actions[Action.TERM]} event(s) dead-lettered"
            self.tracing.record("recorder.write", parent=group.parent, start_ns=self.start_ns, attributes=attributes,
                                error=error)
