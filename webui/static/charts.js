// Chart building blocks shared by the run and comparison pages: series buffers that
// poll with a cursor, event markers for time charts, smoothing.
"use strict";

const C = (() => {
  // Rows reach the store in per-rank batches, so one rank can lag the others by a few
  // steps: every poll asks again for the last LOOKBACK steps and replaces them.
  const LOOKBACK = 20;

  // Buffers one series endpoint: load() fetches all (downsampled), poll() only what
  // follows the cursor. ``shape`` turns a response into [{key, step, time, value}].
  class SeriesBuf {
    constructor(path, params, shape) {
      this.path = path;
      this.params = Object.assign({max_points: 500}, params);
      this.shape = shape || ((body) => body.series);
      this.series = [];
      this.cursor = null;
    }
    async load() {
      const body = await R.api(this.path, this.params);
      this.series = this.shape(body);
      this.cursor = body.cursor;
    }
    // Returns whether anything new arrived.
    async poll() {
      if (this.cursor === null || this.cursor === undefined) { await this.load(); return true; }
      const since = Math.max(-1, this.cursor - LOOKBACK);
      const body = await R.api(this.path, Object.assign({}, this.params, {since}));
      const byKey = new Map(this.series.map((s) => [s.key, s]));
      let before = 0, after = 0;
      for (const fresh of this.shape(body)) {
        after += fresh.step.length;
        const old = byKey.get(fresh.key);
        if (!old) { this.series.push(fresh); continue; }
        const keep = old.step.findIndex((st) => st > since);
        const cut = keep < 0 ? old.step.length : keep;
        before += old.step.length - cut;
        for (const f of ["step", "time", "value"]) old[f] = old[f].slice(0, cut).concat(fresh[f]);
      }
      this.cursor = Math.max(this.cursor, body.cursor ?? this.cursor);
      // Appended points are not downsampled: start afresh once a series grows too long.
      if (this.series.some((s) => s.step.length > 3 * this.params.max_points)) await this.load();
      return after !== before;
    }
    get(key) { return this.series.find((s) => s.key === key); }
  }

  const STYLE = {
    failure: ["#dc2626", "x", "solid"], peer_lost: ["#dc2626", "x-open"],
    restore: ["#f97316", "triangle-left"], reset: ["#a855f7", "diamond", "dot"],
    sync: ["#a855f7", "diamond-open"], resumed: ["#16a34a", "triangle-right"],
    host_added: ["#16a34a", "star", "dash"], host_removed: ["#ca8a04", "star-open", "dash"],
    straggler: ["#ca8a04", "hourglass", "dot"], stall: ["#ca8a04", "hourglass-open", "dot"],
    rebalance: ["#0891b2", "bowtie", "dot"], commit: ["#64748b", "line-ns-open"],
    checkpoint: ["#0891b2", "square-open"], commit_interval: ["#0891b2", "circle-open"],
  };
  const LABELLED = new Set(["failure", "host_added", "host_removed"]);
  const style = (kind) => STYLE[kind] || ["#64748b", "circle-open"];

  // Every rank records the same commit or reset: one marker per kind, step and burst.
  function dedupe(events) {
    const seen = new Map();
    for (const e of events) {
      const key = e.kind + "|" + (e.step ?? "") + "|" + Math.round(e.wall_time / 5);
      const first = seen.get(key);
      if (first) { first.n += 1; first.hosts.add(e.host); continue; }
      seen.set(key, Object.assign({}, e, {n: 1, hosts: new Set([e.host])}));
    }
    return [...seen.values()];
  }

  // Step of a wall time: the step last done before it (events like peer_lost have none).
  function stepAt(timeline, t) {
    let step = null;
    if (timeline) {
      for (let i = 0; i < timeline.time.length && timeline.time[i] <= t; i++) step = timeline.step[i];
    }
    return step;
  }

  function eventX(e, ctx) {
    if (R.state.x === "time") return e.wall_time - ctx.t0;
    return e.step ?? stepAt(ctx.timeline, e.wall_time);
  }

  function describe(e) {
    const detail = Object.entries(e.detail || {}).filter(([, v]) => typeof v !== "object")
      .map(([k, v]) => k + "=" + (typeof v === "number" ? R.fmt.num(v, 4) : v)).join(", ");
    const who = e.kind.startsWith("host_") ? (e.detail || {}).target : [...e.hosts].join(", ");
    return `<b>${R.esc(e.kind)}</b> step ${e.step ?? "–"}<br>${R.esc(who || "")}` +
      `${e.n > 1 ? " (" + e.n + " ranks)" : ""}<br>${R.esc(detail)}`;
  }

  // Lines for the events that change the world, a marker strip for all of them.
  function overlay(events, ctx, withTrace = true) {
    const marks = dedupe(events).map((e) => Object.assign(e, {x: eventX(e, ctx)}))
      .filter((e) => e.x !== null && e.x !== undefined);
    const shapes = [], annotations = [];
    for (const e of marks) {
      const [color, , dash] = style(e.kind);
      if (!dash) continue;
      shapes.push({type: "line", xref: "x", yref: "paper", x0: e.x, x1: e.x, y0: 0, y1: 1,
                   line: {color, width: e.kind === "failure" ? 2 : 1, dash}, layer: "below"});
      if (LABELLED.has(e.kind)) {
        const who = e.kind === "failure" ? [...e.hosts].join(",") : (e.detail || {}).target;
        annotations.push({x: e.x, y: 0.93, xref: "x", yref: "paper", xanchor: "left",
                          yanchor: "top", showarrow: false, font: {size: 10, color},
                          text: (e.kind === "failure" ? "✖ " : "+ ") + R.esc(who || e.kind)});
      }
    }
    const trace = {type: "scatter", mode: "markers", name: "events", yaxis: "y2",
                   x: marks.map((e) => e.x), y: marks.map(() => 0.97), showlegend: false,
                   hovertemplate: "%{text}<extra></extra>", text: marks.map(describe),
                   marker: {size: 9, color: marks.map((e) => style(e.kind)[0]),
                            symbol: marks.map((e) => style(e.kind)[1]), line: {width: 1.5}}};
    return {shapes, annotations, traces: withTrace && marks.length ? [trace] : []};
  }

  // Layout of a time chart with the event overlay on a hidden second y axis.
  function timeLayout(title, yTitle, ov, extra) {
    const lay = R.layout(title, extra);
    lay.yaxis.title = {text: yTitle};
    lay.yaxis2 = {overlaying: "y", range: [0, 1], visible: false, fixedrange: true};
    lay.shapes = ov.shapes;
    lay.annotations = ov.annotations;
    return lay;
  }

  // TensorBoard-style exponential smoothing, debiased so the start is not pulled to 0.
  function smooth(values, weight) {
    let last = 0, n = 0;
    return values.map((v) => {
      if (v === null) return null;
      n += 1;
      last = last * weight + (1 - weight) * v;
      return last / (1 - Math.pow(weight, n));
    });
  }

  function line(name, s, t0, extra) {
    return Object.assign({type: "scatter", mode: "lines", name, x: R.xs(s.step, s.time, t0),
                          y: s.value, customdata: s.step,
                          hovertemplate: `${R.esc(name)}<br>step %{customdata}: %{y:.4g}` +
                                         "<extra></extra>"},
                         extra || {});
  }

  function empty(id, title, message) {
    R.draw(id, [], Object.assign(R.layout(title), {
      xaxis: {visible: false}, yaxis: {visible: false},
      annotations: [{text: message, showarrow: false, xref: "paper", yref: "paper", x: 0.5,
                     y: 0.5, font: {color: R.css("--muted")}}]}));
  }

  return {SeriesBuf, overlay, timeLayout, smooth, line, empty, dedupe, stepAt, LOOKBACK};
})();
