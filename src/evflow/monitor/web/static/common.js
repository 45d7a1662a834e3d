// evflow dashboard: helpers shared by the pages (no framework, no network but our server)
"use strict";
const ev = {
  el(tag, attrs = {}, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (k === "class") e.className = v; else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v);
    }
    for (const k of kids) e.append(k instanceof Node ? k : document.createTextNode(String(k)));
    return e;
  },
  fmt(x, digits = 1) {
    if (x === null || x === undefined) return "-";
    if (Math.abs(x) >= 1e6) return (x / 1e6).toFixed(digits) + "M";
    if (Math.abs(x) >= 1e4) return (x / 1e3).toFixed(digits) + "k";
    return Number.isInteger(x) ? String(x) : x.toFixed(digits);
  },
  // one EventSource per page; the browser reconnects by itself (retry: 2000)
  stream(topic, onData) {
    const src = new EventSource("/api/stream/" + topic);
    src.addEventListener(topic, (m) => onData(JSON.parse(m.data)));
    return src;
  },
  async json(url) {
    const r = await fetch(url);
    const data = await r.json();
    if (!r.ok) throw new Error(data.error || r.statusText);
    return data;
  },
};
