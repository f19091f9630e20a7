// Small line / stacked-area charts on <canvas>, for live training metrics.
//
// Data model: one shared x axis (the optimizer step) and, per series, a value
// or null at each x. Lines connect the non-null values (an eval loss measured
// every 50 steps draws as a line through its points). Stacked charts treat null
// as 0 and fill the area under each running sum.
//
// Drawing is coalesced to one requestAnimationFrame, so a burst of step events
// costs one redraw. The canvas carries `data-points` (number of x values drawn)
// and an aria-label describing the latest values; the legend below it prints
// the same values as text, and the point under the pointer while hovering.
//
// Marks: a count per x drawn as a triangle on the top edge wherever it is above 0
// (the allocator's retries on the step-time chart: the step that stalled stands
// out); the canvas carries `data-marks` (how many x values are marked) and the
// legend the count at the hovered step, or the total and how many steps.

import { h } from "./dom.js";

const PAD = { left: 70, right: 14, top: 12, bottom: 26 };
const HEIGHT = 210;

export class Chart {
  /**
   * @param {object} opts
   * @param {string} opts.title      heading shown above the chart
   * @param {string} opts.testid     data-testid of the <canvas>
   * @param {Array<{key: string, label: string, color: string, dots?: boolean}>} opts.series
   * @param {(v: number) => string} [opts.format]   y-axis and legend formatter
   * @param {boolean} [opts.stacked]  stack the series as areas
   * @param {boolean} [opts.zero]     start the y axis at 0 (default true)
   * @param {boolean} [opts.binary]   values are bytes: y ticks at round KiB/MiB/GiB
   * @param {{key: string, label: string, color: string}} [opts.marks]  a count per x, marked where above 0
   */
  constructor({ title, testid, series, format = String, stacked = false, zero = true, binary = false, marks = null }) {
    this.binary = binary;
    this.series = series;
    this.marks = marks;
    this.counts = []; // marks.key per x, or null
    this.format = format;
    this.stacked = stacked;
    this.zero = zero;
    this.xs = [];
    this.ys = series.map(() => []);
    this.capacity = null;
    this.hoverIndex = null;
    this.note = "";
    this.frame = 0;

    this.canvas = h("canvas", { "data-testid": testid, "data-points": "0", "data-marks": "0", role: "img", height: HEIGHT });
    this.legend = h("ul", { class: "legend", "data-testid": `${testid}-legend` });
    this.noteEl = h("p", { class: "chart-note" });
    this.element = h("figure", { class: "chart" }, h("figcaption", { text: title }), this.canvas, this.legend, this.noteEl);
    this.canvas.setAttribute("aria-label", `${title}: no data yet`);
    this.title = title;

    this.canvas.addEventListener("pointermove", (e) => this.hover(e));
    this.canvas.addEventListener("pointerleave", () => {
      this.hoverIndex = null;
      this.schedule();
    });
    this.resizeObserver = new ResizeObserver(() => this.schedule());
    this.resizeObserver.observe(this.canvas);
    this.schedule();
  }

  /** Set the series values at step ``x`` (a row with the series keys); merges into an existing x. */
  upsert(x, row) {
    let i = this.xs.length;
    if (i > 0 && x <= this.xs[i - 1]) {
      i = lowerBound(this.xs, x);
    }
    if (this.xs[i] !== x) {
      this.xs.splice(i, 0, x);
      for (const ys of this.ys) ys.splice(i, 0, null);
      this.counts.splice(i, 0, null);
    }
    this.series.forEach((s, k) => {
      const v = row[s.key];
      if (v !== undefined && v !== null && Number.isFinite(v)) this.ys[k][i] = v;
    });
    const count = this.marks ? row[this.marks.key] : undefined;
    if (count !== undefined && count !== null && Number.isFinite(count)) this.counts[i] = count;
    this.schedule();
  }

  /** A dashed horizontal line (e.g. the GPU's memory), included in the y range. */
  setCapacity(value, label) {
    this.capacity = value ? { value, label } : null;
    this.schedule();
  }

  setNote(text) {
    this.note = text;
    this.noteEl.textContent = text;
  }

  get points() {
    return this.xs.length;
  }

  /** Whether series ``key`` has at least one value. */
  has(key) {
    const k = this.series.findIndex((s) => s.key === key);
    return k >= 0 && this.ys[k].some((v) => v !== null);
  }

  destroy() {
    this.resizeObserver.disconnect();
    cancelAnimationFrame(this.frame);
  }

  schedule() {
    if (this.frame) return;
    this.frame = requestAnimationFrame(() => {
      this.frame = 0;
      this.draw();
    });
  }

  hover(event) {
    if (!this.xs.length) return;
    const rect = this.canvas.getBoundingClientRect();
    const plotW = rect.width - PAD.left - PAD.right;
    const frac = (event.clientX - rect.left - PAD.left) / Math.max(plotW, 1);
    const [x0, x1] = this.xRange();
    const target = x0 + frac * (x1 - x0);
    let i = lowerBound(this.xs, target);
    if (i > 0 && (i === this.xs.length || target - this.xs[i - 1] < this.xs[i] - target)) i -= 1;
    this.hoverIndex = i;
    this.schedule();
  }

  xRange() {
    const first = this.xs[0] ?? 0;
    const last = this.xs[this.xs.length - 1] ?? 1;
    return first === last ? [first - 1, last + 1] : [first, last];
  }

  /** Running sums per series (stacked) or the values themselves, per x. */
  levels() {
    if (!this.stacked) return this.ys;
    const sums = new Array(this.xs.length).fill(0);
    return this.ys.map((ys) => ys.map((v, i) => (sums[i] += v ?? 0)));
  }

  yRange(levels) {
    let lo = Infinity;
    let hi = -Infinity;
    for (const ys of levels) {
      for (const v of ys) {
        if (v === null) continue;
        if (v < lo) lo = v;
        if (v > hi) hi = v;
      }
    }
    if (this.capacity) hi = Math.max(hi, this.capacity.value);
    if (!Number.isFinite(lo)) return [0, 1];
    if (this.zero) lo = Math.min(0, lo);
    if (hi === lo) hi = lo + (Math.abs(lo) || 1);
    const pad = (hi - lo) * 0.06;
    return [this.zero && lo >= 0 ? lo : lo - pad, hi + pad];
  }

  draw() {
    const canvas = this.canvas;
    const dpr = window.devicePixelRatio || 1;
    const cssW = canvas.clientWidth || 600;
    const cssH = HEIGHT;
    if (canvas.width !== Math.round(cssW * dpr) || canvas.height !== Math.round(cssH * dpr)) {
      canvas.width = Math.round(cssW * dpr);
      canvas.height = Math.round(cssH * dpr);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, cssW, cssH);
    const style = getComputedStyle(canvas);
    const ink = style.getPropertyValue("--chart-ink").trim() || "#555";
    const grid = style.getPropertyValue("--chart-grid").trim() || "#ddd";
    ctx.font = "11px system-ui, sans-serif";

    const plot = { x: PAD.left, y: PAD.top, w: Math.max(cssW - PAD.left - PAD.right, 10), h: cssH - PAD.top - PAD.bottom };
    canvas.dataset.points = String(this.xs.length);
    canvas.dataset.marks = String(this.counts.filter((c) => c > 0).length);

    if (!this.xs.length) {
      ctx.fillStyle = ink;
      ctx.textAlign = "center";
      ctx.fillText("Waiting for the first step…", plot.x + plot.w / 2, plot.y + plot.h / 2);
      this.updateLegend();
      return;
    }

    const levels = this.levels();
    const [y0, y1] = this.yRange(levels);
    const [x0, x1] = this.xRange();
    const px = (x) => plot.x + ((x - x0) / (x1 - x0)) * plot.w;
    const py = (y) => plot.y + plot.h - ((y - y0) / (y1 - y0)) * plot.h;

    // Grid and axes.
    ctx.strokeStyle = grid;
    ctx.fillStyle = ink;
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (const t of this.binary ? binaryTicks(y0, y1, 5) : niceTicks(y0, y1, 5)) {
      const y = Math.round(py(t)) + 0.5;
      ctx.beginPath();
      ctx.moveTo(plot.x, y);
      ctx.lineTo(plot.x + plot.w, y);
      ctx.stroke();
      ctx.fillText(this.format(t), plot.x - 6, y);
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    for (const t of niceTicks(x0, x1, Math.max(2, Math.floor(plot.w / 90)), true)) {
      ctx.fillText(String(t), px(t), plot.y + plot.h + 6);
    }

    // Capacity line.
    if (this.capacity) {
      const y = py(this.capacity.value);
      ctx.save();
      ctx.strokeStyle = ink;
      ctx.setLineDash([5, 4]);
      ctx.beginPath();
      ctx.moveTo(plot.x, y);
      ctx.lineTo(plot.x + plot.w, y);
      ctx.stroke();
      ctx.restore();
      ctx.textAlign = "left";
      ctx.textBaseline = "bottom";
      ctx.fillText(this.capacity.label, plot.x + 4, y - 2);
    }

    // Series: a stacked series is the band between its running sum and the one below.
    ctx.save();
    ctx.beginPath();
    ctx.rect(plot.x, plot.y - 1, plot.w, plot.h + 2);
    ctx.clip();
    if (this.stacked) {
      const n = this.xs.length;
      levels.forEach((top, k) => {
        const below = k > 0 ? levels[k - 1] : null;
        ctx.beginPath();
        for (let i = 0; i < n; i += 1) ctx.lineTo(px(this.xs[i]), py(top[i]));
        for (let i = n - 1; i >= 0; i -= 1) ctx.lineTo(px(this.xs[i]), py(below ? below[i] : 0));
        ctx.closePath();
        ctx.fillStyle = this.series[k].color;
        ctx.globalAlpha = 0.8;
        ctx.fill();
        ctx.globalAlpha = 1;
        if (n === 1) {
          ctx.fillRect(px(this.xs[0]) - 2, py(top[0]), 4, py(below ? below[0] : 0) - py(top[0]));
        }
      });
    } else {
      levels.forEach((ys, k) => this.drawLine(ctx, ys, this.series[k], px, py));
    }
    this.drawMarks(ctx, plot, px);
    // Hover guide.
    if (this.hoverIndex !== null && this.hoverIndex < this.xs.length) {
      const x = Math.round(px(this.xs[this.hoverIndex])) + 0.5;
      ctx.strokeStyle = ink;
      ctx.beginPath();
      ctx.moveTo(x, plot.y);
      ctx.lineTo(x, plot.y + plot.h);
      ctx.stroke();
    }
    ctx.restore();
    this.updateLegend();
  }

  drawLine(ctx, ys, s, px, py) {
    ctx.strokeStyle = s.color;
    ctx.fillStyle = s.color;
    ctx.lineWidth = 1.75;
    ctx.lineJoin = "round";
    ctx.beginPath();
    let started = false;
    ys.forEach((v, i) => {
      if (v === null) return;
      const x = px(this.xs[i]);
      const y = py(v);
      if (started) ctx.lineTo(x, y);
      else ctx.moveTo(x, y);
      started = true;
    });
    ctx.stroke();
    const lone = ys.filter((v) => v !== null).length === 1;
    if (s.dots || lone) {
      ys.forEach((v, i) => {
        if (v === null) return;
        ctx.beginPath();
        ctx.arc(px(this.xs[i]), py(v), 2.5, 0, 2 * Math.PI);
        ctx.fill();
      });
    }
  }

  /** A triangle on the top edge at each x whose count is above 0, over a faint line down the plot. */
  drawMarks(ctx, plot, px) {
    if (!this.marks) return;
    ctx.strokeStyle = this.marks.color;
    ctx.fillStyle = this.marks.color;
    this.counts.forEach((c, i) => {
      if (!(c > 0)) return;
      const x = Math.round(px(this.xs[i])) + 0.5;
      ctx.globalAlpha = 0.35;
      ctx.beginPath();
      ctx.moveTo(x, plot.y);
      ctx.lineTo(x, plot.y + plot.h);
      ctx.stroke();
      ctx.globalAlpha = 1;
      ctx.beginPath();
      ctx.moveTo(x - 5, plot.y);
      ctx.lineTo(x + 5, plot.y);
      ctx.lineTo(x, plot.y + 7);
      ctx.closePath();
      ctx.fill();
    });
  }

  /** The marks' legend text: the count at step index ``i``, or (no hover) the total over the marked steps. */
  marksText(i) {
    if (i !== null) return this.counts[i] === null || this.counts[i] === undefined ? "–" : String(this.counts[i]);
    const marked = this.counts.filter((c) => c > 0);
    const total = marked.reduce((a, c) => a + c, 0);
    return total ? `${total} in ${marked.length} step${marked.length === 1 ? "" : "s"}` : "none";
  }

  /** Legend: each series with data, its value at the hovered step or its latest value. */
  updateLegend() {
    const i = this.hoverIndex;
    const items = [];
    const described = [];
    this.series.forEach((s, k) => {
      const ys = this.ys[k];
      if (!ys.some((v) => v !== null)) return;
      let j = i ?? ys.length - 1;
      if (i === null) while (j > 0 && ys[j] === null) j -= 1;
      const value = ys[j];
      const text = value === null || value === undefined ? "–" : this.format(value);
      items.push(
        h("li", {}, h("span", { class: "swatch", style: `background:${s.color}` }), `${s.label} `, h("strong", { text })),
      );
      described.push(`${s.label} ${text}`);
    });
    if (this.marks && this.counts.some((c) => c !== null)) {
      const text = this.marksText(i);
      items.push(h("li", {}, h("span", { class: "swatch swatch-mark", style: `border-top-color:${this.marks.color}` }), `${this.marks.label} `, h("strong", { text })));
      described.push(`${this.marks.label} ${text}`);
    }
    if (this.capacity) items.push(h("li", {}, h("span", { class: "swatch swatch-dashed" }), this.capacity.label));
    const step = this.xs.length ? this.xs[i ?? this.xs.length - 1] : null;
    if (step !== null) items.unshift(h("li", { class: "legend-step", text: i === null ? `latest (step ${step})` : `step ${step}` }));
    this.legend.replaceChildren(...items);
    this.canvas.setAttribute(
      "aria-label",
      this.xs.length ? `${this.title}: ${this.xs.length} steps; at step ${step}: ${described.join(", ")}` : `${this.title}: no data yet`,
    );
  }
}

function lowerBound(xs, x) {
  let lo = 0;
  let hi = xs.length;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (xs[mid] < x) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/** About ``count`` round tick values covering [lo, hi] (1, 2, 5 × 10^k steps). */
export function niceTicks(lo, hi, count, integer = false) {
  const span = hi - lo;
  if (!(span > 0)) return [lo];
  let step = niceStep(span / Math.max(count, 1));
  if (integer) step = Math.max(1, Math.round(step));
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) {
    ticks.push(Number(t.toPrecision(12)));
  }
  return ticks;
}

/** Ticks for byte values: round numbers of the largest binary unit (KiB, MiB, GiB) below ``hi``. */
export function binaryTicks(lo, hi, count) {
  let unit = 1;
  while (unit * 1024 <= Math.max(Math.abs(hi), Math.abs(lo))) unit *= 1024;
  return niceTicks(lo / unit, hi / unit, count).map((t) => t * unit);
}

function niceStep(raw) {
  const power = 10 ** Math.floor(Math.log10(raw));
  const frac = raw / power;
  const nice = frac <= 1 ? 1 : frac <= 2 ? 2 : frac <= 5 ? 5 : 10;
  return nice * power;
}
