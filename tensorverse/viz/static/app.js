/* Tensorverse multiverse viewer. Plain JS, no build step, no network beyond this server.
 *
 * Security rule for this file: every string that comes from the store (model text, prompts,
 * backend names, tags, ids) reaches the page through textContent, an attribute set with
 * setAttribute/property assignment, or a URL fragment built with encodeURIComponent. No HTML
 * is ever parsed from data, and no event handler is built from data.
 *
 * Data comes from the JSON API (/api/...) or, in an exported file, from the JSON data element
 * with id "tv-data" (a script element of type application/json).
 */
(function () {
  "use strict";

  // ------------------------------------------------------------------ DOM helpers

  function el(tag, props) {
    const node = document.createElement(tag);
    if (props) {
      for (const k of Object.keys(props)) {
        const v = props[k];
        if (v === undefined || v === null || v === false) continue;
        if (k === "class") node.className = v;
        else if (k === "text") node.textContent = v;
        else if (k === "title") node.title = v;
        else if (k === "href") node.setAttribute("href", v);
        else if (k === "on") for (const ev of Object.keys(v)) node.addEventListener(ev, v[ev]);
        else if (k === "data") for (const d of Object.keys(v)) node.dataset[d] = String(v[d]);
        else node.setAttribute(k, String(v));
      }
    }
    for (let i = 2; i < arguments.length; i++) append(node, arguments[i]);
    return node;
  }

  function append(node, child) {
    if (child === undefined || child === null || child === false) return;
    if (Array.isArray(child)) { for (const c of child) append(node, c); return; }
    node.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
  }

  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); return node; }

  const SVG = "http://www.w3.org/2000/svg";
  function svg(tag, attrs) {
    const n = document.createElementNS(SVG, tag);
    for (const k of Object.keys(attrs || {})) n.setAttribute(k, String(attrs[k]));
    return n;
  }

  // ------------------------------------------------------------------ formatting

  function fmtTime(ns) {
    if (!ns) return "–";
    const d = new Date(Number(ns) / 1e6);
    if (isNaN(d.getTime())) return "–";
    const p = (x) => String(x).padStart(2, "0");
    return d.getFullYear() + "-" + p(d.getMonth() + 1) + "-" + p(d.getDate()) + " " +
      p(d.getHours()) + ":" + p(d.getMinutes()) + ":" + p(d.getSeconds());
  }

  function fmtP(p) {
    if (p === null || p === undefined) return "–";
    if (p >= 0.0995) return (p * 100).toFixed(1) + "%";
    if (p >= 0.000995) return (p * 100).toFixed(2) + "%";
    return p.toExponential(1);
  }

  function fmtNum(x, digits) {
    if (x === null || x === undefined) return "–";
    if (x === 0) return "0";
    const a = Math.abs(x);
    if (a >= 0.01 && a < 1000) return x.toFixed(digits === undefined ? 3 : digits);
    return x.toExponential(2);
  }

  function fmtDelta(d) {
    if (d === null || d === undefined || isNaN(d)) return "–";
    return (d >= 0 ? "+" : "−") + Math.abs(d * 100).toFixed(Math.abs(d) < 0.001 ? 3 : 1);
  }

  function fmtRank(r) {
    if (r === null || r === undefined) return "–";
    if (r < 0) return "≥" + (-r);
    return "#" + r;
  }

  // ------------------------------------------------------------------ data source

  const EMBEDDED = (function () {
    const node = document.getElementById("tv-data");
    if (!node) return null;
    try { return JSON.parse(node.textContent); } catch (e) { return { error: String(e) }; }
  })();

  function apiGet(path, params) {
    if (EMBEDDED) return Promise.resolve(embeddedGet(path, params));
    const qs = params ? new URLSearchParams(params).toString() : "";
    return fetch("api/" + path + (qs ? "?" + qs : ""), { headers: { Accept: "application/json" } })
      .then((r) => r.json().then((body) => {
        if (!r.ok) throw new Error(body && body.error ? body.error : ("HTTP " + r.status));
        return body;
      }));
  }

  function embeddedGet(path) {
    const parts = path.split("/");
    if (EMBEDDED.error) throw new Error("embedded data unreadable: " + EMBEDDED.error);
    if (parts[0] === "sessions" && parts.length === 1) {
      const s = EMBEDDED.session.session;
      return { total: 1, offset: 0, limit: 1, items: [s], verdicts: [], sort: "time", order: "desc" };
    }
    if (parts[0] === "sessions") {
      if (decodeURIComponent(parts[1]) !== EMBEDDED.session.session.id) throw new Error("not in this export");
      return EMBEDDED.session;
    }
    if (parts[0] === "turns") {
      const t = EMBEDDED.turns[decodeURIComponent(parts[1])];
      if (!t) throw new Error("turn not in this export");
      return t;
    }
    if (parts[0] === "verdict") return { shadows: [] };  // an export is one session: no verdict
    throw new Error("unknown path " + path);
  }

  // ------------------------------------------------------------------ routing

  function parseRoute() {
    let h = location.hash.replace(/^#/, "");
    if (!h || h === "/") h = EMBEDDED ? "/s/" + encodeURIComponent(EMBEDDED.session.session.id) : "/";
    const q = h.indexOf("?");
    const path = q >= 0 ? h.slice(0, q) : h;
    const params = new URLSearchParams(q >= 0 ? h.slice(q + 1) : "");
    const segs = path.split("/").filter(Boolean).map(decodeURIComponent);
    return { segs: segs, params: params };
  }

  function link(segs, params) {
    const path = "#/" + segs.map(encodeURIComponent).join("/");
    const qs = params ? new URLSearchParams(params).toString() : "";
    return path + (qs ? "?" + qs : "");
  }

  const app = document.getElementById("app");
  const crumbs = document.getElementById("crumbs");
  const statusEl = document.getElementById("status");
  let state = null; // the current turn view state (null elsewhere)
  let routeToken = 0;

  function setCrumbs(items) {
    clear(crumbs);
    items.forEach((it, i) => {
      if (i) append(crumbs, el("span", { class: "sep", text: "›" }));
      append(crumbs, it.href ? el("a", { href: it.href, text: it.text }) : el("span", { text: it.text }));
    });
  }

  function showError(err) {
    document.body.setAttribute("data-view", "error");
    statusEl.textContent = "";
    clear(app);
    append(app, el("div", { class: "error", role: "alert" }, "Cannot show this: ", String(err && err.message || err)));
  }

  function route() {
    const r = parseRoute();
    const token = ++routeToken;
    document.body.setAttribute("data-view", "loading");
    const done = (fn) => (data) => { if (token === routeToken) fn(data, r); };
    statusEl.textContent = "";
    if (r.segs[0] === "s" && r.segs[1]) {
      state = null;
      apiGet("sessions/" + encodeURIComponent(r.segs[1])).then(done(renderSession)).catch(done(showError));
    } else if (r.segs[0] === "t" && r.segs[1]) {
      if (state && state.view.turn.id === r.segs[1]) {
        document.body.setAttribute("data-view", "turn");
        applyTurnParams(r.params);
        return;
      }
      statusEl.textContent = "loading turn…";
      const t0 = performance.now();
      apiGet("turns/" + encodeURIComponent(r.segs[1])).then(done((view) => {
        statusEl.textContent = "";
        const t1 = performance.now();
        renderTurn(view, r.params);
        // timings for benchmarks/viewer.py: data in hand, and the turn drawn
        window.__tvTiming = { fetch_ms: t1 - t0, render_ms: performance.now() - t1 };
      })).catch(done(showError));
    } else {
      state = null;
      const p = Object.fromEntries(r.params.entries());
      apiGet("sessions", p).then(done(renderSessions)).catch(done(showError));
    }
  }

  // ------------------------------------------------------------------ shared bits

  const PALETTE = 8;
  function chip(name, idx, extra) {
    return el("span", { class: "chip b" + (idx % PALETTE) + (extra ? " " + extra : ""), text: name, title: name });
  }

  // why a flip happened (docs/attribution.md): tie, near_tie, noise, parser, runtime
  const FLIP_CLASSES = ["tie", "near_tie", "noise", "parser", "runtime"];
  const CLASS_HELP = {
    tie: "tie: the reference gave both tokens exactly equal logits; rounding decided",
    near_tie: "near tie: the two reference logits are adjacent values of its dtype (bf16: one ulp apart)",
    noise: "noise: the secondary (the primary's exact config) flips here too: batching nondeterminism",
    parser: "parser: same tokens, different tool calls (or the primary's own parse differs from what it sent)",
    runtime: "runtime: none of the above: the setting under test changed the token",
  };
  function classBadge(c) {
    const k = c || "unclassified";
    return el("span", { class: "fclass c-" + k, text: k.replace("_", " "), title: CLASS_HELP[k] || "no class stored for this flip" });
  }
  function parserBadge(pc) {
    const n = pc && pc.differences ? pc.differences.length : 0;
    return el("span", { class: "verdict bad parser-mismatch", text: "parser mismatch",
      title: "the tool calls the primary sent differ from what its own output tokens parse to" +
        (pc ? " (" + pc.verdict + (n ? ": " + pc.differences.map((d) => d.kind + " " + d.path).join(", ") : "") + ")" : "") });
  }
  function classAllowed(classes) {
    const want = state.classFilter;
    if (!want) return true;
    return classes.some((c) => (c || "unclassified") === want);
  }

  function verdictBadge(v) {
    const cls = v === "match" ? "ok" : (v === "none" || !v) ? "none" : v === "error" ? "bad" :
      (v === "value_mismatch" || v === "unexpected_param" || v === "missing_param") ? "warn" : "bad";
    return el("span", { class: "verdict " + cls, text: v || "none", title: "tool-call verdict: " + (v || "none") });
  }

  function tagList(tags) {
    return Object.keys(tags || {}).map((k) => el("span", { class: "tag", text: tags[k] ? k + "=" + tags[k] : k }));
  }

  // ------------------------------------------------------------------ can I ship it? (docs/verdict.md)

  function pct(x) { return x === null || x === undefined ? "n/a" : (x >= 0 ? "+" : "") + (x * 100).toFixed(2) + "%"; }
  function renderShipVerdicts(box, v) {
    clear(box);
    for (const s of v.shadows || []) {
      const b = s.tool_call_break_excess;
      let rest = "";
      if (s.decision === "undecided") {
        rest = s.turns_needed === null ? " · no decision in sight at the current rates" :
          " · about " + s.turns_needed + " more tool-calling turns" +
          (s.hours_needed !== null ? " (" + s.hours_needed.toFixed(1) + " h at the current traffic)" : "");
      }
      box.appendChild(el("div", { class: "ship " + s.decision, "data-backend": s.backend, "data-decision": s.decision,
        title: s.method + "; " + Math.round(v.confidence * 100) + "% bounds" },
        el("strong", { text: s.backend + ": " + s.decision }),
        el("span", { text: " · tool-call break excess " + pct(b.estimate) + " [" + pct(b.low) + ", " + pct(b.high) +
          "] over " + s.tool_call_turns + " tool-calling turns (margin " + pct(b.margin) + ")" +
          " · flip excess " + pct(s.flip_excess.estimate) + " [" + pct(s.flip_excess.low) + ", " + pct(s.flip_excess.high) + "]" +
          (s.floor_backend ? " vs " + s.floor_backend : " (no noise floor)") + rest })));
    }
  }

  // ------------------------------------------------------------------ sessions list

  function renderSessions(data, r) {
    document.body.setAttribute("data-view", "sessions");
    setCrumbs([{ text: "Sessions" }]);
    clear(app);
    const p = r.params;
    const cur = {
      q: p.get("q") || "", sort: p.get("sort") || "time", order: p.get("order") || "desc",
      verdict: p.get("verdict") || "", backend: p.get("backend") || "",
      offset: Number(p.get("offset") || 0), limit: Number(p.get("limit") || 50),
    };
    const go = (changes) => {
      const next = Object.assign({}, cur, changes);
      const params = {};
      for (const k of Object.keys(next)) if (next[k] !== "" && next[k] !== null) params[k] = next[k];
      if (!params.offset) delete params.offset;
      if (params.limit === 50) delete params.limit;
      location.hash = link([], params);
    };
    const q = el("input", { type: "search", placeholder: "filter: id or tag (agent=…)", value: cur.q, "aria-label": "filter" });
    const be = el("input", { type: "search", placeholder: "backend", value: cur.backend, "aria-label": "backend" });
    const form = el("form", { class: "filters", on: { submit: (e) => { e.preventDefault(); go({ q: q.value, backend: be.value, offset: 0 }); } } });
    const verdict = el("select", { "aria-label": "worst verdict", on: { change: () => go({ verdict: verdict.value, offset: 0 }) } },
      el("option", { value: "", text: "any verdict" }),
      (data.verdicts || []).map((v) => el("option", { value: v, text: v, selected: v === cur.verdict ? "selected" : null })));
    append(form, [q, be, verdict, el("button", { type: "submit", text: "Filter" })]);
    const banners = el("div", { class: "ship-verdicts", "aria-live": "polite" });
    append(app, banners);
    apiGet("verdict").then((v) => renderShipVerdicts(banners, v)).catch(() => {});
    append(app, el("section", { class: "panel" }, el("h1", { text: "Sessions" }), form));

    const cols = [
      ["time", "Time"], [null, "Session"], [null, "Tags"], ["turns", "Turns"], ["backends", "Backends"],
      ["verdict", "Worst verdict"], ["flips", "Flips"], [null, "Forced flips"],
    ];
    const head = el("tr", null, cols.map(([key, label]) => {
      if (!key) return el("th", { text: label });
      const active = cur.sort === key;
      const arrow = active ? (cur.order === "desc" ? " ▾" : " ▴") : "";
      return el("th", { class: active ? "sorted" : null },
        el("button", { class: "linkish", type: "button", text: label + arrow, title: "sort by " + label,
          on: { click: () => go({ sort: key, order: active && cur.order === "desc" ? "asc" : "desc", offset: 0 }) } }));
    }));
    const body = el("tbody");
    for (const s of data.items) {
      const href = link(["s", s.id]);
      body.appendChild(el("tr", { class: "row" },
        el("td", { class: "mono nowrap" }, el("a", { href: href, text: fmtTime(s.created_ns) })),
        el("td", { class: "mono" }, el("a", { href: href, text: s.id })),
        el("td", null, tagList(s.tags)),
        el("td", { class: "num", text: s.turns }),
        el("td", null, s.backends.map((b, i) => chip(b, i))),
        el("td", null, verdictBadge(s.worst)),
        el("td", { class: "num", text: s.flips, title: "turns x backends whose free run diverged" }),
        el("td", { class: "num", text: s.forced_flips === null ? "–" : s.forced_flips })));
    }
    if (!data.items.length) body.appendChild(el("tr", null, el("td", { colspan: cols.length, class: "muted", text: "No sessions." })));
    append(app, el("table", { class: "grid sessions" }, el("thead", null, head), body));
    const from = data.total ? data.offset + 1 : 0;
    const to = Math.min(data.total, data.offset + data.items.length);
    append(app, el("div", { class: "pager" },
      el("button", { type: "button", text: "‹ Previous", disabled: data.offset <= 0 ? "disabled" : null,
        on: { click: () => go({ offset: Math.max(0, data.offset - data.limit) }) } }),
      el("span", { class: "muted", text: from + "–" + to + " of " + data.total }),
      el("button", { type: "button", text: "Next ›", disabled: to >= data.total ? "disabled" : null,
        on: { click: () => go({ offset: data.offset + data.limit }) } })));
  }

  // ------------------------------------------------------------------ session view + timeline

  function renderSession(data) {
    document.body.setAttribute("data-view", "session");
    const s = data.session;
    setCrumbs([{ text: "Sessions", href: EMBEDDED ? null : "#/" }, { text: "session " + s.id }]);
    clear(app);
    append(app, el("section", { class: "panel" },
      el("h1", null, "Session ", el("span", { class: "mono", text: s.id })),
      el("p", null, fmtTime(s.created_ns), " · ", String(s.turns), " turns · ", tagList(s.tags), " · worst ", verdictBadge(s.worst))));

    const names = data.timeline.backends;
    const shadows = names.slice(1);
    const tl = el("div", { class: "timeline", role: "grid", "aria-label": "session timeline" });
    tl.style.gridTemplateColumns = "10rem repeat(" + Math.max(1, data.turns.length) + ", minmax(2.8rem, 5rem))";
    append(tl, el("div", { class: "tl-h" }, "turn →"));
    for (const t of data.turns) append(tl, el("a", { class: "tl-h mono", href: link(["t", t.id]), text: String(t.index) }));
    shadows.forEach((b, bi) => {
      append(tl, el("div", { class: "tl-name" }, chip(b, bi + 1)));
      const first = data.timeline.first_divergence[b];
      for (const t of data.turns) {
        const e = t.backends[b];
        if (!e) { append(tl, el("div", { class: "tl-cell empty", text: "·", title: "no run" })); continue; }
        const v = e.verdict || "none";
        const div = e.divergence;
        const label = div === null ? "=" : "@" + div;
        const tip = b + ", turn " + t.index + ": " + (div === null ? "same tokens as " + t.primary : "diverged at token " + div) +
          "; tool calls: " + v + (e.forced_flips !== null ? "; forced flips: " + e.forced_flips : "") +
          (e.error ? "; " + e.error : "");
        const cell = el("a", {
          class: "tl-cell v-" + v + (div !== null ? " diverged" : "") + (first === t.index ? " first" : ""),
          href: link(["t", t.id], div !== null ? { mode: "free", p: div } : { mode: "free" }), title: tip,
        }, first === t.index ? "◆ " : "", label);
        append(tl, cell);
      }
    });
    append(app, el("section", { class: "panel" }, el("h2", { text: "Timeline" }),
      el("p", { class: "muted", text: "Each cell: where that backend's free run left the primary's tokens (=: identical), coloured by its tool-call verdict; ◆ marks the first turn each backend diverged." }),
      tl));

    const body = el("tbody");
    for (const t of data.turns) {
      body.appendChild(el("tr", { class: "row" },
        el("td", { class: "num" }, el("a", { href: link(["t", t.id]), text: String(t.index) })),
        el("td", { class: "mono nowrap", text: fmtTime(t.created_ns) }),
        el("td", { class: "num", text: t.tokens }),
        el("td", null, verdictBadge(t.worst), t.parser_mismatch ? parserBadge() : null),
        el("td", { class: "num", text: t.flips }),
        el("td", { class: "mono" }, el("a", { href: link(["t", t.id]), text: t.id }))));
    }
    append(app, el("section", { class: "panel" }, el("h2", { text: "Turns" }),
      el("table", { class: "grid" }, el("thead", null, el("tr", null,
        ["#", "Time", "Tokens", "Worst verdict", "Diverged backends", "Turn id"].map((h) => el("th", { text: h })))), body)));
  }

  // ------------------------------------------------------------------ turn view

  function tokenText(view, id) {
    if (id === -1) return "■ end";
    const s = view.vocab[String(id)];
    return s === undefined || s === "" ? null : s;
  }

  function visible(text) {
    // make whitespace-only pieces visible; keep real newlines so the text still flows
    return text.replace(/\n/g, "↵\n").replace(/\t/g, "⇥");
  }

  // text: a per-node override (a free run's text split where token boundaries are unknown)
  function tokenSpan(view, id, region, attrs, text, inexact) {
    const t = text !== undefined && text !== null && (text !== "" || inexact) ? text : tokenText(view, id);
    const span = el("span", Object.assign({ class: "tok r-" + (region || "content") + (t === null ? " unk" : "") + (inexact ? " inexact" : "") }, attrs || {}));
    span.textContent = t === null ? "#" + id : visible(t);
    if (inexact) span.title = "token " + id + ": its own text was not recorded; this span shows the text of several tokens";
    return span;
  }

  function marginClass(m) {
    if (m === null || m === undefined) return "m-unk";
    if (m < 0.05) return "m-tie";
    if (m < 0.3) return "m-close";
    return "m-wide";
  }

  function klClass(kl) {
    if (kl === null || kl === undefined) return "k0";
    if (kl >= 1) return "k3";
    if (kl >= 0.1) return "k2";
    if (kl >= 0.01) return "k1";
    return "k0";
  }

  function maxOf(obj) {
    let best = null;
    for (const k of Object.keys(obj || {})) if (obj[k] !== null && (best === null || obj[k] > best)) best = obj[k];
    return best;
  }

  function renderTurn(view, params) {
    const idx = {};
    view.backends.forEach((b, i) => { idx[b.name] = i; });
    state = {
      view: view, idx: idx, mode: null, sel: null, hover: null, spans: new Map(),
      flips: [], flipAt: -1, seqs: buildSeqs(view), panelCache: new Map(), panelPending: new Set(),
      classFilter: null,
    };
    setCrumbs([
      { text: "Sessions", href: EMBEDDED ? null : "#/" },
      { text: "session " + view.session_id, href: link(["s", view.session_id]) },
      { text: "turn " + view.turn.index },
    ]);
    clear(app);
    const modeBar = el("div", { class: "modes", role: "tablist", "aria-label": "mode" });
    for (const m of ["forced", "free"]) {
      const avail = view[m] && view[m].available;
      append(modeBar, el("button", {
        type: "button", role: "tab", class: "mode", id: "mode-" + m, data: { mode: m },
        disabled: avail ? null : "disabled",
        title: m === "forced" ? "forced: every backend decodes the primary's tokens (aligned metrics)" : "free: each backend generates on its own (the multiverse)",
        text: m, on: { click: () => setParams({ mode: m }) },
      }));
    }
    append(app, el("section", { class: "panel turnhead" },
      el("div", { class: "row-flex" },
        el("h1", null, "Turn " + view.turn.index, " ", el("span", { class: "muted mono small", text: view.turn.id })),
        el("span", { class: "spacer" }),
        modeBar),
      el("p", { class: "muted" }, fmtTime(view.turn.created_ns),
        view.turn.state && view.turn.state !== "ok" ? el("span", { class: "verdict bad", text: view.turn.state, title: "the primary's request ended " + view.turn.state }) : null,
        view.parser_check && view.parser_check.mismatch ? parserBadge(view.parser_check) : null,
        view.parser_check && !view.parser_check.mismatch ? el("span", { class: "verdict ok small parser-ok", text: "parser ok",
          title: "the primary's tool calls equal what its own output tokens parse to" }) : null,
        " · primary ", chip(view.turn.primary, 0),
        " · ", String(view.turn.tokens), " output tokens · backends: ",
        view.backends.slice(1).map((b, i) => [chip(b.name, i + 1), b.errors.length ? el("span", { class: "verdict bad", text: "error", title: b.errors.join("\n") }) : null, " "])),
      renderPrompt(view),
      view.warnings.length ? el("details", { class: "warnings" }, el("summary", { text: view.warnings.length + " warning(s)" }),
        el("ul", null, view.warnings.map((w) => el("li", { text: w })))) : null,
      el("p", { class: "keys muted" }, "Keys: ", el("kbd", { text: "n" }), "/", el("kbd", { text: "p" }), " next/previous flip · ",
        el("kbd", { text: "←" }), el("kbd", { text: "→" }), " previous/next token · ", el("kbd", { text: "f" }), " forced/free · ",
        el("kbd", { text: "Esc" }), " clear")));
    const main = el("div", { class: "turnmain" });
    const left = el("div", { class: "streamcol" });
    const right = el("aside", { class: "side" });
    state.sparkBox = el("section", { class: "panel sparks", "aria-label": "KL along the turn" });
    state.legend = legend();
    state.stream = el("section", { class: "panel stream", "aria-label": "token streams" });
    state.topk = el("section", { class: "panel topk", id: "topk", "aria-live": "polite" });
    state.tools = el("section", { class: "panel tools", id: "toolcalls" });
    append(left, [state.sparkBox, state.legend, state.stream]);
    append(right, [state.topk, state.tools]);
    append(main, [left, right]);
    append(app, main);
    state.stream.addEventListener("click", onTokenEvent);
    state.stream.addEventListener("mouseover", onTokenEvent);
    state.stream.addEventListener("mouseleave", () => { state.hover = null; renderTopk(); });
    applyTurnParams(params);
    document.body.setAttribute("data-view", "turn");
  }

  function renderPrompt(view) {
    const p = view.prompt || {};
    const n = p.messages ? p.messages.length : 0;
    const label = "Prompt" + (p.token_count !== null && p.token_count !== undefined ? " · " + p.token_count + " tokens" : "") +
      (n ? " · " + n + " messages" : "");
    const body = el("div", { class: "prompt" });
    if (p.messages && p.messages.length) {
      for (const m of p.messages) append(body, el("div", { class: "msg" }, el("div", { class: "role", text: m.role }), el("pre", { text: m.content })));
    } else if (p.text) {
      append(body, el("pre", { text: p.text }));
    } else {
      append(body, el("p", { class: "muted", text: "The prompt text was not recorded (token ids only)." }));
    }
    return el("details", { class: "promptbox" }, el("summary", { text: label }), body);
  }

  function legend() {
    const regions = ["thinking", "content", "tool_name", "tool_args", "tool_syntax"];
    const filter = el("select", { class: "classfilter", "aria-label": "show flips of class", on: { change: () => {
      state.classFilter = filter.value || null;
      renderStream();
    } } }, el("option", { value: "", text: "all classes" }),
    FLIP_CLASSES.concat(["unclassified"]).map((c) => el("option", { value: c, text: c.replace("_", " ") })));
    return el("div", { class: "legend" },
      el("span", { class: "muted", text: "flip classes:" }), FLIP_CLASSES.map((c) => classBadge(c)),
      el("span", { class: "muted", text: " show:" }), filter,
      el("br"),
      el("span", { class: "muted", text: "regions:" }), regions.map((r) => el("span", { class: "tok r-" + r, text: r })),
      el("span", { class: "muted", text: " flips (margin):" }),
      el("span", { class: "tok flip m-tie", text: "<0.05", title: "the reference's top-2 probabilities were within 0.05 (the class says whether it was a tie in its dtype)" }),
      el("span", { class: "tok flip m-close", text: "<0.3" }),
      el("span", { class: "tok flip m-wide", text: "≥0.3", title: "the reference was confident: a suspicious flip" }),
      el("span", { class: "muted", text: " outline: KL ≥0.01/0.1/1" }));
  }

  function buildSeqs(view) {
    const seqs = {};
    if (!view.free || !view.free.nodes) return seqs;
    for (const n of view.free.nodes) {
      for (const b of n.backends) {
        const s = seqs[b] || (seqs[b] = []);
        for (let i = 0; i < n.tokens.length; i++) s[n.start + i] = n.tokens[i];
      }
    }
    return seqs;
  }

  function setParams(changes) {
    const r = parseRoute();
    const params = Object.fromEntries(r.params.entries());
    Object.assign(params, changes);
    for (const k of Object.keys(params)) if (params[k] === null || params[k] === undefined) delete params[k];
    const h = link(r.segs, params);
    if (location.hash !== h) location.hash = h; else applyTurnParams(new URLSearchParams(params));
  }

  function applyTurnParams(params) {
    const view = state.view;
    let mode = params.get("mode") || view.default_mode;
    if (!view[mode] || !view[mode].available) mode = view.default_mode;
    if (mode !== state.mode) {
      state.mode = mode;
      state.sel = null;
      for (const b of document.querySelectorAll(".modes .mode")) b.setAttribute("aria-selected", b.dataset.mode === mode ? "true" : "false");
      renderStream();
      renderSparks();
      renderTools();
    }
    const p = params.get("p");
    if (p !== null && p !== "") {
      const pos = Number(p);
      const node = params.get("n");
      select(node !== null && node !== "" ? { node: Number(node), pos: pos } : findSel(pos), false);
    } else if (!state.sel) {
      renderTopk();
    }
  }

  // position -> a selection in the current mode (free: prefer the primary's path)
  function findSel(pos) {
    if (state.mode === "forced") return { node: null, pos: pos };
    const nodes = state.view.free.nodes;
    const primary = state.view.turn.primary;
    let fallback = null;
    for (const n of nodes) {
      if (pos >= n.start && pos < n.end) {
        if (n.backends.indexOf(primary) < 0 && n.start === pos) return { node: n.id, pos: pos }; // the flip itself
        if (n.backends.indexOf(primary) >= 0) fallback = fallback || { node: n.id, pos: pos };
        else if (!fallback) fallback = { node: n.id, pos: pos };
      }
    }
    return fallback || { node: null, pos: pos };
  }

  function key(sel) { return (sel.node === null || sel.node === undefined ? "f" : sel.node) + ":" + sel.pos; }

  // ---- the token streams

  function renderStream() {
    const box = clear(state.stream);
    state.spans = new Map();
    state.flips = [];
    state.flipAt = -1;
    if (state.mode === "forced") renderForced(box); else renderFree(box);
  }

  function renderForced(box) {
    const view = state.view, f = view.forced;
    const flipBy = {};
    for (const fl of f.flips) flipBy[fl.position] = fl;
    append(box, el("h2", null, "Forced · all backends decode ", chip(view.turn.primary, 0), "'s tokens",
      el("span", { class: "muted small", text: "  reference distribution: " + (f.reference || "none") })));
    const lane = el("div", { class: "lane shared" });
    append(lane, el("div", { class: "lanehead" }, el("span", { class: "muted", text: "shared by " }),
      f.members.map((m) => chip(m, state.idx[m])), el("span", { class: "muted small", text: " · " + f.flips.length + " flip position(s)" })));
    const text = el("div", { class: "tokens" });
    const frag = document.createDocumentFragment();
    for (let i = 0; i < f.tokens.length; i++) {
      let fl = flipBy[i];
      const span = tokenSpan(view, f.tokens[i], f.regions[i], { data: { p: i } });
      const classes = fl ? fl.backends.map((b) => (fl.classes || {})[b] || null) : [];
      if (fl && !classAllowed(classes)) { span.classList.add("filtered"); fl = null; }
      if (fl) {
        span.classList.add("flip", marginClass(fl.margin), klClass(maxOf(fl.kl)));
        for (const c of classes) span.classList.add("c-" + (c || "unclassified"));
        span.dataset.cls = classes.map((c) => c || "unclassified").join(" ");
        span.title = "flip at " + i + ": " + fl.backends.map((b, j) => b + " → " + (tokenText(view, fl.top1[b]) ?? "#" + fl.top1[b]) +
          " (kl " + fmtNum(fl.kl[b]) + ", " + (classes[j] || "unclassified") + ")").join("; ") + "; margin " + fmtNum(fl.margin);
        const dots = el("span", { class: "dots" });
        for (const b of fl.backends) append(dots, el("span", { class: "dot b" + (state.idx[b] % PALETTE) }));
        span.appendChild(dots);
        state.flips.push({ node: null, pos: i });
      }
      state.spans.set("f:" + i, span);
      frag.appendChild(span);
    }
    text.appendChild(frag);
    append(lane, text);
    append(box, lane);
  }

  function renderFree(box) {
    const view = state.view, fr = view.free;
    const byId = {};
    for (const n of fr.nodes) byId[n.id] = n;
    const flipFirst = new Set();
    for (const bp of fr.branch_points) for (const o of bp.options) if (o.node !== null) flipFirst.add(o.node);
    const bpBy = {};
    for (const bp of fr.branch_points) bpBy[bp.node] = bp;
    append(box, el("h2", null, "Free · the multiverse: ", String(fr.branch_points.length), " branch point(s), ",
      String(fr.nodes.filter((n) => n.ended.length).length), " distinct output(s)"));
    const build = (node) => {
      const wrap = el("div", { class: "lane node d" + Math.min(node.depth, 5), data: { node: node.id } });
      const head = el("div", { class: "lanehead" });
      if (node.parent === null) append(head, el("span", { class: "muted", text: node.children.length ? "shared by " : "all agree: " }));
      else append(head, el("span", { class: "muted", text: "branch @" + node.start + ": " }));
      append(head, node.backends.map((b) => chip(b, state.idx[b])));
      const hbp = node.parent !== null ? bpBy[node.parent] : null;
      if (hbp && hbp.classes) {
        const mine = node.backends.filter((b) => b in hbp.classes);
        if (mine.length) append(head, [el("span", { class: "muted small", text: " · " }), mine.map((b) => classBadge(hbp.classes[b]))]);
      }
      append(wrap, head);
      const text = el("div", { class: "tokens" });
      const frag = document.createDocumentFragment();
      const inexact = new Set(node.inexact || []);
      for (let i = 0; i < node.tokens.length; i++) {
        const pos = node.start + i;
        const span = tokenSpan(view, node.tokens[i], node.regions[i], { data: { n: node.id, p: pos } },
          node.texts ? node.texts[i] : null, inexact.has(i));
        const bcls = (bpBy[node.parent] && bpBy[node.parent].classes) || {};
        const nodeClasses = node.backends.filter((b) => b in bcls).map((b) => bcls[b]);
        if (i === 0 && flipFirst.has(node.id) && !classAllowed(nodeClasses.length ? nodeClasses : [null])) span.classList.add("filtered");
        else if (i === 0 && flipFirst.has(node.id)) {
          const bp = bpBy[node.parent];
          for (const c of nodeClasses) span.classList.add("c-" + (c || "unclassified"));
          const kl = bp ? maxOf(bp.kl) : null;
          span.classList.add("flip", marginClass(bp ? bp.margin : null), klClass(kl));
          if (node.backends.indexOf(bp.reference) >= 0) span.classList.add("refbranch");
          span.title = "branch point at " + pos + ": " + node.backends.join(", ") + " took this token; margin " +
            fmtNum(bp ? bp.margin : null) + ", kl " + fmtNum(kl);
          if (node.backends.indexOf(bp.reference) < 0) state.flips.push({ node: node.id, pos: pos });
        }
        state.spans.set(node.id + ":" + pos, span);
        frag.appendChild(span);
      }
      text.appendChild(frag);
      if (!node.tokens.length && node.parent === null && node.children.length) append(text, el("span", { class: "muted small", text: "(they differ from the first token)" }));
      append(wrap, text);
      if (node.ended.length && (node.children.length || node.parent !== null)) {
        append(wrap, el("div", { class: "ended muted small" }, "■ ends here: ", node.ended.map((b) => chip(b, state.idx[b]))));
      }
      if (node.children.length) {
        const kids = el("div", { class: "branches" });
        for (const c of node.children) append(kids, build(byId[c]));
        append(wrap, kids);
      }
      return wrap;
    };
    append(box, build(byId[fr.root]));
    state.flips.sort((a, b) => a.pos - b.pos || a.node - b.node);
  }

  function onTokenEvent(ev) {
    const span = ev.target.closest ? ev.target.closest(".tok") : null;
    if (!span || !state.stream.contains(span) || span.dataset.p === undefined) return;
    const sel = { node: span.dataset.n === undefined ? null : Number(span.dataset.n), pos: Number(span.dataset.p) };
    if (ev.type === "click") { clearTimeout(state.hoverTimer); select(sel, true); return; }
    if (state.hover && key(state.hover) === key(sel)) return;
    state.hover = sel;
    // with lazily fetched panels, wait until the pointer rests on a token
    clearTimeout(state.hoverTimer);
    if (state.view.lazy_panels) state.hoverTimer = setTimeout(renderTopk, 80); else renderTopk();
  }

  function select(sel, updateUrl) {
    if (state.sel) {
      const old = state.spans.get(key(state.sel));
      if (old) old.classList.remove("sel");
    }
    state.sel = sel;
    state.hover = null;
    const span = state.spans.get(key(sel));
    if (span) {
      span.classList.add("sel");
      if (span.scrollIntoView) span.scrollIntoView({ block: "nearest", inline: "nearest" });
    }
    state.flipAt = state.flips.findIndex((f) => f.pos === sel.pos && (f.node === sel.node));
    renderTopk();
    updateCursor();
    if (updateUrl) {
      const r = parseRoute();
      const params = Object.fromEntries(r.params.entries());
      params.mode = state.mode;
      params.p = sel.pos;
      if (sel.node !== null && sel.node !== undefined) params.n = sel.node; else delete params.n;
      history.replaceState(null, "", link(r.segs, params));
    }
  }

  function stepFlip(dir) {
    const fl = state.flips;
    if (!fl.length) { statusEl.textContent = "no flips in this mode"; return; }
    let i;
    if (state.flipAt >= 0) i = state.flipAt + dir;
    else if (state.sel) {
      const pos = state.sel.pos;
      if (dir > 0) { i = fl.findIndex((f) => f.pos > pos); if (i < 0) i = fl.length; }
      else { i = -1; for (let j = fl.length - 1; j >= 0; j--) if (fl[j].pos < pos) { i = j; break; } }
    } else i = dir > 0 ? 0 : fl.length - 1;
    if (i < 0 || i >= fl.length) { statusEl.textContent = dir > 0 ? "last flip" : "first flip"; return; }
    statusEl.textContent = "flip " + (i + 1) + " of " + fl.length;
    select(fl[i], true);
    state.flipAt = i;
  }

  function stepToken(dir) {
    const sel = state.sel || (state.mode === "forced" ? { node: null, pos: -1 } : null);
    if (!sel) { select(findSel(0), true); return; }
    const pos = sel.pos + dir;
    if (state.mode === "forced") {
      if (pos >= 0 && pos < state.view.forced.tokens.length) select({ node: null, pos: pos }, true);
      return;
    }
    const nodes = state.view.free.nodes;
    let node = nodes.find((n) => n.id === sel.node);
    if (!node) return;
    if (pos < node.start) node = nodes.find((n) => n.id === node.parent);
    else if (pos >= node.end) node = node.children.length ? nodes.find((n) => n.id === node.children[0]) : null;
    if (node && pos >= node.start && pos < node.end) select({ node: node.id, pos: pos }, true);
  }

  document.addEventListener("keydown", (ev) => {
    if (!state || ev.altKey || ev.ctrlKey || ev.metaKey) return;
    const t = ev.target;
    if (t && (t.tagName === "INPUT" || t.tagName === "SELECT" || t.tagName === "TEXTAREA")) return;
    if (ev.key === "n" || ev.key === "j" || ev.key === "]") { stepFlip(1); ev.preventDefault(); }
    else if (ev.key === "p" || ev.key === "k" || ev.key === "[") { stepFlip(-1); ev.preventDefault(); }
    else if (ev.key === "ArrowRight") { stepToken(1); ev.preventDefault(); }
    else if (ev.key === "ArrowLeft") { stepToken(-1); ev.preventDefault(); }
    else if (ev.key === "f") {
      const other = state.mode === "forced" ? "free" : "forced";
      if (state.view[other] && state.view[other].available) setParams({ mode: other, p: null, n: null });
    } else if (ev.key === "Escape") {
      if (state.sel) { const s = state.spans.get(key(state.sel)); if (s) s.classList.remove("sel"); }
      state.sel = null; state.flipAt = -1; renderTopk(); updateCursor();
    }
  });

  // ---- the top-k panel

  // The top-k panel of a selection. Short turns (and exports) carry every panel; for long ones
  // (view.lazy_panels) each is fetched once, and the panel re-renders when it arrives.
  function panelFor(sel) {
    const view = state.view;
    let node = null;
    if (state.mode !== "forced") {
      node = view.free.nodes.find((n) => n.id === sel.node) || null;
      if (!node) return { panel: null, node: null, loading: false };
    }
    if (!view.lazy_panels) {
      const panel = node ? node.panels[sel.pos - node.start] : view.forced.panels[sel.pos];
      return { panel: panel || null, node: node, loading: false };
    }
    const k = state.mode + ":" + key(sel);
    if (state.panelCache.has(k)) return { panel: state.panelCache.get(k), node: node, loading: false };
    if (!state.panelPending.has(k)) {
      state.panelPending.add(k);
      const params = { mode: state.mode, p: sel.pos };
      if (node) params.n = node.id;
      const forView = view;
      apiGet("turns/" + encodeURIComponent(view.turn.id) + "/panel", params).then((r) => {
        if (state.view !== forView) return;
        state.panelCache.set(k, r.panel);
        state.panelPending.delete(k);
        const cur = state.hover || state.sel;
        if (cur && state.mode + ":" + key(cur) === k) renderTopk();
      }).catch((err) => {
        state.panelPending.delete(k);
        statusEl.textContent = "top-k: " + (err && err.message || err);
      });
    }
    return { panel: null, node: node, loading: true };
  }

  function renderTopk() {
    const box = clear(state.topk);
    const sel = state.hover || state.sel;
    const view = state.view;
    if (!sel) {
      append(box, el("h2", { text: "Top-k" }), el("p", { class: "muted", text: "Hover or click a token to compare every backend's distribution at that position. Flips are outlined; press n for the first one." }));
      return;
    }
    const { panel, node, loading } = panelFor(sel);
    const pos = sel.pos;
    let emitted = {};
    let refName = null;
    let region = null;
    const info = el("div", { class: "posinfo" });
    if (state.mode === "forced") {
      const f = view.forced;
      refName = f.reference;
      region = f.regions[pos];
      for (const m of f.members) emitted[m] = f.tokens[pos];
      const fl = f.flips.find((x) => x.position === pos);
      append(info, el("div", null, "margin of the reference: ", el("b", { text: fmtNum(f.margin[pos]) })));
      for (const b of Object.keys(f.lanes)) {
        const L = f.lanes[b];
        if (L.kl[pos] === null && L.top1[pos] === null) continue;
        const flipped = fl && fl.backends.indexOf(b) >= 0;
        append(info, el("div", { class: flipped ? "flipline" : null }, chip(b, state.idx[b]),
          " kl ", el("b", { text: fmtNum(L.kl[pos]) }), " · Δp ", fmtDelta(L.delta_p[pos]), " pp · rank ", fmtRank(L.rank[pos]),
          flipped ? [" · flips to ", el("span", { class: "tokchip", text: tokenText(view, L.top1[pos]) ?? "#" + L.top1[pos] })] : "",
          L.approximate ? el("span", { class: "muted small", text: " (approx.)" }) : null));
      }
    } else {
      region = node ? node.regions[pos - node.start] : null;
      for (const b of Object.keys(state.seqs)) if (state.seqs[b][pos] !== undefined) emitted[b] = state.seqs[b][pos];
      const bp = node && node.start === pos ? view.free.branch_points.find((x) => x.node === node.parent) : null;
      refName = panel ? view.backends[panel.m[0]].name : null;
      if (bp) {
        append(info, el("div", null, "branch point · margin of ", chip(bp.reference, state.idx[bp.reference]), " ", el("b", { text: fmtNum(bp.margin) })));
        for (const o of bp.options) append(info, el("div", null, el("span", { class: "tokchip", text: o.token === -1 ? "■ end" : (tokenText(view, o.token) ?? "#" + o.token) }), " ← ",
          o.backends.map((b) => [chip(b, state.idx[b]), bp.kl[b] !== undefined ? el("span", { class: "muted small", text: "(kl " + fmtNum(bp.kl[b]) + ") " }) : " "])));
      }
    }
    const tokId = state.mode === "forced" ? view.forced.tokens[pos] : (node ? node.tokens[pos - node.start] : null);
    append(box, el("h2", null, "Position " + pos + " · ", el("span", { class: "tokchip", text: tokId === null ? "?" : (tokenText(view, tokId) ?? "#" + tokId) }),
      region ? el("span", { class: "tok r-" + region + " small", text: region }) : null,
      state.hover ? el("span", { class: "muted small", text: " (hover)" }) : null));
    append(box, info);
    if (!panel) {
      append(box, el("p", { class: "muted", text: loading ? "Loading the distributions…" : "No distribution stored at this position (no logits rows and no top-k logprobs)." }));
      return;
    }
    const members = panel.m.map((i) => view.backends[i].name);
    let refCol = members.indexOf(refName);
    if (refCol < 0) refCol = 0;
    const head = el("tr", null, el("th", { text: "token" }), members.map((b, j) =>
      el("th", { colspan: j === refCol ? 1 : 2 }, chip(b, state.idx[b]), j === refCol ? el("span", { class: "muted small", text: " ref" }) : null)));
    const sub = el("tr", { class: "sub" }, el("th"), members.map((b, j) => [el("th", { text: "p  rank" }), j === refCol ? null : el("th", { text: "Δp pp", title: "p − p(reference), in percentage points" })]));
    const body = el("tbody");
    panel.ids.forEach((id, r) => {
      const tr = el("tr");
      append(tr, el("td", { class: "tokcell" }, el("span", { class: "tokchip", text: tokenText(view, id) ?? "#" + id, title: "token id " + id })));
      members.forEach((b, j) => {
        const p = panel.p[j][r];
        const isEmitted = emitted[b] === id;
        const cell = el("td", { class: "pcell" + (isEmitted ? " emitted" : ""), title: isEmitted ? b + " emitted this token" : null });
        const bar = el("span", { class: "bar b" + (state.idx[b] % PALETTE) });
        bar.style.width = (p === null ? 0 : Math.max(1, Math.round(p * 100))) + "%";
        append(cell, [bar, el("span", { class: "pv", text: fmtP(p) }), el("span", { class: "rk", text: fmtRank(panel.r[j][r]) })]);
        append(tr, cell);
        if (j !== refCol) {
          const pr = panel.p[refCol][r];
          const d = p === null || pr === null ? null : p - pr;
          append(tr, el("td", { class: "num small " + (d === null ? "" : d > 0 ? "pos" : d < 0 ? "neg" : ""), text: fmtDelta(d) }));
        }
      });
      body.appendChild(tr);
    });
    append(box, el("div", { class: "scrollx" }, el("table", { class: "grid topktable" }, el("thead", null, head, sub), body)));
    if (panel.e) append(box, el("p", { class: "small engine", title: "requests in the engine's batch when each row was computed (engine step in parentheses)" },
      "batch: ", members.map((b, j) => panel.e[j] ? [chip(b, state.idx[b]), " " + panel.e[j].b + " req · step " + panel.e[j].s + "  "] : null)));
    append(box, el("p", { class: "muted small", text: "–: not in that backend's reported top-k (top-k logprobs only); ≥k: rank at least k." }));
  }

  // ---- KL sparklines (one lane per backend)

  function renderSparks() {
    const box = clear(state.sparkBox);
    const f = state.view.forced;
    state.cursors = [];
    if (!f || !f.available || !f.lanes || !Object.keys(f.lanes).length) {
      append(box, el("p", { class: "muted small", text: "No forced runs with a reference distribution: no KL to plot." }));
      return;
    }
    append(box, el("h2", null, "KL(P‖Q) along the turn ", el("span", { class: "muted small", text: "vs " + f.reference + " · log scale 1e-6…10 · ticks: flips" })));
    const n = Math.max(1, f.tokens.length);
    for (const b of Object.keys(f.lanes)) {
      const L = f.lanes[b];
      const s = L.summary;
      const row = el("div", { class: "spark" });
      const label = el("div", { class: "sparklabel" }, chip(b, state.idx[b]),
        el("span", { class: "small muted", text: s ? " kl " + fmtNum(s.kl_mean) + " ± " + fmtNum(s.kl_se) + " · same top " + (s.same_top_p * 100).toFixed(2) + "% · " + s.flips + " flips" + (L.approximate ? " (approx.)" : "") : " no metrics" }));
      const g = svg("svg", { viewBox: "0 0 " + n + " 32", preserveAspectRatio: "none", class: "sparksvg", role: "img" });
      g.setAttribute("aria-label", "KL of " + b);
      let d = "";
      let pen = false;
      for (let i = 0; i < L.kl.length; i++) {
        const v = L.kl[i];
        if (v === null) { pen = false; continue; }
        const y = 32 - 32 * Math.max(0, Math.min(1, (Math.log10(v + 1e-6) + 6) / 7));
        d += (pen ? "L" : "M") + (i + 0.5) + " " + y.toFixed(2);
        pen = true;
      }
      for (const p of L.flips) g.appendChild(svg("rect", { x: p, y: 0, width: Math.max(1, n / 400), height: 32, class: "flipmark b" + (state.idx[b] % PALETTE) }));
      g.appendChild(svg("path", { d: d || "M0 32", class: "sparkline", "vector-effect": "non-scaling-stroke" }));
      const cursor = svg("rect", { x: -10, y: 0, width: Math.max(1, n / 300), height: 32, class: "cursor" });
      g.appendChild(cursor);
      state.cursors.push(cursor);
      g.addEventListener("click", (ev) => {
        const r = g.getBoundingClientRect();
        const pos = Math.max(0, Math.min(n - 1, Math.floor((ev.clientX - r.left) / r.width * n)));
        select(findSel(pos), true);
      });
      append(row, [label, g]);
      append(box, row);
    }
    updateCursor();
  }

  function updateCursor() {
    for (const c of state.cursors || []) c.setAttribute("x", state.sel ? state.sel.pos : -10);
  }

  // ---- tool calls per branch

  function diffParts(a, b) {
    let i = 0;
    while (i < a.length && i < b.length && a[i] === b[i]) i++;
    let j = 0;
    while (j < a.length - i && j < b.length - i && a[a.length - 1 - j] === b[b.length - 1 - j]) j++;
    return [a.slice(0, i), a.slice(i, a.length - j), a.slice(a.length - j)];
  }

  function diffView(text, other) {
    const parts = diffParts(text, other);
    return el("span", { class: "mono" }, parts[0], parts[1] ? el("mark", { text: parts[1] }) : null, parts[2]);
  }

  // does a difference path ($.arguments.k, $[1].arguments.k[2], $.arguments["a b"].x) name argument k?
  function argMatch(path, k) {
    for (const form of [".arguments." + k, ".arguments[" + JSON.stringify(k) + "]"]) {
      const i = path.indexOf(form);
      if (i < 0) continue;
      const rest = path.slice(i + form.length);
      if (rest === "" || rest[0] === "." || rest[0] === "[") return true;
    }
    return false;
  }

  function jsonText(v) {
    if (typeof v === "string") return v;
    try { return JSON.stringify(v); } catch (e) { return String(v); }
  }

  function renderTools() {
    const box = clear(state.tools);
    const view = state.view;
    const fr = view.free;
    append(box, el("h2", { text: "Tool calls" }));
    if (state.mode === "forced" || !fr || !fr.toolcalls) {
      append(box, el("p", { class: "muted small", text: "Forced runs emit the primary's tokens, so their calls are the primary's. Switch to free (f) for each branch's calls and verdicts." }));
    }
    const entries = fr && fr.toolcalls ? fr.toolcalls : [];
    for (const e of entries) {
      if (state.mode === "forced" && !e.reference) continue;
      const diffs = e.verdict ? e.verdict.differences : [];
      const card = el("div", { class: "toolcard" + (e.reference ? " ref" : "") });
      append(card, el("div", { class: "toolhead" }, e.backends.map((b) => chip(b, state.idx[b])),
        e.reference ? el("span", { class: "verdict none", text: "reference" }) : verdictBadge(e.verdict.verdict),
        e.classes ? Object.keys(e.classes).filter((b) => e.classes[b]).map((b) => classBadge(e.classes[b])) : null,
        el("button", { type: "button", class: "linkish small", text: "show branch", on: { click: () => jumpToNode(e.node) } })));
      const calls = e.extraction.calls;
      if (!calls.length && !e.extraction.malformed.length) append(card, el("p", { class: "muted small", text: "no tool calls" + (e.extraction.content ? " (content only)" : "") }));
      calls.forEach((c, ci) => {
        const single = calls.length === 1 && (!e.verdict || e.verdict.n_reference === 1);
        const base = single ? "$" : null;
        const mine = diffs.filter((d) => d.candidate_index === ci);
        const nameDiff = mine.find((d) => d.kind === "wrong_func_name");
        const argRows = Object.keys(c.arguments || {}).map((k) => {
          const d = mine.find((x) => argMatch(x.path, k));
          const val = jsonText(c.arguments[k]);
          return el("tr", { class: d ? "argdiff" : null, title: d ? d.kind + " at " + d.path : null },
            el("td", { class: "mono argk", text: k }),
            el("td", { class: "argv" }, d && d.reference !== undefined ? diffView(val, jsonText(d.reference)) : el("span", { class: "mono", text: val })));
        });
        append(card, el("div", { class: "call" },
          el("div", { class: "callname mono" + (nameDiff ? " argdiff" : "") }, c.name, "(…)", base === null ? el("span", { class: "muted small", text: " call " + ci }) : null),
          argRows.length ? el("table", { class: "args" }, el("tbody", null, argRows)) : null));
      });
      for (const m of e.extraction.malformed) append(card, el("div", { class: "malformed" }, el("b", { text: "malformed: " + m.reason }), " ", el("span", { class: "mono small", text: m.raw.slice(0, 300) })));
      if (diffs.length) {
        const ul = el("ul", { class: "diffs" });
        for (const d of diffs) {
          const li = el("li", null, el("span", { class: "verdict warn small", text: d.kind }), " ", el("span", { class: "mono", text: d.path }));
          if (d.reference !== undefined || d.candidate !== undefined) {
            const rv = d.reference === undefined ? "(absent)" : jsonText(d.reference);
            const cv = d.candidate === undefined ? "(absent)" : jsonText(d.candidate);
            append(li, el("div", { class: "diffvals" },
              el("div", null, el("span", { class: "muted small", text: "reference " }), diffView(rv, cv)),
              el("div", null, el("span", { class: "muted small", text: "this branch " }), diffView(cv, rv))));
          }
          ul.appendChild(li);
        }
        append(card, ul);
      }
      append(box, card);
    }
  }

  function jumpToNode(id) {
    if (state.mode !== "free") { setParams({ mode: "free", p: null, n: null }); return; }
    const node = state.view.free.nodes.find((n) => n.id === id);
    if (!node) return;
    if (node.end > node.start) select({ node: id, pos: node.end - 1 }, true);
  }

  window.addEventListener("hashchange", route);
  route();
})();
