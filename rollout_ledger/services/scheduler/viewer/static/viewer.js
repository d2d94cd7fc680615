// Rollout Ledger viewer: hash-routed pages over the scheduler's read API (/v1/viewer, read scope).
// Pages: #/batches, #/batch/<id>?<filters>, #/group/<batch>/<task>, #/episode/<id>. A bearer token comes from
// the page's form or from a `token=` parameter in the fragment (never sent to a server), kept in sessionStorage.
// Every text from the ledger is hostile input: it reaches the DOM escaped or through textContent only.

const API = new URL("../v1/viewer/", document.baseURI);
const ORIGINS = ["sampled", "environment", "template"];
const BLOCK = 512; // tokens per lazily rendered block: a 70,000-token trajectory draws only what is on screen
const view = document.getElementById("view");
const statusBar = document.getElementById("status-bar");

const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
const fmt = (x, d = 3) => (x === null || x === undefined ? "–" : typeof x === "number" ? Number(x.toFixed(d)).toString() : String(x));

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "text") node.textContent = v;
    else if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined) node.append(c instanceof Node ? c : String(c));
  return node;
}

function show(...nodes) {
  view.replaceChildren(...nodes.filter((n) => n !== null && n !== undefined));
}

// --- auth and fetch ---------------------------------------------------------------------------------------------
function takeTokenFromHash() {
  const [path, query] = location.hash.slice(1).split("?");
  if (!query) return;
  const params = new URLSearchParams(query);
  if (!params.has("token")) return;
  sessionStorage.setItem("rl-token", params.get("token"));
  params.delete("token");
  const rest = params.toString();
  history.replaceState(null, "", `#${path}${rest ? "?" + rest : ""}`);
}

class Unauthorized extends Error {}

async function api(path, params) {
  const url = new URL(path, API);
  for (const [k, v] of Object.entries(params || {})) if (v !== "" && v !== null && v !== undefined) url.searchParams.set(k, v);
  const token = sessionStorage.getItem("rl-token");
  const resp = await fetch(url, { headers: token ? { Authorization: `Bearer ${token}` } : {} });
  if (resp.status === 401) throw new Unauthorized();
  const body = await resp.json().catch(() => ({}));
  if (!resp.ok) throw new Error(`${resp.status}: ${typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail || body)}`);
  return body;
}

function askToken() {
  const box = document.getElementById("auth");
  box.hidden = false;
  view.replaceChildren();
  document.getElementById("auth-token").focus();
}

document.getElementById("auth-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem("rl-token", document.getElementById("auth-token").value.trim());
  document.getElementById("auth").hidden = true;
  route();
});

// --- routing -----------------------------------------------------------------------------------------------------
function crumbs(...items) {
  document.getElementById("crumbs").replaceChildren(...items.map(([label, href]) => (href ? el("a", { href, text: label }) : el("span", { text: label }))));
}

let routeSeq = 0; // a route that a newer one overtook (two hash changes in a row) does not mark the page ready

async function route() {
  const seq = ++routeSeq;
  takeTokenFromHash();
  const [path, query] = location.hash.slice(1).split("?");
  const parts = (path || "/batches").split("/").filter(Boolean).map(decodeURIComponent);
  const params = new URLSearchParams(query || "");
  statusBar.textContent = "";
  view.replaceChildren(el("p", { class: "note", text: "loading…" }));
  view.dataset.ready = "false";
  try {
    if (parts[0] === "batch" && parts[1]) await batchPage(parts[1], params);
    else if (parts[0] === "group" && parts[1] && parts[2]) await groupPage(parts[1], parts[2]);
    else if (parts[0] === "episode" && parts[1]) await episodePage(parts[1], params);
    else await batchesPage(params);
    if (seq !== routeSeq) return;
    view.dataset.route = path || "/batches"; // which page is ready (tests wait for theirs, not the one before)
    view.dataset.ready = "true";
  } catch (err) {
    if (seq !== routeSeq) return;
    if (err instanceof Unauthorized) return askToken();
    view.replaceChildren(el("p", { class: "error", text: String(err.message || err) }));
    view.dataset.ready = "error";
  }
}
window.addEventListener("hashchange", route);

// --- batches ----------------------------------------------------------------------------------------------------
const STATUS_ORDER = ["completed", "truncated", "aborted", "failed", "cancelled", "running", "requested", "waiting"];

function progressBar(counts, total) {
  const bar = el("div", { class: "progress", title: STATUS_ORDER.filter((s) => counts[s]).map((s) => `${s} ${counts[s]}`).join(", ") });
  for (const s of STATUS_ORDER) {
    if (!counts[s]) continue;
    const part = el("span", { class: `s-${s}` });
    part.style.width = `${(100 * counts[s]) / Math.max(1, total)}%`; // CSSOM: allowed by the CSP, unlike style=""
    bar.append(part);
  }
  return bar;
}

async function batchesPage(params) {
  crumbs(["batches"]);
  const offset = Number(params.get("offset") || 0);
  const data = await api("batches", { limit: 50, offset });
  const rows = data.batches.map((b) => el("tr", { "data-batch": b.batch_id },
    el("td", {}, el("a", { href: `#/batch/${encodeURIComponent(b.batch_id)}`, text: b.batch_id })),
    el("td", { text: b.env }),
    el("td", { class: "num", text: b.num_episodes }),
    el("td", {}, progressBar(b.counts, b.num_episodes)),
    el("td", { class: "num", text: fmt(b.mean_reward) }),
    el("td", { text: new Date(b.created_at).toLocaleString() + (b.cancelled_at ? " (cancelled)" : "") })));
  show(
    el("h1", { text: "Batches" }),
    el("table", { id: "batches" }, el("thead", {}, el("tr", {}, ...["batch", "env", "episodes", "progress", "mean reward", "created"].map((h) => el("th", { text: h })))), el("tbody", {}, rows)),
    offset + data.batches.length < data.total ? el("p", {}, el("a", { href: `#/batches?offset=${offset + data.batches.length}`, text: "older batches →" })) : null,
  );
}

// --- one batch ---------------------------------------------------------------------------------------------------
function histogram(h, edges) {
  const W = 220, H = 90, pad = 14;
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("width", W); svg.setAttribute("height", H);
  const max = Math.max(1, ...h.counts);
  const bw = (W - 2) / h.counts.length;
  h.counts.forEach((c, i) => {
    const r = document.createElementNS(ns, "rect");
    const bh = ((H - pad - 2) * c) / max;
    r.setAttribute("x", 1 + i * bw); r.setAttribute("y", H - pad - bh); r.setAttribute("width", Math.max(1, bw - 2)); r.setAttribute("height", bh);
    r.setAttribute("class", "bar");
    const t = document.createElementNS(ns, "title"); t.textContent = `[${fmt(edges[i])}, ${fmt(edges[i + 1])}): ${c}`;
    r.append(t); svg.append(r);
  });
  for (const [x, label] of [[1, fmt(edges[0], 2)], [W - 30, fmt(edges[edges.length - 1], 2)]]) {
    const t = document.createElementNS(ns, "text"); t.setAttribute("x", x); t.setAttribute("y", H - 2); t.textContent = label; svg.append(t);
  }
  return el("div", { class: "card hist", "data-env": h.env, "data-version": h.version },
    el("div", {}, el("b", { text: h.env }), " ", el("span", { text: h.version }), el("span", { class: "note", text: `  n=${h.n} mean=${fmt(h.mean)}` })), svg);
}

function select(name, label, options, value) {
  return el("label", {}, label, el("select", { name }, el("option", { value: "", text: "any" }),
    ...options.map((o) => el("option", { value: o, text: o, selected: String(o) === value }))));
}

async function batchPage(batchId, params) {
  crumbs(["batches", "#/batches"], [batchId]);
  const filters = Object.fromEntries(["env", "status", "reward_min", "reward_max", "version", "failure_class", "offset"].map((k) => [k, params.get(k) || ""]));
  const [summary, list] = await Promise.all([api(`batches/${encodeURIComponent(batchId)}`), api(`batches/${encodeURIComponent(batchId)}/episodes`, { ...filters, limit: 100 })]);
  const form = el("form", { class: "filters", id: "filters" },
    select("env", "env", summary.envs, filters.env),
    select("status", "status", summary.statuses, filters.status),
    el("label", {}, "reward ≥", el("input", { name: "reward_min", type: "number", step: "any", value: filters.reward_min })),
    el("label", {}, "reward ≤", el("input", { name: "reward_max", type: "number", step: "any", value: filters.reward_max })),
    select("version", "weight version", summary.versions, filters.version),
    select("failure_class", "failure class", summary.failure_classes, filters.failure_class),
    el("button", { type: "submit", text: "filter" }));
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const q = new URLSearchParams();
    for (const [k, v] of new FormData(form)) if (v !== "") q.set(k, v);
    location.hash = `#/batch/${encodeURIComponent(batchId)}${q.toString() ? "?" + q : ""}`;
  });
  const failures = Object.entries(summary.attempt_failures);
  const rows = list.episodes.map((e) => el("tr", { "data-episode": e.episode_id },
    el("td", {}, e.num_tokens !== null ? el("a", { href: `#/episode/${encodeURIComponent(e.episode_id)}`, text: e.episode_id }) : el("span", { text: e.episode_id })),
    el("td", {}, el("a", { href: `#/group/${encodeURIComponent(batchId)}/${e.task_index}`, text: `task ${e.task_index}` }), ` #${e.group_index}`),
    el("td", { text: e.env }), el("td", { text: e.status }), el("td", { class: "num", text: fmt(e.reward) }),
    el("td", { class: "num", text: fmt(e.num_turns) }), el("td", { class: "num", text: fmt(e.num_tokens) }),
    el("td", { text: e.versions }), el("td", { text: e.failure_class ? `${e.failure_class}: ${e.failure_reason || ""}` : "" })));
  const next = Number(filters.offset || 0) + list.episodes.length;
  const more = new URLSearchParams(params); more.set("offset", next);
  show(
    el("h1", { text: `Batch ${batchId}` }),
    el("p", {}, el("span", { text: `${summary.env} · ${summary.num_tasks} tasks × ${summary.group_size} · ${summary.num_episodes} episodes · ${summary.done ? "done" : "in progress"}` })),
    progressBar(summary.counts, summary.num_episodes),
    el("p", { class: "note", id: "counts", text: Object.entries(summary.counts).filter(([, n]) => n).map(([s, n]) => `${s} ${n}`).join(" · ") }),
    el("h2", { text: "Reward by env and weight version" }),
    el("div", { class: "cards", id: "histograms" }, summary.histograms.length ? summary.histograms.map((h) => histogram(h, summary.edges)) : el("p", { class: "note", text: "no reward yet" })),
    el("h2", { text: "Failures by class" }),
    failures.length ? el("table", { id: "failures" }, el("thead", {}, el("tr", {}, el("th", { text: "class" }), el("th", { class: "num", text: "episodes failed" }), el("th", { class: "num", text: "attempts retried" }), el("th", { class: "num", text: "attempts final" }))),
      el("tbody", {}, failures.map(([c, n]) => el("tr", { "data-class": c }, el("td", {}, el("a", { href: `#/batch/${encodeURIComponent(batchId)}?failure_class=${encodeURIComponent(c)}`, text: c })), el("td", { class: "num", text: summary.failures[c] || 0 }), el("td", { class: "num", text: n.retried }), el("td", { class: "num", text: n.final })))))
      : el("p", { class: "note", text: "no failed attempt" }),
    el("h2", { text: "Episodes" }), form,
    el("p", { class: "note", id: "matched", text: `${list.total} match` }),
    el("table", { id: "episodes" }, el("thead", {}, el("tr", {}, ...["episode", "group", "env", "status", "reward", "turns", "tokens", "versions", "failure"].map((h) => el("th", { text: h })))), el("tbody", {}, rows)),
    next < list.total ? el("p", {}, el("a", { href: `#/batch/${encodeURIComponent(batchId)}?${more}`, text: "next page →" })) : null,
  );
}

// --- tokens ------------------------------------------------------------------------------------------------------
const heat = (lp) => Math.max(0, Math.min(9, Math.floor(Math.exp(lp) * 10)));
// The audit gap |trainer - inference logprob| in decades: g0 < 1e-4 … g3 < 1e-1, g4 larger; gx not recomputed.
const GAP_EDGES = [1e-4, 1e-3, 1e-2, 1e-1];
const gapClass = (g) => (g === null ? "gx" : `g${GAP_EDGES.filter((e) => g >= e).length}`);

// The newest audit that kept every recomputed logprob, lined up with the tokens: v.audit_lp[i] and v.audit_gap[i]
// for each sampled token i (the audit's k-th value belongs to the k-th token whose loss mask is 1), null elsewhere.
function lineUpAudit(v) {
  const a = [...v.audits].reverse().find((x) => x.token_logprobs);
  if (!a) return null;
  v.audit_lp = new Array(v.num_tokens).fill(null);
  v.audit_gap = new Array(v.num_tokens).fill(null);
  let k = 0;
  for (let i = 0; i < v.num_tokens; i++) {
    if (v.loss_mask[i] !== 1) continue;
    const lp = a.token_logprobs[k++];
    if (lp !== null) { v.audit_lp[i] = lp; v.audit_gap[i] = Math.abs(lp - v.logprobs[i]); }
  }
  return a;
}

function tokenSpan(v, i, extra = "") {
  const o = v.origins[i];
  let cls = `t o${o} m${v.loss_mask[i]}`;
  if (o === 0) cls += ` h${heat(v.logprobs[i])} v${((v.weight_versions[i] % 8) + 8) % 8}${v.audit_gap ? " " + gapClass(v.audit_gap[i]) : ""}`;
  const text = v.pieces ? v.pieces[i] : `⟨${v.token_ids[i]}⟩`;
  return `<span class="${cls}${extra}" data-i="${i}">${esc(text)}</span>`;
}

// Where a marker goes before token i: turn starts, version changes, segment starts; after the observation of a
// turn (before the next turn or the end): that turn's step.
function markers(v) {
  const before = new Map();
  const add = (i, html) => before.set(i, (before.get(i) || "") + html);
  let lastVersion = null;
  const resumedAt = v.resume && v.resume.turns_reused > 0 ? v.resume.turns_reused : null;
  v.turns.forEach((t) => {
    if (resumedAt !== null && t.turn_index === resumedAt) add(t.start, `<span class="mark resume" data-resumed="${t.turn_index}">attempt ${v.attempt} resumed here (${esc(v.resume.mode)}): ${t.turn_index === 1 ? "turn 0" : "turns 0–" + (t.turn_index - 1)} carried over from attempt ${v.resume.from_attempt}</span>`);
    add(t.start, `<span class="mark turn${t.reused_from ? " reused" : ""}" data-turn="${t.turn_index}">turn ${t.turn_index}${t.reused_from ? " · carried over" : ""}</span>`);
    if (t.weight_version !== null && lastVersion !== null && t.weight_version !== lastVersion) add(t.start, `<span class="mark vchg" data-version="${t.weight_version}">v${lastVersion}→v${t.weight_version}</span>`);
    if (t.weight_version !== null) lastVersion = t.weight_version;
    (t.version_changes || []).forEach(([at, version]) => {
      add(at, `<span class="mark vchg inside" data-version="${version}" data-turn="${t.turn_index}">v${lastVersion}→v${version} inside turn ${t.turn_index} (keep)</span>`);
      lastVersion = version;
    });
    if (t.reward !== null) {
      const next = v.turns[t.turn_index + 1];
      const seg = v.segments.find((s) => s.start >= t.end && (!next || s.start <= next.start));
      const at = seg ? seg.start : next ? next.start : v.num_tokens;
      add(at, `<span class="mark step" data-step="${t.turn_index}">step ${t.turn_index}: reward ${esc(fmt(t.reward))}${t.terminated ? " · terminated" : ""}${t.truncated ? " · truncated" : ""}${t.drift ? " · drift " + esc(t.drift) : ""}</span>`);
    }
  });
  v.segments.forEach((s, k) => {
    if (k > 0) add(s.start, `<span class="mark seg" data-segment="${k}">segment ${k + 1}${s.drift ? " · drift: " + esc(s.drift) : ""}${s.turn_index !== null ? " (turn " + s.turn_index + ")" : ""}</span>`);
  });
  return before;
}

// Block bounds: BLOCK tokens each, stretched so that no tool-call fold is cut.
function blocks(v) {
  const out = [];
  let start = 0;
  while (start < v.num_tokens) {
    let end = Math.min(v.num_tokens, start + BLOCK);
    for (const f of v.folds) if (f.start < end && f.end > end) end = f.end;
    out.push([start, end]);
    start = end;
  }
  return out;
}

function renderBlock(v, [start, end], before, extraClass) {
  const parts = [];
  const folds = new Map(v.folds.map((f) => [f.start, f]));
  for (let i = start; i < end; i++) {
    if (before.has(i)) parts.push(before.get(i));
    const f = folds.get(i);
    if (f) {
      parts.push(`<span class="fold closed" data-fold="${f.start}"><button type="button" title="tool call: click to unfold">▸ ${esc(f.label)}</button><span class="inner">`);
      for (; i < f.end; i++) parts.push(tokenSpan(v, i, extraClass ? extraClass(i) : ""));
      i--;
      parts.push("</span></span>");
      continue;
    }
    parts.push(tokenSpan(v, i, extraClass ? extraClass(i) : ""));
  }
  if (end === v.num_tokens && before.has(end)) parts.push(before.get(end));
  return parts.join("");
}

function tokenPane(v, opts = {}) {
  const pane = el("div", { class: "tokens by-origin", id: opts.id || "tokens", "data-num-tokens": v.num_tokens });
  const before = opts.markers === false ? new Map() : markers(v);
  const bounds = blocks(v);
  const draw = (node) => {
    if (node.dataset.rendered === "true") return;
    const b = bounds[Number(node.dataset.block)];
    node.innerHTML = renderBlock(v, b, before, opts.extraClass);
    node.dataset.rendered = "true";
    node.classList.remove("pending");
  };
  const observer = "IntersectionObserver" in window ? new IntersectionObserver((entries) => {
    for (const e of entries) if (e.isIntersecting) { draw(e.target); observer.unobserve(e.target); }
  }, { rootMargin: "1200px 0px" }) : null;
  bounds.forEach(([s, e], k) => {
    const node = el("div", { class: "block pending", "data-block": k, "data-start": s, "data-end": e });
    node.textContent = `tokens ${s}–${e - 1}…`;
    node.style.minHeight = `${Math.ceil((e - s) / 40) * 1.6}em`; // a rough height, so the scroll bar is honest
    pane.append(node);
    if (observer && k > 0) observer.observe(node); else draw(node);
  });
  pane.drawAll = () => pane.querySelectorAll(".block").forEach(draw);
  pane.drawAt = (i) => pane.querySelectorAll(".block").forEach((n) => { if (Number(n.dataset.start) <= i && i < Number(n.dataset.end)) draw(n); });
  pane.addEventListener("click", (ev) => {
    const btn = ev.target.closest(".fold > button");
    if (btn) { const f = btn.parentElement; f.classList.toggle("closed"); btn.textContent = (f.classList.contains("closed") ? "▸ " : "▾ ") + btn.textContent.slice(2); }
  });
  pane.addEventListener("mouseover", (ev) => {
    const t = ev.target.closest(".t");
    if (!t) return;
    const i = Number(t.dataset.i);
    statusBar.textContent = `token ${i} · id ${v.token_ids[i]} · ${ORIGINS[v.origins[i]]} · mask ${v.loss_mask[i]}` +
      (v.loss_mask[i] ? ` · logprob ${fmt(v.logprobs[i], 4)} (p=${fmt(Math.exp(v.logprobs[i]))}) · v${v.weight_versions[i]}` : "") +
      (v.audit_gap && v.loss_mask[i] ? (v.audit_gap[i] === null ? " · audit: not recomputed" : ` · audit logprob ${fmt(v.audit_lp[i], 4)} · |Δ| ${v.audit_gap[i].toExponential(2)}`) : "");
  });
  return pane;
}

function legend(pane, audited) {
  const modes = [["origin", "by-origin"], ["logprob", "by-logprob"], ["weight version", "by-version"], ...(audited ? [["audit gap", "by-gap"]] : [])];
  const buttons = modes.map(([label, cls]) => el("button", { type: "button", class: "mode", "data-mode": cls, "aria-pressed": cls === "by-origin" ? "true" : "false", text: label,
    onclick: () => { pane.classList.remove(...modes.map((m) => m[1])); pane.classList.add(cls); buttons.forEach((b) => b.setAttribute("aria-pressed", String(b.dataset.mode === cls))); } }));
  return el("div", { class: "legend" }, "colour by:", ...buttons,
    el("span", { class: "t o0 m1", text: "sampled (loss mask 1)" }), el("span", { class: "t o1 m0", text: "environment" }),
    el("span", { class: "t o2 m0", text: "template" }), el("span", { class: "note", text: "dimmed: loss mask 0 · logprob: red low → green high" }),
    audited ? el("span", { class: "by-gap gapscale", title: `audit ${audited.source} · ${audited.checkpoint}` }, "audit |Δ|:",
      ...["<1e-4", "<1e-3", "<1e-2", "<0.1", "≥0.1", "not recomputed"].map((label, g) => el("span", { class: `t o0 m1 ${g < 5 ? "g" + g : "gx"}`, text: label }))) : null);
}

async function episodePage(episodeId) {
  const v = await api(`episodes/${encodeURIComponent(episodeId)}`);
  crumbs(["batches", "#/batches"], [v.batch_id, `#/batch/${encodeURIComponent(v.batch_id)}`], [`task ${v.task_index}`, `#/group/${encodeURIComponent(v.batch_id)}/${v.task_index}`], [episodeId]);
  const audited = lineUpAudit(v);
  const pane = tokenPane(v);
  const versions = [...new Set(v.weight_versions.filter((x) => x >= 0))];
  const side = el("aside", { class: "side", id: "turns" },
    el("h2", { text: "Turns" }),
    ...v.turns.map((t) => el("div", { class: "turn", "data-turn": t.turn_index },
      el("div", {}, el("a", { href: "#", onclick: (ev) => { ev.preventDefault(); pane.drawAt(t.start); pane.querySelector(`[data-i="${t.start}"]`)?.scrollIntoView({ block: "center" }); }, text: `turn ${t.turn_index}` }),
        el("span", { text: ` · tokens ${t.start}–${t.end - 1} · v${fmt(t.weight_version)}${(t.version_changes || []).map(([at, ver]) => `→v${ver} at ${at}`).join("")} · ${t.finish_reason || ""}${t.drift ? " · drift " + t.drift : ""}${t.reused_from ? ` · carried over from attempt ${t.attempt}` : ""}` })),
      t.observation !== null ? el("details", {}, el("summary", { text: `observation · reward ${fmt(t.reward)}${t.terminated ? " · terminated" : ""}${t.truncated ? " · truncated" : ""}` }), el("div", { class: "obs", text: t.observation })) : null)),
    el("h2", { text: "Logprob audit" }),
    v.audits.length ? el("table", { id: "audits" }, el("thead", {}, el("tr", {}, ...["source", "tokens", "mean |Δ|", "p99 |Δ|", "max |Δ|"].map((h) => el("th", { text: h })))),
      el("tbody", {}, v.audits.map((a) => el("tr", { title: `${a.checkpoint} · ${a.engine} · per token: ${a === audited ? "colours the tokens" : a.token_logprobs ? "kept" : a.token_note || "aggregates only"}`, class: a === audited ? "per-token" : "" },
        el("td", { text: a.source }), el("td", { class: "num", text: a.num_tokens }), el("td", { class: "num", text: a.mean_abs_delta.toExponential(2) }), el("td", { class: "num", text: a.p99_abs_delta.toExponential(2) }), el("td", { class: "num", text: a.max_abs_delta.toExponential(2) })))))
      : el("p", { class: "note", text: "no audit of this trajectory (rollout audit --batch …)" }),
    v.audits.length ? el("p", { class: "note", id: "audit-tokens", text: audited ? `per token: ${audited.source} · ${audited.checkpoint} (highlighted) colours the tokens in the "audit gap" mode` : `per token: ${v.audits.map((a) => a.token_note || "aggregates only").join("; ")}` }) : null);
  show(
    el("h1", { text: `Episode ${episodeId}` }),
    el("p", { id: "summary" }, el("span", { text: `${v.env} · ${v.status}${v.failure_class ? " (" + v.failure_class + ": " + (v.failure_reason || "") + ")" : ""} · reward ${fmt(v.reward)} · ${v.num_tokens} tokens, ${v.num_sampled_tokens} sampled · ${v.turns.length} turns · ${v.segments.length} segment(s) · versions ${versions.map((x) => "v" + x).join(", ") || "none"} · token check ${v.token_check || "–"}` })),
    v.note ? el("p", { class: "note", text: v.note }) : null,
    v.resume ? el("p", { id: "resume", class: "note", text: v.resume.mode === "restart" ? `attempt ${v.attempt} started again at turn 0${v.resume.reason ? " (" + v.resume.reason + ")" : ""}` : `attempt ${v.attempt} resumed from attempt ${v.resume.from_attempt} (${v.resume.mode}): ${v.resume.turns_reused} of ${v.resume.turns_recorded} recorded turns carried over, ${v.resume.turns_unstepped} in flight generated again${v.resume.reason ? " · " + v.resume.reason : ""}` }) : null,
    legend(pane, audited),
    el("div", { class: "layout" }, pane, side));
}

// --- a group -----------------------------------------------------------------------------------------------------
async function groupPage(batchId, task) {
  const g = await api(`batches/${encodeURIComponent(batchId)}/groups/${encodeURIComponent(task)}`);
  crumbs(["batches", "#/batches"], [batchId, `#/batch/${encodeURIComponent(batchId)}`], [`task ${task}`]);
  const columns = g.siblings.map((s) => {
    const v = { num_tokens: s.start + s.pieces.length, pieces: [], origins: [], loss_mask: [], logprobs: [], weight_versions: [], token_ids: [], turns: [], segments: [], folds: [] };
    for (let k = 0; k < s.pieces.length; k++) { const i = s.start + k; v.pieces[i] = s.pieces[k]; v.origins[i] = s.origins[k]; v.loss_mask[i] = s.origins[k] === 0 ? 1 : 0; v.logprobs[i] = 0; v.weight_versions[i] = 0; v.token_ids[i] = ""; }
    const parts = [];
    for (let i = s.start; i < v.num_tokens; i++) {
      if (i === g.common_prefix) parts.push(`<span class="mark diverge">diverges at token ${i}</span>`);
      parts.push(tokenSpan(v, i, i < g.common_prefix ? " shared" : i === g.common_prefix ? " div" : ""));
    }
    const pane = el("div", { class: "tokens by-origin" });
    pane.innerHTML = (s.start > 0 ? `<span class="mark">… ${s.start} shared tokens</span>` : "") + parts.join("") + (s.truncated ? `<span class="mark">… more in the trajectory</span>` : "");
    return el("div", { class: "sibling", "data-episode": s.episode_id },
      el("h3", {}, s.num_tokens !== null ? el("a", { href: `#/episode/${encodeURIComponent(s.episode_id)}`, text: `#${s.group_index}` }) : el("span", { text: `#${s.group_index}` }),
        el("span", { class: "note", text: ` ${s.status} · reward ${fmt(s.reward)} · ${s.versions} · ${fmt(s.num_tokens)} tokens · ${s === g.siblings[0] ? "the reference" : `differs from #${g.siblings[0].group_index} at ${fmt(s.divergence)}`}` })),
      pane);
  });
  show(
    el("h1", { text: `Group ${g.group_id}` }),
    el("p", { id: "divergence", text: `${g.siblings.length} siblings share their first ${g.common_prefix} tokens (prompt: ${fmt(g.prompt_len)}); the first divergence is marked.` }),
    g.note ? el("p", { class: "note", text: g.note }) : null,
    el("div", { class: "siblings" }, columns));
}

route();
