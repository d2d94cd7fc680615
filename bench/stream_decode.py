"""Cost of the streamed texts of one turn (one piece per sampled id): per-prefix decoding versus ``DecodeStream``.

The session endpoint streams a turn as one chunk per sampled id, each carrying the text that id adds. The
baseline (``per_prefix_texts``, what ``sessions/turns.token_texts`` did before) decodes every prefix of the
turn: O(n²) in the turn's length. ``ChatTokenizer.stream_texts`` steps a ``tokenizers`` ``DecodeStream`` once
per id and checks the result once against the whole decode: O(n). Both are timed on 64-, 512- and 4,096-token
turns of the real SmolLM2 tokenizer (English, accents, CJK and emoji, so characters split across ids) and
checked to give the same pieces. Run: `python -m bench.stream_decode`.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence

from rollout_ledger.shared.kit.chat import ChatTokenizer, load_chat_tokenizer
from rollout_ledger.shared.kit.settings import default_model_dir

LENGTHS = (64, 512, 4096)
BUDGET_S = 3.0
"""Seconds of repetitions per method and length (at least 3 repetitions each)."""
PARAGRAPH = ("Let me check the order status first. The parcel left Zürich on Tuesday and should arrive soon; "
             "東京の倉庫からも確認します 🎲🚚 — café, naïve, 漢字 and a few more words to keep it going.\n")


def per_prefix_texts(tok: ChatTokenizer, token_ids: Sequence[int]) -> list[str]:
    """The baseline: the former ``token_texts``, decoding every prefix of the turn."""
    out = []
    prev = ""
    for i in range(1, len(token_ids) + 1):
        text = tok.decode(token_ids[:i], skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the ids that complete it
            out.append("")
            continue
        out.append(text[len(prev):])
        prev = text
    if out:
        full = tok.decode(token_ids, skip_special_tokens=True)
        out[-1] += full[len(prev):]
    return out


def turn_ids(tok: ChatTokenizer, n: int) -> list[int]:
    """``n`` sampled ids: ``n - 1`` ids of repeated text and the end-of-turn id."""
    ids: list[int] = []
    while len(ids) < n - 1:
        ids += tok.encode(PARAGRAPH).tolist()
    return [*ids[:n - 1], tok.eos_token_id if tok.eos_token_id is not None else 0]


def ms_per_turn(fn: Callable[[ChatTokenizer, Sequence[int]], list[str]], tok: ChatTokenizer,
                ids: list[int]) -> float:
    """Median milliseconds of ``fn`` on one turn, repeated for about ``BUDGET_S`` seconds."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < BUDGET_S:
        t0 = time.perf_counter()
        fn(tok, ids)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e3


def run(model_dir: str) -> dict[str, object]:
    tok = load_chat_tokenizer(model_dir)
    out: dict[str, object] = {}
    for n in LENGTHS:
        ids = turn_ids(tok, n)
        new = tok.stream_texts(ids)
        if new != per_prefix_texts(tok, ids) or "".join(new) != tok.decode(ids, skip_special_tokens=True):
            raise AssertionError(f"the streamed texts of a {n}-token turn differ from the baseline's")
        old_ms = ms_per_turn(per_prefix_texts, tok, ids)
        new_ms = ms_per_turn(ChatTokenizer.stream_texts, tok, ids)
        out[str(n)] = {"per_prefix_ms": round(old_ms, 3), "decode_stream_ms": round(new_ms, 3),
                       "speedup": round(old_ms / new_ms, 1), "decode_stream_us_per_token": round(new_ms * 1e3 / n, 2)}
    return out


if __name__ == "__main__":
    json.dump(run(str(default_model_dir())), sys.stdout, indent=1)
    print()
