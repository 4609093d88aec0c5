/* Tensorverse hypercube site (tensorverse/hypercube/site.py). Opens from disk: no request.

   The data (#hc-data) comes from untrusted bundles: every string of it is put in the page as
   text (textContent / createTextNode) and every attribute through setAttribute. Nothing here
   writes HTML (no innerHTML, outerHTML, insertAdjacentHTML or document.write). */
(function () {
  "use strict";

  const marks = { start_ms: performance.now() };
  const D = JSON.parse(document.getElementById("hc-data").textContent);
  marks.parsed_ms = performance.now();
  const CLASSES = ["tie", "near_tie", "noise", "runtime"];
  const EAGER_CELLS = 40000;  // position-map cells built at load; past that, a case's map when opened
  const FEW_LANES = 24;        // the multiverse shows every lane up to this many
  const STRIP = 6;             // positions either side in a lane's strip

  // ---------------------------------------------------------------- helpers (text only)

  function add(parent, child) {
    if (child === null || child === undefined || child === false) return;
    if (Array.isArray(child)) { for (const c of child) add(parent, c); return; }
    parent.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
  }

  function el(tag, attrs) {
    const e = document.createElement(tag);
    if (attrs) {
      for (const k of Object.keys(attrs)) {
        const v = attrs[k];
        if (v !== null && v !== undefined && v !== false) e.setAttribute(k, String(v));
      }
    }
    for (let i = 2; i < arguments.length; i++) add(e, arguments[i]);
    return e;
  }

  function isNum(x) { return typeof x === "number" && isFinite(x); }
  function pct(x, signed) {
    if (!isNum(x)) return "n/a";
    const a = Math.abs(x) * 100;
    const s = a !== 0 && a < 0.1 ? a.toFixed(3) : a.toFixed(2);
    return (x < 0 ? "\u2212" : signed && x > 0 ? "+" : "") + s + "%";
  }
  function fnum(x, d) {
    if (!isNum(x)) return "n/a";
    if (x !== 0 && Math.abs(x) < 1e-3) return x.toExponential(2);
    return x.toFixed(d === undefined ? 3 : d);
  }
  function interval(iv, signed) {
    if (!iv || !isNum(iv.estimate)) return "n/a";
    const ci = isNum(iv.low) && isNum(iv.high) ? " [" + pct(iv.low, signed) + ", " + pct(iv.high, signed) + "]" : " (no interval)";
    return pct(iv.estimate, signed) + ci;
  }
  function rigName(r) { return r.label ? r.label : r.id; }
  // a rig's number on this page (labels are free-form and may share a long prefix)
  function rigTag(ri) { return el("span", { class: "ri" }, "#" + (ri + 1)); }
  function str(x) { return x === null || x === undefined ? "" : String(x); }

  // ---------------------------------------------------------------- the data, indexed

  const S = D.settings;
  const R = D.rigs;
  const refIdx = S.findIndex((s) => s.name === D.reference);
  const noiseIdx = D.noise === null ? -1 : S.findIndex((s) => s.name === D.noise);
  const rigById = new Map(R.map((r, i) => [r.id, i]));
  const settingByName = new Map(S.map((s, i) => [s.name, i]));
  const caseById = new Map(D.cases.map((c, i) => [c.id, i]));
  const axisOrder = [];
  for (const a of D.axes) for (const i of a.settings) axisOrder.push(i);
  let maxRate = 0;
  for (const row of D.cells) for (const c of row) if (c && isNum(c.flip_rate)) maxRate = Math.max(maxRate, c.flip_rate);
  const flipMaps = new WeakMap();  // lane -> Map(position -> flip)
  function flipsOf(lane) {
    let m = flipMaps.get(lane);
    if (!m) { m = new Map(lane[4].map((f) => [f[0], f])); flipMaps.set(lane, m); }
    return m;
  }

  // ---------------------------------------------------------------- page skeleton

  const app = document.getElementById("app");
  while (app.firstChild) app.removeChild(app.firstChild);
  document.getElementById("hc-title").textContent =
    D.suite.name + " v" + D.suite.version + " \u00b7 corpus " + D.corpus.name + " \u00b7 " + R.length + " rig(s)";

  function section(id, title, ...kids) {
    return el("section", { id: id, class: "panel" }, el("h2", null, title), kids);
  }

  // ---------------------------------------------------------------- 0. what this is

  function intro() {
    const model = D.corpus.model || {};
    return el("section", { id: "intro", class: "panel" },
      el("h1", null, "Suite ", el("code", null, str(D.suite.name)), " on ", String(R.length), " rig(s)"),
      el("p", { class: "muted" },
        "Corpus ", el("code", null, str(D.corpus.name)), " (", String(D.corpus.cases), " cases, ",
        String(D.corpus.positions), " positions, model ", el("code", null, str(model.name)), "): every rig forces the ",
        "corpus's recorded tokens, so a position is the same token on every rig. A flip: the setting's top-1 is not the ",
        "recorded token. Reference setting ", el("code", null, str(D.reference)), "; noise point ",
        D.noise === null ? "none" : el("code", null, str(D.noise)), "."),
      el("p", { class: "muted" },
        "Effects are a setting's flip rate minus the reference's (or the noise point's), paired on the same (rig, case, ",
        "turn); ", String(Math.round(D.method.confidence * 100)), " % intervals by ", str(D.method.text), ", ",
        String(D.method.replicates), " replicates, seed ", String(D.method.seed),
        ": the turn is the unit, since flips cluster by turn."));
  }

  // ---------------------------------------------------------------- 1. the axes

  function effectBar(iv, scale) {
    const bar = el("div", { class: "ebar" }, el("span", { class: "zero" }));
    if (!iv || !isNum(iv.estimate) || !(scale > 0)) return bar;
    const x = (v) => 50 + 50 * Math.max(-1, Math.min(1, v / scale));
    if (isNum(iv.low) && isNum(iv.high)) {
      const ci = el("span", { class: "ci" });
      ci.style.left = x(iv.low) + "%";
      ci.style.width = Math.max(0.5, x(iv.high) - x(iv.low)) + "%";
      bar.appendChild(ci);
    }
    const est = el("span", { class: "est" });
    est.style.left = x(iv.estimate) + "%";
    bar.appendChild(est);
    return bar;
  }

  function axes() {
    let scale = 0;
    for (const m of D.marginals) {
      for (const iv of [m.vs_reference, m.vs_noise]) {
        if (iv) for (const v of [iv.low, iv.high, iv.estimate]) if (isNum(v)) scale = Math.max(scale, Math.abs(v));
      }
    }
    const body = el("tbody");
    for (const a of D.axes) {
      a.settings.forEach((si, k) => {
        const m = D.marginals[si];
        const s = S[si];
        const role = si === refIdx ? "reference" : si === noiseIdx ? "noise point" : null;
        body.appendChild(el("tr", { "data-setting": s.name, "data-axis": a.axis, class: k === 0 ? "axis-first" : null },
          k === 0 ? el("th", { rowspan: a.settings.length, class: "axis" }, str(a.axis)) : null,
          el("td", null, el("code", null, s.name), role ? el("span", { class: "tag" }, role) : null),
          el("td", { class: "muted" }, str(s.value)),
          el("td", { class: "num" }, String(m.rigs), "/", String(R.length)),
          el("td", { class: "num" }, String(m.flips), " / ", String(m.positions)),
          el("td", { class: "num", "data-figure": "flip_rate" }, interval(m.flip_rate, false)),
          el("td", { class: "num", "data-figure": "vs_reference" }, m.vs_reference ? interval(m.vs_reference, true) : "\u2014"),
          el("td", null, effectBar(m.vs_reference, scale)),
          el("td", { class: "num", "data-figure": "vs_noise" }, m.vs_noise ? interval(m.vs_noise, true) : "\u2014"),
          el("td", { class: "num" }, String(m.turns_with_flip), " / ", String(m.turns))));
      });
    }
    const head = el("tr", null, ["axis", "setting", "value", "rigs", "flips / positions", "flip rate",
      "vs reference", "", "vs noise point", "turns with a flip"].map((h) => el("th", null, h)));
    return section("axes", "Axes: each setting pooled over the rigs that ran it",
      el("div", { class: "scroll" }, el("table", { class: "grid", id: "axes-table" }, el("thead", null, head), body)),
      el("p", { class: "muted small" }, "Bars: the effect vs the reference and its interval, on a scale of \u00b1",
        pct(scale, false), "."));
  }

  // ---------------------------------------------------------------- 2. rig x setting heat map

  function heat(rate) {
    if (!isNum(rate) || !(maxRate > 0)) return "";
    const t = Math.sqrt(Math.min(1, rate / maxRate));
    const c0 = [246, 247, 249], c1 = [224, 62, 62];
    return "rgb(" + c0.map((v, i) => Math.round(v + (c1[i] - v) * t)).join(",") + ")";
  }

  function heatmap() {
    const head = el("tr", null, el("th", null, "rig"),
      axisOrder.map((si) => el("th", { "data-setting": S[si].name }, el("code", null, S[si].name),
        el("div", { class: "muted small" }, str(S[si].axis)))));
    const body = el("tbody");
    R.forEach((r, ri) => {
      const tr = el("tr", { "data-rig": r.id },
        el("th", { class: "rig", title: rigName(r) }, rigTag(ri), el("span", { class: "rl" }, rigName(r)),
          el("div", { class: "muted small" }, str(r.hardware))));
      for (const si of axisOrder) {
        const c = D.cells[ri][si] || { status: "absent", reason: null };
        const b = el("button", { type: "button", class: "hm " + (c.status === "ran" ? "ran" : "not-ran"),
          "data-rig": r.id, "data-setting": S[si].name, "data-status": c.status });
        if (c.status === "ran") {
          b.style.backgroundColor = heat(c.flip_rate);
          if (isNum(c.flip_rate) && maxRate > 0 && c.flip_rate / maxRate > 0.4) b.classList.add("dark");
          add(b, [el("span", { class: "rate" }, pct(c.flip_rate, false)),
            el("span", { class: "muted small" }, String(c.flips) + "/" + String(c.positions))]);
        } else {
          b.setAttribute("title", str(c.reason));
          add(b, [el("span", { class: "status" }, str(c.status)), el("span", { class: "reason" }, str(c.reason))]);
        }
        b.addEventListener("click", () => selectCell(ri, si, true));
        tr.appendChild(el("td", null, b));
      }
      body.appendChild(tr);
    });
    return section("heatmap", "Rigs \u00d7 settings: flip rate",
      el("div", { class: "scroll" }, el("table", { class: "heat" }, el("thead", null, head), body)),
      el("section", { id: "cell-detail", class: "detail", hidden: "" }));
  }

  function figure(k, v) { return [el("dt", null, k), el("dd", null, v)]; }

  function selectCell(ri, si, scroll) {
    const r = R[ri], s = S[si], c = D.cells[ri][si] || { status: "absent" };
    for (const e of document.querySelectorAll(".hm.sel, tr.sel")) e.classList.remove("sel");
    for (const e of document.querySelectorAll('.hm[data-rig="' + r.id + '"][data-setting="' + cssName(s.name) + '"], ' +
      'table.pm tr[data-rig="' + r.id + '"][data-setting="' + cssName(s.name) + '"]')) e.classList.add("sel");
    const box = document.getElementById("cell-detail");
    while (box.firstChild) box.removeChild(box.firstChild);
    box.hidden = false;
    box.setAttribute("data-rig", r.id);
    box.setAttribute("data-setting", s.name);
    add(box, el("h3", null, rigTag(ri), el("span", { class: "rl" }, rigName(r)), " \u00b7 ", el("code", null, s.name)));
    const dl = el("dl", { class: "figs" });
    add(dl, [figure("status", str(c.status)), figure("hardware", str(r.hardware) || "\u2014"), figure("rig id", r.id)]);
    if (c.status === "ran") {
      add(dl, [figure("flips / positions", String(c.flips) + " / " + String(c.positions) + " (" + pct(c.flip_rate) + ")"),
        figure("turns with a flip", String(c.turns_with_flip) + " / " + String(c.turns)),
        figure("flips by class", CLASSES.map((k) => k + " " + String((c.flips_by_class || {})[k] || 0)).join(", ")),
        figure("KL mean / max", fnum(c.kl_mean, 4) + " / " + fnum(c.kl_max, 4)),
        figure("free runs diverged", String(c.free_diverged) + " / " + String(c.free_turns)),
        figure("tool-call breaks", String(c.tool_call_breaks)),
        figure("vLLM args", (c.vllm_args || []).join(" ") || "(the base)")]);
    } else {
      add(dl, figure("reason", str(c.reason)));
    }
    box.appendChild(dl);
    if (c.status === "ran") {
      const list = el("div", { class: "fliplist" });
      let n = 0;
      D.cases.forEach((cs, ci) => cs.turns.forEach((t, ti) => {
        for (const ln of t.lanes) {
          if (ln[0] !== ri || ln[1] !== si) continue;
          for (const f of ln[4]) {
            if (n++ >= 300) continue;
            const b = el("button", { type: "button", class: "tk f k-" + klass(f[2]), "data-case": cs.id,
              "data-turn": t.turn, "data-position": f[0] }, cs.id + " t" + t.turn + " p" + f[0]);
            b.addEventListener("click", () => openMultiverse(ci, ti, f[0], ri, si));
            list.appendChild(b);
          }
        }
      }));
      add(box, [el("h4", null, "Flips (", String(n), n > 300 ? ", the first 300" : "", ")"), list]);
    }
    if (scroll) box.scrollIntoView({ block: "nearest" });
    setHash("cell=" + encodeURIComponent(r.id) + "/" + encodeURIComponent(s.name));
  }

  // setting names and rig ids are plain names (the checker refuses others); quote them anyway
  function cssName(v) { return String(v).replace(/["\\]/g, "\\$&"); }
  function klass(c) { return CLASSES.indexOf(c) >= 0 ? c : "runtime"; }

  // ---------------------------------------------------------------- 3. rigs

  function rigs() {
    const body = el("tbody");
    R.forEach((r, ri) => {
      body.appendChild(el("tr", { "data-rig": r.id },
        el("td", null, rigTag(ri), el("span", { class: "rl" }, rigName(r))), el("td", null, el("code", null, r.id)), el("td", null, str(r.hardware)),
        el("td", { class: "nowrap" }, str(r.created)), el("td", null, str(r.tensorverse_version)),
        el("td", null, str(r.bundle)),
        el("td", null, el("details", null, el("summary", null, "fingerprint"),
          el("pre", { class: "fp" }, JSON.stringify(r.fingerprint, null, 1))))));
    });
    return section("rigs", "Rigs",
      el("table", { class: "grid" }, el("thead", null, el("tr", null,
        ["label", "id", "hardware", "created", "tensorverse", "bundle", ""].map((h) => el("th", null, h)))), body));
  }

  // ---------------------------------------------------------------- 4. position maps

  function laneOrder(lanes) {
    return lanes.slice().sort((a, b) => (axisOrder.indexOf(a[1]) - axisOrder.indexOf(b[1])) || (a[0] - b[0]));
  }

  function positionMap(ci, ti) {
    const cs = D.cases[ci], t = cs.turns[ti], n = t.tokens.length;
    const lanes = laneOrder(t.lanes);
    const head = el("tr", null, el("th", { class: "corner" }, "rig \u00b7 setting"));
    for (let p = 0; p < n; p++) {
      head.appendChild(el("th", { class: "ph", "data-position": p, title: "token id " + t.tokens[p] }, p % 5 === 0 ? String(p) : ""));
    }
    // one row of this turn's cells (case, turn, position; no flip), cloned per lane: cloning
    // copies the attributes natively, so a lane sets only its own two and its flips
    const blank = document.createElement("tr");
    for (let p = 0; p < n; p++) {
      blank.appendChild(el("td", { class: "c", "data-case": cs.id, "data-turn": t.turn, "data-position": p, "data-flip": "0" }));
    }
    const body = el("tbody");
    for (const ln of lanes) {
      const r = R[ln[0]], s = S[ln[1]];
      const tr = blank.cloneNode(true);
      tr.setAttribute("data-rig", r.id);
      tr.setAttribute("data-setting", s.name);
      for (let td = tr.firstChild; td; td = td.nextSibling) {
        td.setAttribute("data-rig", r.id);
        td.setAttribute("data-setting", s.name);
      }
      const cells = tr.children;
      for (const f of ln[4]) {
        const td = cells[f[0]];
        if (!td) continue;
        td.className = "c f k-" + klass(f[2]);
        td.setAttribute("data-flip", "1");
      }
      tr.insertBefore(el("th", { class: "rowh", title: rigName(r) + " \u00b7 " + s.name },
        rigTag(ln[0]), el("span", { class: "rl" }, rigName(r)), el("code", { class: "sn" }, s.name)), tr.firstChild);
      body.appendChild(tr);
    }
    const table = el("table", { class: "pm", "data-case": cs.id, "data-turn": t.turn }, el("thead", null, head), body);
    table.style.width = (240 + 11 * n) + "px";  // fixed layout: the browser need not measure every cell
    table.addEventListener("click", (ev) => {
      const td = ev.target.closest ? ev.target.closest("td.c") : null;
      if (!td) return;
      const ln = lanes[td.parentNode.sectionRowIndex];
      openMultiverse(ci, ti, td.cellIndex - 1, ln[0], ln[1]);
    });
    const flips = t.lanes.reduce((k, ln) => k + ln[4].length, 0);
    return el("div", { class: "pm-turn" },
      el("div", { class: "pm-cap muted small" }, "turn " + t.turn + " \u00b7 " + n + " positions \u00b7 " +
        lanes.length + " lanes \u00b7 " + flips + " flips"),
      el("div", { class: "scroll" }, table));
  }

  function cases() {
    let cells = 0;
    for (const cs of D.cases) for (const t of cs.turns) cells += t.tokens.length * t.lanes.length;
    const eager = cells <= EAGER_CELLS;
    const box = section("cases", "Position maps: where each rig + setting flips",
      el("p", { class: "muted small" }, "Per case and turn: columns are positions, rows (rig, setting); a marked cell ",
        "is a flip (colour: its class: ", CLASSES.map((k) => el("span", { class: "legend k-" + k }, k)),
        "). Click a cell for the multiverse of that position."));
    D.cases.forEach((cs, ci) => {
      const flips = cs.turns.reduce((k, t) => k + t.lanes.reduce((j, ln) => j + ln[4].length, 0), 0);
      const body = el("div", { class: "case-body" });
      const det = el("details", { class: "case", "data-case": cs.id, open: eager || ci === 0 ? "" : null },
        el("summary", null, el("code", null, cs.id), " \u00b7 ", String(cs.turns.length), " turn(s) \u00b7 ",
          String(flips), " flips"), body);
      const build = () => {
        if (det.dataset.built) return;
        det.dataset.built = "1";
        cs.turns.forEach((t, ti) => body.appendChild(positionMap(ci, ti)));
      };
      if (eager || ci === 0) build();
      det.addEventListener("toggle", () => { if (det.open) build(); });
      box.appendChild(det);
    });
    return box;
  }

  // ---------------------------------------------------------------- 5. the multiverse of a position

  const mv = el("aside", { id: "multiverse", class: "mv", hidden: "", "aria-label": "multiverse" });
  let mvState = null;

  function openMultiverse(ci, ti, p, focusR, focusS, all) {
    const cs = D.cases[ci], t = cs.turns[ti], n = t.tokens.length;
    if (p < 0 || p >= n) return;
    mvState = { ci: ci, ti: ti, p: p, r: focusR, s: focusS, all: !!all };
    const lanes = t.lanes;
    const keep = (ln) => lanes.length <= FEW_LANES || all || ln[1] === focusS || flipsOf(ln).has(p) ||
      (ln[0] === focusR && ln[1] === refIdx);
    const rank = (ln) => (ln[0] === focusR && ln[1] === focusS ? 0 : flipsOf(ln).has(p) ? 1 : 2);
    const shown = lanes.filter(keep).sort((a, b) => (rank(a) - rank(b)) ||
      (axisOrder.indexOf(a[1]) - axisOrder.indexOf(b[1])) || (a[0] - b[0]));
    while (mv.firstChild) mv.removeChild(mv.firstChild);
    mv.setAttribute("data-case", cs.id);
    mv.setAttribute("data-turn", t.turn);
    mv.setAttribute("data-position", p);
    const close = el("button", { type: "button", class: "close", "aria-label": "close" }, "\u00d7");
    close.addEventListener("click", closeMultiverse);
    const prev = el("button", { type: "button", class: "step" }, "\u2190");
    const next = el("button", { type: "button", class: "step" }, "\u2192");
    prev.addEventListener("click", () => openMultiverse(ci, ti, p - 1, focusR, focusS, all));
    next.addEventListener("click", () => openMultiverse(ci, ti, p + 1, focusR, focusS, all));
    const more = shown.length < lanes.length ? el("button", { type: "button", class: "linkish" },
      "show all " + lanes.length + " lanes") : null;
    if (more) more.addEventListener("click", () => openMultiverse(ci, ti, p, focusR, focusS, true));
    const flipping = lanes.filter((ln) => flipsOf(ln).has(p)).length;
    add(mv, el("div", { class: "mv-h" }, prev, next,
      el("strong", null, "case ", el("code", null, cs.id), " \u00b7 turn " + t.turn + " \u00b7 position " + p),
      el("span", { class: "muted" }, " recorded token id ", el("code", { class: "rec" }, String(t.tokens[p])),
        " \u00b7 " + flipping + " of " + lanes.length + " lanes flip here \u00b7 showing " + shown.length),
      more, el("span", { class: "spacer" }), close));
    const row = el("div", { class: "lanes" });
    for (const ln of shown) row.appendChild(laneCard(t, ln, p, ci, ti));
    mv.appendChild(row);
    mv.hidden = false;
    for (const e of document.querySelectorAll("td.c.cur")) e.classList.remove("cur");
    for (const e of document.querySelectorAll('table.pm[data-case="' + cssName(cs.id) + '"][data-turn="' + t.turn +
      '"] td.c[data-position="' + p + '"]')) e.classList.add("cur");
    setHash("pos=" + encodeURIComponent(cs.id) + "/" + t.turn + "/" + p);
  }

  function laneCard(t, ln, p, ci, ti) {
    const r = R[ln[0]], s = S[ln[1]], fm = flipsOf(ln), f = fm.get(p), rec = t.tokens[p];
    const card = el("div", { class: "lane" + (f ? " flip" : ""), "data-rig": r.id, "data-setting": s.name,
      "data-flip": f ? "1" : "0" });
    add(card, el("div", { class: "lane-h" }, rigTag(ln[0]), el("span", { class: "rl", title: rigName(r) }, rigName(r)),
      el("code", { class: "sn" }, s.name)));
    const dl = el("dl", { class: "figs" });
    add(dl, [figure("top-1", f ? el("span", null, el("code", { class: "top1" }, String(f[1])), " flip (" + klass(f[2]) + ")")
      : el("span", null, el("code", { class: "top1" }, String(rec)), " = recorded")),
    figure("margin", fnum(ln[2][p])), figure("KL", fnum(ln[3][p], 4))]);
    card.appendChild(dl);
    const strip = el("div", { class: "strip" });
    for (let q = Math.max(0, p - STRIP); q <= Math.min(t.tokens.length - 1, p + STRIP); q++) {
      const g = fm.get(q);
      const b = el("button", { type: "button", class: "tk" + (g ? " f k-" + klass(g[2]) : "") + (q === p ? " cur" : ""),
        title: "position " + q + (g ? ": top-1 " + g[1] + " instead of " + t.tokens[q] : "") }, String(t.tokens[q]));
      b.addEventListener("click", () => openMultiverse(ci, ti, q, ln[0], ln[1], mvState && mvState.all));
      strip.appendChild(b);
    }
    card.appendChild(strip);
    if (f) {
      const body = el("tbody");
      f[3].forEach((id, k) => body.appendChild(el("tr", { class: id === rec ? "rec" : null },
        el("td", { class: "num" }, "#" + k), el("td", null, el("code", null, String(id))),
        el("td", { class: "num" }, fnum(f[4][k])))));
      card.appendChild(el("table", { class: "topk" }, el("thead", null, el("tr", null, el("th", null, ""),
        el("th", null, "id"), el("th", null, "logit"))), body));
    }
    return card;
  }

  function closeMultiverse() {
    mv.hidden = true;
    mvState = null;
    for (const e of document.querySelectorAll("td.c.cur")) e.classList.remove("cur");
  }

  document.addEventListener("keydown", (ev) => {
    if (!mvState) return;
    if (ev.key === "Escape") closeMultiverse();
    else if (ev.key === "ArrowLeft" || ev.key === "ArrowRight") {
      const m = mvState;
      openMultiverse(m.ci, m.ti, m.p + (ev.key === "ArrowLeft" ? -1 : 1), m.r, m.s, m.all);
    }
  });

  // ---------------------------------------------------------------- links (#cell=RIG/SETTING, #pos=CASE/TURN/P)

  let ownHash = null;
  function setHash(h) {
    ownHash = "#" + h;
    if (location.hash !== ownHash) history.replaceState(null, "", ownHash);
  }
  function follow() {
    const h = location.hash;
    if (!h || h === ownHash) return;
    const parts = h.slice(1).split("=");
    const args = (parts[1] || "").split("/").map((x) => { try { return decodeURIComponent(x); } catch (e) { return ""; } });
    if (parts[0] === "cell" && rigById.has(args[0]) && settingByName.has(args[1])) {
      selectCell(rigById.get(args[0]), settingByName.get(args[1]), true);
    } else if (parts[0] === "pos" && caseById.has(args[0])) {
      const ci = caseById.get(args[0]);
      const ti = D.cases[ci].turns.findIndex((t) => String(t.turn) === args[1]);
      const ln = ti >= 0 ? D.cases[ci].turns[ti].lanes[0] : null;
      if (ln) openMultiverse(ci, ti, parseInt(args[2], 10), ln[0], ln[1]);
    }
  }
  window.addEventListener("hashchange", follow);

  // ---------------------------------------------------------------- render

  const parts = [intro(), axes(), heatmap()];
  marks.top_ms = performance.now();
  parts.push(cases());
  marks.cases_ms = performance.now();
  parts.push(rigs());
  add(app, parts);
  document.body.appendChild(mv);
  marks.built_ms = performance.now();
  follow();
  requestAnimationFrame(() => setTimeout(() => {
    const at = performance.now();
    window.__hcTiming = Object.assign(marks, { rendered_ms: at });
    document.getElementById("status").textContent = "rendered in " + Math.round(at) + " ms";
    document.body.dataset.rendered = "1";
  }, 0));
})();
