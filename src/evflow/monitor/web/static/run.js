// The run page: devices, graph, progress and rates, updated from the "run" SSE stream.
"use strict";
// what the page has shown, per device: the states in the order seen and the pids
window.evRun = { updates: 0, last: null, states: {}, pids: {} };

function remember(d) {
  const states = (window.evRun.states[d.id] = window.evRun.states[d.id] || []);
  if (states[states.length - 1] !== d.state) states.push(d.state);
  const pids = (window.evRun.pids[d.id] = window.evRun.pids[d.id] || []);
  // pid 0: a device known from its STATE report before its first metrics (no pid yet)
  if (d.pid && pids[pids.length - 1] !== d.pid) pids.push(d.pid);
}

// a restart stays marked this long (s) after the collector saw the new process
const RECENT_S = 15;

function deviceRow(d) {
  const fill = d.queue_fill === null ? "-" : "";
  const tr = ev.el("tr", { "data-device": d.id, class: d.stale || d.ended ? "stale" : "" },
    ev.el("td", {}, d.id), ev.el("td", { class: "host" }, d.host), ev.el("td", { class: "role" }, d.role),
    ev.el("td", {}, ev.el("span", { class: "state state-" + d.state, "data-state": d.state }, d.state),
      ...(d.restarted_ago_s !== null && d.restarted_ago_s < RECENT_S
        ? [" ", ev.el("span", { class: "state state-RESTARTED", title: d.restarted_ago_s + " s ago" }, "RESTARTED")] : [])),
    ev.el("td", {}, ev.fmt(d.msg_in_hz)), ev.el("td", {}, ev.fmt(d.msg_out_hz)),
    ev.el("td", {}, ev.fmt(d.events_in_hz)), ev.el("td", { class: "events" }, ev.fmt(d.events_in, 0)),
    ev.el("td", {}, fill || ev.el("div", { class: "bar", title: (100 * d.queue_fill).toFixed(0) + "%" },
      ev.el("div", { style: "width:" + Math.min(100, 100 * d.queue_fill) + "%" }))),
    ev.el("td", { class: "restarts" }, d.restarts), ev.el("td", {}, ev.fmt(d.rss_mb)), ev.el("td", {}, ev.fmt(d.cpu_percent)));
  return tr;
}

function drawGraph(devices, edges) {
  const svg = document.getElementById("graph");
  const ns = "http://www.w3.org/2000/svg";
  svg.replaceChildren();
  const cols = {};
  for (const d of devices) (cols[d.role] = cols[d.role] || []).push(d);
  const order = ["input", "worker", "output"];
  const roles = Object.keys(cols).sort((a, b) => (order.indexOf(a) + 1 || 9) - (order.indexOf(b) + 1 || 9));
  const W = 420, pos = {};
  const H = Math.max(260, 28 * Math.max(...roles.map((r) => cols[r].length), 1) + 20);
  svg.setAttribute("height", H);
  roles.forEach((r, i) => cols[r].forEach((d, j) => {
    pos[d.id] = [(W / (roles.length + 1)) * (i + 1), (H / (cols[r].length + 1)) * (j + 1)];
  }));
  for (const [a, b] of edges) {
    if (!pos[a] || !pos[b]) continue;
    const l = document.createElementNS(ns, "line");
    l.setAttribute("x1", pos[a][0]); l.setAttribute("y1", pos[a][1]);
    l.setAttribute("x2", pos[b][0]); l.setAttribute("y2", pos[b][1]);
    l.setAttribute("stroke", "#9ca3af"); svg.append(l);
  }
  for (const d of devices) {
    const [x, y] = pos[d.id];
    const g = document.createElementNS(ns, "g");
    const c = document.createElementNS(ns, "circle");
    c.setAttribute("cx", x); c.setAttribute("cy", y); c.setAttribute("r", 9);
    c.setAttribute("class", "state-" + d.state);
    c.style.fill = { RUNNING: "#16a34a", ERROR: "#dc2626", EXITING: "#6b7280" }[d.state] || "#d97706";
    const t = document.createElementNS(ns, "text");
    t.setAttribute("x", x + 12); t.setAttribute("y", y + 4); t.setAttribute("font-size", "11");
    t.textContent = d.id;
    g.append(c, t); svg.append(g);
  }
}

function showProgress(p, run) {
  const box = document.getElementById("progress");
  if (!p) { box.hidden = true; return; }
  box.hidden = false;
  const frac = p.total ? Math.min(1, p.done / p.total) : 0;
  box.querySelector(".bar > div").style.width = (100 * frac).toFixed(1) + "%";
  const eta = p.eta_s === null ? "" : ", ETA " + p.eta_s.toFixed(0) + " s";
  document.getElementById("progress-text").textContent =
    ev.fmt(p.done, 0) + (p.total ? " / " + ev.fmt(p.total, 0) : "") + " events, " + ev.fmt(p.rate_hz) + " events/s" + eta +
    (run && run.workers_restarted ? ", workers restarted " + run.workers_restarted : "");
}

function update(data) {
  window.evRun.updates += 1;
  window.evRun.last = data;
  data.devices.forEach(remember);
  if (window.evRun.onUpdate) window.evRun.onUpdate(data); // a hook for measurements
  document.getElementById("title").textContent = data.title;
  document.getElementById("conn").textContent = "live, " + new Date(data.time * 1000).toLocaleTimeString();
  document.querySelector("#devices tbody").replaceChildren(...data.devices.map(deviceRow));
  drawGraph(data.devices, data.edges);
  showProgress(data.progress, data.run);
  const t = data.rate.t.map((s) => new Date(s * 1000));
  Plotly.react("rateplot", [{ x: t, y: data.rate.events_hz, mode: "lines", name: "events/s" }],
    { title: { text: "workers' event rate (events/s)", font: { size: 13 } }, margin: { t: 30, l: 50, r: 10, b: 30 } },
    { displayModeBar: false });
  if (data.modules && data.modules.t.length > 0) plotModules(data.modules);
}

// per-module busy time, s per s summed over the workers (1 = one core): the collector
// computes it from each worker's own clock (collector.py), the page only plots it
function plotModules(m) {
  const traces = Object.entries(m.s).map(([name, busy]) => ({
    x: m.t.map((s) => new Date(s * 1000)), y: busy, mode: "lines", name: name,
  }));
  Plotly.react("moduleplot", traces,
    { title: { text: "time in each module (s per s, all workers)", font: { size: 13 } },
      margin: { t: 30, l: 50, r: 10, b: 30 }, showlegend: true }, { displayModeBar: false });
}

async function history() {
  try {
    const h = await ev.json("/api/history?key=events_in_hz&minutes=10&device=output");
    Plotly.react("histplot", [{ x: h.t.map((s) => new Date(s * 1000)), y: h.v, mode: "lines", name: "output" }],
      { title: { text: "output events/s, last 10 minutes", font: { size: 13 } }, margin: { t: 30, l: 50, r: 10, b: 30 } },
      { displayModeBar: false });
    document.getElementById("histsource").textContent = "from " + h.source;
  } catch (e) { document.getElementById("histsource").textContent = String(e); }
}

const source = ev.stream("run", update);
source.onerror = () => { document.getElementById("conn").textContent = "reconnecting..."; };
history();
setInterval(history, 10000);
