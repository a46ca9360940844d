"use strict";
// What chat.js and estimate.js share: elements built with textContent (model text is never parsed as
// HTML), sizes in words, and small SVG plots (axes with round ticks, lines, labels).

const draw = (() => {
  const SVG = "http://www.w3.org/2000/svg";
  const $ = id => document.getElementById(id);

  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (v !== undefined && v !== null) node.setAttribute(k, v);
    }
    for (const child of children) {
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function svg(parent, tag, attrs = {}, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    parent.append(node);
    return node;
  }

  function bytes(n) {
    if (n === null || n === undefined) return "—";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return `${i ? n.toFixed(n < 10 ? 2 : 1) : n} ${units[i]}`;
  }

  function rate(r) {
    if (r === null || r === undefined || !isFinite(r)) return "—";
    if (r === 0) return "0";
    return r >= 100 ? r.toFixed(0) : r >= 10 ? r.toFixed(1) : r.toFixed(2);
  }

  // Round ticks covering [lo, hi]: steps of 1, 2 or 5 times a power of ten.
  function ticks(lo, hi, count) {
    const span = hi - lo || Math.abs(hi) || 1;
    const power = Math.pow(10, Math.floor(Math.log10(span / count)));
    const step = [1, 2, 5, 10].map(m => m * power).find(s => span / s <= count) || span;
    const out = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(t);
    return out;
  }

  // An axis of bytes: round ticks in the one unit that suits its largest value, labelled in it.
  function byteAxis(hi) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (hi / Math.pow(1024, i) >= 1024 && i < units.length - 1) i++;
    const unit = Math.pow(1024, i);
    return {
      ticks: (lo, top, count) => ticks(lo / unit, top / unit, count).map(t => t * unit),
      format: v => `${+(v / unit).toFixed(2)} ${units[i]}`,
    };
  }

  // A plot area inside `box` ({x, y, w, h} in the SVG's units) for data in [x0, x1] x [y0, y1]; draws the
  // grid and the axes' ticks (`xAxis`, `yAxis`: {ticks, format}), and returns the scales.
  function frame(root, box, { x0, x1, y0, y1, xAxis, yAxis, xLabel, yLabel }) {
    const sx = v => box.x + (x1 === x0 ? 0.5 : (v - x0) / (x1 - x0)) * box.w;
    const sy = v => box.y + box.h - (y1 === y0 ? 0.5 : (v - y0) / (y1 - y0)) * box.h;
    const grid = svg(root, "g", { class: "grid" });
    for (const t of (yAxis.ticks || ticks)(y0, y1, 4)) {
      svg(grid, "line", { x1: box.x, x2: box.x + box.w, y1: sy(t), y2: sy(t) });
      svg(root, "text", { x: box.x - 6, y: sy(t) + 4, class: "tick", "text-anchor": "end" }, yAxis.format(t));
    }
    for (const t of (xAxis.ticks || ticks)(x0, x1, Math.max(2, Math.floor(box.w / 90)))) {
      svg(grid, "line", { x1: sx(t), x2: sx(t), y1: box.y, y2: box.y + box.h });
      svg(root, "text", { x: sx(t), y: box.y + box.h + 15, class: "tick", "text-anchor": "middle" }, xAxis.format(t));
    }
    svg(root, "rect", { x: box.x, y: box.y, width: box.w, height: box.h, class: "frame" });
    if (xLabel) {
      svg(root, "text", { x: box.x + box.w, y: box.y + box.h + 30, class: "axis", "text-anchor": "end" }, xLabel);
    }
    if (yLabel) svg(root, "text", { x: box.x, y: box.y - 7, class: "axis" }, yLabel);
    return { sx, sy };
  }

  function line(root, points, cls) {
    if (!points.length) return null;
    const text = points.map(([x, y]) => `${x.toFixed(1)},${y.toFixed(1)}`).join(" ");
    return svg(root, "polyline", { points: text, class: cls });
  }

  // A size typed by the user as the API takes it: digits are bytes, anything else ("64MiB") is sent as
  // written for the server to check; empty or "none" is no size.
  function size(text) {
    const t = text.trim();
    if (!t || t.toLowerCase() === "none") return undefined;
    return /^\d+$/.test(t) ? Number(t) : t;
  }

  function clear(node) {
    while (node.firstChild) node.firstChild.remove();
  }

  return { $, el, svg, bytes, rate, ticks, byteAxis, frame, line, size, clear };
})();
