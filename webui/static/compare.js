// The comparison page: two or more runs on the same charts (whole-run series), each run
// in one colour; failures and host changes as dashed lines in the run's colour.
"use strict";

(() => {
  const COLORS = ["#2563eb", "#f97316", "#16a34a", "#a855f7", "#e11d48", "#0891b2"];
  const ids = (document.body.dataset.runs || "").split(",").filter(Boolean);
  const CHARTS = [
    ["cmp-throughput", "Throughput (whole run)", "samples/s", "samples_per_s"],
    ["cmp-loss", "Loss", "loss", "loss"],
    ["cmp-steptime", "Step time (mean over ranks)", "seconds", "step_time"],
    ["cmp-comm", "Comm fraction (mean over ranks)", "comm / step time", "comm_fraction"],
  ];
  const runs = new Map();  // id -> {info, color, bufs, events, timeline}

  function load(id, i) {
    const base = "runs/" + R.runPath(id);
    const bufs = Object.fromEntries(CHARTS.map(([, , , metric]) =>
      [metric, new C.SeriesBuf(base + "/series", {metric, by: "all"})]));
    bufs.imbalance = new C.SeriesBuf(base + "/imbalance", {},
      (b) => [{key: "all", step: b.step, time: b.time, value: b.step_time}]);
    const entry = {base, bufs, color: COLORS[i % COLORS.length], events: [], timeline: null};
    runs.set(id, entry);
    return entry;
  }

  // Series poll with cursors (cheap); the timeline scans the whole run, so it follows
  // at most every SLOW_MS while the run changes. Returns whether anything changed.
  const SLOW_MS = Math.max(5 * R.pollMs, 5000);
  async function update(entry, full) {
    const fresh = await Promise.all(Object.values(entry.bufs).map(
      (b) => (full ? b.load().then(() => true) : b.poll())));
    entry.dirty = entry.dirty || fresh.some(Boolean);
    if (!full && !(entry.dirty && Date.now() - entry.slowAt > SLOW_MS)) return fresh.some(Boolean);
    const [info, events, timeline] = await Promise.all([full ? R.api(entry.base) : entry.info,
      R.api(entry.base + "/events", {kinds: Object.keys(EVENT_KINDS).filter(
        (k) => EVENT_KINDS[k].klass === "major").join(",")}),
      R.api(entry.base + "/timeline")]);
    Object.assign(entry, {info, events: events.events, timeline, slowAt: Date.now(), dirty: false});
    return true;
  }

  function draw(id, title, yTitle, pick, extra) {
    const traces = [], shapes = [];
    for (const [runId, r] of runs) {
      if (!r.info) continue;
      const s = pick(r);
      if (s) {
        traces.push(C.line(r.info.name || runId, s, r.info.started_at, Object.assign(
          {line: {color: r.color, width: 2}}, extra || {})));
      }
      for (const e of C.dedupe(r.events).filter((e) => C.KIND(e.kind).klass === "major")) {
        const x = R.state.x === "time" ? e.wall_time - r.info.started_at : e.step;
        shapes.push({type: "line", xref: "x", yref: "paper", x0: x, x1: x, y0: 0, y1: 1,
                     line: {color: r.color, dash: e.kind === "failure" ? "solid" : "dash", width: 1}});
      }
    }
    const lay = R.layout(title, {shapes, hovermode: "x unified"});
    lay.yaxis.title = {text: yTitle};
    R.draw(id, traces, lay);
  }

  function flatten(obj, prefix, out) {
    for (const [k, v] of Object.entries(obj || {})) {
      if (v && typeof v === "object" && !Array.isArray(v)) flatten(v, prefix + k + ".", out);
      else out.set(prefix + k, JSON.stringify(v));
    }
    return out;
  }

  // Every setting of the compared runs; the ones that differ are marked (and, with the
  // box ticked, the only ones shown).
  function renderConfig() {
    const shown = [...runs.entries()].filter(([, r]) => r.info);
    const configs = shown.map(([, r]) => flatten(r.info.config, "", new Map()));
    const keys = [...new Set(configs.flatMap((c) => [...c.keys()]))].sort();
    const onlyDiff = document.getElementById("only-diff").checked;
    const head = R.el("tr", {}, R.el("th", {}, "Setting"), ...shown.map(([id, r]) => {
      const th = R.el("th", {}, r.info.name || id);
      th.style.color = r.color;
      return th;
    }));
    const rows = [];
    for (const k of keys) {
      const values = configs.map((c) => (c.has(k) ? c.get(k) : "–"));
      const differs = new Set(values).size > 1;
      if (onlyDiff && !differs) continue;
      rows.push(R.el("tr", {class: differs ? "diff" : ""}, R.el("td", {}, k),
                     ...values.map((v) => R.el("td", {class: "mono"}, v))));
    }
    document.querySelector("#config-diff thead").replaceChildren(head);
    document.querySelector("#config-diff tbody").replaceChildren(...(rows.length ? rows
      : [R.el("tr", {}, R.el("td", {colspan: shown.length + 1, class: "muted"},
          onlyDiff ? "The configs do not differ." : "No config recorded."))]));
  }

  function render() {
    renderConfig();
    for (const [id, title, yTitle, metric] of CHARTS) {
      draw(id, title, yTitle, (r) => r.bufs[metric].get("all"));
    }
    draw("cmp-imbalance", "Imbalance: max / median step time", "ratio",
         (r) => r.bufs.imbalance.get("all"));
    draw("cmp-world", "World size", "ranks", (r) => r.timeline &&
         {step: r.timeline.step, time: r.timeline.time, value: r.timeline.world_size},
         {line: {shape: "hv", width: 2}});
  }

  function setRuns(next) {
    const url = next.length ? "/compare?runs=" + next.map(encodeURIComponent).join(",") : "/compare";
    location.href = url;
  }

  async function picker() {
    const chips = ids.map((id) => {
      const remove = R.el("button", {type: "button", title: "remove " + id}, "×");
      remove.addEventListener("click", () => setRuns(ids.filter((x) => x !== id)));
      const dot = R.el("span", {class: "dot"});
      dot.style.background = runs.get(id).color;
      const link = R.el("a", {href: "/runs/" + R.runPath(id)}, id);
      return R.el("span", {class: "chip"}, dot, link, remove);
    });
    document.getElementById("picked").replaceChildren(...(chips.length ? chips
      : [R.el("span", {class: "muted"}, "none yet: pick two or more")]));
    const select = document.getElementById("add-run");
    const {runs: all} = await R.api("runs");
    for (const r of all.filter((r) => !ids.includes(r.id))) {
      select.append(R.el("option", {value: r.id}, `${r.id} (${r.job}, ${r.status})`));
    }
    select.addEventListener("change", () => select.value && setRuns(ids.concat([select.value])));
  }

  ids.forEach(load);
  R.controls(render);
  document.getElementById("only-diff").addEventListener("change", renderConfig);
  picker().catch(R.showError);
  Promise.all([...runs.values()].map((r) => update(r, true))).then(render).catch(R.showError)
    .finally(() => R.live(async () => {
      const changed = await Promise.all([...runs.values()].map((r) => update(r, false)));
      if (changed.some(Boolean)) render();
    }));
})();
