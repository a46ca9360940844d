"use strict";
// The chat and its pebbles: /api/tags for the picker, /api/show for the number of layers, /api/chat streamed
// (NDJSON) with the strategy and budget as options, and the final chunk's `pebbling` report drawn: which
// layers were resident, the budget against the estimated and measured peak, bytes restored, speed.

(() => {
const { $, el, svg, bytes, rate, byteAxis, frame, line, size, clear } = draw;

const JSON_HEADERS = { "Content-Type": "application/json" };
const NOTES = {
  none: "none: every layer stays on the device. The most memory; nothing is copied.",
  sqrt: "sqrt: ⌈√L⌉ layers, evenly spaced, stay on the device; the rest stream through two working slots.",
  adaptive: "adaptive: as many layers as the budget holds stay on the device, spread out so that each copy "
    + "overlaps a resident layer's compute. Without a budget: the free device memory (on the CPU, every layer).",
  minimal: "minimal: no layer stays. Everything streams through two working slots: the smallest footprint.",
  every: "every:N: every N-th layer stays on the device; the rest stream.",
};

const state = {
  messages: [],     // the conversation so far, as /api/chat takes it
  answers: [],      // each answer's figures, for the table
  nLayers: null,    // of the model picked (from /api/show)
  memoryTop: 0,     // the most memory its answers' bars have drawn
  controller: null, // the answer streaming now, to stop it
  run: null,        // its timings: sent, chunk arrival times, rate samples, the final report
};

// --- models ----------------------------------------------------------------------------------------

async function loadModels() {
  const picker = $("model");
  try {
    const r = await fetch("/api/tags");
    const names = (await r.json()).models.map(m => m.name);
    clear(picker);
    for (const name of names) picker.append(el("option", { value: name }, name));
    if (!names.length) picker.append(el("option", { value: "" }, "no models"));
  } catch (err) {
    picker.append(el("option", { value: "" }, "models unavailable"));
  }
  await modelPicked();
}

async function modelPicked() {
  state.nLayers = null;
  state.memoryTop = 0;
  const model = $("model").value;
  if (model) {
    try {
      const r = await fetch("/api/show", { method: "POST", headers: JSON_HEADERS,
        body: JSON.stringify({ model }) });
      const info = (await r.json()).model_info || {};
      state.nLayers = info[`${info["general.architecture"]}.block_count`] || null;
    } catch (err) { /* the map appears with the first answer */ }
  }
  drawLayers(state.nLayers, null, false);
  $("pebbles-state").textContent = state.nLayers ? `${state.nLayers} layers; send a prompt to see the plan` : "";
  document.dispatchEvent(new CustomEvent("pebbling-model"));
}

// --- the request -----------------------------------------------------------------------------------

function strategy() {
  const s = $("strategy").value;
  return s === "every" ? `every:${Math.max(1, parseInt($("every-n").value, 10) || 1)}` : s;
}

function options() {
  const out = { pebbling_strategy: strategy(), num_predict: parseInt($("num-predict").value, 10) || 64 };
  const budget = size($("budget").value);
  if (budget !== undefined) out.pebbling_memory_limit = budget;
  return out;
}

function addMessage(role, text) {
  const body = el("div", { class: "text" }, text);
  const node = el("div", { class: `message ${role}` }, el("div", { class: "role" }, role), body);
  $("messages").append(node);
  node.scrollIntoView({ block: "end" });
  return { node, body };
}

async function send(event) {
  event.preventDefault();
  const prompt = $("prompt").value.trim();
  const model = $("model").value;
  if (!prompt || !model || state.controller) return;
  $("prompt").value = "";
  state.messages.push({ role: "user", content: prompt });
  addMessage("user", prompt);
  const answer = addMessage("assistant", "");
  answer.node.classList.add("streaming");
  const opts = options();
  state.controller = new AbortController();
  state.run = { sent: performance.now(), chunks: [], samples: [], report: null, final: null };
  setBusy(true);
  drawLayers(state.nLayers, null, true);
  $("pebbles-state").textContent = `planning under ${opts.pebbling_strategy}…`;
  drawLive();
  let text = "";
  try {
    const r = await fetch("/api/chat", {
      method: "POST", headers: JSON_HEADERS, signal: state.controller.signal,
      body: JSON.stringify({ model, messages: state.messages, stream: true, options: opts }),
    });
    if (!r.ok) throw new Error((await r.json().catch(() => ({}))).error || `HTTP ${r.status}`);
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let pending = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      pending += decoder.decode(value, { stream: true });
      const lines = pending.split("\n");
      pending = lines.pop();
      for (const l of lines.filter(l => l.trim())) {
        const chunk = JSON.parse(l);
        if (chunk.error) throw new Error(chunk.error);
        const piece = (chunk.message && chunk.message.content) || "";
        if (piece) {
          text += piece;
          answer.body.textContent = text;  // model text: as text, never as markup
          answer.node.dataset.chunks = String(state.run.chunks.length + 1);
          arrived(performance.now());
        }
        if (chunk.done) finished(chunk, opts);
      }
    }
    state.messages.push({ role: "assistant", content: text });
  } catch (err) {
    state.messages.pop();  // the turn that failed is not part of the conversation
    const aborted = err.name === "AbortError";
    answer.node.classList.add(aborted ? "stopped" : "error");
    answer.body.textContent = text + (aborted ? " [stopped]" : (text ? "\n" : "") + String(err.message || err));
    drawLayers(state.nLayers, null, false);
    $("pebbles-state").textContent = aborted ? "stopped before the final report" : "no report: the request failed";
  } finally {
    answer.node.classList.remove("streaming");
    state.controller = null;
    setBusy(false);
    drawLive();
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// A chunk of text arrived: the speed is the rate of the last WINDOW chunks (a chunk is a token's text).
const WINDOW = 8;
function arrived(now) {
  const run = state.run;
  run.chunks.push(now);
  const recent = run.chunks.slice(-WINDOW);
  if (recent.length >= 2 && now - recent[0] >= 2) {  // two chunks in the same instant say nothing
    run.samples.push([(now - run.sent) / 1000, (recent.length - 1) / ((now - recent[0]) / 1000)]);
  }
  scheduleLive();
}

// Chunks that reach the page together make a rate spike that says nothing: the speed axis is scaled to
// most of the samples (and the server's figure), and a sample past it is drawn at its top.
function speedTop(samples, serverRate) {
  const sorted = samples.map(s => s[1]).sort((a, b) => a - b);
  const typical = sorted.length ? sorted[Math.floor(0.8 * (sorted.length - 1))] : 0;
  return Math.max(1, typical * 1.5, (serverRate || 0) * 1.3);
}

// One memory scale for the model's answers, so that a strategy that holds less draws shorter.
function memoryTop(report) {
  const values = [report.budget_bytes, report.estimated_peak_bytes, report.measured_peak_bytes].filter(v => v);
  state.memoryTop = Math.max(state.memoryTop || 0, ...values);
  return state.memoryTop;
}

function finished(chunk, opts) {
  const report = chunk.pebbling || {};
  const run = state.run;
  run.report = report;
  run.final = chunk;
  run.ended = performance.now();
  const serverRate = chunk.eval_duration ? chunk.eval_count / (chunk.eval_duration / 1e9) : null;
  drawLayers(report.n_layers, report.resident || null, false);
  const n = report.n_layers;
  $("pebbles-state").textContent = `${report.resident_layers} of ${n} resident under ${report.strategy}`;
  drawMemory(report);
  drawStats(report, chunk, serverRate);
  state.answers.push({ strategy: report.strategy, resident: `${report.resident_layers}/${n}`,
    budget: report.budget_bytes, est: report.estimated_peak_bytes, meas: report.measured_peak_bytes,
    perToken: report.bytes_restored_per_token, rate: serverRate });
  drawHistory();
}

// --- the pebbles -----------------------------------------------------------------------------------

function drawLayers(n, resident, pending) {
  const map = $("layer-map");
  clear(map);
  map.classList.toggle("pending", pending);
  if (!n) return;
  const kept = new Set(resident || []);
  for (let i = 0; i < n; i++) {
    const known = resident !== null;
    const where = !known ? "unknown" : kept.has(i) ? "resident" : "streamed";
    const square = el("span", { class: `layer ${where}`, "data-layer": i,
      title: `layer ${i}: ${known ? where : "not planned yet"}` }, el("span", {}, i));
    map.append(square);
  }
  map.dataset.resident = resident ? String(kept.size) : "";
}

function drawMemory(report) {
  const bars = $("memory-bars");
  clear(bars);
  const rows = [
    ["budget", report.budget_bytes, "budget", report.budget_bytes === null ? "none set" : null],
    ["estimated peak", report.estimated_peak_bytes, "estimated", null],
    ["measured peak", report.measured_peak_bytes, "measured", null],
  ];
  const top = memoryTop(report);
  for (const [label, value, cls, instead] of rows) {
    const fill = el("span", { class: `fill ${cls}` });
    fill.style.width = `${value ? (100 * value / top).toFixed(1) : 0}%`;
    bars.append(el("div", { class: "bar-row" }, el("span", { class: "bar-label" }, label),
      el("span", { class: "track" }, fill), el("span", { class: "bar-value" }, instead || bytes(value))));
  }
  // how the peak was measured: by the GPU, or (host, stub) the store's byte accounting
  bars.append(el("p", { class: "note" }, `measured: ${(report.measured_peak_how || "").split(" (")[0]}; `
    + "bars share one scale across this model's answers"));
}

function drawStats(report, chunk, serverRate) {
  const stats = $("stats");
  clear(stats);
  const first = state.run.chunks[0];
  const items = [
    ["strategy", report.strategy],
    ["backend", `${report.backend} (${report.decode_step} decode step)`],
    ["resident layers", `${report.resident_layers} of ${report.n_layers}`],
    ["bytes restored", `${bytes(report.bytes_restored)} in ${report.restores} restores`],
    ["restored per token", bytes(report.bytes_restored_per_token)],
    ["tokens", `${chunk.eval_count} (${chunk.done_reason})`],
    ["tok/s", `${rate(serverRate)} (server: eval_count / eval_duration)`],
    ["first token", first ? `${((first - state.run.sent) / 1000).toFixed(2)} s after sending` : "—"],
  ];
  for (const [k, v] of items) stats.append(el("dt", {}, k), el("dd", {}, v));
}

function drawHistory() {
  const body = $("history").querySelector("tbody");
  clear(body);
  state.answers.forEach((a, i) => {
    body.append(el("tr", {}, ...[i + 1, a.strategy, a.resident, a.budget === null ? "none" : bytes(a.budget),
      bytes(a.est), bytes(a.meas), bytes(a.perToken), rate(a.rate)].map(v => el("td", {}, v))));
  });
}

// Speed over the answer (measured here, from the chunks' arrival), and memory: the stream carries no
// per-token memory, so the final report's peaks are drawn across the answer once it arrives.
let liveQueued = false;
function scheduleLive() {
  if (!liveQueued) { liveQueued = true; requestAnimationFrame(() => { liveQueued = false; drawLive(); }); }
}

function drawLive() {
  const root = $("live-plot");
  clear(root);
  const run = state.run;
  if (!run) {
    svg(root, "text", { x: 220, y: 115, class: "empty", "text-anchor": "middle" },
      "speed and memory appear with an answer");
    return;
  }
  const end = ((run.ended || performance.now()) - run.sent) / 1000;
  const x1 = run.ended ? end : Math.max(end, 0.5);
  const final = run.final;
  const serverRate = final && final.eval_duration ? final.eval_count / (final.eval_duration / 1e9) : null;
  const y1 = speedTop(run.samples, serverRate);
  const seconds = { format: t => `${+t.toFixed(2)} s` };
  const speed = frame(root, { x: 56, y: 18, w: 370, h: 88 }, { x0: 0, x1, y0: 0, y1, xAxis: seconds,
    yAxis: { format: t => `${+t.toFixed(1)}` },
    yLabel: `tok/s over the last ${WINDOW} chunks (measured by this page)` });
  line(root, run.samples.map(([t, r]) => [speed.sx(t), speed.sy(Math.min(r, y1))]), "series speed");
  if (serverRate) {
    const y = speed.sy(serverRate);
    svg(root, "line", { x1: speed.sx(0), x2: speed.sx(x1), y1: y, y2: y, class: "series server" });
    svg(root, "text", { x: 422, y: y - 4, class: "label", "text-anchor": "end" }, `server ${rate(serverRate)} tok/s`);
  }
  const report = run.report;
  const box = { x: 56, y: 140, w: 370, h: 60 };
  if (!report) {
    frame(root, box, { x0: 0, x1, y0: 0, y1: 1, xAxis: seconds, yAxis: { ticks: () => [], format: () => "" },
      yLabel: "device memory", xLabel: "seconds since sent" });
    svg(root, "text", { x: box.x + box.w / 2, y: box.y + 35, class: "empty", "text-anchor": "middle" },
      run.ended ? "no report" : "the peaks arrive with the final report");
    return;
  }
  const top = memoryTop(report) * 1.1;
  const axis = byteAxis(top);
  const mem = frame(root, box, { x0: 0, x1, y0: 0, y1: top, xAxis: seconds, yAxis: axis,
    yLabel: "device memory (final report)", xLabel: "seconds since sent" });
  const from = run.chunks.length ? (run.chunks[0] - run.sent) / 1000 : 0;
  const series = [["budget", report.budget_bytes, "budget"],
    ["estimated peak", report.estimated_peak_bytes, "estimated"],
    ["measured peak", report.measured_peak_bytes, "measured"]];
  let lastY = box.y - 2;
  for (const [label, value, cls] of series.filter(s => s[1]).sort((a, b) => b[1] - a[1])) {
    const y = mem.sy(value);
    svg(root, "line", { x1: mem.sx(from), x2: mem.sx(x1), y1: y, y2: y, class: `series ${cls}` });
    const ty = Math.max(y + 11, lastY + 11);  // under its line, below the label above
    svg(root, "text", { x: box.x + box.w - 4, y: ty, class: `label ${cls}`, "text-anchor": "end" },
      `${label} ${bytes(value)}`);
    lastY = ty;
  }
}

// --- wiring ----------------------------------------------------------------------------------------

function showView() {
  const estimate = location.hash === "#estimate";
  $("view-chat").classList.toggle("hidden", estimate);
  $("view-estimate").classList.toggle("hidden", !estimate);
  $("tab-chat").classList.toggle("active", !estimate);
  $("tab-estimate").classList.toggle("active", estimate);
  document.dispatchEvent(new CustomEvent("pebbling-view"));
}

function strategyChanged() {
  $("every-label").classList.toggle("hidden", $("strategy").value !== "every");
  $("strategy-note").textContent = NOTES[$("strategy").value];
}

document.addEventListener("DOMContentLoaded", () => {
  $("ask").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", e => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("ask").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("new-chat").addEventListener("click", () => { state.messages = []; clear($("messages")); });
  $("strategy").addEventListener("change", strategyChanged);
  $("model").addEventListener("change", () => { state.messages = []; clear($("messages")); modelPicked(); });
  window.addEventListener("hashchange", showView);
  strategyChanged();
  showView();
  drawLive();
  loadModels();
});
})();
