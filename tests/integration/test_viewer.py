"""The trajectory viewer on a real stack: its JSON API against the database, then the pages in a real browser.

Playwright drives Debian's chromium (``/usr/bin/chromium``; nothing is downloaded): it opens finished batches,
follows a group and its trajectories, and checks token counts, loss masks, origins and their colours against the
rows in Postgres; a 70,000-token trajectory draws only what is on screen. Without a chromium the test skips on a
laptop and fails on CI (``CI`` set), which installs one. ``ROLLOUT_VIEWER_SCREENSHOTS=DIR`` keeps
the screenshots (``make viewer-screenshots`` writes docs/viewer/ that way).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from bench.viewer_render import insert_long_trajectory
from rollout_ledger.cli.stack.supervisor import Stack
from rollout_ledger.services.scheduler.viewer.queries import bin_edges, bin_of, version_label
from rollout_ledger.services.scheduler.viewer.tokens import Origin, first_divergence
from rollout_ledger.shared.kit.chat import ChatTokenizer, load_chat_tokenizer
from tests.helpers import API_TOKEN, AUTH, Sql
from tests.integration.test_pipeline import start_all, submit_and_wait

CHROMIUM = os.environ.get("ROLLOUT_CHROMIUM", "/usr/bin/chromium")
ORIGIN_COLOURS = {Origin.SAMPLED: "rgb(207, 227, 255)", Origin.ENVIRONMENT: "rgb(238, 240, 243)",
                  Origin.TEMPLATE: "rgb(234, 215, 255)"}
"""viewer.css: --sampled, --env, --template."""
HEAT_COLOURS = ["rgb(185, 28, 28)", "rgb(220, 38, 38)", "rgb(239, 68, 68)", "rgb(248, 113, 113)",
                "rgb(252, 165, 165)", "rgb(253, 230, 138)", "rgb(217, 249, 157)", "rgb(187, 247, 208)",
                "rgb(134, 239, 172)", "rgb(74, 222, 128)"]
"""viewer.css: .by-logprob .t.o0.h0 .. h9 (h = floor(10 p), p the sampled token's probability)."""
LONG_TOKENS = 70_000


def _get(url: str, path: str, **params: Any) -> Any:
    resp = httpx.get(f"{url}/v1/viewer/{path}", params=params, headers=AUTH, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _run_batches(url: str) -> dict[str, str]:
    arith = submit_and_wait(url, env="arithmetic", batch_id="view-arith", group_size=4, sampling={"max_tokens": 16},
                            tasks=[*({"a": i, "b": 2 * i + 1, "op": "+"} for i in range(5)), {"op": "bogus"}])
    window = submit_and_wait(url, env="fixed-turns", batch_id="view-window", group_size=2, max_turns=4,
                             tasks=[{"turns": 4}], sampling={"max_tokens": 10},
                             context={"policy": "window", "window_turns": 1})
    tools = submit_and_wait(url, env="retail-orders", batch_id="view-tools", group_size=2, max_turns=3,
                            tasks=[{"seed": 3}],
                            sampling={"max_tokens": 48, "tool_call": {"names": ["get_order"]}})
    return {"arith": str(arith["batch_id"]), "window": str(window["batch_id"]), "tools": str(tools["batch_id"])}


@pytest.fixture
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"no chromium at {CHROMIUM}: apt-get install chromium (.ci/run installs it), or set "
                    "ROLLOUT_CHROMIUM to a Chrome")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield b
        finally:
            b.close()


def test_viewer_api_and_pages_match_the_ledger(stack: Stack, database_url: str, model_dir: str, browser: Any,
                                               tmp_path: Path) -> None:
    url = start_all(stack)
    batches = _run_batches(url)
    sql = Sql(database_url)
    tok = load_chat_tokenizer(model_dir)
    shots = Path(os.environ.get("ROLLOUT_VIEWER_SCREENSHOTS") or tmp_path / "shots")
    shots.mkdir(parents=True, exist_ok=True)
    try:
        _check_api(url, sql, batches)
        long_episode = insert_long_trajectory(database_url, tok, LONG_TOKENS)
        arith_episode = sql.scalar("select episode_id from trajectories where batch_id = 'view-arith' "
                                   "order by episode_id limit 1")
        _insert_audits(sql, arith_episode)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        _check_pages(page, url, sql, tok, batches, arith_episode, long_episode, shots)
        _check_resumed(page, url, sql, tok, insert_resumed_trajectory(sql, tok), shots)
        assert errors == []
    finally:
        sql.close()


def _check_api(url: str, sql: Sql, batches: dict[str, str]) -> None:
    listed = _get(url, "batches")
    assert [b["batch_id"] for b in listed["batches"]] == ["view-tools", "view-window", "view-arith"]
    assert listed["total"] == 3 and listed["batches"][2]["counts"] == {"completed": 20, "failed": 4}, listed
    assert [b["batch_id"] for b in _get(url, "batches", limit=2, offset=2)["batches"]] == ["view-arith"]
    mean = sql.scalar("select avg(reward) from episodes where batch_id = 'view-arith'")
    assert listed["batches"][2]["mean_reward"] == pytest.approx(mean)

    summary = _get(url, f"batches/{batches['arith']}")
    rows = sql.rows("select env, status, reward, weight_versions, failure_class from episodes where batch_id = :b",
                    b=batches["arith"])
    assert summary["counts"]["failed"] == 4 and summary["done"]
    assert summary["failures"] == {"env": 4}
    rewards = [r["reward"] for r in rows if r["reward"] is not None]
    edges = bin_edges(rewards)
    assert summary["edges"] == pytest.approx(edges)
    expected: dict[tuple[str, str], list[int]] = {}
    for r in rows:
        if r["reward"] is not None:
            counts = expected.setdefault((r["env"], version_label(r["weight_versions"])), [0] * (len(edges) - 1))
            counts[bin_of(edges, r["reward"])] += 1
    assert {(h["env"], h["version"]): h["counts"] for h in summary["histograms"]} == expected
    assert sum(h["n"] for h in summary["histograms"]) == len(rewards) == 20

    failed = _get(url, f"batches/{batches['arith']}/episodes", status="failed")
    assert failed["total"] == 4 and {e["failure_class"] for e in failed["episodes"]} == {"env"}
    assert all("bogus" in (e["failure_reason"] or "") for e in failed["episodes"])
    good = _get(url, f"batches/{batches['arith']}/episodes", reward_min=0.5)
    assert good["total"] == sum(1 for r in rewards if r >= 0.5)
    assert _get(url, f"batches/{batches['arith']}/episodes", version=0)["total"] == 20
    assert _get(url, f"batches/{batches['arith']}/episodes", version=7)["total"] == 0
    paged = _get(url, f"batches/{batches['arith']}/episodes", limit=5, offset=20)
    assert paged["total"] == 24 and [e["episode_id"] for e in paged["episodes"]] == [
        f"view-arith.5.{g}" for g in range(4)]

    group = _get(url, f"batches/{batches['arith']}/groups/1")
    ids = [r["token_ids"] for r in sql.rows("select t.token_ids from trajectories t join episodes e on "
                                            "e.id = t.episode_id where e.batch_id = :b and e.task_index = 1 "
                                            "order by e.group_index", b=batches["arith"])]
    assert group["common_prefix"] == first_divergence(ids) and len(group["siblings"]) == 4
    assert group["common_prefix"] >= group["prompt_len"]
    for sib, seq in zip(group["siblings"], ids, strict=True):
        assert sib["num_tokens"] == len(seq) and sib["start"] + len(sib["pieces"]) == len(seq)
        assert sib["divergence"] == first_divergence([ids[0], seq])

    for batch in ("window", "tools"):
        for tr in sql.rows("select * from trajectories where batch_id = :b", b=batches[batch]):
            v = _get(url, f"episodes/{tr['episode_id']}")
            assert v["token_ids"] == tr["token_ids"] and v["loss_mask"] == tr["loss_mask"]
            assert v["weight_versions"] == tr["weight_versions"]
            assert v["logprobs"] == pytest.approx(tr["logprobs"])
            assert [i for i, o in enumerate(v["origins"]) if o == Origin.SAMPLED] == [
                i for i, m in enumerate(tr["loss_mask"]) if m]
            assert len(v["pieces"]) == tr["num_tokens"] and len(v["turns"]) == tr["num_turns"]
            assert [[s["start"], s["end"]] for s in v["segments"]] == tr["segments"]
            if batch == "window":
                assert tr["num_segments"] > 1 and all(s["drift"] for s in v["segments"][1:])
            else:
                assert len(v["folds"]) == tr["num_turns"]  # one forced call a turn
                assert all(f["label"].startswith("get_order(") for f in v["folds"])

    # what is wrong gets a 4xx that says so; no token, no data
    assert httpx.get(f"{url}/v1/viewer/batches", timeout=10).status_code == 401
    for path, params, code, words in [
        ("batches/nope", {}, 404, "unknown batch"), ("episodes/nope.0.0", {}, 404, "unknown episode"),
        (f"batches/{batches['arith']}/groups/99", {}, 404, "no task 99"),
        (f"batches/{batches['arith']}/episodes", {"reward_min": 1, "reward_max": 0}, 400, "reward_min"),
        (f"batches/{batches['arith']}/episodes", {"status": "exploded"}, 422, "status"),
        (f"batches/{batches['arith']}/episodes", {"limit": 0}, 422, "limit"),
        ("batches", {"offset": "yesterday"}, 422, "offset"),
    ]:
        resp = httpx.get(f"{url}/v1/viewer/{path}", params=params, headers=AUTH, timeout=10)
        assert resp.status_code == code and words in resp.text, (path, resp.text)
    page = httpx.get(f"{url}/viewer/", timeout=10)
    assert page.status_code == 200 and "script-src 'self'" in page.headers["content-security-policy"]
    assert httpx.get(f"{url}/viewer", timeout=10, follow_redirects=True).url.path == "/viewer/"


def _ready(page: Any) -> None:
    """Until the page the address names is rendered: ``data-route`` says which page ``data-ready`` is for (after a
    hash change the previous page's ``ready`` stays until the viewer's handler runs)."""
    path = urlsplit(page.url).fragment.split("?")[0] or "/batches"
    page.wait_for_function("p => { const m = document.querySelector('main'); "
                           "return m !== null && m.dataset.ready === 'true' && m.dataset.route === p; }",
                           arg=path, timeout=30_000)


AUDIT_DELTAS = [0.0, 3e-4, 3e-3, 3e-2, 0.3, math.nan]
"""The trainer-minus-inference logprob written for the k-th sampled token: AUDIT_DELTAS[k % 6] (NaN: not
recomputed), so every gap class of viewer.js (g0..g4, gx) appears."""
GAP_COLOURS = {"g0": "rgb(224, 242, 254)", "g1": "rgb(186, 230, 253)", "g2": "rgb(253, 230, 138)",
               "g3": "rgb(251, 146, 60)", "g4": "rgb(185, 28, 28)", "gx": "rgb(243, 244, 246)"}
"""viewer.css: .by-gap .t.o0.g0 .. g4, gx."""


def _insert_audits(sql: Sql, episode_id: str) -> None:
    """Two audits of the trajectory: the trainer's, aggregates only (the older), and ``rollout audit``'s with every
    recomputed logprob (the stored logprob plus AUDIT_DELTAS)."""
    from sqlalchemy import text

    tr = sql.rows("select logprobs, loss_mask from trajectories where episode_id = :e", e=episode_id)[0]
    sampled = [lp for lp, m in zip(tr["logprobs"], tr["loss_mask"], strict=True) if m == 1]
    recomputed = [lp + AUDIT_DELTAS[k % len(AUDIT_DELTAS)] for k, lp in enumerate(sampled)]
    insert = ("insert into logprob_audits (episode_id, attempt, batch_id, source, checkpoint, engine, min_version, "
              "max_version, num_tokens, mean_abs_delta, p99_abs_delta, max_abs_delta, token_logprobs, created_at) "
              "select episode_id, attempt, batch_id, :source, 'ckpt-v0', 'fake', 0, 0, num_sampled_tokens, :mean, "
              "0.05, 0.0625, :tokens, :at from trajectories where episode_id = :e")
    with sql.engine.begin() as conn:
        conn.execute(text(insert), {"e": episode_id, "source": "trainer", "mean": 0.0125, "tokens": None,
                                    "at": "2026-11-26 10:00:00+00"})
        conn.execute(text(insert), {"e": episode_id, "source": "audit", "mean": 0.025, "tokens": recomputed,
                                    "at": "2026-11-26 11:00:00+00"})


def _check_audit_gap(page: Any, sql: Sql, episode_id: str) -> None:
    """The audit table, and the tokens coloured by the newer audit's gap, class and colour as AUDIT_DELTAS say."""
    assert page.locator("#audits tbody tr").count() == 2
    assert page.locator("#audits tbody tr").nth(0).locator("td").nth(2).inner_text() == "1.25e-2"
    assert page.locator("#audits tbody tr").nth(0).get_attribute("title").endswith("per token: aggregates only")
    assert page.locator("#audits tbody tr.per-token").locator("td").first.inner_text() == "audit"
    assert page.locator("#audit-tokens").inner_text().startswith("per token: audit · ckpt-v0 (highlighted)")
    page.click("button[data-mode=by-gap]")
    mask = sql.rows("select loss_mask from trajectories where episode_id = :e", e=episode_id)[0]["loss_mask"]
    positions = [i for i, m in enumerate(mask) if m == 1]
    assert len(positions) >= len(AUDIT_DELTAS)
    classes = page.eval_on_selector_all("#tokens .t.o0", "ns => ns.map(n => [Number(n.dataset.i), "
                                        "n.className.split(' ').find(c => /^g[0-4x]$/.test(c))])")
    expected = ["gx" if math.isnan(d) else f"g{sum(d >= e for e in (1e-4, 1e-3, 1e-2, 1e-1))}"
                for d in AUDIT_DELTAS]
    assert classes == [[i, expected[k % len(AUDIT_DELTAS)]] for k, i in enumerate(positions)]
    for k, i in enumerate(positions[:len(AUDIT_DELTAS)]):
        assert _colour(page, f"#tokens .t[data-i='{i}']") == GAP_COLOURS[expected[k]]
    page.hover(f"#tokens .t[data-i='{positions[4]}']")
    assert "· |Δ| 3.00e-1" in page.locator("#status-bar").inner_text()
    page.hover(f"#tokens .t[data-i='{positions[5]}']")
    assert "audit: not recomputed" in page.locator("#status-bar").inner_text()


def _colour(page: Any, selector: str) -> str:
    return str(page.eval_on_selector(selector, "n => getComputedStyle(n).backgroundColor"))


def _check_pages(page: Any, url: str, sql: Sql, tok: ChatTokenizer, batches: dict[str, str], arith_episode: str,
                 long_episode: str, shots: Path) -> None:
    # the token travels in the fragment (never to a server) and is kept for the tab
    page.goto(f"{url}/viewer/#/batches?token={API_TOKEN}")
    _ready(page)
    assert "token" not in page.url
    assert page.locator("#batches tbody tr").count() == 4
    page.screenshot(path=str(shots / "batches.png"))

    page.click(f"a[href='#/batch/{batches['arith']}']")
    _ready(page)
    assert page.locator("#histograms .hist").count() == len(_get(url, f"batches/{batches['arith']}")["histograms"])
    assert page.locator("#failures tr[data-class=env] td").nth(1).inner_text() == "4"
    page.screenshot(path=str(shots / "batch.png"), full_page=True)
    page.select_option("#filters select[name=status]", "failed")
    page.click("#filters button[type=submit]")
    _ready(page)
    assert page.locator("#matched").inner_text() == "4 match"
    assert page.locator("#episodes tbody tr").count() == 4

    # a group: siblings side by side, the first divergence marked where the database says
    page.goto(f"{url}/viewer/#/group/{batches['arith']}/1")
    _ready(page)
    ids = [r["token_ids"] for r in sql.rows("select t.token_ids from trajectories t join episodes e on "
                                            "e.id = t.episode_id where e.batch_id = :b and e.task_index = 1 "
                                            "order by e.group_index", b=batches["arith"])]
    common = first_divergence(ids)
    assert page.locator(".sibling").count() == 4
    assert f"share their first {common} tokens" in page.locator("#divergence").inner_text()
    assert page.locator(".sibling").first.locator(".mark.diverge").inner_text() == f"diverges at token {common}"
    assert page.locator(".sibling").first.locator(f".t.div[data-i='{common}']").count() == 1
    page.screenshot(path=str(shots / "group.png"), full_page=True)

    # a trajectory: every token drawn once, origin, mask and colour as the rows say
    page.locator(".sibling h3 a").first.click()
    _ready(page)
    first_sibling = sql.scalar("select e.id from episodes e where e.batch_id = :b and e.task_index = 1 "
                               "order by e.group_index limit 1", b=batches["arith"])
    _check_trajectory(page, sql, first_sibling)
    page.goto(f"{url}/viewer/#/episode/{arith_episode}")
    _ready(page)
    _check_trajectory(page, sql, arith_episode)
    _check_audit_gap(page, sql, arith_episode)
    page.screenshot(path=str(shots / "trajectory-audit.png"))
    page.click("button[data-mode=by-logprob]")
    tr = sql.rows("select logprobs, loss_mask from trajectories where episode_id = :e", e=arith_episode)[0]
    first = tr["loss_mask"].index(1)
    h = max(0, min(9, math.floor(math.exp(tr["logprobs"][first]) * 10)))
    assert _colour(page, f"#tokens .t[data-i='{first}']") == HEAT_COLOURS[h]
    page.hover(f"#tokens .t[data-i='{first}']")
    assert f"token {first} · " in page.locator("#status-bar").inner_text()
    assert "sampled · mask 1 · logprob" in page.locator("#status-bar").inner_text()
    page.screenshot(path=str(shots / "trajectory-logprob.png"))

    window_episode = _open_first_trajectory(page, url, sql, batches["window"])
    segs = sql.scalar("select num_segments from trajectories where episode_id = :e", e=window_episode)
    assert page.locator("#tokens .mark.seg").count() == segs - 1
    assert "drift: " in page.locator("#tokens .mark.seg").first.inner_text()
    page.screenshot(path=str(shots / "trajectory-segments.png"))

    tools_episode = _open_first_trajectory(page, url, sql, batches["tools"])
    folds = page.locator("#tokens .fold")
    assert folds.count() == sql.scalar("select num_turns from trajectories where episode_id = :e", e=tools_episode)
    assert folds.first.locator(".inner").is_hidden()
    folds.first.locator("button").click()
    assert folds.first.locator(".inner").is_visible() and "<tool_call>" in folds.first.locator(".inner").inner_text()
    assert page.locator("#turns details").count() >= 1
    page.locator("#turns details summary").first.click()
    page.screenshot(path=str(shots / "trajectory-tools.png"))

    # 70,000 tokens: the page draws the blocks on screen, and the rest as they scroll into view
    page.goto(f"{url}/viewer/#/episode/{long_episode}")
    _ready(page)
    assert page.locator("#tokens").get_attribute("data-num-tokens") == str(LONG_TOKENS)
    drawn = page.locator("#tokens .t").count()
    assert 0 < drawn < LONG_TOKENS // 8, drawn  # the blocks near the screen (rootMargin 1200px), not all 137
    page.eval_on_selector("#tokens .block:last-child", "n => n.scrollIntoView()")
    page.wait_for_selector(f"#tokens .t[data-i='{LONG_TOKENS - 1}']", timeout=10_000)
    assert page.locator("#tokens .t").count() < LONG_TOKENS // 4
    page.click("#turns .turn[data-turn='50'] a")  # the side panel jumps to a turn, drawing its block
    page.wait_for_selector("#tokens .mark.vchg", timeout=10_000)
    assert page.locator("#tokens .mark.vchg").inner_text() == "v0→v1"  # the weights changed at turn 50
    assert page.locator("#tokens .t").count() < LONG_TOKENS // 4
    page.screenshot(path=str(shots / "trajectory-long.png"))


def _open_first_trajectory(page: Any, url: str, sql: Sql, batch_id: str) -> str:
    """Open the batch's first trajectory in the viewer and check it against its row; its episode id."""
    episode_id = str(sql.scalar("select episode_id from trajectories where batch_id = :b order by episode_id "
                                "limit 1", b=batch_id))
    page.goto(f"{url}/viewer/#/episode/{episode_id}")
    _ready(page)
    _check_trajectory(page, sql, episode_id)
    return episode_id


def _check_trajectory(page: Any, sql: Sql, episode_id: str) -> None:
    tr = sql.rows("select token_ids, loss_mask, weight_versions from trajectories where episode_id = :e",
                  e=episode_id)[0]
    page.evaluate("document.getElementById('tokens').drawAll()")
    tokens = page.locator("#tokens .t")
    assert tokens.count() == len(tr["token_ids"])
    assert page.locator("#tokens .t.m1").count() == sum(tr["loss_mask"])
    assert page.locator("#tokens .t.o0").count() == sum(tr["loss_mask"])
    assert page.locator("#tokens .t.m0").count() == len(tr["loss_mask"]) - sum(tr["loss_mask"])
    drawn = page.eval_on_selector_all("#tokens .t", "ns => ns.map(n => [Number(n.dataset.i), n.className])")
    assert [i for i, _ in drawn] == list(range(len(tr["token_ids"])))
    for i, cls in drawn:
        assert f" m{tr['loss_mask'][i]}" in f" {cls}"
    for origin, colour in ORIGIN_COLOURS.items():
        if page.locator(f"#tokens .t.o{int(origin)}").count():
            assert _colour(page, f"#tokens .t.o{int(origin)}") == colour
    masked = page.locator("#tokens .t.m0").first
    assert masked.evaluate("n => getComputedStyle(n).opacity") == "0.62"
    versions = sorted({v for v in tr["weight_versions"] if v >= 0})
    assert f"versions {', '.join(f'v{v}' for v in versions)}" in page.locator("#summary").inner_text()


def insert_resumed_trajectory(sql: Sql, tok: ChatTokenizer) -> dict[str, Any]:
    """A trajectory as the recorder writes a resumed one: attempt 2 carried turn 0 over from attempt 1, and a swap in
    mode keep cut turn 1 after 3 ids (version 0, then 1), so turn 1 owns two action ranges."""
    prompt = tok.encode(tok.render([{"role": "user", "content": "Count to three."}],
                                   add_generation_prompt=True)).tolist()
    sampled = [tok.encode(text).tolist() for text in ("One.", "Two, and then", "Three.")]
    obs = tok.encode("<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n").tolist()
    ep, batch = "view-resume.0.0", "view-resume"
    ids, mask, versions, ranges, starts = list(prompt), [0] * len(prompt), [-1] * len(prompt), [], []
    runs: list[Any] = [None, [[0, 0], [3, 1]], None]
    for t, take in enumerate(sampled):
        starts.append(len(ids))
        turn_versions = [0] * len(take) if t == 0 else [1] * len(take) if t == 2 else [0, 0, 0] + [1] * (len(take) - 3)
        if t == 1:
            ranges += [[len(ids), len(ids) + 3], [len(ids) + 3, len(ids) + len(take)]]
        else:
            ranges.append([len(ids), len(ids) + len(take)])
        ids += take
        mask += [1] * len(take)
        versions += turn_versions
        rest = obs if t < 2 else []
        ids += rest
        mask += [0] * len(rest)
        versions += [-1] * len(rest)
    sql.execute("insert into batches (id, env, group_size, max_turns, sampling, num_tasks, num_episodes, request_hash) "
                "values (:b, 'fixed-turns', 1, 3, '{}', 1, 1, 'x')", b=batch)
    sql.execute("insert into episodes (id, batch_id, group_id, group_index, task_index, env, task, status, reward, "
                "num_turns, attempt) values (:e, :b, :g, 0, 0, 'fixed-turns', '{}', 'completed', 1.0, 3, 2)",
                e=ep, b=batch, g=f"{batch}.0")
    for t, take in enumerate(sampled):
        attempt = 1 if t == 0 else 2
        turn_id = f"{ep}:a{attempt}:t{t}:r0"
        sql.execute("insert into turns (event_id, episode_id, attempt, turn_index, prompt_len, token_ids, logprobs, "
                    "finish_reason, weight_version, engine, worker_id, queue_ms, generate_ms, produced_at, "
                    "version_runs) values (:i, :e, :a, :t, 0, :ids, :lps, 'stop', :v, 'fake', 'w', 0, 0, now(), "
                    "cast(:runs as jsonb))", i=turn_id, e=ep, a=attempt, t=t, ids=take, lps=[-0.5] * len(take),
                    v=1 if t == 2 else 0, runs=None if runs[t] is None else json.dumps(runs[t]))
        sql.execute("insert into steps (event_id, episode_id, attempt, turn_index, turn_event_id, action, observation, "
                    "observation_token_ids, reward, terminated, truncated, info, step_ms, produced_at, reused_from) "
                    "values (:i, :e, 2, :t, :turn, 'a', 'o', :obs, 0, :term, false, '{}', 0, now(), :reused)",
                    i=f"{ep}:a2:s{t}", e=ep, t=t, turn=turn_id, obs=obs if t < 2 else [], term=t == 2,
                    reused=f"{ep}:a1:s0" if t == 0 else None)
    sql.execute("insert into attempt_resumes (episode_id, attempt, batch_id, mode, from_attempt, turns_recorded, "
                "turns_reused, turns_unstepped, reason, produced_at) "
                "values (:e, 2, :b, 'replay', 1, 1, 1, 1, '', now())", e=ep, b=batch)
    sql.execute("insert into trajectories (episode_id, episode_created_at, batch_id, group_id, env, attempt, status, "
                "reward, token_ids, loss_mask, logprobs, weight_versions, action_ranges, prompt_len, num_tokens, "
                "num_sampled_tokens, num_turns, segments, num_segments) values (:e, (select created_at from episodes "
                "where id = :ek), :b, :g, 'fixed-turns', 2, 'completed', 1.0, :ids, :mask, :lps, :versions, :ranges, "
                ":plen, :n, :ns, 3, :segs, 1)",
                e=ep, ek=ep, b=batch, g=f"{batch}.0", ids=ids, mask=mask, lps=[-0.5 if m else 0.0 for m in mask],
                versions=versions, ranges=ranges, plen=len(prompt), n=len(ids), ns=sum(mask), segs=[[0, len(ids)]])
    return {"episode_id": ep, "turn_starts": starts, "change_at": starts[1] + 3}


def _check_resumed(page: Any, url: str, sql: Sql, tok: ChatTokenizer, resumed: dict[str, Any], shots: Path) -> None:
    """The page says where the attempt resumed and where turn 1's version changes, at the right tokens."""
    view = _get(url, f"episodes/{resumed['episode_id']}")
    assert [t["start"] for t in view["turns"]] == resumed["turn_starts"]
    assert view["turns"][1]["version_changes"] == [[resumed["change_at"], 1]]
    assert view["turns"][0]["reused_from"] and view["turns"][0]["attempt"] == 1
    assert view["resume"]["mode"] == "replay" and view["resume"]["turns_reused"] == 1
    page.goto(f"{url}/viewer/#/episode/{resumed['episode_id']}")
    _ready(page)
    _check_trajectory(page, sql, resumed["episode_id"])
    assert "resumed from attempt 1 (replay): 1 of 1 recorded turns carried over" in page.locator("#resume").inner_text()
    assert page.locator("#tokens .mark.turn.reused").count() == 1
    first_live = page.locator("#tokens .mark.resume ~ .t").first.get_attribute("data-i")
    assert first_live == str(resumed["turn_starts"][1]), "the resume marker stands before the first live turn"
    inside = page.locator("#tokens .mark.vchg.inside")
    assert inside.count() == 1 and inside.inner_text() == "v0→v1 inside turn 1 (keep)"
    assert page.locator("#tokens .mark.vchg.inside ~ .t").first.get_attribute("data-i") == str(resumed["change_at"])
    page.screenshot(path=str(shots / "trajectory-resumed.png"), full_page=True)
