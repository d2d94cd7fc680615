"""Viewer render cost: a 70,000-token trajectory in Debian's chromium, drawn lazily (the viewer: blocks near the
screen) and all at once (the baseline: every block drawn on load), side by side in one run.

Reports, per mode: the API answer (time, bytes), time from navigation to the page being ready, the longest time the
main thread was busy (a 10 ms timer's longest gap between ticks: the page is frozen that long), token spans in the
DOM, the JS heap, and the time to draw the last token after jumping to the end. Usage: ``python -m bench.viewer_render``
(in ``make bench``; figures and command to docs/benchmarks.md), ``--tokens N``, ``--rounds R``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any

import httpx
from sqlalchemy import create_engine, text

from rollout_ledger.cli.stack.devstack import DevStack
from rollout_ledger.migrations.runner import sync_url
from rollout_ledger.shared.kit.chat import ChatTokenizer, load_chat_tokenizer
from rollout_ledger.shared.kit.settings import default_model_dir

CHROMIUM = os.environ.get("ROLLOUT_CHROMIUM", "/usr/bin/chromium")
HEARTBEAT = """
window.__gap = 0;
window.__last = performance.now();
setInterval(() => { const now = performance.now(); window.__gap = Math.max(window.__gap, now - window.__last);
  window.__last = now; }, 10);
"""
"""A 10 ms timer: the longest gap between its ticks is the longest time the main thread was busy (frozen)."""


def insert_long_trajectory(database_url: str, tok: ChatTokenizer, num_tokens: int, batch_id: str = "view-long",
                           versions_every: int = 50) -> str:
    """A trajectory of ``num_tokens`` tokens: a prompt, then turns of 500 sampled tokens and a short user message,
    the weight version moving up every ``versions_every`` turns; written as the recorder writes one (the owner's
    SQL; the packed copies are filled by the table's defaults). Returns its episode id."""
    prompt = tok.encode(tok.render([{"role": "user", "content": "Tell me a long story."}],
                                   add_generation_prompt=True)).tolist()
    answer = tok.encode("Once upon a time there was a ledger that kept every token. " * 40).tolist()[:500]
    obs = tok.encode("<|im_end|>\n<|im_start|>user\nGo on, and keep it exact.<|im_end|>\n"
                     "<|im_start|>assistant\n").tolist()
    ids, mask, lps, versions, ranges = list(prompt), [0] * len(prompt), [0.0] * len(prompt), [-1] * len(prompt), []
    turn = 0
    while len(ids) < num_tokens:
        take = answer[: min(len(answer), num_tokens - len(ids))]
        ranges.append([len(ids), len(ids) + len(take)])
        ids += take
        mask += [1] * len(take)
        lps += [-(k % 7) / 3 for k in range(len(take))]
        versions += [turn // versions_every] * len(take)
        turn += 1
        rest = obs[: num_tokens - len(ids)]
        ids += rest
        mask += [0] * len(rest)
        lps += [0.0] * len(rest)
        versions += [-1] * len(rest)
    episode = f"{batch_id}.0.0"
    engine = create_engine(sync_url(database_url))
    try:
        with engine.begin() as conn:
            conn.execute(text("insert into batches (id, env, group_size, max_turns, sampling, num_tasks, "
                              "num_episodes, request_hash) values (:b, 'fixed-turns', 1, :n, '{}', 1, 1, 'x')"),
                         {"b": batch_id, "n": len(ranges)})
            conn.execute(text("insert into episodes (id, batch_id, group_id, group_index, task_index, env, task, "
                              "status, reward, num_turns) values (:e, :b, :g, 0, 0, 'fixed-turns', '{}', "
                              "'completed', 1.0, :n)"), {"e": episode, "b": batch_id, "g": f"{batch_id}.0",
                                                         "n": len(ranges)})
            conn.execute(text(
                "insert into trajectories (episode_id, episode_created_at, batch_id, group_id, env, attempt, status, "
                "reward, token_ids, loss_mask, logprobs, weight_versions, action_ranges, prompt_len, num_tokens, "
                "num_sampled_tokens, num_turns, segments, num_segments) values (:e, (select created_at from episodes "
                "where id = :ek), :b, :g, 'fixed-turns', 0, 'completed', 1.0, :ids, :mask, :lps, :versions, :ranges, "
                ":plen, :n, :ns, :nt, :segs, 1)"),
                {"e": episode, "ek": episode, "b": batch_id, "g": f"{batch_id}.0", "ids": ids, "mask": mask, "lps": lps,
                 "versions": versions, "ranges": ranges, "plen": len(prompt), "n": len(ids), "ns": sum(mask),
                 "nt": len(ranges), "segs": [[0, len(ids)]]})
    finally:
        engine.dispose()
    return episode


def _measure(browser: Any, url: str, token: str, episode: str, eager: bool, num_tokens: int) -> dict[str, float]:
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.add_init_script(HEARTBEAT)
    page.goto(f"{url}/viewer/#/batches?token={token}")
    page.wait_for_selector("main[data-ready=true]")
    started = time.perf_counter()
    page.evaluate(f"window.__gap = 0; window.__last = performance.now(); location.hash = '#/episode/{episode}'")
    page.wait_for_selector("main[data-ready=true] #tokens")
    if eager:
        page.evaluate("setTimeout(() => document.getElementById('tokens').drawAll(), 0)")  # as a task of its own
    page.evaluate("new Promise((r) => setTimeout(() => requestAnimationFrame(() => requestAnimationFrame(r)), 20))")
    ready_s = time.perf_counter() - started
    spans = page.locator("#tokens .t").count()
    jump = time.perf_counter()
    page.eval_on_selector("#tokens .block:last-child", "n => n.scrollIntoView()")
    page.wait_for_selector(f"#tokens .t[data-i='{num_tokens - 1}']")
    last_s = time.perf_counter() - jump
    frozen_ms = page.evaluate("new Promise((r) => setTimeout(() => r(window.__gap), 50))")
    heap = page.evaluate("performance.memory ? performance.memory.usedJSHeapSize : 0")
    page.close()
    return {"ready_s": ready_s, "longest_freeze_ms": frozen_ms, "spans": spans, "heap_mb": heap / 2**20,
            "last_token_s": last_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=70_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    tok = load_chat_tokenizer(str(default_model_dir()))
    results: dict[str, list[dict[str, float]]] = {"viewer (lazy blocks)": [], "baseline (all drawn)": []}
    api: list[tuple[float, int]] = []
    with DevStack(scheduler_port=None, echo=lambda s: None) as stack:
        episode = insert_long_trajectory(stack.infra.database_url, tok, args.tokens)
        headers = {"Authorization": f"Bearer {stack.api_token}"}
        for _ in range(args.rounds):
            started = time.perf_counter()
            resp = httpx.get(f"{stack.scheduler_url}/v1/viewer/episodes/{episode}", headers=headers, timeout=120)
            resp.raise_for_status()
            api.append((time.perf_counter() - started, len(resp.content)))
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            try:
                for _ in range(args.rounds):  # alternated, so drift hits both alike
                    for name, eager in (("viewer (lazy blocks)", False), ("baseline (all drawn)", True)):
                        results[name].append(_measure(browser, stack.scheduler_url, stack.api_token, episode,
                                                      eager, args.tokens))
            finally:
                browser.close()
    print(f"# viewer render: {args.tokens} tokens, {args.rounds} rounds, {platform.node()}, "
          f"{os.cpu_count()} cpus")
    print(f"API GET /v1/viewer/episodes/{{id}}: median {statistics.median(t for t, _ in api):.2f} s, "
          f"{api[0][1] / 2**20:.1f} MiB")
    summary: dict[str, dict[str, float]] = {}
    for name, runs in results.items():
        summary[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        s = summary[name]
        print(f"{name:22s} ready {s['ready_s']:.2f} s | longest freeze {s['longest_freeze_ms']:.0f} ms | "
              f"spans {s['spans']:.0f} | heap {s['heap_mb']:.0f} MiB | last token {s['last_token_s']:.2f} s")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
