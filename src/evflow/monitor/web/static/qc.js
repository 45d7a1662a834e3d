// The QC viewer: object tree, plot (1D bars, 2D heat map), quality, reference + ratio,
// history slider over versions, layouts (saved/imported as JSON). Live from the "qc" stream.
"use strict";
const qc = { objects: [], byPath: {}, selected: null, versions: [], atLatest: true, updates: 0, shown: null,
  layout: JSON.parse(localStorage.getItem("evflow-layout") || "[]"), layoutIds: {} };
window.evQc = qc;

function centres(edges) { return edges.slice(0, -1).map((e, i) => (e + edges[i + 1]) / 2); }
function integral(v) { return v.flat().reduce((a, b) => a + (b || 0), 0); }

function traces(obj, ref) {
  if (obj.type !== "histogram") {
    const v = obj.type === "array" ? obj.values.flat() : [obj.value];
    return { data: [{ y: v, type: "bar", name: "value" }], layout: {} };
  }
  const ax = obj.axes;
  if (ax.length === 2) {
    const z = ax[1].edges ? obj.values[0].map((_, j) => obj.values.map((row) => row[j])) : obj.values;
    return { data: [{ z: z, x: ax[0].edges ? centres(ax[0].edges) : ax[0].categories,
      y: ax[1].edges ? centres(ax[1].edges) : ax[1].categories, type: "heatmap", colorscale: "Viridis" }],
      layout: { xaxis: { title: ax[0].label || ax[0].name }, yaxis: { title: ax[1].label || ax[1].name } } };
  }
  const x = ax[0].edges ? centres(ax[0].edges) : ax[0].categories;
  const data = [{ x: x, y: obj.values, type: "bar", name: "object", marker: { color: "#3b82f6" } }];
  const layout = { xaxis: { title: ax[0].label || ax[0].name }, bargap: 0 };
  if (ref && ref.type === "histogram" && ref.values.length === obj.values.length) {
    const scale = integral(ref.values) ? integral(obj.values) / integral(ref.values) : 1;
    const rv = ref.values.map((v) => v * scale);
    data.push({ x: x, y: rv, type: "scatter", mode: "lines", line: { shape: "hvh", color: "#dc2626" }, name: "reference" });
    data.push({ x: x, y: obj.values.map((v, i) => (rv[i] ? v / rv[i] : null)), type: "scatter", mode: "markers",
      name: "ratio", yaxis: "y2", marker: { color: "#111", size: 4 } });
    layout.yaxis = { domain: [0.32, 1] };
    layout.yaxis2 = { domain: [0, 0.25], title: "ratio" };
  }
  return { data, layout };
}

function plot(div, obj, ref, title) {
  const t = traces(obj, ref);
  Plotly.react(div, t.data, Object.assign({ title: { text: title, font: { size: 13 } },
    margin: { t: 30, l: 50, r: 10, b: 40 }, showlegend: !!ref }, t.layout), { displayModeBar: false });
}

function renderTree() {
  const root = {};
  for (const o of qc.objects) {
    let node = root;
    const parts = o.path.split("/");
    parts.slice(0, -1).forEach((p) => { node = node[p] = node[p] || {}; });
    node[parts[parts.length - 1]] = o;
  }
  const build = (node) => ev.el("ul", {}, ...Object.keys(node).sort().map((k) => {
    const v = node[k];
    if (v.path) {
      return ev.el("li", { class: "leaf" + (v.path === qc.selected ? " selected" : ""), "data-path": v.path,
        onclick: () => select(v.path) }, ev.el("span", { class: "qdot q-" + (v.quality || "none") }), k);
    }
    return ev.el("li", {}, k, build(v));
  }));
  const tree = document.getElementById("tree");
  tree.replaceChildren(qc.objects.length ? build(root) : ev.el("div", { class: "muted" }, "no objects yet"));
  const sel = document.getElementById("reference");
  const cur = sel.value;
  sel.replaceChildren(ev.el("option", { value: "" }, "none"), ...qc.objects.map((o) => ev.el("option", { value: o.path }, o.path)));
  sel.value = cur;
}

async function select(path) {
  qc.selected = path;
  qc.atLatest = true;
  renderTree();
  await loadVersions();
  await show();
}

async function loadVersions() {
  const b = await ev.json("/api/qc/browse/" + qc.selected);
  qc.versions = b.versions.slice().reverse(); // oldest first: the slider's right end is the newest
  const s = document.getElementById("history");
  s.max = Math.max(0, qc.versions.length - 1);
  if (qc.atLatest) s.value = s.max;
}

async function show() {
  if (!qc.selected || !qc.versions.length) return;
  const s = document.getElementById("history");
  const v = qc.versions[Number(s.value)];
  const got = await ev.json("/api/qc/get/" + qc.selected + "?version=" + v.id);
  const refPath = document.getElementById("reference").value;
  const ref = refPath ? (await ev.json("/api/qc/latest/" + refPath)).object : null;
  const info = got.version;
  plot("qcplot", got.object, ref, qc.selected);
  const q = document.getElementById("quality");
  q.textContent = info.quality || "not checked";
  q.className = "q-" + (info.quality || "none");
  q.dataset.quality = info.quality || "none";
  document.getElementById("path").textContent = qc.selected;
  document.getElementById("version").textContent = "version " + info.id + ", run " + info.run + ", cycle " + info.cycle;
  document.getElementById("cycle").textContent = (Number(s.value) + 1) + " / " + qc.versions.length;
  document.getElementById("flags").replaceChildren(...info.flags.map((f) => ev.el("li", {}, f.name + ": " + f.reason)));
  qc.shown = { path: qc.selected, version: info.id, quality: info.quality, values: got.object.values };
}

function saveLayout() {
  localStorage.setItem("evflow-layout", JSON.stringify(qc.layout));
  renderLayout(true);
}

async function renderLayout(force) {
  const grid = document.getElementById("layout");
  if (force) { grid.replaceChildren(); qc.layoutIds = {}; }
  for (const path of qc.layout) {
    const o = qc.byPath[path];
    let cell = grid.querySelector('[data-path="' + CSS.escape(path) + '"]');
    if (!cell) { cell = ev.el("div", { "data-path": path, style: "height:240px" }); grid.append(cell); }
    if (!o) { cell.textContent = path + ": not in the repository"; continue; }
    if (qc.layoutIds[path] === o.id) continue;
    qc.layoutIds[path] = o.id;
    const got = await ev.json("/api/qc/latest/" + path);
    plot(cell, got.object, null, path + " (" + (o.quality || "not checked") + ")");
  }
}

document.getElementById("history").addEventListener("input", (e) => {
  qc.atLatest = Number(e.target.value) === qc.versions.length - 1;
  show();
});
document.getElementById("reference").addEventListener("change", show);
document.getElementById("add").addEventListener("click", () => {
  if (qc.selected && !qc.layout.includes(qc.selected)) { qc.layout.push(qc.selected); saveLayout(); }
});
document.getElementById("clear").addEventListener("click", () => { qc.layout = []; saveLayout(); });
document.getElementById("save").addEventListener("click", () => {
  const blob = new Blob([JSON.stringify({ evflow_layout: 1, objects: qc.layout }, null, 1)], { type: "application/json" });
  const a = ev.el("a", { href: URL.createObjectURL(blob), download: "evflow-layout.json" });
  a.click();
});
document.getElementById("import").addEventListener("change", async (e) => {
  const file = e.target.files[0];
  if (!file) return;
  try {
    const data = JSON.parse(await file.text());
    if (!Array.isArray(data.objects) || !data.objects.every((p) => typeof p === "string")) throw new Error("expected {\"objects\": [paths]}");
    qc.layout = data.objects;
    saveLayout();
  } catch (err) { alert("not an evflow layout: " + err.message); }
});

ev.stream("qc", async (data) => {
  qc.updates += 1;
  document.getElementById("repo").textContent = data.repository || "no repository";
  const before = qc.selected && qc.byPath[qc.selected] ? qc.byPath[qc.selected].id : null;
  qc.objects = data.objects;
  qc.byPath = Object.fromEntries(data.objects.map((o) => [o.path, o]));
  renderTree();
  if (!qc.selected) {
    const wanted = new URLSearchParams(location.search).get("path");
    if (wanted && qc.byPath[wanted]) await select(wanted);
  } else if (qc.byPath[qc.selected] && qc.byPath[qc.selected].id !== before) {
    await loadVersions();
    if (qc.atLatest) await show();
  }
  renderLayout(false);
});
renderLayout(true);
