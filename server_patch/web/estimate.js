"use strict";
// The estimate page: POST /api/pebbling/estimate for the model picked, drawn as budget against predicted
// speed (adaptive's budgets, each strategy marked, the smallest budget marked) and budget against the bytes
// a token streams, with every strategy's row below. Estimates and predictions are labelled as such.

(() => {
const { $, el, svg, bytes, rate, byteAxis, frame, line, size, clear } = draw;

let shown = null;  // the model and options of the estimate on the page

function request() {
  const options = {};
  const limit = size($("estimate-limit").value);
  if (limit !== undefined) options.pebbling_memory_limit = limit;
  const ctx = parseInt($("estimate-ctx").value, 10);
  if (ctx) options.num_ctx = ctx;
  return { model: $("model").value, options };
}

async function run() {
  const body = request();
  if (!body.model) return;
  shown = JSON.stringify(body);
  $("estimate-state").textContent = `measuring ${body.model}…`;
  $("estimate-run").disabled = true;
  try {
    const r = await fetch("/api/pebbling/estimate", { method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body) });
    const found = await r.json();
    if (!r.ok) throw new Error(found.error || `HTTP ${r.status}`);
    drawSpeed(found);
    drawBytes(found);
    drawTable(found);
    drawNotes(found);
    $("estimate-state").textContent = `${found.model}: ${found.n_layers} layers, backend ${found.backend}`;
  } catch (err) {
    shown = null;
    $("estimate-state").textContent = String(err.message || err);
  } finally {
    $("estimate-run").disabled = false;
  }
}

const perSecond = s => (s ? 1 / s : null);

// The budgets axis: from below the smallest budget to past every layer resident (and the limit).
function budgetRange(found) {
  const points = found.budgets;
  const lo = points[0].budget_bytes;
  const hi = Math.max(points[points.length - 1].budget_bytes, found.memory_limit_bytes || 0);
  const pad = (hi - lo) * 0.08 || lo * 0.05;
  return [Math.max(0, lo - pad), hi + pad];
}

// Adaptive keeps k layers from the budget that holds k up to the one that holds k + 1: a step.
function steps(points, value, sx, sy, x1) {
  const out = [];
  points.forEach((p, i) => {
    const next = i + 1 < points.length ? points[i + 1].budget_bytes : x1;
    out.push([sx(p.budget_bytes), sy(value(p))], [sx(next), sy(value(p))]);
  });
  return out;
}

function markBudgets(root, found, plot, box) {
  const smallest = found.smallest_footprint_bytes;
  const x = plot.sx(smallest);
  svg(root, "rect", { x: box.x, y: box.y, width: Math.max(0, x - box.x), height: box.h, class: "below" });
  svg(root, "line", { x1: x, x2: x, y1: box.y, y2: box.y + box.h, class: "marker smallest" });
  svg(root, "text", { x: x + 4, y: box.y + 12, class: "label smallest" }, `smallest budget ${bytes(smallest)}`);
  if (found.memory_limit_bytes) {
    const lx = plot.sx(found.memory_limit_bytes);
    svg(root, "line", { x1: lx, x2: lx, y1: box.y, y2: box.y + box.h, class: "marker limit" });
    svg(root, "text", { x: lx - 4, y: box.y + 12, class: "label limit", "text-anchor": "end" },
      `limit ${bytes(found.memory_limit_bytes)}`);
  }
}

// Strategies at the same point share one label.
function strategyPoints(found, value) {
  const at = new Map();
  for (const [name, s] of Object.entries(found.strategies)) {
    if (name === "adaptive") continue;  // adaptive is the curve
    const key = `${s.estimated_peak_bytes}`;
    if (!at.has(key)) at.set(key, { peak: s.estimated_peak_bytes, value: value(s), names: [] });
    at.get(key).names.push(name);
  }
  return [...at.values()];
}

function drawSpeed(found) {
  const root = $("estimate-chart");
  clear(root);
  const box = { x: 70, y: 46, w: 660, h: 232 };
  const [x0, x1] = budgetRange(found);
  const tps = found.budgets.map(p => perSecond(p.predicted_seconds_per_token));
  const top = Math.max(...tps.filter(v => v), 1e-9) * 1.2;
  svg(root, "text", { x: box.x, y: 16, class: "title" }, `estimate: predicted speed by memory budget, ${found.model}`);
  const plot = frame(root, box, { x0, x1, y0: 0, y1: top, xAxis: byteAxis(x1),
    yAxis: { format: t => rate(t) }, yLabel: "tok/s (predicted)", xLabel: "memory budget (estimated peak)" });
  markBudgets(root, found, plot, box);
  line(root, steps(found.budgets, p => perSecond(p.predicted_seconds_per_token), plot.sx, plot.sy, x1), "series curve");
  for (const p of found.budgets) {
    const speed = perSecond(p.predicted_seconds_per_token);
    const dot = svg(root, "circle", { cx: plot.sx(p.budget_bytes), cy: plot.sy(speed), r: 2.5, class: "point" });
    svg(dot, "title", {}, `${p.resident_layers} of ${found.n_layers} resident: budget ${bytes(p.budget_bytes)}, `
      + `${rate(speed)} tok/s (predicted)`);
  }
  if (!found.restores) {
    svg(root, "text", { x: box.x + box.w - 6, y: box.y + box.h - 8, class: "label", "text-anchor": "end" },
      `backend ${found.backend}: nothing is copied for a streamed layer, so the budget does not change the speed`);
  }
  strategyPoints(found, s => perSecond(s.predicted_seconds_per_token)).forEach((p, i) => {
    const cx = plot.sx(p.peak), cy = plot.sy(p.value);
    svg(root, "circle", { cx, cy, r: 5, class: "strategy" });
    svg(root, "text", { x: cx + 7, y: cy + 16 + 12 * (i % 2), class: "label" }, p.names.join(", "));
  });
}

function drawBytes(found) {
  const root = $("estimate-bytes");
  clear(root);
  const box = { x: 70, y: 42, w: 660, h: 140 };
  const [x0, x1] = budgetRange(found);
  const streamed = p => p.streamed_bytes_per_token_estimate;
  const top = Math.max(...found.budgets.map(streamed), 1) * 1.15;
  svg(root, "text", { x: box.x, y: 14, class: "title" }, "estimate: bytes a token streams by memory budget");
  const plot = frame(root, box, { x0, x1, y0: 0, y1: top, xAxis: byteAxis(x1), yAxis: byteAxis(top),
    yLabel: "streamed per token (estimate)", xLabel: "memory budget (estimated peak)" });
  markBudgets(root, found, plot, box);
  line(root, steps(found.budgets, streamed, plot.sx, plot.sy, x1), "series bytes");
  if (!found.restores) {
    svg(root, "text", { x: box.x + box.w - 6, y: box.y + box.h - 8, class: "label", "text-anchor": "end" },
      `backend ${found.backend}: streamed layers are computed from host memory in place, `
      + "so none of these bytes is copied");
  }
}

function drawTable(found) {
  const body = $("estimate-table").querySelector("tbody");
  clear(body);
  for (const [name, s] of Object.entries(found.strategies)) {
    const fits = s.fits === null ? "no limit" : s.fits ? "yes" : "no";
    body.append(el("tr", {}, ...[s.plan, `${s.resident_layers}/${s.n_layers}`, bytes(s.estimated_peak_bytes),
      `${s.reduction_pct}%`, bytes(s.streamed_bytes_per_token_estimate),
      rate(perSecond(s.predicted_seconds_per_token)), fits].map(v => el("td", {}, v))));
  }
}

function drawNotes(found) {
  const m = found.measured;
  $("estimate-notes").textContent = `Measured in this run (median of ${m.repeats}): restore `
    + `${(m.restore_bytes_per_s / 1e9).toFixed(2)} GB/s (${m.restore_path}), one store call `
    + `${(m.store_call_seconds * 1e6).toFixed(1)} µs, one layer's decode ${(m.layer_decode_seconds * 1e3).toFixed(3)} ms `
    + `at context position ${found.context_pos} of num_ctx ${found.num_ctx}. `
    + `The smallest budget is for ${found.smallest_footprint_for}.`;
}

function maybeRun() {
  if (location.hash === "#estimate" && $("model").value && shown !== JSON.stringify(request())) run();
}

document.addEventListener("DOMContentLoaded", () => {
  $("estimate-run").addEventListener("click", run);
  document.addEventListener("pebbling-view", maybeRun);
  document.addEventListener("pebbling-model", maybeRun);
});
})();
