"""Tokenisation cost per turn at turn 1 versus turn 40 of one long conversation (issue 3, benchmark b).

The env worker's token-exact transcript (rollout_ledger/services/env_worker/tokenization.py) appends each turn's sampled
ids verbatim and tokenises only the template text the turn adds; its cost must not grow with the history. Times
``add_sampled`` + ``add_observation`` per turn index, averaged over many conversations, with the real SmolLM2
tokenizer and chat template. Run: `python -m bench.tokenization_cost` (part of `make bench`).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from rollout_ledger.services.env_worker.tokenization import Transcript, TurnTemplate
from rollout_ledger.shared.kit.chat import load_chat_tokenizer
from rollout_ledger.shared.kit.settings import default_model_dir

TURNS = 40
CONVERSATIONS = 300


def run(model_dir: str) -> dict[str, object]:
    tok = load_chat_tokenizer(model_dir)
    template = TurnTemplate(tok)
    answer = np.append(tok.encode("I think the answer is 42, but let me check the numbers once more."),
                       np.int32(tok.eos_token_id or 2)).astype(np.int32)
    per_turn = np.zeros((CONVERSATIONS, TURNS))
    for c in range(CONVERSATIONS):
        tr = Transcript(template, [{"role": "user", "content": "Let us play a long game. Ready?"}])
        for t in range(TURNS):
            obs = [{"role": "user", "content": f"Round {t + 1}: that is not it, try a different number than {t}."}]
            t0 = time.perf_counter()
            tr.add_sampled(answer)
            tr.add_observation(obs, final=False)
            per_turn[c, t] = time.perf_counter() - t0
        if c == 0 and not tr.verify():
            raise AssertionError("the transcript does not decode to the rendered conversation")
    med = np.median(per_turn, axis=0) * 1e6
    # Side by side: re-render and re-tokenise the whole history every turn (what a re-tokenising design does).
    full = np.zeros((CONVERSATIONS // 10, TURNS))
    text = tok.decode(answer, skip_special_tokens=True)
    for c in range(CONVERSATIONS // 10):
        msgs = [{"role": "user", "content": "Let us play a long game. Ready?"}]
        for t in range(TURNS):
            msgs += [{"role": "assistant", "content": text},
                     {"role": "user", "content": f"Round {t + 1}: that is not it, try a different number than {t}."}]
            t0 = time.perf_counter()
            tok.encode(tok.render(msgs, add_generation_prompt=True))
            full[c, t] = time.perf_counter() - t0
    fmed = np.median(full, axis=0) * 1e6
    return {"retokenise_turn_1_us": round(float(fmed[0]), 1), "retokenise_turn_40_us": round(float(fmed[-1]), 1),
            "retokenise_ratio": round(float(fmed[-1] / fmed[0]), 2),
            "turns": TURNS, "conversations": CONVERSATIONS, "context_tokens_at_turn_40": len(tr),
            "turn_1_us": round(float(med[0]), 1), "turn_40_us": round(float(med[-1]), 1),
            "ratio_40_over_1": round(float(med[-1] / med[0]), 3),
            "mean_turns_2_10_us": round(float(med[1:10].mean()), 1),
            "mean_turns_31_40_us": round(float(med[30:40].mean()), 1)}


if __name__ == "__main__":
    json.dump(run(str(default_model_dir())), sys.stdout)
    print()
