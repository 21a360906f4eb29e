// tokenweir timeline: one row per request, one column per step (or time), drawn on canvas.
// Data: the JSON in #timeline-data (tokenweir/timeline/layout.py). Only the visible part of
// each grid is drawn; when several columns share a pixel, the most telling state wins
// (level of detail). Test hooks: window.timelineState (see the end of this file).
"use strict";
(function () {
  const DATA = JSON.parse(document.getElementById("timeline-data").textContent);
  const OPTIONS = window.TIMELINE_OPTIONS || {};
  const ROW_H = 14, GUTTER = 64, SERIES_H = 188, AXIS_Y = 170;
  const RANK = [0, 1, 2, 5, 4, 6, 3, 7];  // by state code: which state wins a shared pixel
  const SCHEDULED = new Set([3, 4, 7]);    // prefill, decode, cut: ran in that step
  const errors = [];
  window.addEventListener("error", (e) => errors.push(String(e.message)));
  const rowIndex = new Map(DATA.rowIds.map((id, i) => [id, i]));
  let mode = "step";
  let hoverRow = -1;

  // ---- per panel geometry -----------------------------------------------------------------
  function makePanel(model, index) {
    const cols = model.cols, n = cols.start.length;
    const t0 = n ? cols.start[0] : 0;
    const tEnd = n ? cols.start[n - 1] + cols.dur[n - 1] : 1;
    const p = { model, index, n, t0, tEnd, pxPerCol: 12, pxPerSec: 1, shared: new Map() };
    p.el = document.createElement("section");
    p.el.className = "panel";
    const notes = model.notes.length ? model.notes.join("; ") : "nothing dropped";
    p.el.innerHTML = `<h2></h2><div class="sub"></div>
      <div class="grid"><canvas></canvas><div class="scroller"><div class="spacer"></div></div></div>
      <div class="series"><canvas></canvas></div>`;
    p.el.querySelector("h2").textContent = model.label;
    p.el.querySelector(".sub").textContent = `${model.numSteps} steps, ` +
      `${Object.keys(model.rows).length} requests; ${notes}` +
      (model.estimated ? "; token splits estimated (chrome trace)" : "");
    p.canvas = p.el.querySelector(".grid canvas");
    p.scroller = p.el.querySelector(".scroller");
    p.spacer = p.el.querySelector(".spacer");
    p.seriesCanvas = p.el.querySelector(".series canvas");
    return p;
  }

  // every panel gets the same scale (px per step, or per second) so that side by side they
  // compare like for like: the longest run fits the view
  function fit(p) {
    const w = Math.max(50, p.scroller.clientWidth - GUTTER);
    const n = Math.max(...panels.map((q) => q.n), 1);
    const span = Math.max(...panels.map((q) => q.tEnd - q.t0), 1e-9);
    p.pxPerCol = Math.min(24, Math.max(w / n, 0.001));
    p.pxPerSec = w / span;
  }
  function totalWidth(p) {
    return mode === "step" ? p.n * p.pxPerCol : (p.tEnd - p.t0) * p.pxPerSec;
  }
  // left edge of column c (c may be n: the right edge of the last column)
  function colX(p, c) {
    if (mode === "step") return c * p.pxPerCol;
    const cols = p.model.cols;
    if (c >= p.n) return (p.tEnd - p.t0) * p.pxPerSec;
    return (cols.start[c] - p.t0) * p.pxPerSec;
  }
  function colEndX(p, c) {
    if (mode === "step") return (c + 1) * p.pxPerCol;
    const cols = p.model.cols;
    return (cols.start[c] + cols.dur[c] - p.t0) * p.pxPerSec;
  }
  // the column under grid x (content coordinates), clamped to 0..n-1
  function colAt(p, x) {
    if (mode === "step") return Math.min(p.n - 1, Math.max(0, Math.floor(x / p.pxPerCol)));
    return lastStartAtOrBefore(p, p.t0 + x / p.pxPerSec);
  }
  function lastStartAtOrBefore(p, t) {
    const s = p.model.cols.start;
    let lo = 0, hi = p.n - 1;
    while (lo < hi) { const mid = (lo + hi + 1) >> 1; if (s[mid] <= t) lo = mid; else hi = mid - 1; }
    return lo;
  }
  function timeX(p, t) {  // grid x of a time (the TTFT marker)
    if (mode === "time") return (t - p.t0) * p.pxPerSec;
    const c = lastStartAtOrBefore(p, t), cols = p.model.cols;
    const frac = cols.dur[c] > 0 ? Math.min(1, Math.max(0, (t - cols.start[c]) / cols.dur[c])) : 0;
    return (c + (t >= cols.start[c] ? frac : 0)) * p.pxPerCol;
  }
  function colOfStep(p, step) {  // the column holding a step (bucketed when aggregated)
    const s = p.model.cols.step;
    let lo = 0, hi = p.n - 1;
    while (lo < hi) { const mid = (lo + hi + 1) >> 1; if (s[mid] <= step) lo = mid; else hi = mid - 1; }
    return lo;
  }

  // ---- drawing ------------------------------------------------------------------------------
  function sizeCanvas(canvas, w, h) {
    const dpr = window.devicePixelRatio || 1;
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
      canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr);
      canvas.style.width = w + "px"; canvas.style.height = h + "px";
    }
    const ctx = canvas.getContext("2d", { willReadFrequently: true });
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    return ctx;
  }
  function firstRun(runs, c0) {  // index of the first run ending after column c0
    let lo = 0, hi = runs.length;
    while (lo < hi) { const mid = (lo + hi) >> 1; if (runs[mid][0] + runs[mid][1] <= c0) lo = mid + 1; else hi = mid; }
    return lo;
  }
  // Runs snap to whole pixels; a pixel holding several runs shows the highest-ranked state
  // (a one-step preemption stays visible however far out the view is zoomed).
  function drawRow(p, ctx, runs, y, c0, c1, left) {
    let drawnTo = -Infinity, drawnRank = -1;  // end (exclusive) and rank of the last rect
    for (let i = firstRun(runs, c0); i < runs.length && runs[i][0] <= c1; i++) {
      const [c, len, state, tokens] = runs[i];
      let a = Math.floor(colX(p, c) - left);
      const b = Math.max(a + 1, Math.round(colEndX(p, c + len - 1) - left));
      if (a < drawnTo && RANK[state] <= drawnRank) a = drawnTo;
      if (b <= a) continue;
      ctx.fillStyle = DATA.colors[state];
      ctx.fillRect(GUTTER + a, y + 1, b - a, ROW_H - 2);
      drawnTo = b; drawnRank = RANK[state];
      if (state === 3 && len === 1 && b - a >= 24) {
        ctx.fillStyle = "#fff"; ctx.fillText(String(tokens), GUTTER + a + 2, y + ROW_H - 3);
      }
    }
  }
  function drawMarker(p, ctx, rid, y, left, width) {
    const info = p.model.requests[rid];
    if (!info || info.ttft_slo_ms == null || info.arrival == null) return;
    const x = GUTTER + timeX(p, info.arrival + info.ttft_slo_ms / 1000) - left;
    if (x < GUTTER || x > width) return;
    const missed = info.first_token == null || info.first_token > info.arrival + info.ttft_slo_ms / 1000;
    ctx.fillStyle = missed ? "#b00000" : "#000";
    ctx.fillRect(x - 1, y, 2, ROW_H);
  }
  function drawGrid(p) {
    const w = p.scroller.clientWidth, h = p.scroller.clientHeight;
    const ctx = sizeCanvas(p.canvas, w, h);
    ctx.clearRect(0, 0, w, h);
    ctx.font = "10px system-ui, sans-serif";
    const left = p.scroller.scrollLeft, top = p.scroller.scrollTop;
    if (!p.n) return;
    const c0 = colAt(p, left), c1 = colAt(p, left + w);
    const r0 = Math.floor(top / ROW_H), r1 = Math.min(DATA.rowIds.length - 1, Math.floor((top + h) / ROW_H));
    for (let r = r0; r <= r1; r++) {
      const rid = DATA.rowIds[r], y = r * ROW_H - top, runs = p.model.rows[rid];
      if (runs) drawRow(p, ctx, runs, y, c0, c1, left);
      drawMarker(p, ctx, rid, y, left, w);
      ctx.fillStyle = r === hoverRow ? "#ffe680" : "#f4f4f4";
      ctx.fillRect(0, y, GUTTER - 2, ROW_H);
      drawRowLabel(ctx, DATA.rowLabels[r], y);
      if (r === hoverRow) { ctx.strokeStyle = "#000"; ctx.strokeRect(GUTTER + 0.5, y + 0.5, w - GUTTER - 1, ROW_H - 1); }
    }
  }
  // the row's label (layout.row_label: long ids shortened), clipped to the gutter
  function drawRowLabel(ctx, label, y) {
    ctx.save();
    ctx.beginPath(); ctx.rect(0, y, GUTTER - 3, ROW_H); ctx.clip();
    ctx.fillStyle = "#333"; ctx.fillText(label, 3, y + ROW_H - 3);
    ctx.restore();
  }
  // per pixel column of the series canvas: sums for tokens and hits, peaks for the rest
  function seriesBins(p, w, left) {
    const cols = p.model.cols, bins = [];
    const c0 = colAt(p, left), c1 = colAt(p, left + w - GUTTER);
    for (let c = c0; c <= c1; c++) {
      const px = Math.floor(GUTTER + colX(p, c) - left), pw = Math.max(1, colEndX(p, c) - colX(p, c));
      let b = bins[bins.length - 1];
      if (!b || px > b.px + b.w - 1) { b = { px, w: pw, prefill: 0, decode: 0, running: 0, waiting: 0, kv: 0, hits: 0 }; bins.push(b); }
      b.prefill = Math.max(b.prefill, cols.prefill[c]); b.decode = Math.max(b.decode, cols.decode[c]);
      b.running = Math.max(b.running, cols.running[c]); b.waiting = Math.max(b.waiting, cols.waiting[c]);
      b.kv = Math.max(b.kv, cols.kv[c]); b.hits = Math.max(b.hits, cols.hits[c]);
    }
    return bins;
  }
  function drawSeries(p) {
    const w = p.scroller.clientWidth, ctx = sizeCanvas(p.seriesCanvas, w, SERIES_H);
    ctx.clearRect(0, 0, w, SERIES_H);
    ctx.font = "10px system-ui, sans-serif";
    if (!p.n) return;
    const m = p.maxes, band = 40;
    const bins = seriesBins(p, w, p.scroller.scrollLeft);
    for (const b of bins) {
      const hp = (b.prefill / m.tokens) * (band - 2), hd = (b.decode / m.tokens) * (band - 2);
      ctx.fillStyle = DATA.colors[3]; ctx.fillRect(b.px, band - hp, b.w, hp);
      ctx.fillStyle = DATA.colors[4]; ctx.fillRect(b.px, band - hp - hd, b.w, hd);
      const hr = (b.running / m.queue) * (band - 2), hw = (b.waiting / m.queue) * (band - 2);
      ctx.fillStyle = "#333"; ctx.fillRect(b.px, 2 * band - hr, b.w, Math.max(1, Math.min(2, hr)));
      ctx.fillStyle = "#999"; ctx.fillRect(b.px, 2 * band - hw, b.w, Math.max(1, Math.min(2, hw)));
      ctx.fillStyle = DATA.colors[6]; ctx.fillRect(b.px, 3 * band - b.kv * (band - 2), b.w, b.kv * (band - 2));
      const hh = (b.hits / m.hits) * (band - 2);
      ctx.fillStyle = "#e08a00"; ctx.fillRect(b.px, 4 * band + 8 - hh, b.w, hh);
    }
    const labels = [`tokens/step (prefill blue, decode green), max ${m.tokens}`,
      `running (dark) / waiting (grey), max ${m.queue}`, "KV pool usage (0..1)",
      m.anyHits ? `prefix-cache hit tokens, max ${m.hits}` : "prefix-cache hit tokens: none"];
    ctx.fillStyle = "#f4f4f4"; ctx.fillRect(0, 0, GUTTER - 2, SERIES_H);
    labels.forEach((text, i) => {
      ctx.fillStyle = "rgba(255,255,255,0.8)";
      ctx.fillRect(GUTTER + 2, i * band + 1, ctx.measureText(text).width + 4, 11);
      ctx.fillStyle = "#000"; ctx.fillText(text, GUTTER + 4, i * band + 10);
      ctx.fillStyle = "#ddd"; ctx.fillRect(GUTTER, (i + 1) * band + (i === 3 ? 8 : 0), w, 1);
    });
    drawAxis(p, ctx, w);
  }
  // ticks along the bottom: step numbers, or seconds in time mode, about every 100 px
  function drawAxis(p, ctx, w) {
    const left = p.scroller.scrollLeft, cols = p.model.cols;
    const perPx = mode === "step" ? 1 / p.pxPerCol : 1 / p.pxPerSec;
    const raw = perPx * 100, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const every = [1, 2, 5, 10].map((k) => k * mag).find((v) => v >= raw);
    ctx.fillStyle = "#000"; ctx.fillRect(GUTTER, AXIS_Y, w, 1);
    ctx.fillText(mode === "step" ? "step" : "time (s)", 4, AXIS_Y + 12);
    const origin = mode === "step" ? 0 : p.t0;  // ticks at round steps, or round seconds
    const first = Math.ceil((origin + left * perPx) / every) * every;
    for (let v = first; (v - origin) / perPx - left < w - GUTTER; v += every) {
      const x = GUTTER + (v - origin) / perPx - left;
      const label = mode === "step" ? String(cols.step[Math.min(p.n - 1, Math.round(v))] ?? v)
        : v.toFixed(every < 0.01 ? 3 : every < 1 ? 2 : 0);
      ctx.fillRect(x, AXIS_Y, 1, 4); ctx.fillText(label, x + 2, AXIS_Y + 13);
    }
  }
  function layout(p) {
    p.spacer.style.width = (GUTTER + totalWidth(p)) + "px";
    p.spacer.style.height = (DATA.rowIds.length * ROW_H) + "px";
  }
  function redraw(p) { drawGrid(p); drawSeries(p); }
  let frameQueued = false;
  function redrawAll() {
    if (frameQueued) return;
    frameQueued = true;
    requestAnimationFrame(() => { frameQueued = false; panels.forEach(redraw); });
  }

  // ---- hover: the request and the steps it shared --------------------------------------------
  function sharedWith(p, rid) {
    if (p.shared.has(rid)) return p.shared.get(rid);
    const mine = (p.model.rows[rid] || []).filter((r) => SCHEDULED.has(r[2]));
    const counts = [];
    let steps = 0;
    for (const r of mine) steps += r[1] * p.model.bucket;
    for (const [other, runs] of Object.entries(p.model.rows)) {
      if (other === rid) continue;
      let k = 0;
      for (const a of mine) for (let i = firstRun(runs, a[0]); i < runs.length && runs[i][0] < a[0] + a[1]; i++) {
        if (SCHEDULED.has(runs[i][2])) k += Math.min(a[0] + a[1], runs[i][0] + runs[i][1]) - Math.max(a[0], runs[i][0]);
      }
      if (k) counts.push([other, k]);
    }
    counts.sort((x, y) => y[1] - x[1]);
    const result = { steps, with: counts };
    p.shared.set(rid, result);
    return result;
  }
  function fmt(t) { return t == null ? "n/a" : (t * 1000).toFixed(1) + " ms"; }
  function cellAt(p, rid, c) {
    const runs = p.model.rows[rid] || [];
    const i = firstRun(runs, c);
    if (i < runs.length && runs[i][0] <= c) return { state: runs[i][2], tokens: c === runs[i][0] ? runs[i][3] : runs[i][3] };
    return { state: 0, tokens: 0 };
  }
  function describe(p, rid, c) {
    const info = p.model.requests[rid] || {}, cell = cellAt(p, rid, c);
    const sh = sharedWith(p, rid);
    const ttft = info.first_token != null && info.arrival != null ? info.first_token - info.arrival : null;
    const lines = [`request ${rid}  (${p.model.label})`,
      `arrival ${fmt(info.arrival)}, first token ${fmt(info.first_token)}` +
        (ttft != null ? ` (TTFT ${fmt(ttft)})` : ""),
      `finish ${fmt(info.finished)}, preemptions ${info.preemptions ?? "n/a"}`];
    if (info.ttft_slo_ms != null) {
      lines.push(`TTFT target ${info.ttft_slo_ms.toFixed(0)} ms: ` +
        (ttft != null && ttft * 1000 <= info.ttft_slo_ms ? "met" : "missed"));
    }
    if (info.prompt_len != null) lines.push(`prompt ${info.prompt_len} tokens, output ${info.output_len ?? "n/a"}`);
    const step = p.model.cols.step[c];
    lines.push(`step ${step}${p.model.bucket > 1 ? "+" + (p.model.bucket - 1) : ""}: ` +
      `${DATA.states[cell.state]}` + (cell.state === 3 ? ` (${cell.tokens} tokens)` : ""));
    const top = sh.with.slice(0, 5).map(([o, k]) => `${o} (${k})`).join(", ");
    lines.push(`ran in ${sh.steps} steps, shared with ${sh.with.length} requests` + (top ? `: ${top}` : ""));
    return lines.join("\n");
  }
  const tooltip = document.getElementById("tooltip");
  let pinned = false;
  function onMove(p, ev) {
    if (pinned) return;
    const rect = p.scroller.getBoundingClientRect();
    const x = ev.clientX - rect.left + p.scroller.scrollLeft - GUTTER;
    const r = Math.floor((ev.clientY - rect.top + p.scroller.scrollTop) / ROW_H);
    if (r < 0 || r >= DATA.rowIds.length || !p.n) { hide(); return; }
    if (r !== hoverRow) { hoverRow = r; redrawAll(); }
    tooltip.textContent = describe(p, DATA.rowIds[r], colAt(p, Math.max(0, x)));
    tooltip.hidden = false;
    tooltip.style.left = Math.min(ev.clientX + 14, window.innerWidth - 390) + "px";
    tooltip.style.top = Math.min(ev.clientY + 14, window.innerHeight - 160) + "px";
  }
  // Every panel to the same row offset at once: the panels' scroll handlers keep them in step,
  // but a handler still queued from an earlier scroll would otherwise move this panel back to
  // the offset it saw (a hovered point then lands on another row).
  function scrollAllTo(top) { panels.forEach((q) => { q.scroller.scrollTop = top; }); }
  function hide() { if (!pinned) { tooltip.hidden = true; if (hoverRow !== -1) { hoverRow = -1; redrawAll(); } } }

  // ---- set-up ---------------------------------------------------------------------------------
  function maxes(p) {
    const c = p.model.cols;
    let tokens = 1, queue = 1, hits = 1;
    for (let i = 0; i < p.n; i++) {
      tokens = Math.max(tokens, c.prefill[i] + c.decode[i]);
      queue = Math.max(queue, c.running[i], c.waiting[i]); hits = Math.max(hits, c.hits[i]);
    }
    return { tokens, queue, hits, anyHits: c.hits.some((h) => h > 0) };
  }
  function legend() {
    const el = document.getElementById("legend");
    DATA.states.forEach((name, s) => {
      if (s === 0) return;
      const item = document.createElement("span");
      item.innerHTML = `<span class="swatch" style="background:${DATA.colors[s]}"></span>`;
      item.appendChild(document.createTextNode(`${name}: ${DATA.descriptions[s]}`));
      el.appendChild(item);
    });
    const m = document.createElement("span");
    m.innerHTML = '<span class="marker"></span>';
    m.appendChild(document.createTextNode("TTFT target (red: missed)"));
    el.appendChild(m);
  }
  function zoom(factor, anchorX) {
    for (const p of panels) {
      const ax = anchorX ?? p.scroller.clientWidth / 2;
      const pos = (p.scroller.scrollLeft + ax - GUTTER) / Math.max(1e-9, totalWidth(p));
      if (mode === "step") p.pxPerCol = Math.min(64, Math.max(1e-4, p.pxPerCol * factor));
      else p.pxPerSec = Math.max(1e-6, p.pxPerSec * factor);
      layout(p);
      p.scroller.scrollLeft = pos * totalWidth(p) - ax + GUTTER;
    }
    redrawAll();
  }
  function setMode(m) {
    mode = m;
    panels.forEach((p) => { fit(p); layout(p); p.scroller.scrollLeft = 0; });
    document.querySelectorAll("input[name=mode]").forEach((i) => { i.checked = i.value === m; });
    redrawAll();
  }
  function wire(p) {
    p.scroller.addEventListener("scroll", () => {
      for (const q of panels) {
        if (q === p) continue;
        if (q.scroller.scrollTop !== p.scroller.scrollTop) q.scroller.scrollTop = p.scroller.scrollTop;
        if (q.pxPerCol === p.pxPerCol && q.scroller.scrollLeft !== p.scroller.scrollLeft) q.scroller.scrollLeft = p.scroller.scrollLeft;
      }
      redrawAll();
    });
    p.scroller.addEventListener("mousemove", (ev) => onMove(p, ev));
    p.scroller.addEventListener("mouseleave", hide);
    p.scroller.addEventListener("click", (ev) => { pinned = false; onMove(p, ev); pinned = !tooltip.hidden; tooltip.classList.toggle("pinned", pinned); });
    p.scroller.addEventListener("wheel", (ev) => {
      if (!ev.ctrlKey) return;
      ev.preventDefault();
      zoom(ev.deltaY < 0 ? 1.25 : 0.8, ev.clientX - p.scroller.getBoundingClientRect().left);
    }, { passive: false });
  }

  const started = performance.now();
  let panels = [];
  panels = DATA.panels.map(makePanel);
  const container = document.getElementById("panels");
  panels.forEach((p) => { container.appendChild(p.el); p.maxes = maxes(p); });
  legend();
  const notes = DATA.panels.flatMap((m) => m.notes.map((n) => `${m.label}: ${n}`));
  document.getElementById("notes").textContent = notes.length ? "Dropped or aggregated: " + notes.join("; ") : "Nothing dropped.";
  panels.forEach((p) => { fit(p); layout(p); wire(p); });
  document.querySelectorAll("input[name=mode]").forEach((i) => i.addEventListener("change", () => setMode(i.value)));
  document.getElementById("zoom-in").onclick = () => zoom(2);
  document.getElementById("zoom-out").onclick = () => zoom(0.5);
  document.getElementById("zoom-fit").onclick = () => setMode(mode);
  window.addEventListener("resize", () => { panels.forEach(layout); redrawAll(); });
  panels.forEach(redraw);
  const renderMs = performance.now() - started;
  document.getElementById("status").textContent = `${DATA.rowIds.length} rows, drawn in ${renderMs.toFixed(0)} ms`;
  if (OPTIONS.refreshSeconds) restoreAndRefresh(OPTIONS.refreshSeconds);

  function restoreAndRefresh(seconds) {  // live page: reload, keeping the view
    const key = "tokenweir-timeline-view";
    try {
      const v = JSON.parse(sessionStorage.getItem(key) || "null");
      if (v) panels.forEach((p, i) => { p.scroller.scrollTop = v.top; p.scroller.scrollLeft = v.lefts[i] ?? 0; });
    } catch (e) { /* a fresh view */ }
    setTimeout(() => {
      sessionStorage.setItem(key, JSON.stringify({ top: panels[0]?.scroller.scrollTop ?? 0, lefts: panels.map((p) => p.scroller.scrollLeft) }));
      location.reload();
    }, seconds * 1000);
  }

  // ---- test hooks -----------------------------------------------------------------------------
  function panelOf(i) { return panels[i]; }
  window.timelineState = {
    ready: true, renderMs, errors, rowIds: DATA.rowIds,
    panels: DATA.panels.map((m) => ({ label: m.label, numSteps: m.numSteps, numCols: m.cols.start.length, bucket: m.bucket, notes: m.notes })),
    notesText: () => document.getElementById("notes").textContent,
    mode: () => mode, setMode,
    stateAt: (i, rid, step) => DATA.states[cellAt(panelOf(i), rid, colOfStep(panelOf(i), step)).state],
    colorAt: (i, rid, step) => DATA.colors[cellAt(panelOf(i), rid, colOfStep(panelOf(i), step)).state],
    // brings a cell into view, zoomed so a column is `px` wide; returns its centre (client px)
    showCell(i, rid, step, px = 16) {
      const p = panelOf(i), c = colOfStep(p, step), r = rowIndex.get(rid);
      mode = "step"; p.pxPerCol = px; layout(p);
      p.scroller.scrollLeft = Math.max(0, colX(p, c) - 40);
      scrollAllTo(Math.max(0, r * ROW_H - 40));
      redraw(p);
      const rect = p.scroller.getBoundingClientRect();
      return { x: rect.left + GUTTER + colX(p, c) - p.scroller.scrollLeft + px / 2,
               y: rect.top + r * ROW_H - p.scroller.scrollTop + ROW_H / 2 };
    },
    // scrolls a cell's row into view at the current zoom; returns its centre (client px)
    cellCenter(i, rid, step) {
      const p = panelOf(i), c = colOfStep(p, step), r = rowIndex.get(rid);
      scrollAllTo(Math.max(0, r * ROW_H - 60));
      const x = GUTTER + (colX(p, c) + colEndX(p, c)) / 2;
      if (x - GUTTER < p.scroller.scrollLeft || x > p.scroller.scrollLeft + p.scroller.clientWidth) p.scroller.scrollLeft = Math.max(0, x - 200);
      panels.forEach(redraw);
      const rect = p.scroller.getBoundingClientRect();
      return { x: rect.left + x - p.scroller.scrollLeft, y: rect.top + r * ROW_H - p.scroller.scrollTop + ROW_H / 2 };
    },
    pixelAt(i, x, y) {  // the grid canvas's colour at client (x, y), as #rrggbb
      const p = panelOf(i), rect = p.canvas.getBoundingClientRect(), dpr = window.devicePixelRatio || 1;
      const d = p.canvas.getContext("2d").getImageData(Math.round((x - rect.left) * dpr), Math.round((y - rect.top) * dpr), 1, 1).data;
      return "#" + [d[0], d[1], d[2]].map((v) => v.toString(16).padStart(2, "0")).join("");
    },
    tooltipText: () => (tooltip.hidden ? "" : tooltip.textContent),
    hoverRow: () => (hoverRow >= 0 ? DATA.rowIds[hoverRow] : null),
    // times a full redraw of every panel at the current view (ms)
    timeRedraw() { const t = performance.now(); panels.forEach(redraw); return performance.now() - t; },
    scrollBy(dx, dy) { panels.forEach((p) => { p.scroller.scrollLeft += dx; p.scroller.scrollTop += dy; redraw(p); }); },
    zoom,
  };
})();
