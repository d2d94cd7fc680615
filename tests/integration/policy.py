"""The in-test inference worker (``Policy``) that the env-worker integration tests answer turns with."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable

import numpy as np
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from rollout_ledger.shared.events import FinishReason, InferenceRequested, TurnGenerated, decode_as, dumps, encode
from rollout_ledger.shared.kit import bus
from rollout_ledger.shared.kit.chat import ChatTokenizer
from rollout_ledger.shared.subjects import INFER_ANY, INFER_HEARTBEAT, INFER_QUEUE, infer_worker_subject
from tests.helpers import publish_event


class Policy:
    """An in-test inference worker: answers arithmetic right, binary-searches guess-number, says "ok" otherwise.

    It publishes each turn to RL_EVENTS (as the real worker does) before replying. ``hold`` lets a test pause
    chosen requests until it releases them.
    """

    def __init__(self, nc: bus.NATS, tok: ChatTokenizer, worker_id: str = "policy", delay_s: float = 0.0) -> None:
        self.nc, self.js, self.tok, self.worker_id, self.delay_s = nc, nc.jetstream(), tok, worker_id, delay_s
        self.requests: list[InferenceRequested] = []
        self.hold: Callable[[InferenceRequested], bool] = lambda _r: False
        self.release = asyncio.Event()
        self._subs: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._beat: asyncio.Task[None] | None = None

    async def start(self) -> Policy:
        for subject, queue in ((infer_worker_subject(self.worker_id), ""), (INFER_ANY, INFER_QUEUE)):
            self._subs.append(await self.nc.subscribe(subject, queue=queue, cb=self._on_request))
        self._beat = asyncio.create_task(self._beat_forever())
        await self.nc.flush()
        return self

    async def stop(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        for task in self._tasks:
            task.cancel()

    async def _beat_forever(self) -> None:
        while not self.nc.is_closed:
            await self.nc.publish(INFER_HEARTBEAT, dumps({
                "worker_id": self.worker_id, "subject": infer_worker_subject(self.worker_id),
                "inflight": len(self._tasks), "capacity": 1000, "weight_version": 0, "engine": "policy",
                "draining": False, "time": time.time()}))
            await asyncio.sleep(0.5)

    async def _on_request(self, msg: Msg) -> None:
        task = asyncio.create_task(self._serve(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, msg: Msg) -> None:
        req = decode_as(msg.data, InferenceRequested)
        self.requests.append(req)
        if self.hold(req):
            await self.release.wait()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        ids = np.append(self.tok.encode(self.text_for(req)), self.tok.eos_token_id or 2).astype(np.int32)
        turn = TurnGenerated(
            event_id=req.request_id, episode_id=req.episode_id, batch_id=req.batch_id, attempt=req.attempt,
            seq=req.reply_seq, produced_by=f"inference-worker/{self.worker_id}", request_id=req.request_id,
            turn_index=req.turn_index, prompt_len=len(req.prompt_token_ids), token_ids=ids,
            logprobs=np.full(len(ids), -0.5, dtype=np.float32), finish_reason=FinishReason.STOP, weight_version=0,
            engine="policy", worker_id=self.worker_id, queue_ms=0.0, generate_ms=0.0)
        await publish_event(self.js, turn)
        await self.nc.publish(msg.reply, encode(turn))

    def text_for(self, req: InferenceRequested) -> str:
        """The turn's text (subclasses script it); the end-of-turn id is appended by ``_serve``."""
        return self.answer(self.tok.decode(req.prompt_token_ids))

    @staticmethod
    def answer(context: str) -> str:
        if m := re.search(r"What is (-?\d+) ([-+*]) (-?\d+)\?", context):
            a, op, b = int(m[1]), m[2], int(m[3])
            return f"The answer is {a + b if op == '+' else a - b if op == '-' else a * b}."
        if m := re.search(r"between (\d+) and (\d+)", context):
            low, high = int(m[1]), int(m[2])
            for guess, feedback in re.findall(r"assistant\nMy guess is (\d+)\.<\|im_end\|>\n<\|im_start\|>user\n(\w+)",
                                              context):
                if feedback == "higher":
                    low = int(guess) + 1
                elif feedback == "lower":
                    high = int(guess) - 1
            return f"My guess is {(low + high) // 2}."
        return "ok"
