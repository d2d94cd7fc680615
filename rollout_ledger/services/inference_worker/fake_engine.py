"""``FakeEngine``: a deterministic stand-in for vLLM that answers with real token ids of the policy tokenizer.

It is a fake, for unit tests and benchmarks of everything around the engine; it is never the only test of a
feature that depends on a model (those run against the real engine in tests/e2e).

How it answers (all deterministic: the same prompt ids, sampling parameters and session give the same turn):

- It decodes at most the last ``TAIL_TOKENS`` prompt ids, so its cost does not grow with the context, and
  reads the last user message of the ChatML text (the whole tail when no role markers are visible).
- An arithmetic question ("What is 12 + 7?", also ``-``, ``*``, ``×``) gets "The answer is N.", correct for a
  deterministic ~60% of prompts (a hash of the prompt tail and the seed) and off by one otherwise. With
  ``sampling.seed`` None the session key (the episode id) is part of the hash, as vLLM samples a seedless
  request at random: the members of a GRPO group get different answers, each episode its own reproducible one.
- A number-guessing prompt ("guess a number between 1 and 100", feedback such as "higher" / "too low") gets
  "My guess is N." with N in the range, narrowed by the feedback visible in the tail.
- Anything else gets one sentence from a small list.
- With ``sampling.tool_call`` set (a forced tool call) the answer is, whatever the prompt, the hermes call of the
  first allowed name with no arguments, exactly as vLLM's grammar lays it out
  (``<tool_call>\n{"name": "NAME", "arguments": {}}\n</tool_call>``).
- The text is encoded with the real tokenizer; it is cut at ``max_tokens`` (finish ``length``), otherwise the
  eos id is appended (finish ``stop``). A stop string in ``sampling.stop`` ends the turn as in vLLM: the ids run
  up to and including the first id whose text completes a stop string (the one ending first), without the eos
  id, so decoded they end with the stop string and maybe more text of that id (finish ``stop``; cutting the
  text before it is the caller's business, as with vLLM). With ``sampling.min_tokens`` the answer is said again
  until it has that many ids, and a stop string counts only where it ends past them.
- Logprobs are a hash of id, position and prompt, in [-3, -0.001] (looked up in a 2,999-entry table).
- ``cached_tokens`` models a prefix cache per session key (the worker passes the episode id): the longest
  common prefix of this prompt with the previous request's prompt + output of the same session, in whole
  ``block_size`` blocks and never the last prompt token (as vLLM counts it). Without a session key it is None.
  The model keeps the last ``max_sessions`` sessions (least recently used first out).

Cost knobs: ``delay_s`` (sleep per request, for crash and drain tests), ``delay_jitter_s`` (up to that much more,
the same for the same request id, so episodes started together drift apart as real decodes do) and
``tokens_per_s`` (simulated decode speed; 0 is instant). All default to 0, so the engine costs microseconds per
request.

Weight updates: ``load_weights`` checks the checkpoint as a real engine would (``checkpoints.check_compatible``:
architecture, tokenizer, readable safetensors headers), takes ``load_s`` seconds and drops its prefix-cache model.
The answers do not depend on the weights (it is a fake); the version a turn carries is the inference worker's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import struct
import time
from collections import OrderedDict
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from rollout_ledger.services.inference_worker.checkpoints import check_compatible
from rollout_ledger.services.inference_worker.engine import Generation
from rollout_ledger.shared.events import FinishReason, SamplingParams
from rollout_ledger.shared.kit.chat import ChatTokenizer, load_chat_tokenizer

TAIL_TOKENS = 256
"""Prompt ids decoded per request (the responder only looks at the end of the conversation)."""

SENTENCES = (
    "I am not sure, but I will think about it.",
    "That is an interesting question.",
    "Let me try to help with that.",
    "Here is what I think: it depends on the details.",
    "Could you tell me more about what you need?",
    "I would start with the simplest approach.",
    "Thank you for asking.",
    "The short answer is yes.",
)
"""What the fake says when it recognises no question."""

_IM_START = "<|im_start|>"
_IM_END = "<|im_end|>"
_ROLE = re.compile(r"(\w+)\n")
_ARITH = re.compile(r"(-?\d+)\s*([-+*×])\s*(-?\d+)")
_ASKS = re.compile(r"\bwhat\s+is\b|\bcompute\b|\bcalculate\b|\?", re.IGNORECASE)
_RANGE = re.compile(
    r"(?:between|from)\s+(-?\d+)\s+(?:and|to)\s+(-?\d+)|\[\s*(-?\d+)\s*,\s*(-?\d+)\s*\]", re.IGNORECASE
)
_GUESS = re.compile(r"\bguess", re.IGNORECASE)
_HIGHER = re.compile(r"\bhigher\b|\btoo\s+low\b|\bbigger\b|\blarger\b", re.IGNORECASE)
_LOWER = re.compile(r"\blower\b|\btoo\s+high\b|\bsmaller\b", re.IGNORECASE)
_INT = re.compile(r"-?\d+")
_MASK64 = (1 << 64) - 1


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character BPE vocabularies spell it with."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


class TailDecoder:
    """Decodes ids to text by joining per-id byte strings: ~10x faster than ``tokenizers`` on a 256-id tail.

    Only for byte-level BPE vocabularies (GPT-2 style, like SmolLM2's); ``build`` returns None for others and
    the fake then uses the tokenizer's own ``decode``. Invalid UTF-8 (a tail cut inside a character) becomes
    U+FFFD as it does in ``tokenizers``.
    """

    def __init__(self, table: list[bytes]) -> None:
        self.table = table

    @classmethod
    @lru_cache(maxsize=4)
    def build(cls, tok: ChatTokenizer) -> TailDecoder | None:
        config = json.loads(tok.tokenizer.to_str())
        if (config.get("decoder") or {}).get("type") != "ByteLevel":
            return None
        byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        added = {int(t["id"]): str(t["content"]) for t in config.get("added_tokens", [])}
        table = [b""] * tok.tokenizer.get_vocab_size()
        for piece, i in tok.tokenizer.get_vocab(with_added_tokens=False).items():
            try:
                table[i] = bytes([byte_of[c] for c in piece])
            except KeyError:
                return None
        for i, content in added.items():
            table[i] = content.encode()
        return cls(table)

    def decode(self, ids: list[int]) -> str:
        return b"".join(map(self.table.__getitem__, ids)).decode("utf-8", errors="replace")


def stop_end(text: str, stop: Sequence[str], past: int = 0) -> int | None:
    """Where in ``text`` the stop string that ends first ends, at the earliest after character ``past`` (None when
    none does): vLLM looks for stop strings only once ``min_tokens`` ids are out."""
    ends = []
    for s in stop:
        at = text.find(s, max(0, past - len(s) + 1)) if s else -1
        if at >= 0:
            ends.append(at + len(s))
    return min(ends, default=None)


def prompt_hash(tail_ids: np.ndarray, prompt_len: int, sampling: SamplingParams,
                session_key: str | None = None) -> int:
    """64-bit hash of the prompt tail, its length and the parameters that change what is sampled.

    With ``sampling.seed`` None, ``session_key`` (when given) is mixed in: a seedless request samples at
    random in a real engine, so two sessions with the same prompt should not get the same turn.
    """
    h = hashlib.blake2b(np.ascontiguousarray(tail_ids, dtype="<i4").tobytes(), digest_size=8)
    h.update(struct.pack("<qqdd", prompt_len, sampling.seed or 0, sampling.temperature, sampling.top_p))
    if sampling.seed is None and session_key is not None:
        h.update(session_key.encode())
    return int.from_bytes(h.digest(), "little")


def _messages(text: str) -> list[tuple[str, str]]:
    """(role, content) of the ChatML turns visible in ``text``; the whole text as one user turn otherwise.

    A turn is ``<|im_start|>ROLE\n`` and its content up to ``<|im_end|>``, the next ``<|im_start|>`` or the
    end (split on the markers: several times cheaper than one lazy regex over the tail).
    """
    turns = []
    for piece in text.split(_IM_START)[1:]:
        m = _ROLE.match(piece)
        if m is None:
            continue
        end = piece.find(_IM_END, m.end())
        turns.append((m.group(1), (piece[m.end():] if end < 0 else piece[m.end():end]).strip()))
    return turns or [("user", text.strip())]


def _arithmetic(question: str, h: int) -> str | None:
    if not _ASKS.search(question):
        return None
    matches = list(_ARITH.finditer(question))
    if not matches:
        return None
    a, op, b = int(matches[-1].group(1)), matches[-1].group(2), int(matches[-1].group(3))
    value = a + b if op == "+" else a - b if op == "-" else a * b
    if h % 100 >= 60:
        value += 1 if (h >> 8) & 1 else -1
    return f"The answer is {value}."


def _guess(turns: list[tuple[str, str]], h: int) -> str | None:
    last_user = next((c for r, c in reversed(turns) if r == "user"), "")
    if not (_GUESS.search(last_user) or _HIGHER.search(last_user) or _LOWER.search(last_user)):
        return None
    start = None
    for i in range(len(turns) - 1, -1, -1):
        m = _RANGE.search(turns[i][1])
        if m is not None:
            nums = [int(g) for g in m.groups() if g is not None]
            start, lo, hi = i, min(nums), max(nums)
            break
    if start is None:
        return None
    first_lo, first_hi = lo, hi
    guess: int | None = None
    for role, content in turns[start + 1 :]:
        if role == "assistant":
            ints = _INT.findall(content)
            guess = int(ints[-1]) if ints else None
        elif role == "user" and guess is not None:
            if _HIGHER.search(content):
                lo = max(lo, guess + 1)
            elif _LOWER.search(content):
                hi = min(hi, guess - 1)
            guess = None
    if lo > hi:
        lo, hi = first_lo, first_hi
    return f"My guess is {lo + h % (hi - lo + 1)}."


def _in_range(ids: np.ndarray, n: int) -> bool:
    """0 <= every id < n (for int32 with one reduction: as unsigned, a negative id is huge)."""
    if ids.dtype == np.int32:
        return int(ids.view(np.uint32).max()) < n
    return int(ids.min()) >= 0 and int(ids.max()) < n


def tool_call_text(name: str) -> str:
    """The forced call the fake answers with: a hermes call of ``name`` with no arguments."""
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {{}}}}\n</tool_call>'


def respond(text: str, h: int) -> str:
    """The fake's answer to the conversation tail ``text``, chosen by the hash ``h``."""
    turns = _messages(text)
    last_user = next((c for r, c in reversed(turns) if r == "user"), "")
    answer = _arithmetic(last_user, h)
    if answer is None:
        answer = _guess(turns, h)
    if answer is None:
        answer = SENTENCES[h % len(SENTENCES)]
    return answer


@lru_cache(maxsize=1)
def _logprob_table() -> np.ndarray:
    """The logprob of each of the 2,999 hash buckets (float32 arithmetic, as the hash is defined)."""
    buckets = np.arange(2999, dtype=np.uint64)
    table = (-0.001 - buckets.astype(np.float32) / np.float32(1000.0)).astype(np.float32)
    table.setflags(write=False)
    return table


def fake_logprobs(token_ids: np.ndarray, h: int) -> np.ndarray:
    """Deterministic logprobs in [-3, -0.001] from id, position and the prompt hash.

    Bucket ``(id * 2654435761 + pos * 40503 + h % 1000003) mod 2**64 mod 2999`` (unsigned 64-bit arithmetic,
    a negative id wraps), mapped through ``_logprob_table``; turns are short, so Python ints beat numpy here.
    """
    hm = h % 1_000_003
    buckets = [(((tid & _MASK64) * 2654435761 + pos * 40503 + hm) & _MASK64) % 2999
               for pos, tid in enumerate(token_ids.tolist())]
    return _logprob_table()[np.asarray(buckets, dtype=np.intp)]


def jitter_fraction(request_id: str) -> float:
    """A fraction in [0, 1) fixed by the request id (the same id waits the same, run after run)."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "big") / 2**64


class FakeEngine:
    """Deterministic fake engine with real token ids (see the module docstring for its behaviour)."""

    name = "fake"
    supports_keep = True
    """A cut generation returns the ids "sampled" so far (the share of its wait that passed), so ``keep`` can
    continue it."""

    def __init__(
        self,
        model: str,
        *,
        delay_s: float = 0.0,
        delay_jitter_s: float = 0.0,
        tokens_per_s: float = 0.0,
        block_size: int = 16,
        max_sessions: int = 4096,
        tokenizer: ChatTokenizer | None = None,
        load_s: float = 0.0,
    ) -> None:
        self.model = model
        self.load_s = load_s
        self.checkpoint = model
        """The directory whose weights it "serves" (the model until ``load_weights``)."""
        self.delay_s = delay_s
        self.delay_jitter_s = delay_jitter_s
        self.tokens_per_s = tokens_per_s
        self.block_size = block_size
        self.max_sessions = max_sessions
        self._tokenizer = tokenizer
        self._sessions: OrderedDict[str, np.ndarray] = OrderedDict()
        self._encoded: dict[tuple[str, int], np.ndarray] = {}
        self._aborts: dict[str, asyncio.Event] = {}
        self.eos_id: int | None = None
        self._tail_decoder: TailDecoder | None = None

    @property
    def tokenizer(self) -> ChatTokenizer:
        if self._tokenizer is None:
            self._tokenizer = load_chat_tokenizer(self.model)
        return self._tokenizer

    async def start(self) -> None:
        """Load the tokenizer and warm the responder up once."""
        tok = self.tokenizer
        self.eos_id = tok.eos_token_id
        self._tail_decoder = TailDecoder.build(tok)
        warm = tok.encode(tok.render([{"role": "user", "content": "What is 1 + 1?"}], add_generation_prompt=True))
        self._sample(warm, SamplingParams(), 16)

    @property
    def healthy(self) -> bool:
        """The fake never dies."""
        return True

    async def stop(self) -> None:
        for event in self._aborts.values():
            event.set()
        self._sessions.clear()

    async def load_weights(self, checkpoint: str) -> None:
        check_compatible(self.model, checkpoint)
        if self.load_s > 0:
            await asyncio.sleep(self.load_s)
        self.checkpoint = checkpoint
        self._sessions.clear()  # the prefix cache holds nothing computed with the old weights

    async def abort(self, request_id: str) -> None:
        event = self._aborts.get(request_id)
        if event is not None:
            event.set()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: np.ndarray,
        sampling: SamplingParams,
        max_tokens: int,
        *,
        session_key: str | None = None,
    ) -> Generation:
        ids, finish, h = self._sample(prompt_token_ids, sampling, max_tokens, session_key)
        wait_s = self.delay_s + (ids.shape[0] / self.tokens_per_s if self.tokens_per_s > 0 else 0.0)
        if self.delay_jitter_s > 0:
            wait_s += self.delay_jitter_s * jitter_fraction(request_id)
        began = time.monotonic()
        if wait_s > 0 and await self._wait(request_id, wait_s):
            # cut: the ids "sampled" so far, as vLLM returns an aborted request's (the share of the wait that passed)
            elapsed = time.monotonic() - began
            if self.tokens_per_s > 0:
                done = int(max(0.0, elapsed - self.delay_s) * self.tokens_per_s)
            else:
                done = int(ids.shape[0] * min(1.0, elapsed / wait_s))
            done = min(done, max(0, int(ids.shape[0]) - 1))
            return Generation(ids[:done].copy(), fake_logprobs(ids, h)[:done].copy(), FinishReason.ABORT)
        logprobs = fake_logprobs(ids, h)
        top = self._top_logprobs(ids, logprobs, sampling.logprobs) if sampling.logprobs > 0 else None
        cached = self._cached(session_key, prompt_token_ids, ids)
        return Generation(ids, logprobs, finish, top, cached)

    def _sample(
        self, prompt: np.ndarray, sampling: SamplingParams, max_tokens: int, session_key: str | None = None
    ) -> tuple[np.ndarray, FinishReason, int]:
        """The turn's ids, finish reason and the prompt hash (pure CPU work, no waiting)."""
        tail = prompt[-TAIL_TOKENS:]
        h = prompt_hash(tail, int(prompt.shape[0]), sampling, session_key)
        forced = sampling.tool_call
        text = tool_call_text(forced.names[0]) if forced is not None else respond(self._decode_tail(tail), h)
        finish = FinishReason.STOP
        floor = min(sampling.min_tokens, max_tokens)
        if floor > 0 and forced is None:
            # once more after the floor when a stop string may end the turn there (past the floor, as in vLLM)
            text = self._at_least(text, floor) + (" " + text if sampling.stop else "")
        end = stop_end(text, sampling.stop, self._char_at(text, floor) if floor > 0 else 0)
        ids = self._encode(text, self.eos_id is not None) if end is None else self._encode_through(text, end)
        if ids.shape[0] > max_tokens:
            ids, finish = ids[:max_tokens], FinishReason.LENGTH
        return ids, finish, h

    def _at_least(self, text: str, floor: int) -> str:
        """``text`` said again (space-separated) until its ids, without the eos id, number at least ``floor``: with
        ``min_tokens`` the engine may not end the turn before (vLLM keeps sampling; the fake repeats itself)."""
        times = -(-floor // max(1, int(self._encode(text, False).shape[0])))
        said = " ".join([text] * times)
        while int(self.tokenizer.encode(said).shape[0]) < floor:
            times += 1
            said = " ".join([text] * times)
        return said

    def _char_at(self, text: str, n: int) -> int:
        """How many characters of ``text`` its first ``n`` ids spell."""
        ids = self._encode(text, False)[:n]
        return sum(len(piece) for piece in self.tokenizer.stream_texts(ids))

    def _decode_tail(self, tail: np.ndarray) -> str:
        ids = tail.tolist()
        fast = self._tail_decoder
        if fast is not None and ids and _in_range(tail, len(fast.table)):
            return fast.decode(ids)
        return str(self.tokenizer.tokenizer.decode(ids, skip_special_tokens=False))

    def _encode(self, text: str, add_eos: bool) -> np.ndarray:
        """Ids of one of the fake's answers (a small set of texts, so they are kept), with the eos id or not."""
        key = (text, add_eos)
        ids = self._encoded.get(key)
        if ids is None:
            if len(self._encoded) >= 4096:
                self._encoded.clear()
            ids = self.tokenizer.encode(text)
            if add_eos and self.eos_id is not None:
                ids = np.append(ids, np.int32(self.eos_id)).astype(np.int32)
            ids.setflags(write=False)
            self._encoded[key] = ids
        return ids

    def _encode_through(self, text: str, end: int) -> np.ndarray:
        """The shortest prefix of ``text``'s ids whose text reaches character ``end`` (where vLLM, detokenising
        after every id, finds the stop string and stops), without the eos id."""
        key = (text, -1 - end)  # apart from _encode's (text, bool) keys
        ids = self._encoded.get(key)
        if ids is None:
            full = self._encode(text, False)
            reached, n = 0, len(full)
            for i, piece in enumerate(self.tokenizer.stream_texts(full)):
                reached += len(piece)
                if reached >= end:
                    n = i + 1
                    break
            ids = full[:n]
            if len(self._encoded) >= 4096:
                self._encoded.clear()
            self._encoded[key] = ids
        return ids

    async def _wait(self, request_id: str, seconds: float) -> bool:
        """Sleep ``seconds``; True when the request was aborted meanwhile."""
        event = self._aborts[request_id] = asyncio.Event()
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout=seconds)
            return event.is_set()
        finally:
            self._aborts.pop(request_id, None)

    def _top_logprobs(self, ids: np.ndarray, logprobs: np.ndarray, k: int) -> list[dict[int, float]]:
        vocab = self.tokenizer.vocab_size
        out = []
        for tid, lp in zip(ids.tolist(), logprobs.tolist(), strict=True):
            alts = {tid: lp}
            for j in range(1, k + 1):
                alts.setdefault((tid + 7919 * j) % vocab, lp - 0.25 * j)
            out.append(alts)
        return out

    def _cached(self, session_key: str | None, prompt: np.ndarray, output: np.ndarray) -> int | None:
        if session_key is None:
            return None
        previous = self._sessions.pop(session_key, None)
        self._sessions[session_key] = np.concatenate((prompt, output))
        if len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        if previous is None or prompt.shape[0] == 0:
            return 0
        n = min(previous.shape[0], prompt.shape[0] - 1)
        differ = np.flatnonzero(previous[:n] != prompt[:n])
        common = int(differ[0]) if differ.size else n
        return common - common % self.block_size
