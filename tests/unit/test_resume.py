"""The pure parts of resume and keep: the contexts an agent replay matches, the env LLM's journal, per-token versions
of a turn across a keep swap, and the pieces a keep swap joins into one turn."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from rollout_ledger.services.env_worker.agents.episode import recorded_contexts
from rollout_ledger.services.env_worker.env_llm_journal import JournaledLLM, ScriptExhausted
from rollout_ledger.services.env_worker.resume_reader import Recorded
from rollout_ledger.services.inference_worker.engine import Generation
from rollout_ledger.services.inference_worker.server import _Kept
from rollout_ledger.services.recorder.assembly import TurnRecord
from rollout_ledger.shared import resume as contract
from rollout_ledger.shared.errors import SchemaError
from rollout_ledger.shared.events import FinishReason, token_versions
from rollout_ledger.shared.resume import RecordedTurn, ResumeQuery, ResumeRecord


def _turn(t: int, ids: list[int], obs: list[int], new_segment: bool = False) -> RecordedTurn:
    return RecordedTurn(turn_index=t, turn_event_id=f"e:a1:t{t}:r0", step_event_id=f"e:a1:s{t}", token_ids=ids,
                        logprobs=[-0.5] * len(ids), finish_reason="stop", weight_version=0, worker_id="w",
                        prompt_len=0, action="a", observation="o", observation_token_ids=obs, reward=0.0,
                        terminated=False, truncated=False, new_segment=new_segment)


def test_recorded_contexts_follow_the_segments_as_the_recorder_assembles_them() -> None:
    recorded = Recorded(1, np.array([1, 2], np.int32), [
        _turn(0, [3, 4], [5]), _turn(1, [6], [7, 8, 9], new_segment=True), _turn(2, [10], [])], 0)
    contexts = recorded_contexts(recorded)
    assert [c.tolist() for c in contexts] == [[1, 2], [1, 2, 3, 4, 5], [7, 8, 9]]


class _Llm:
    def __init__(self) -> None:
        self.calls = 0

    async def chat(self, messages: list[dict[str, Any]], *, pool: str = "", max_tokens: int = 256,
                   temperature: float = 1.0, stop: list[str] | None = None) -> str:
        self.calls += 1
        return f"live {self.calls}"


async def test_the_journal_keeps_live_replies_and_answers_a_replay_from_the_record() -> None:
    live = _Llm()
    journal = JournaledLLM(live)
    assert await journal.chat([]) == "live 1" and await journal.chat([]) == "live 2"
    assert journal.take() == ["live 1", "live 2"] and journal.take() == []
    journal.play(["recorded"])
    assert await journal.chat([]) == "recorded" and live.calls == 2, "a replay asks no model"
    with pytest.raises(ScriptExhausted):
        await journal.chat([])
    journal.play(["a", "b"])
    await journal.chat([])
    assert journal.left() == 1, "a replay that used fewer replies than recorded diverged"
    journal.live()
    assert await journal.chat([]) == "live 3"


def test_a_turn_across_a_keep_swap_has_versions_per_run() -> None:
    assert token_versions(5, 3, [(0, 3), (2, 4)]).tolist() == [3, 3, 4, 4, 4]
    assert token_versions(3, 7, None).tolist() == [7, 7, 7]
    turn = TurnRecord("t", 0, 0, np.arange(5, dtype=np.int32), np.zeros(5, np.float32), 3,
                      version_runs=((0, 3), (2, 4)))
    assert turn.runs() == [(0, 2, 3), (2, 5, 4)]
    cut_at_start = TurnRecord("t", 0, 0, np.arange(3, dtype=np.int32), np.zeros(3, np.float32), 3,
                              version_runs=((0, 3), (0, 4)))
    assert cut_at_start.runs() == [(0, 3, 4)], "an empty run owns no action range"


def _piece(ids: list[int], finish: FinishReason) -> Generation:
    return Generation(np.array(ids, np.int32), np.array([-0.25] * len(ids), np.float32), finish)


def test_keep_joins_the_pieces_of_a_turn_and_says_which_version_sampled_each() -> None:
    kept = _Kept()
    prompt = np.array([9, 9], np.int32)
    kept.add(_piece([1, 2, 3], FinishReason.ABORT), version=0)
    assert kept.prompt(prompt).tolist() == [9, 9, 1, 2, 3], "the continuation is generated after the kept ids"
    kept.add(_piece([], FinishReason.ABORT), version=1)  # cut again before sampling anything: no run
    last = _piece([4, 5], FinishReason.STOP)
    kept.add(last, version=2, final=True)
    whole = kept.generation(last)
    assert whole.token_ids.tolist() == [1, 2, 3, 4, 5] and whole.finish_reason == FinishReason.STOP
    assert kept.runs == [(0, 0), (3, 2)]
    one = _Kept()
    only = _piece([7], FinishReason.STOP)
    one.add(only, version=5, final=True)
    assert one.runs == [(0, 5)] and one.generation(only) is only


def test_the_resume_contract_round_trips_and_refuses_garbage() -> None:
    query = ResumeQuery(episode_id="e", attempt=2, from_turn=3, from_attempt=1)
    assert contract.decode_query(contract.encode(query)) == query
    record = ResumeRecord(episode_id="e", source_attempt=1, prompt_token_ids=np.array([1, 2], np.int32),
                          turns=[_turn(0, [3], [4])], more=True, unstepped_turns=1)
    back = contract.decode_record(contract.encode(record))
    assert back.turns[0].token_ids.tolist() == [3] and back.prompt_token_ids is not None
    assert back.more and back.unstepped_turns == 1
    with pytest.raises(SchemaError, match="ResumeQuery"):
        contract.decode_query(b"\xc1garbage")
