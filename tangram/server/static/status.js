// The broker's status page: polls /v1/status/history (the sampled time series) and /v1/resources (the state now)
// and draws line charts with uPlot (vendored: uplot-*.min.js, see THIRD_PARTY.md). Nothing is loaded from elsewhere.
"use strict";

(() => {
  const HEIGHT = 240;  // the chart's CSS height; its width follows the page
  // Okabe-Ito colours: distinguishable with the common colour-vision deficiencies
  const PALETTE = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#000000", "#999999"];
  const ACT_SERIES = [
    { key: "act_p50_s", name: "p50", colour: "#0072B2" },
    { key: "act_p90_s", name: "p90", colour: "#E69F00" },
    { key: "act_p99_s", name: "p99", colour: "#D55E00" },
  ];
  const INK = "#1f2328", MUTED = "#59636e", GRID = "#eaeef2";

  const state = {
    samples: [], lastT: null, intervalS: 2, keepS: 900, colours: new Map(), lastUpdate: null, now: null,
  };

  // -- formatting -------------------------------------------------------------------------------------------

  const clock = (t) => new Date(t * 1000).toLocaleTimeString([], { hour12: false });

  function seconds(value) {
    if (value === null || value === undefined) return "–";
    if (value < 1) return `${Number((value * 1000).toPrecision(3))} ms`;
    return `${Number(value.toPrecision(3))} s`;
  }

  const plain = (value) => String(Number(value.toPrecision(4)));
  const percent = (fraction) => `${Math.round(fraction * 100)}%`;
  const ratio = (value) => (value === null ? "–" : `${value.toFixed(2)}×`);

  function niceStep(rough) {
    const power = 10 ** Math.floor(Math.log10(rough));
    const fraction = rough / power;
    return (fraction <= 1 ? 1 : fraction <= 2 ? 2 : fraction <= 5 ? 5 : 10) * power;
  }

  // Ticks from 0 to a round top at or above `max`; `integer` keeps the step at 1 or more (counts of actions).
  function ticksUpTo(max, integer) {
    const step = integer ? Math.max(1, niceStep(Math.max(max, 1) / 4)) : niceStep(max > 0 ? max / 4 : 0.001);
    const top = Math.max(step, Math.ceil(max / step - 1e-9) * step);
    const ticks = [];
    for (let value = 0; value <= top + step / 2; value += step) ticks.push(Number(value.toPrecision(12)));
    return ticks;
  }

  // -- charts ---------------------------------------------------------------------------------------------------

  // uPlot's columns: the sample times, then one column per series. A gap of more than `gapS` between samples (the
  // broker was away) gets a row of nulls, which breaks every line there, as a null value does.
  function columns(times, series, gapS) {
    const xs = [];
    const ys = series.map(() => []);
    times.forEach((t, i) => {
      if (i && t - times[i - 1] > gapS) {
        xs.push(times[i - 1] + gapS);
        ys.forEach((column) => column.push(null));
      }
      xs.push(t);
      series.forEach((line, s) => ys[s].push(line.values[i] ?? null));
    });
    return [xs, ...ys];
  }

  // Draw `series` ([{name, colour, values (one per time, or null), total?}]) in the chart element `holder`, on the
  // y ticks given; the first series is drawn on top. The uPlot instance stays on the element (`holder.chart`),
  // kept while the series stay the same and made anew when they change; a test reads the plotted values from it.
  function drawChart(holder, { series, times, yTicks, yTitle, formatTick, tMin, tMax, gapS, empty }) {
    const shown = holder.querySelector(".empty");
    shown.hidden = !empty;
    shown.textContent = empty ?? "";
    const width = Math.max(320, Math.round(holder.getBoundingClientRect().width));
    const names = series.map((line) => `${line.name}:${line.colour}`).join("|");
    const drawn = [...series].reverse();  // uPlot paints in order: the last on top
    holder.xRange = [tMin, tMax];
    holder.yRange = [0, yTicks[yTicks.length - 1]];
    holder.yTicks = yTicks;
    let chart = holder.chart;
    if (chart === undefined || chart.names !== names) {
      chart?.destroy();
      chart = new uPlot({
        width, height: HEIGHT, legend: { show: false }, cursor: { y: false },
        scales: { x: { time: true, range: () => holder.xRange }, y: { range: () => holder.yRange } },
        axes: [
          { label: "time (local clock)", stroke: MUTED, labelFont: "13px system-ui", font: "12px system-ui",
            grid: { stroke: GRID }, ticks: { stroke: MUTED } },
          { label: yTitle, stroke: MUTED, labelFont: "13px system-ui", font: "12px system-ui", size: 56,
            grid: { stroke: GRID }, ticks: { stroke: MUTED }, splits: () => holder.yTicks,
            values: (u, splits) => splits.map(formatTick) },
        ],
        series: [{}, ...drawn.map((line) => ({
          label: line.name, stroke: line.colour, width: 2, dash: line.total ? [5, 3] : undefined,
          points: { size: 5, fill: line.colour },
        }))],
      }, null, holder);
      chart.names = names;
      holder.chart = chart;
    }
    if (chart.width !== width) chart.setSize({ width, height: HEIGHT });
    chart.setData(columns(times, drawn, gapS));
  }

  function drawLegend(list, entries) {
    list.replaceChildren(...entries.map(({ name, colour, value, total }) => {
      const item = document.createElement("li");
      item.dataset.series = name;
      const swatch = document.createElement("span");
      swatch.className = total ? "swatch total" : "swatch";
      swatch.style.borderTopColor = colour;
      swatch.setAttribute("aria-hidden", "true");
      const label = document.createElement("span");
      label.textContent = name;
      const latest = document.createElement("span");
      latest.className = "value";
      latest.textContent = value;
      item.append(swatch, label, latest);
      return item;
    }));
  }

  // -- the three charts -----------------------------------------------------------------------------------

  function colourOf(resource) {
    if (!state.colours.has(resource)) state.colours.set(resource, PALETTE[state.colours.size % PALETTE.length]);
    return state.colours.get(resource);
  }

  function resourcesSeen() {
    const names = new Set();
    for (const sample of state.samples) for (const name of Object.keys(sample.utilization)) names.add(name);
    return Array.from(names).sort();
  }

  function timeRange() {
    const samples = state.samples;
    if (!samples.length) {
      const empty = `No samples yet: the broker samples every ${plain(state.intervalS)} s.`;
      return { times: [], tMin: 0, tMax: 1, gapS: 0, empty };
    }
    const tMax = samples[samples.length - 1].t;
    return { times: samples.map((s) => s.t), tMin: Math.min(samples[0].t, tMax - state.intervalS), tMax,
      gapS: 3 * state.intervalS, empty: null };
  }

  function describe(id, latest, parts) {
    document.getElementById(id).textContent = latest
      ? `Latest sample at ${clock(latest.t)}: ${parts.join(", ")}.` : "No samples yet.";
  }

  function drawUtilization(range, latest) {
    const series = resourcesSeen().map((name) => ({
      name, colour: colourOf(name),
      values: state.samples.map((s) => (name in s.utilization ? s.utilization[name] * 100 : null)),
    }));
    drawChart(document.getElementById("chart-utilization"), { ...range, series, yTicks: [0, 25, 50, 75, 100],
      yTitle: "utilization (%)", formatTick: (v) => `${v}%` });
    const values = series.map((s) => (latest && s.name in latest.utilization ? percent(latest.utilization[s.name])
      : "–"));
    drawLegend(document.getElementById("legend-utilization"),
      series.map((s, i) => ({ name: s.name, colour: s.colour, value: values[i] })));
    describe("utilization-desc", latest, series.map((s, i) => `${s.name} ${values[i]}`));
  }

  function drawQueue(range, latest) {
    const perResource = resourcesSeen().map((name) => ({
      name, colour: colourOf(name), values: state.samples.map((s) => (name in s.queued ? s.queued[name] : null)),
    }));
    const total = { name: "total", colour: INK, total: true, values: state.samples.map((s) => s.queued_total) };
    const series = [total, ...perResource];
    const highest = Math.max(0, ...state.samples.map((s) => s.queued_total),
      ...state.samples.flatMap((s) => Object.values(s.queued)));
    drawChart(document.getElementById("chart-queue"), { ...range, series, yTicks: ticksUpTo(highest, true),
      yTitle: "queued actions", formatTick: plain });
    const valueOf = (s) => (latest ? String(s.total ? latest.queued_total : latest.queued[s.name] ?? "–") : "–");
    drawLegend(document.getElementById("legend-queue"),
      series.map((s) => ({ name: s.name, colour: s.colour, total: s.total, value: valueOf(s) })));
    describe("queue-desc", latest, series.map((s) => `${s.name} ${valueOf(s)}`));
  }

  function drawAct(range, latest) {
    const series = ACT_SERIES.map(({ key, name, colour }) => ({
      name, colour, values: state.samples.map((s) => s[key]),
    }));
    const highest = Math.max(0, ...state.samples.map((s) => s.act_p99_s ?? 0));
    drawChart(document.getElementById("chart-act"), { ...range, series, yTicks: ticksUpTo(highest, false),
      yTitle: "ACT (s)", formatTick: plain });
    const lastFinished = [...state.samples].reverse().find((s) => s.finished > 0);
    const valueOf = (key) => (lastFinished ? seconds(lastFinished[key]) : "–");
    drawLegend(document.getElementById("legend-act"),
      ACT_SERIES.map(({ key, name, colour }) => ({ name, colour, value: valueOf(key) })));
    const parts = ACT_SERIES.map(({ key, name }) => `${name} ${valueOf(key)}`);
    describe("act-desc", latest, lastFinished
      ? [`${lastFinished.finished} actions finished in the interval ending ${clock(lastFinished.t)}`, ...parts]
      : ["no action finished yet"]);
  }

  // -- the state now: header and table --------------------------------------------------------------------

  function cell(row, text, className) {
    const td = document.createElement("td");
    if (className) td.className = className;
    td.textContent = text;
    row.append(td);
    return td;
  }

  function drawNow(now) {
    const stats = now.stats;
    document.getElementById("total-queued").textContent = String(stats.queued);
    document.getElementById("total-running").textContent = String(stats.running);
    document.getElementById("total-leases").textContent = String(stats.leases);
    document.getElementById("total-act-p50").textContent = seconds(stats.act_p50_s);
    const rows = now.resources.map((r) => {
      const row = document.createElement("tr");
      row.dataset.resource = r.resource;
      row.dataset.pool = r.pool;
      cell(row, r.resource);
      cell(row, r.pool);
      cell(row, r.manager);
      cell(row, String(r.in_use), "num in-use");
      cell(row, String(r.capacity), "num capacity");
      const usage = cell(row, "");
      const meter = document.createElement("meter");
      Object.assign(meter, { min: 0, max: Math.max(r.capacity, 1), value: r.in_use });
      meter.setAttribute("aria-label", `${r.resource} ${r.pool} utilization`);
      const pct = document.createElement("span");
      pct.className = "pct";
      pct.textContent = r.capacity ? percent(r.in_use / r.capacity) : "–";
      usage.append(meter, pct);
      cell(row, String(r.queued), "num queued");
      return row;
    });
    if (!rows.length) {
      const row = document.createElement("tr");
      row.className = "empty";
      cell(row, "This broker has no resources.").colSpan = 7;
      rows.push(row);
    }
    document.querySelector("#resources tbody").replaceChildren(...rows);
    drawSlo(now.slo);
    drawPlacement(now.placement);
  }

  function drawPlacement(placement) {
    document.getElementById("placement-panel").hidden = !placement;
    if (!placement) return;
    document.getElementById("placement-how").textContent = placement.answered_by === null
      ? `${placement.method}: not solved yet (no demand measured).`
      : `${placement.method}, answered by ${placement.answered_by}: every load served ` +
        `${placement.objective === null ? "–" : placement.objective.toPrecision(3)}×, solved in ` +
        `${placement.solve_s.toFixed(3)} s` + (placement.fallback ? ` (fell back: ${placement.fallback})` : "") + ".";
    const rows = placement.services.map((s) => {
      const row = document.createElement("tr");
      row.dataset.service = s.service;
      cell(row, s.service);
      cell(row, s.load.toFixed(3), "num load");
      cell(row, Object.entries(s.types).map(([kind, gpus]) => `${kind} ${gpus.toFixed(2)}`).join(", ") || "–",
           "types");
      cell(row, s.confined ? "yes" : "no (every node)", "confined");
      return row;
    });
    document.querySelector("#placement tbody").replaceChildren(...rows);
  }

  function drawSlo(tasks) {
    document.getElementById("slo-panel").hidden = !tasks.length;
    const rows = tasks.map((t) => {
      const row = document.createElement("tr");
      row.dataset.task = t.task;
      cell(row, t.task);
      cell(row, ratio(t.slo), "num slo");
      const predicted = cell(row, t.predicted_slowdown === null ? "unbounded" : ratio(t.predicted_slowdown),
                             "num predicted");
      if (t.predicted_slowdown === null || t.predicted_slowdown > t.slo) predicted.classList.add("over");
      cell(row, t.reserved_gpus ? String(t.reserved_gpus) : "–", "num reserved");
      cell(row, String(t.windows), "num windows");
      cell(row, String(t.within), "num within");
      cell(row, t.attainment === null ? "–" : percent(t.attainment), "num attainment");
      cell(row, ratio(t.last_slowdown), "num last");
      return row;
    });
    document.querySelector("#slo tbody").replaceChildren(...rows);
  }

  // -- polling --------------------------------------------------------------------------------------------

  const pollDelayMs = () => Math.min(3000, Math.max(500, state.intervalS * 1000));

  function absorb(history) {
    state.intervalS = history.interval_s;
    state.keepS = history.keep_s;
    for (const sample of history.samples) {
      if (state.lastT === null || sample.t > state.lastT) {
        state.samples.push(sample);
        state.lastT = sample.t;
      }
    }
    // the same bound as the broker's ring buffer, so the page shows what the broker still holds
    const keep = Math.ceil(state.keepS / state.intervalS);
    if (state.samples.length > keep) state.samples.splice(0, state.samples.length - keep);
  }

  function render(now) {
    const range = timeRange();
    const latest = state.samples.length ? state.samples[state.samples.length - 1] : null;
    drawUtilization(range, latest);
    drawQueue(range, latest);
    drawAct(range, latest);
    drawNow(now);
    const footer = document.getElementById("footer");
    footer.dataset.samples = String(state.samples.length);
    footer.dataset.lastT = state.lastT === null ? "" : String(state.lastT);
    footer.textContent = `Sampled every ${plain(state.intervalS)} s, keeping ${plain(state.keepS / 60)} min; `
      + `${state.samples.length} samples shown. Updated ${clock(state.lastUpdate)}.`;
  }

  function showConnection(live, reason) {
    const badge = document.getElementById("connection");
    badge.dataset.state = live ? "live" : "disconnected";
    document.body.classList.toggle("stale", !live);
    if (live) {
      badge.textContent = "live";
      badge.title = "";
    } else {
      const since = state.lastUpdate === null ? "no data yet" : `showing data from ${clock(state.lastUpdate)}`;
      badge.textContent = `disconnected (${since}); retrying`;
      badge.title = String(reason);
    }
  }

  async function getJSON(path) {
    const response = await fetch(path, { cache: "no-store", headers: { accept: "application/json" } });
    if (!response.ok) throw new Error(`${path} answered HTTP ${response.status}`);
    return response.json();
  }

  async function poll() {
    let replies;
    try {
      const since = state.lastT === null ? "" : `?since=${state.lastT}`;
      replies = await Promise.all([getJSON(`/v1/status/history${since}`), getJSON("/v1/resources")]);
    } catch (error) {
      showConnection(false, error);  // keep drawing what we have; try again
      setTimeout(poll, pollDelayMs());
      return;
    }
    try {
      state.lastUpdate = Date.now() / 1000;
      absorb(replies[0]);
      state.now = replies[1];
      render(state.now);
      showConnection(true);
    } finally {
      setTimeout(poll, pollDelayMs());
    }
  }

  let resizing = null;
  window.addEventListener("resize", () => {  // charts are drawn at the page's width: redraw at the new one
    clearTimeout(resizing);
    resizing = setTimeout(() => state.now !== null && render(state.now), 150);
  });
  document.addEventListener("DOMContentLoaded", poll);
})();
