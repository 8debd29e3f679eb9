// Chart building blocks shared by the run and comparison pages: series buffers that
// poll with a cursor, event markers for time charts, smoothing.
"use strict";

const C = (() => {
  // Rows reach the store in per-rank batches, so one rank can lag the others by a few
  // steps: every poll asks again for the last LOOKBACK steps and replaces them.
  const LOOKBACK = 20;

  // Buffers one series endpoint: load() fetches all (downsampled), poll() only what
  // follows the cursor. ``shape`` turns a response into [{key, step, time, value}].
  // ``at`` is the field the cursor counts in: "step", or "time" for series over wall
  // time (host samples), whose lookback is in seconds.
  class SeriesBuf {
    constructor(path, params, shape, {at = "step", lookback = LOOKBACK} = {}) {
      this.path = path;
      this.params = Object.assign({max_points: 500}, params);
      this.shape = shape || ((body) => body.series);
      this.at = at;
      this.lookback = lookback;
      this.series = [];
      this.cursor = null;
    }
    async load() {
      const body = await R.api(this.path, this.params);
      this.series = this.shape(body);
      this.cursor = body.cursor;
      this.bucket = body.bucket ?? body.bucket_s ?? 1;   // steps (host samples: seconds) per point
    }
    // Returns whether anything new arrived.
    async poll() {
      if (this.cursor === null || this.cursor === undefined) { await this.load(); return true; }
      const since = Math.max(this.at === "step" ? -1 : 0, this.cursor - this.lookback);
      const body = await R.api(this.path, Object.assign({}, this.params, {since}));
      const byKey = new Map(this.series.map((s) => [s.key, s]));
      let before = 0, after = 0;
      for (const fresh of this.shape(body)) {
        after += fresh[this.at].length;
        const old = byKey.get(fresh.key);
        if (!old) { this.series.push(fresh); continue; }
        const keep = old[this.at].findIndex((x) => x > since);
        const cut = keep < 0 ? old[this.at].length : keep;
        before += old[this.at].length - cut;
        for (const f of ["step", "time", "value", "rank"]) {
          if (old[f]) old[f] = old[f].slice(0, cut).concat(fresh[f] || []);
        }
      }
      this.cursor = Math.max(this.cursor, body.cursor ?? this.cursor);
      // Appended points are not downsampled: start afresh once a series grows too long.
      if (this.series.some((s) => s[this.at].length > 3 * this.params.max_points)) await this.load();
      return after !== before;
    }
    get(key) { return this.series.find((s) => s.key === key); }
  }

  // Kinds, classes and colours come from the server (monitor/event_kinds.py).
  const KIND = (name) => EVENT_KINDS[name] || {klass: "none", label: name, color: "#64748b",
                                               symbol: "circle-open"};

  // Decisions every rank takes together and records alike, whatever host it is on.
  const COLLECTIVE = new Set(["replan", "rebalance"]);

  // Every rank records the same commit or reset: one marker per kind, step, subject and
  // burst (events within BURST_S of the first of theirs; events come in time order).
  const BURST_S = 5;
  function dedupe(events) {
    const open = new Map(), out = [];
    for (const e of events) {
      const subject = COLLECTIVE.has(e.kind) ? "" : who(e);
      const key = e.kind + "|" + (e.step ?? "") + "|" + subject;
      const first = open.get(key);
      if (first && Math.abs(e.wall_time - first.wall_time) < BURST_S) {
        first.n += 1;
        first.hosts.add(e.host);
        continue;
      }
      const mark = Object.assign({}, e, {n: 1, hosts: new Set([e.host])});
      open.set(key, mark);
      out.push(mark);
    }
    return out;
  }

  // The host an event is about: the one it names (the dead, added or removed host), else
  // the one that recorded it.
  function who(e) {
    const d = e.detail || {};
    return d.target || d.straggler_host || e.host || "";
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

  // A pipeline plan (a re-plan's old and new) in a few characters: pp2×dp2.
  const plan = (p) => (p && typeof p === "object" && "pp" in p && "dp" in p ? `pp${p.pp}×dp${p.dp}` : null);

  function describe(e) {
    const detail = Object.entries(e.detail || {}).filter(([, v]) => typeof v !== "object" || plan(v))
      .map(([k, v]) => k + "=" + (typeof v === "number" ? R.fmt.num(v, 4) : plan(v) || v)).join(", ");
    return `<b>${R.esc(KIND(e.kind).label)}</b> step ${e.step ?? "–"}<br>${R.esc(who(e))}` +
      `${e.n > 1 ? " (" + e.n + " ranks)" : ""}<br>${R.esc(detail)}`;
  }

  const SIGN = {failure: "✖ ", fault_injected: "⚡ ", host_added: "+ ", host_removed: "− "};

  // What a major line says: the host affected, or for a re-plan the plans it went between.
  function lineLabel(e) {
    const d = e.detail || {};
    if (e.kind === "replan" && plan(d.old) && plan(d.new)) return `${KIND(e.kind).label} ${plan(d.old)} → ${plan(d.new)}`;
    const name = who(e);
    return name && e.kind !== "replan" && e.kind !== "rebalance" ? name : KIND(e.kind).label;
  }

  // Major events: labelled vertical lines naming the host affected. Minor events: a low
  // rug of markers, shown while the "minor events" box is ticked. The rest: not drawn.
  function overlay(events, ctx, withTrace = true) {
    const marks = dedupe(events).filter((e) => KIND(e.kind).klass !== "none")
      .map((e) => Object.assign(e, {x: eventX(e, ctx)}))
      .filter((e) => e.x !== null && e.x !== undefined);
    const shapes = [], annotations = [];
    const major = marks.filter((e) => KIND(e.kind).klass === "major");
    major.forEach((e, i) => {
      const k = KIND(e.kind);
      shapes.push({type: "line", xref: "x", yref: "paper", x0: e.x, x1: e.x, y0: 0, y1: 1,
                   line: {color: k.color, width: e.kind === "failure" ? 2 : 1,
                          dash: e.kind === "failure" ? "solid" : "dash"}, layer: "below"});
      annotations.push({x: e.x, y: 1 - 0.07 * (i % 3), xref: "x", yref: "paper",
                        xanchor: "left", yanchor: "top",
                        showarrow: false, font: {size: 10, color: k.color}, textangle: 0,
                        text: R.esc((SIGN[e.kind] || "") + lineLabel(e)), hovertext: describe(e)});
    });
    const shown = marks.filter((e) => KIND(e.kind).klass === "major" ||
                                      (R.state.minor && KIND(e.kind).klass === "minor"));
    const rug = shown.map((e) => KIND(e.kind).klass === "major" ? 0.97 : 0.03);
    const trace = {type: "scatter", mode: "markers", name: "events", yaxis: "y2",
                   x: shown.map((e) => e.x), y: rug, showlegend: false,
                   hovertemplate: "%{text}<extra></extra>", text: shown.map(describe),
                   marker: {size: shown.map((e) => KIND(e.kind).klass === "major" ? 9 : 6),
                            color: shown.map((e) => KIND(e.kind).color),
                            symbol: shown.map((e) => KIND(e.kind).symbol), line: {width: 1.5}}};
    return {shapes, annotations, traces: withTrace && shown.length ? [trace] : []};
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

  // A series as a line, broken (a null point) where its steps jump by more than the
  // bucket width: the process was absent there, and a straight line would lie.
  function line(name, s, t0, extra, bucket) {
    const step = [], time = [], value = [], rank = [];
    s.step.forEach((st, i) => {
      if (bucket && i > 0 && st - s.step[i - 1] > bucket) {
        step.push(null); time.push(null); value.push(null); rank.push(null);
      }
      step.push(st); time.push(s.time ? s.time[i] : null); value.push(s.value[i]);
      rank.push(s.rank ? s.rank[i] : null);
    });
    const x = R.state.x === "time" ? time.map((t) => (t === null ? null : t - t0)) : step;
    const who = R.esc(name);
    const detail = s.rank ? "<br>rank %{customdata[1]}" : "";
    return Object.assign({type: "scatter", mode: "lines", name: who, x, y: value,
                          connectgaps: false, customdata: step.map((st, i) => [st, rank[i]]),
                          hovertemplate: `${who}<br>step %{customdata[0]}: %{y:.4g}${detail}` +
                                         "<extra></extra>"},
                         extra || {});
  }

  function empty(id, title, message) {
    R.draw(id, [], Object.assign(R.layout(title), {
      xaxis: {visible: false}, yaxis: {visible: false},
      annotations: [{text: message, showarrow: false, xref: "paper", yref: "paper", x: 0.5,
                     y: 0.5, font: {color: R.css("--muted")}}]}));
  }

  return {SeriesBuf, overlay, timeLayout, smooth, line, empty, dedupe, stepAt, who, KIND, LOOKBACK};
})();
