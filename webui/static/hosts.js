// The run page's host charts: CPU % and memory per host over wall time (GPU where
// sampled), from /api/v1/runs/<id>/hosts, polled with a wall-time cursor.
"use strict";

const H = (() => {
  const METRICS = ["cpu_percent", "rss_bytes", "gpu_util", "gpu_mem"];
  // One buffer entry per (metric, host).
  const shape = (body) => body.hosts.flatMap((h) => METRICS.map((metric) =>
    ({key: metric + "|" + h.host, metric, host: h.host, time: h.time, value: h[metric]})));
  const buffer = (path) => new C.SeriesBuf(path, {}, shape, {at: "time", lookback: 20});

  // A host's line (x: seconds, or the step done by then), broken where its samples stop
  // for a while (its processes were gone).
  function line(name, s, t0, timeline, gap, extra) {
    const step = [], time = [], value = [];
    s.time.forEach((t, i) => {
      if (i > 0 && t - s.time[i - 1] > gap) { step.push(null); time.push(null); value.push(null); }
      step.push(C.stepAt(timeline, t)); time.push(t); value.push(s.value[i]);
    });
    return C.line(name, {step, time, value}, t0, extra);
  }

  // ``draw(id, title, yTitle, traces)``: the page's time chart with its event overlay.
  function render(buf, t0, timeline, draw) {
    const of = (metric) => buf.series.filter((s) => s.metric === metric && s.value.some((v) => v !== null));
    const mib = (s) => Object.assign({}, s, {value: s.value.map((v) => (v === null ? null : v / 2 ** 20))});
    const gap = 3 * Math.max(2, buf.bucket);
    const charts = [["chart-host-cpu", "CPU per host", "%", of("cpu_percent"), of("gpu_util")],
                    ["chart-host-mem", "Memory per host (its workers' RSS)", "MiB",
                     of("rss_bytes").map(mib), of("gpu_mem").map(mib)]];
    for (const [id, title, unit, main, gpu] of charts) {
      if (!main.length) { C.empty(id, title, "no host samples"); continue; }
      draw(id, title, unit, main.map((s) => line(s.host, s, t0, timeline, gap)).concat(
        gpu.map((s) => line("GPU " + s.host, s, t0, timeline, gap, {line: {dash: "dot"}}))));
    }
  }

  return {buffer, render};
})();
