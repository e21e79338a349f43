// edgetune fleet dashboard: telemetry plots (uPlot) and the live command log. Everything from the server is
// put into the page with textContent, never as HTML.
"use strict";

const enc = encodeURIComponent;
const FAST_MS = 1000, SLOW_MS = 5000, TELEMETRY_MS = 10000;

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

async function getJSON(url) {
  const r = await fetch(url, {credentials: "same-origin", headers: {"Accept": "application/json"}});
  if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
  return r.json();
}

const pad = n => String(n).padStart(2, "0");

function when(ts) {  // as the server renders it (fleet/web/filters.py when): YYYY-MM-DD HH:MM:SS UTC
  const d = new Date(ts * 1000);
  if (!ts || isNaN(d)) return "-";
  return `${d.getUTCFullYear()}-${pad(d.getUTCMonth() + 1)}-${pad(d.getUTCDate())} ` +
         `${pad(d.getUTCHours())}:${pad(d.getUTCMinutes())}:${pad(d.getUTCSeconds())} UTC`;
}

function ago(ts) {
  if (!ts) return "never";
  const s = Math.max(0, Date.now() / 1000 - ts);
  for (const [u, n] of [["d", 86400], ["h", 3600], ["m", 60]]) if (s >= n) return `${Math.round(s / n)}${u} ago`;
  return `${Math.round(s)}s ago`;
}

// ---- device list: select all --------------------------------------------------------------------------------
function setupSelectAll() {
  const all = document.getElementById("select-all");
  if (!all) return;
  all.addEventListener("change", () => {
    for (const box of document.querySelectorAll("input.pick")) box.checked = all.checked;
  });
}

// ---- device page: telemetry plots ---------------------------------------------------------------------------
const SCALE = {rss: 1 / (1 << 20)};
window.etPlots = {};

function plotData(rows, key) {
  const xs = [], ys = [];
  for (const r of rows) {
    const v = r[key];
    if (v === null || v === undefined) continue;
    xs.push(r.ts || r.received_at);
    ys.push(v * (SCALE[key] || 1));
  }
  return [xs, ys];
}

async function refreshTelemetry(box) {
  const rows = await getJSON(`/api/v1/devices/${enc(box.dataset.device)}/telemetry`);
  document.getElementById("telemetry-empty").hidden = rows.length > 0;
  for (const fig of box.querySelectorAll("figure.plot")) {
    const key = fig.dataset.series, data = plotData(rows, key);
    const chart = fig.querySelector(".chart");
    fig.classList.toggle("nodata", data[0].length === 0);
    if (window.etPlots[key]) {
      window.etPlots[key].setData(data);
      continue;
    }
    const opts = {
      width: Math.max(260, chart.clientWidth || 300), height: 160, legend: {show: false},
      series: [{}, {label: fig.querySelector("figcaption").textContent, stroke: "#2a6fdb", width: 1.5,
                    fill: "rgba(42,111,219,0.08)", points: {show: data[0].length < 60}}],
      axes: [{}, {size: 50}],
    };
    window.etPlots[key] = new uPlot(opts, data, chart);
  }
}

function setupTelemetry() {
  const box = document.getElementById("plots");
  if (!box || typeof uPlot === "undefined") return;
  const tick = () => refreshTelemetry(box).catch(e => console.warn(e)).finally(() => setTimeout(tick, TELEMETRY_MS));
  tick();
}

// ---- device page: live command log --------------------------------------------------------------------------
function commandRow(c) {
  const tr = el("tr", {"data-command": c.id, "class": "cmd" + (c.open ? " open" : "")});
  const by = el("td", {}, c.origin || "-");
  if (c.note) by.append(": ", el("span", {"class": "note"}, c.note));
  tr.append(el("td", {"class": "mono", title: c.id}, c.id.slice(-8)), el("td", {}, c.op || "-"), by);
  const st = el("td");
  st.append(el("span", {"class": `badge cmd-${c.status}`}, c.status));
  const pr = el("td");
  if (c.fraction !== null && c.fraction !== undefined) {
    pr.append(el("progress", {max: "1", value: String(c.fraction)}), document.createTextNode(` ${Math.round(c.fraction * 100)}%`));
  }
  tr.append(st, pr, el("td", {}, c.reason || ""), el("td", {}, when(c.requested_at)), el("td", {}, ago(c.updated_at)));
  return tr;
}

function setupCommandLog() {
  const table = document.getElementById("command-log");
  if (!table) return;
  let pending = table.dataset.pending;  // a command just sent, until the receiver has stored it
  const open = new Set();
  const tick = async () => {
    let fast = false;
    try {
      const cmds = await getJSON(`/api/v1/devices/${enc(table.dataset.device)}/commands`);
      const body = table.querySelector("tbody");
      const none = el("tr", {"class": "empty"});
      none.append(el("td", {colspan: "8"}, "no commands yet"));
      body.replaceChildren(...(cmds.length ? cmds.map(commandRow) : [none]));
      if (pending && cmds.some(c => c.id === pending)) pending = "";
      fast = Boolean(pending) || cmds.some(c => c.open);
      if (cmds.some(c => open.has(c.id) && !c.open)) document.getElementById("finished").hidden = false;
      for (const c of cmds) if (c.open) open.add(c.id); else open.delete(c.id);
    } catch (e) {
      console.warn(e);
    }
    setTimeout(tick, fast ? FAST_MS : SLOW_MS);
  };
  tick();
}

document.addEventListener("DOMContentLoaded", () => {
  setupSelectAll();
  setupTelemetry();
  setupCommandLog();
});
