// FLAYER Edge dashboard: renders the snapshots the server pushes (Server-Sent Events) into the page.
// No library, nothing fetched from elsewhere: the charts are hand-written SVG.
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const SVG = "http://www.w3.org/2000/svg";
  const view = { sort: "id", dir: 1, filter: "", state: "", snap: null };

  function el(tag, attrs, text) {
    const e = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  const fmt = (x, d) => (x === null || x === undefined ? "-" : Number(x).toFixed(d));
  // the devices' own privacy ledgers (coordinator.device_privacy), private runs only
  const epsFmt = (x) => (x === "inf" ? "infinite" : fmt(x, 3));  // "inf": a device booked a round without countable noise
  const devicePrivacy = (dp) => !dp ? "" : ` · devices' own epsilon ` +
    (dp.min === null ? "not reported" : `min ${epsFmt(dp.min)}, median ${epsFmt(dp.median)}, max ${epsFmt(dp.max)} over ${dp.with_epsilon}` +
      (dp.infinite ? ` (${dp.infinite} infinite)` : "")) +
    `, ${dp.at_budget} of ${dp.devices} at their budget`;
  const ago = (s) => (s === null || s === undefined ? "never" : s < 60 ? `${s.toFixed(0)} s ago` : `${(s / 60).toFixed(1)} min ago`);

  // ---- charts --------------------------------------------------------------------------------------
  const W = 480, H = 220, L = 44, R = 10, T = 10, B = 28;
  function axes(svg, xs, ymax, yfmt) {
    svg.replaceChildren();
    const n = Math.max(xs.length, 1);
    for (let i = 0; i <= 4; i++) {
      const y = T + (H - T - B) * (1 - i / 4);
      svg.append(el("svg:line", { x1: L, x2: W - R, y1: y, y2: y, class: "grid" }));
      svg.append(el("svg:text", { x: L - 4, y: y + 3, "text-anchor": "end" }, yfmt(ymax * i / 4)));
    }
    svg.append(el("svg:line", { x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis" }));
    const step = Math.max(1, Math.ceil(n / 12));
    xs.forEach((r, i) => {
      if (i % step === 0 || i === n - 1)
        svg.append(el("svg:text", { x: xpos(i, n), y: H - B + 14, "text-anchor": "middle" }, String(r)));
    });
    svg.append(el("svg:text", { x: (L + W - R) / 2, y: H - 2, "text-anchor": "middle" }, "round"));
  }
  const xpos = (i, n) => L + (W - L - R) * (n === 1 ? 0.5 : (i + 0.5) / n);
  const ypos = (v, ymax) => T + (H - T - B) * (1 - v / ymax);

  function accChart(rounds) {
    const svg = $("acc-chart");
    const pts = rounds.filter((r) => r.acc !== null);
    axes(svg, pts.map((r) => r.round), 1, (v) => v.toFixed(2));
    svg.dataset.rounds = pts.map((r) => r.round).join(",");
    if (!pts.length) return;
    const d = pts.map((r, i) => `${i ? "L" : "M"}${xpos(i, pts.length).toFixed(1)},${ypos(r.acc, 1).toFixed(1)}`).join("");
    svg.append(el("svg:path", { d: d, class: "line" }));
    pts.forEach((r, i) => {
      const c = el("svg:circle", { cx: xpos(i, pts.length), cy: ypos(r.acc, 1), r: 3, class: "pt", "data-round": r.round,
                                   "data-acc": r.acc });
      c.append(el("svg:title", {}, `round ${r.round}: ${(r.acc * 100).toFixed(2)}%`));
      svg.append(c);
    });
  }

  function bytesChart(rounds) {
    const svg = $("bytes-chart");
    const mb = (b) => b / 1e6;
    const ymax = Math.max(1e-6, ...rounds.map((r) => Math.max(mb(r.bytes_up), mb(r.bytes_down)))) * 1.1;
    axes(svg, rounds.map((r) => r.round), ymax, (v) => v.toPrecision(2));
    svg.dataset.rounds = rounds.map((r) => r.round).join(",");
    const n = Math.max(rounds.length, 1), bw = Math.min(18, (W - L - R) / n / 2.5);
    rounds.forEach((r, i) => {
      [["down", r.bytes_down, -bw], ["up", r.bytes_up, 0]].forEach(([dir, b, off]) => {
        const y = ypos(mb(b), ymax);
        const rect = el("svg:rect", { x: xpos(i, n) + off, y: y, width: bw, height: Math.max(0, H - B - y), class: dir,
                                      "data-round": r.round, "data-dir": dir, "data-bytes": b });
        rect.append(el("svg:title", {}, `round ${r.round} ${dir}: ${mb(b).toFixed(3)} MB`));
        svg.append(rect);
      });
    });
  }

  // ---- device table ---------------------------------------------------------------------------------
  function deviceTable(rows) {
    const states = [...new Set(rows.map((r) => r.state))].sort();
    const sel = $("state-filter");
    const have = [...sel.options].map((o) => o.value);
    states.filter((s) => !have.includes(s)).forEach((s) => sel.append(el("option", { value: s }, s)));
    const f = view.filter.toLowerCase();
    const shown = rows.filter((r) => (!view.state || r.state === view.state) &&
      (!f || [r.id, r.state, r.last_result].some((v) => String(v || "").toLowerCase().includes(f))));
    const key = view.sort;
    shown.sort((a, b) => {
      const x = a[key], y = b[key];
      if (x === y) return a.id < b.id ? -1 : 1;
      if (x === null || x === undefined) return 1;
      if (y === null || y === undefined) return -1;
      return (x < y ? -1 : 1) * view.dir;
    });
    const body = $("devices").tBodies[0];
    body.replaceChildren(...shown.map((r) => {
      const tr = el("tr", { "data-device": r.id, "data-state": r.state, "data-result": r.last_result || "" });
      tr.append(el("td", { class: "id" }, r.id),
                el("td", { class: "state", title: r.invalid || "" }, r.invalid ? `${r.state} (invalid status)` : r.state),
                el("td", {}, ago(r.last_seen_s)), el("td", {}, fmt(r.link_kbps, 0)),
                el("td", { class: "accepted" }, String(r.accepted)), el("td", { class: "result" }, r.last_result || "-"),
                el("td", {}, r.last_result_round ? String(r.last_result_round) : "-"), el("td", {}, fmt(r.acc, 4)));
      return tr;
    }));
    $("shown").textContent = `${shown.length} of ${rows.length} shown`;
    document.querySelectorAll("#devices th").forEach((th) => {
      th.classList.toggle("asc", th.dataset.key === key && view.dir === 1);
      th.classList.toggle("desc", th.dataset.key === key && view.dir === -1);
    });
  }

  // ---- the rest -------------------------------------------------------------------------------------
  function render(s) {
    view.snap = s;
    const p = s.progress, src = s.source || {}, last = s.last_round;
    $("federation").textContent = src.federation || (s.run && s.run.federation) || (s.run && s.run.source) || "";
    const live = src.broker ? (src.connected ? "live: " + src.broker : "broker " + src.broker + " not reachable") : "finished run";
    $("connection").textContent = src.broker_error || src.metrics_error || live;
    $("connection").className = "pill " + (src.broker_error || src.metrics_error ? "bad" : src.connected ? "ok" : "");
    // the round open now (the plan), else the last one closed; after the final plan, the federation's last round
    let current = last ? last.round : null;
    if (p.round !== null && p.phase === "train") current = Math.max(current || 0, p.round);
    if (p.phase === "final") current = Math.max(current || 0, p.rounds || p.round - 1);
    $("round").textContent = current === null ? "-" : String(current);
    $("rounds-total").textContent = p.rounds || (s.run && s.run.rounds) || "-";
    $("phase").textContent = s.end ? (s.end.finished ? "finished" : "stopped") : p.phase ? "phase " + p.phase : "waiting for a plan";
    $("progress").textContent = p.selected ? `${p.done}/${p.selected} done` : "-";
    $("progress-bar").style.width = p.selected ? `${(100 * p.done / p.selected).toFixed(0)}%` : "0";
    $("deadline").textContent = Object.entries(p.by_state || {}).map(([k, v]) => `${v} ${k}`).join(", ") +
      (p.deadline_in_s !== null && p.deadline_in_s !== undefined ? ` · deadline ${p.deadline_in_s > 0 ? "in " + p.deadline_in_s.toFixed(0) + " s" : "passed"}` : "");
    $("closed").textContent = String(s.rounds.length);
    $("last-round").textContent = (last ? `round ${last.round}: ${last.reported}/${last.selected} reported, acc ${fmt(last.acc, 4)}, ${last.closed}` +
      (last.epsilon !== null && last.epsilon !== undefined ? ` · epsilon ${typeof last.epsilon === "string" ? last.epsilon : last.epsilon.toFixed(3)} at delta ${last.delta.toPrecision(3)} against readers of the models and plans, ${last.epsilon_coordinator === null || last.epsilon_coordinator === undefined || typeof last.epsilon_coordinator === "string" ? (last.epsilon_coordinator || "inf") : last.epsilon_coordinator.toFixed(3)} against the coordinator` : "") : "-") + devicePrivacy(s.device_privacy);
    $("device-count").textContent = String(s.devices.length);
    $("state-counts").textContent = Object.entries(s.states).map(([k, v]) => `${v} ${k}`).join(", ") || "-";
    $("accepted-total").textContent = String(s.updates_accepted);
    const refused = s.rounds.reduce((n, r) => n + Object.values(r.refused).reduce((a, b) => a + b, 0), 0);
    $("refused-total").textContent = `${refused} refused`;
    accChart(s.rounds);
    bytesChart(s.rounds);
    deviceTable(s.devices);
    const ol = $("refusals");
    ol.replaceChildren(...(s.refusals.length ? s.refusals.slice(0, 20).map((r) => {
      const li = el("li", { "data-reason": r.reason });
      li.append(el("span", { class: "reason" }, r.reason), document.createTextNode(` round ${r.round}` +
        (r.device ? `, ${r.device}` : "") + `: ${r.detail}`));
      return li;
    }) : [el("li", { class: "empty" }, "none")]));
    $("source").textContent = [src.broker ? "broker " + src.broker : null, src.metrics ? "metrics " + src.metrics : null].filter(Boolean).join(" · ");
    $("updated").textContent = new Date(s.time * 1000).toLocaleTimeString();
    document.body.dataset.version = String(s.version);
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  }

  document.querySelectorAll("#devices th").forEach((th) => th.addEventListener("click", () => {
    view.dir = view.sort === th.dataset.key ? -view.dir : 1;
    view.sort = th.dataset.key;
    if (view.snap) deviceTable(view.snap.devices);
  }));
  $("filter").addEventListener("input", (e) => { view.filter = e.target.value; if (view.snap) deviceTable(view.snap.devices); });
  $("state-filter").addEventListener("change", (e) => { view.state = e.target.value; if (view.snap) deviceTable(view.snap.devices); });

  const events = new EventSource("events");
  events.onmessage = (e) => render(JSON.parse(e.data));
  events.onerror = () => { $("connection").textContent = "dashboard server not reachable; retrying"; $("connection").className = "pill bad"; };
})();
