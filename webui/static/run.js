// The run page: which node is slow, where time goes, what failures cost. Loads every
// series once, then polls with cursors (common.js R.live) and redraws what changed.
"use strict";

(() => {
  const runId = document.body.dataset.run;
  const base = "runs/" + R.runPath(runId);
  const series = (metric, by) => new C.SeriesBuf(base + "/series", {metric, by});
  const imbalanceShape = (b) => ["step_time", "compute_time"].map(
    (key) => ({key, step: b.step, time: b.time, value: b[key]}));
  const bufs = {
    throughput: series("samples_per_s", "host"), steptime: series("step_time", "slot"),
    datatime: series("data_time", "slot"),
    comm: series("comm_fraction", "all"), bw: series("bus_bandwidth", "all"),
    loss: series("loss", "all"), imbalance: new C.SeriesBuf(base + "/imbalance", {}, imbalanceShape),
    hosts: H.buffer(base + "/hosts"),
  };
  const d = {run: null, events: [], eventCursor: null, recoveries: [], timeline: null,
             breakdown: {step: [], parts: []}, pipeline: null, by: "slot", custom: new Map()};

  // Processes are host:slot (stable across resets); the rank they had is a detail.
  const label = (key) => (d.by === "rank" ? "rank " + key : String(key));

  async function loadEvents() {
    const body = await R.api(base + "/events", {since: d.eventCursor});
    d.events = d.events.concat(body.events);
    d.eventCursor = body.cursor;
  }

  async function loadBreakdown() {
    d.breakdown = await B.load(base + "/series", d.by);
  }

  async function loadDerived() {
    const [rec, timeline, pipe] = await Promise.all([R.api(base + "/recoveries"),
      R.api(base + "/timeline"), R.api(base + "/pipeline"), loadBreakdown(), loadCustom()]);
    d.recoveries = rec.recoveries;
    d.timeline = timeline;
    d.pipeline = pipe.pipeline;
  }

  // User-logged metrics (eval loss, accuracy, ...): one chart each, polled by id cursor.
  async function loadCustom() {
    const {names} = await R.api(base + "/metrics/custom");
    for (const {name} of names) {
      if (!d.custom.has(name)) d.custom.set(name, {name, step: [], time: [], value: [], rank: [], cursor: null});
    }
  }

  async function pollCustom() {
    let changed = false;
    await Promise.all([...d.custom.values()].map(async (m) => {
      const body = await R.api(base + "/metrics/custom", {name: m.name, since: m.cursor});
      if (!body.value.length) return;
      for (const f of ["step", "time", "value", "rank"]) m[f] = m[f].concat(body[f]);
      m.cursor = body.cursor;
      changed = true;
    }));
    return changed;
  }

  // Series and events poll with cursors: cheap however long the run. The run summary,
  // recoveries, breakdown and timeline scan the whole run: they follow at most every
  // SLOW_MS while something changes, and once a minute anyway (a status change).
  const SLOW_MS = Math.max(5 * R.pollMs, 5000);
  let slowAt = 0, dirty = false;
  async function loadSlow() {
    [d.run] = await Promise.all([R.api(base), loadDerived()]);
    slowAt = Date.now();
    dirty = false;
  }

  async function refresh(full) {
    if (full) {
      await Promise.all([...Object.values(bufs).map((b) => b.load()), loadEvents(), loadSlow()]);
      await pollCustom();
      return render();
    }
    const seen = d.eventCursor;
    const fresh = await Promise.all(Object.values(bufs).map((b) => b.poll()));
    await loadEvents();
    const custom = await pollCustom();
    const changed = fresh.some(Boolean) || d.eventCursor !== seen || custom;
    dirty = dirty || changed;
    const age = Date.now() - slowAt;
    const slow = (dirty && age > SLOW_MS) || age > 60_000;
    if (slow) await loadSlow();
    if (changed || slow) render();
  }

  function ctx() { return {t0: d.run.started_at, timeline: d.timeline}; }

  function renderTiles() {
    const r = d.run;
    const status = document.getElementById("run-status");
    status.textContent = r.status;
    status.className = "badge " + r.status;
    status.title = r.error || (r.status === "lost" ? "running, but no rows for a while" : "");
    document.getElementById("run-name").textContent = r.name || "";
    document.getElementById("run-tags").replaceChildren(...r.tags.map((t) =>
      R.el("a", {class: "tag", href: "/?tag=" + encodeURIComponent(t)}, t)));
    const error = document.getElementById("run-error");
    error.hidden = !r.error;
    error.textContent = r.error ? "Failed: " + r.error : "";
    const tiles = [
      ["Job", r.job, r.launcher],
      ["World size now", r.world_size,
       `min ${r.world_size_min ?? "–"} · max ${r.world_size_max ?? "–"}`],
      ["Throughput", R.fmt.num(r.throughput), "samples/s overall"],
      ["Last step", r.last_step, `${r.step_rows} step rows`],
      ["Duration", R.fmt.secs(r.duration_s), ""],
      ["Started", new Date(r.started_at * 1000).toLocaleTimeString([], {hour: "2-digit",
                                                                      minute: "2-digit"}),
       new Date(r.started_at * 1000).toLocaleDateString()],
      ["Failures survived", `${r.failures_survived} / ${r.failures}`, ""],
      ["Processes · hosts", `${r.ranks} · ${r.hosts.length}`, r.hosts.join(" ")],
    ];
    document.getElementById("tiles").replaceChildren(...tiles.map(([k, v, sub]) =>
      R.el("div", {class: "tile"}, R.el("div", {class: "k"}, k),
           R.el("div", {class: "v"}, v ?? "–"), R.el("div", {class: "sub", title: sub}, sub))),
      B.tile(d.breakdown));
  }

  function drawTime(id, title, yTitle, traces, extra) {
    const ov = C.overlay(d.events, ctx());
    R.draw(id, traces.concat(ov.traces), C.timeLayout(title, yTitle, ov, extra));
  }

  function renderThroughput(t0) {
    const hosts = bufs.throughput.series;
    const total = new Map();
    for (const s of hosts) s.step.forEach((st, i) => {
      const prev = total.get(st) || {time: s.time[i], value: 0};
      total.set(st, {time: prev.time, value: prev.value + (s.value[i] || 0)});
    });
    const steps = [...total.keys()].sort((a, b) => a - b);
    const sum = {step: steps, time: steps.map((s) => total.get(s).time),
                 value: steps.map((s) => total.get(s).value)};
    const traces = hosts.map((s) => C.line(s.key, s, t0, {}, bufs.throughput.bucket));
    if (hosts.length > 1) traces.push(C.line("total", sum, t0, {line: {dash: "dot", width: 2.5}}));
    drawTime("chart-throughput", "Throughput per host and total", "samples/s", traces);
  }

  function renderHeatmap(t0) {
    const rows = bufs.steptime.series;
    if (!rows.length) return C.empty("chart-heatmap", "Step time heatmap", "no steps yet");
    const steps = [...new Set(rows.flatMap((s) => s.step))].sort((a, b) => a - b);
    const col = new Map(steps.map((s, i) => [s, i]));
    const times = new Array(steps.length).fill(null);
    const z = rows.map((s) => {
      const row = new Array(steps.length).fill(null);
      s.step.forEach((st, i) => { row[col.get(st)] = s.value[i]; times[col.get(st)] = s.time[i]; });
      return row;
    });
    const ov = C.overlay(d.events, ctx(), false);
    const lay = C.timeLayout("Step time per " + (d.by === "rank" ? "rank" : d.by) + " (s)", "", ov);
    lay.yaxis = Object.assign(lay.yaxis, {type: "category", autorange: "reversed"});
    R.draw("chart-heatmap", [{type: "heatmap", x: R.xs(steps, times, t0),
      y: rows.map((s) => R.esc(label(s.key))), z, colorscale: "YlOrRd", reversescale: true,
      hovertemplate: "%{y}<br>x %{x}: %{z:.4f} s<extra></extra>", colorbar: {thickness: 10}}], lay);
  }

  function render() {
    const t0 = d.run.started_at;
    renderTiles();
    renderThroughput(t0);
    drawTime("chart-steptime", "Step time per " + (d.by === "slot" ? "process" : d.by), "seconds",
             bufs.steptime.series.map((s) => C.line(label(s.key), s, t0, {}, bufs.steptime.bucket)));
    renderHeatmap(t0);
    // A loader re-warming after a reset shows here, apart from compute.
    drawTime("chart-datatime", "Waiting for data per " + (d.by === "slot" ? "process" : d.by), "seconds",
             bufs.datatime.series.map((s) => C.line(label(s.key), s, t0, {}, bufs.datatime.bucket)));
    const [st, ct] = ["step_time", "compute_time"].map((k) => bufs.imbalance.get(k));
    drawTime("chart-imbalance", "Imbalance: max / median across ranks", "ratio",
             st ? [C.line("step time", st, t0), C.line("compute time", ct, t0)] : []);
    B.render("chart-breakdown", d.breakdown, label);
    const comm = bufs.comm.get("all");
    let bw = bufs.bw.get("all");
    if (bw && !bw.value.some((v) => v > 0)) bw = null;  // one rank: no allreduce traffic
    // The ceiling: a plain memory copy's bandwidth, measured by rank 0 at start.
    const calibration = d.events.find((e) => e.kind === "calibration");
    const bound = bw && calibration && calibration.detail.memcpy_bytes_per_s;
    drawTime("chart-comm", "Communication", "comm / step time",
             [comm && C.line("comm fraction", comm, t0),
              bw && C.line("bus bandwidth (B/s)", bw, t0, {yaxis: "y3", line: {dash: "dot"}}),
              bound && C.line("memory-copy bound (B/s)",
                              {step: bw.step, time: bw.time, value: bw.value.map(() => bound)},
                              t0, {yaxis: "y3", line: {dash: "dash", width: 1}})]
               .filter(Boolean),
             bw ? {yaxis3: {overlaying: "y", side: "right", title: {text: "bytes/s"},
                            showgrid: false, automargin: true}} : {});
    const tl = d.timeline;
    drawTime("chart-world", "World size", "ranks",
             [C.line("world size", {step: tl.step, time: tl.time, value: tl.world_size}, t0,
                     {line: {shape: "hv", width: 2.5}})]);
    renderLoss(t0);
    H.render(bufs.hosts, t0, d.timeline, drawTime);
    renderCustom(t0);
    renderPipeline();
    renderRecoveries();
    renderConfig();
  }

  function renderCustom(t0) {
    const box = document.getElementById("custom-charts");
    document.getElementById("custom-section").hidden = d.custom.size === 0;
    for (const m of d.custom.values()) {
      const id = "custom-" + [...m.name].map((c) => c.charCodeAt(0).toString(16)).join("");
      if (!document.getElementById(id)) {
        box.append(R.el("div", {class: "card chart", id, "data-metric": m.name}));
      }
      // Values logged without a step sit at the step the run was at then.
      const steps = m.step.map((st, i) => st ?? C.stepAt(d.timeline, m.time[i]));
      drawTime(id, m.name, "value", [C.line(m.name, {step: steps, time: m.time, value: m.value}, t0,
                                            {mode: "lines+markers"})]);
    }
  }

  // The run's whole config as a table: one row per setting, sections flattened.
  function flatten(obj, prefix, out) {
    for (const [k, v] of Object.entries(obj || {})) {
      if (v && typeof v === "object" && !Array.isArray(v)) flatten(v, prefix + k + ".", out);
      else out.push([prefix + k, JSON.stringify(v)]);
    }
    return out;
  }

  function renderConfig() {
    const rows = flatten(d.run.config, "", []);
    document.querySelector("#config tbody").replaceChildren(...(rows.length ? rows.map(([k, v]) =>
      R.el("tr", {}, R.el("td", {}, k), R.el("td", {class: "mono"}, v)))
      : [R.el("tr", {}, R.el("td", {colspan: 2, class: "muted"},
          d.run.config_error ? "config unreadable: " + d.run.config_error : "no config recorded"))]));
    const form = document.getElementById("manage");
    if (!form.dataset.filled) {   // fill once; the user may be typing
      form.elements.name.value = d.run.name || "";
      form.elements.tags.value = d.run.tags.join(", ");
      form.elements.notes.value = d.run.notes || "";
      form.dataset.filled = "1";
    }
  }

  document.getElementById("manage").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const f = ev.target.elements;
    const note = document.getElementById("manage-status");
    try {
      d.run = Object.assign(d.run, await R.write(base, "PATCH", {name: f.name.value.trim() || null,
        tags: f.tags.value.split(",").map((t) => t.trim()).filter(Boolean), notes: f.notes.value}));
      note.textContent = "saved";
      render();
    } catch (err) { note.textContent = "not saved: " + err.message; }
  });
  document.getElementById("delete-run").addEventListener("click", async () => {
    if (!confirm(`Delete run ${runId} and every row of it?`)) return;
    try {
      await loaded;
      await poller.stop();
      await R.write(base, "DELETE");
      location.href = "/";
    } catch (err) { document.getElementById("manage-status").textContent = "not deleted: " + err.message; }
  });

  function renderLoss(t0) {
    const loss = bufs.loss.get("all");
    if (!loss) return C.empty("chart-loss", "Loss", "no loss recorded");
    const weight = Number(document.getElementById("smooth").value);
    drawTime("chart-loss", "Loss", "loss", [
      C.line("raw", loss, t0, {opacity: 0.35}),
      C.line("smoothed", Object.assign({}, loss, {value: C.smooth(loss.value, weight)}), t0,
             {line: {width: 2.5}})]);
  }

  function renderPipeline() {
    const p = d.pipeline;
    document.getElementById("pipeline-section").hidden = !p;
    if (!p) return;
    const mean = (a) => a.reduce((x, y) => x + y, 0) / a.length;
    const stages = p.stages.map((s) => "stage " + s.stage);
    R.draw("chart-stage-busy", [
      {type: "bar", name: "busy", x: stages, y: p.stages.map((s) => mean(s.busy))},
      {type: "bar", name: "idle (bubble)", x: stages,
       y: p.stages.map((s) => mean(s.step_time) - mean(s.busy))}],
      Object.assign(R.layout("Per-stage busy vs idle (mean s per step)"),
                    {barmode: "stack", xaxis: {title: {text: ""}},
                     legend: {orientation: "h", y: -0.15, traceorder: "normal"}}));
    const lay = R.layout(`Bubble per stage (run: ${(100 * p.overall).toFixed(1)} %)`);
    lay.xaxis.title = {text: "step"};
    lay.yaxis = Object.assign(lay.yaxis, {tickformat: ".0%", type: "linear"});
    R.draw("chart-bubble", p.stages.map((s) => ({type: "scatter", mode: "lines",
      name: "stage " + s.stage, x: s.step, y: s.bubble})), lay);
  }

  // Which state the re-formed world trained on, and what it moved to get there.
  const PATHS = {recovered_live: "live state", adopted: "live state (some ranks behind)",
                 restored_commit: "commit", restored_checkpoint: "checkpoint"};
  function wentOnFrom(r) {
    if (!r.recovered_from) return "–";
    const moved = r.moved_bytes ? `, ${R.fmt.num(r.moved_bytes)}B moved` : ", nothing moved";
    return (PATHS[r.recovered_from] || r.recovered_from) + moved;
  }

  function renderRecoveries() {
    const body = document.querySelector("#recoveries tbody");
    if (!d.recoveries.length) {
      body.replaceChildren(R.el("tr", {}, R.el("td", {colspan: 12, class: "muted"},
        "No failures or host changes recorded.")));
    } else {
      body.replaceChildren(...d.recoveries.map((r) => R.el("tr", {class: "recovery " + r.kind},
        R.el("td", {class: "kind " + r.kind}, r.kind), R.el("td", {}, r.host),
        R.el("td", {}, r.fault ? r.fault + " (injected)" : "–"),
        R.el("td", {class: "num"}, r.step),
        R.el("td", {class: "num"}, (r.wall_time - d.run.started_at).toFixed(1)),
        ...["detected_s", "reset_done_s", "state_synced_s", "first_step_done_s"].map(
          (k) => R.el("td", {class: "num"}, R.fmt.secs(r[k]))),
        R.el("td", {class: "num"}, r.steps_redone),
        R.el("td", {class: "went-on-from"}, wentOnFrom(r)),
        R.el("td", {class: "num"}, r.size_before ? `${r.size_before} → ${r.size_after}` : "–"))));
    }
    const counts = new Map();
    for (const e of C.dedupe(d.events)) counts.set(e.kind, (counts.get(e.kind) || 0) + 1);
    // counts are per kind; labels come from the server's table
    document.getElementById("event-counts").replaceChildren(R.el("span", {class: "muted"}, "Events:"),
      ...(counts.size ? [...counts].map(([k, n]) => R.el("span", {},
        R.el("span", {class: "kind " + k}, k), " ×" + n)) : [R.el("span", {class: "muted"}, "none")]));
  }

  document.getElementById("smooth").addEventListener("input", (ev) => {
    document.getElementById("smooth-value").textContent = Number(ev.target.value).toFixed(2);
    if (d.run) renderLoss(d.run.started_at);
  });
  document.getElementById("by").addEventListener("change", async (ev) => {
    d.by = ev.target.value;
    bufs.steptime = series("step_time", d.by);
    bufs.datatime = series("data_time", d.by);
    await Promise.all([bufs.steptime.load(), bufs.datatime.load(), loadBreakdown()]).catch(R.showError);
    if (d.run) render();    // else the first load, still under way, draws with the new series
  });
  R.controls(() => d.run && render());
  let poller = null;
  const loaded = refresh(true).catch(R.showError).finally(() => { poller = R.live(() => refresh(false)); });
})();
