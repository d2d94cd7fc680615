"""``Transcript.verify`` on a last turn the template renders differently from its sampled text (a final drift).

The other segment checks (closed by a re-render, open at the end) are covered in test_tokenization.py.
"""

from __future__ import annotations

import numpy as np

from rollout_ledger.services.env_worker.tokenization import Drift, Transcript, TurnTemplate
from rollout_ledger.shared.kit.chat import ChatTokenizer, load_chat_tokenizer


def test_a_final_drift_checks_the_rendering_before_the_last_turn_plus_its_sampled_text(model_dir: str) -> None:
    tok = load_chat_tokenizer(model_dir)
    trimming = ChatTokenizer(model_dir, chat_template=tok.template_source.replace(
        "message['content']", "message['content'] | trim"))
    tr = Transcript(TurnTemplate(trimming), [{"role": "user", "content": "x"}])
    assert tok.eos_token_id is not None
    sampled = np.append(tok.encode("  padded answer  "), np.int32(tok.eos_token_id)).astype(np.int32)
    tr.add_sampled(sampled)
    final = tr.add_observation([], final=True)
    assert final.drift == Drift.ASSISTANT_RENDER and tr.drifts == [(0, Drift.ASSISTANT_RENDER)]
    assert tr.check_results() == [True] and tr.verify()
    tr._ids[1] = tok.encode(" corrupted")[0]  # a prompt id that is not the rendering's
    assert tr.check_results() == [False] and not tr.verify()
