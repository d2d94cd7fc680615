"""Pure scheduler helpers: the canonical request hash, episode ids and work items, trajectory spans, settings."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rollout_ledger.services.scheduler.app import describe_validation_errors
from rollout_ledger.services.scheduler.planning import (
    BatchRunSpec,
    canonical_request,
    episode_id,
    group_id,
    new_batch_id,
    plan_episodes,
    request_hash,
)
from rollout_ledger.services.scheduler.schemas import BatchCreate
from rollout_ledger.services.scheduler.settings import SchedulerSettings
from rollout_ledger.services.scheduler.trajectory_view import ViewSpan, trajectory_spans
from rollout_ledger.services.scheduler.work_items import work_item
from rollout_ledger.shared.events import SamplingParams, decode, encode


def _req(**kw: object) -> BatchCreate:
    body: dict[str, object] = {"env": "echo", "tasks": [{"q": "a", "n": 1}, {"q": "b"}]}
    body.update(kw)
    return BatchCreate.model_validate(body)


def test_request_hash_ignores_key_order_defaults_and_batch_id() -> None:
    base = _req()
    same = BatchCreate.model_validate(
        {"tasks": [{"n": 1, "q": "a"}, {"q": "b"}], "env": "echo", "group_size": 1, "max_turns": 1,
         "sampling": {"temperature": 1.0}, "metadata": {}, "batch_id": "given-id"}
    )
    assert request_hash(base) == request_hash(same)
    assert len(request_hash(base)) == 64
    assert b"batch_id" not in canonical_request(same)


@pytest.mark.parametrize(
    "change",
    [{"env": "other"}, {"tasks": [{"q": "a", "n": 2}, {"q": "b"}]}, {"group_size": 2}, {"max_turns": 3},
     {"sampling": {"temperature": 0.5}}, {"metadata": {"run": 1}}],
)
def test_request_hash_changes_with_the_request(change: dict[str, object]) -> None:
    assert request_hash(_req(**change)) != request_hash(_req())


def test_ids_follow_the_common_scheme() -> None:
    bid = new_batch_id()
    assert len(bid) == 32 and bid.isalnum()
    assert new_batch_id() != bid
    assert group_id("b1", 3) == "b1.3"
    assert episode_id("b1", 3, 2) == "b1.3.2"


def test_plan_episodes_is_task_major_with_groups() -> None:
    tasks = [{"i": 0}, {"i": 1}]
    planned = plan_episodes("b", "echo", tasks, group_size=3)
    assert [p.id for p in planned] == ["b.0.0", "b.0.1", "b.0.2", "b.1.0", "b.1.1", "b.1.2"]
    assert {p.group_id for p in planned[:3]} == {"b.0"}
    assert planned[4].task == {"i": 1} and planned[4].group_index == 1 and planned[4].task_index == 1
    assert planned[0].row() == {"id": "b.0.0", "batch_id": "b", "group_id": "b.0", "task_index": 0,
                                "group_index": 0, "env": "echo", "task": {"i": 0}}


def test_work_item_roundtrips_with_a_deterministic_event_id() -> None:
    ep = plan_episodes("b", "echo", [{"x": 1}], group_size=2)[1]
    spec = BatchRunSpec("echo", 2, 4, SamplingParams(temperature=0.0, max_tokens=8))
    ev = work_item(ep, spec, "scheduler/w1")
    assert ev.event_id == "b.0.1:requested"
    assert (ev.attempt, ev.seq, ev.group_index, ev.group_size, ev.max_turns) == (1, 0, 1, 2, 4)
    back = decode(encode(ev))
    assert back == ev
    assert work_item(ep, spec, "scheduler/w2").event_id == ev.event_id


def test_trajectory_spans_cover_the_sequence() -> None:
    # prompt [0,5), turn 0 sampled [5,8), observation [8,10), turn 1 sampled [10,12), trailing template [12,13)
    spans = trajectory_spans(13, 5, [[5, 8], [10, 12]])
    assert spans == [
        ViewSpan("prompt", 0, 5, None),
        ViewSpan("sampled", 5, 8, 0),
        ViewSpan("observation", 8, 10, 0),
        ViewSpan("sampled", 10, 12, 1),
        ViewSpan("observation", 12, 13, 1),
    ]
    assert trajectory_spans(4, 4, []) == [ViewSpan("prompt", 0, 4, None)]
    # malformed ranges are clipped, never an exception
    assert trajectory_spans(6, 3, [[3, 99]]) == [ViewSpan("prompt", 0, 3, None), ViewSpan("sampled", 3, 6, 0)]


@pytest.mark.parametrize("token", ["changeme", "CHANGEME", "<token>", "secret", "short"])
def test_settings_refuse_placeholder_tokens(token: str) -> None:
    with pytest.raises(ValidationError, match="ROLLOUT_API_TOKEN"):
        SchedulerSettings(api_token=token, _env_file=None)


def test_settings_accept_a_real_token_and_treat_empty_as_unset() -> None:
    settings = SchedulerSettings(api_token="k3y-1234567890", _env_file=None)
    assert settings.api_token is not None and settings.api_token.get_secret_value() == "k3y-1234567890"
    assert "k3y" not in repr(settings)
    assert SchedulerSettings(api_token="  ", api_auth="disabled", _env_file=None).api_token is None


def test_validation_errors_name_the_field() -> None:
    with pytest.raises(ValidationError) as info:
        BatchCreate.model_validate({"env": "e", "tasks": [], "group_size": 0})
    detail, message = describe_validation_errors([{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()])
    assert {d["field"] for d in detail} == {"tasks", "group_size"}
    assert "group_size: Input should be greater than or equal to 1" in message
    assert "tasks: List should have at least 1 item" in message


def test_bounds_not_given_leave_the_canonical_request_as_it_was() -> None:
    """Requests from before admission hash as they did: the fields appear only when given."""
    plain = BatchCreate(env="echo", tasks=[{"q": 1}])
    assert b"max_staleness" not in canonical_request(plain) and b"episodes_per_version" not in canonical_request(plain)
    bounded = BatchCreate(env="echo", tasks=[{"q": 1}], max_staleness=0)
    assert b'"max_staleness":0' in canonical_request(bounded)
    assert request_hash(bounded) != request_hash(plain)
