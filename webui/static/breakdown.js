// Where each step goes: the mean data / compute / comm / wait time per process, as
// stacked bars, and said plainly when one part dominates: a DataLoader that cannot keep
// up is a bottleneck (a tile, and a flag on the chart).
"use strict";

const B = (() => {
  const PARTS = [["data_time", "data"], ["compute_time", "compute"], ["comm_time", "comm"],
                 ["wait_time", "wait"]];
  const NAMES = {data: "data loading", compute: "compute", comm: "communication",
                 wait: "waiting for other ranks"};
  const FLAG = "bottleneck: data loading";

  // One bucket per key (max_points=1): each part's and the step time's mean over the run.
  async function load(path, by) {
    const [step, ...parts] = await Promise.all([["step_time"], ...PARTS].map(([metric]) =>
      R.api(path, {metric, by, max_points: 1})));
    return {step: step.series, parts: parts.map((body, i) => ({name: PARTS[i][1], series: body.series}))};
  }

  // The part with the largest share of step time (means over keys), with every part's
  // share; null before any step.
  function largest(b) {
    const mean = (series) => series.reduce((sum, s) => sum + (s.value[0] || 0), 0) /
                             Math.max(1, series.length);
    const step = mean(b.step);
    if (!(step > 0)) return null;
    const shares = b.parts.map((part) => ({name: part.name, share: mean(part.series) / step}));
    const top = shares.reduce((x, y) => (y.share > x.share ? y : x), shares[0]);
    return top && top.share > 0 ? {top, shares} : null;
  }

  function tile(b) {
    const found = largest(b);
    const pct = (share) => (100 * share).toFixed(0) + " %";
    const dataBound = found && found.top.name === "data";
    const sub = !found ? "" : dataBound ? FLAG
      : found.shares.filter((s) => s !== found.top).map((s) => `${s.name} ${pct(s.share)}`).join(" · ");
    return R.el("div", {class: "tile wide" + (dataBound ? " alert" : ""), id: "share-tile"},
      R.el("div", {class: "k"}, "Largest share of step time"),
      R.el("div", {class: "v"}, found ? `${NAMES[found.top.name]} ${pct(found.top.share)}` : "–"),
      R.el("div", {class: "sub", title: dataBound ? "the training waits for the DataLoader: " +
        "more loader workers, prefetching or faster storage would speed it up" : sub}, sub));
  }

  // ``label(key)``: how the page names a rank, process or host.
  function render(id, b, label) {
    const traces = b.parts.map((part) => ({type: "bar", orientation: "h", name: part.name,
      y: part.series.map((s) => R.esc(label(s.key))), x: part.series.map((s) => s.value[0]),
      hovertemplate: `${part.name} %{x:.4f} s<extra>%{y}</extra>`}));
    const lay = R.layout("Where each step goes (mean s)", {barmode: "stack"});
    const found = largest(b);
    if (found && found.top.name === "data") {
      lay.annotations = [{text: FLAG, xref: "paper", yref: "paper", x: 1, y: 1.02,
                          xanchor: "right", yanchor: "bottom", showarrow: false,
                          font: {size: 12, color: R.css("--bad")}}];
    }
    lay.legend.traceorder = "normal";  // data, compute, comm, wait: the order of a step
    lay.yaxis = Object.assign(lay.yaxis, {type: "category", autorange: "reversed"});
    lay.xaxis.title = {text: "seconds per step"};
    R.draw(id, traces, lay);
  }

  return {load, tile, render};
})();
