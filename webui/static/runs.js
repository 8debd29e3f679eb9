// The runs list: one row per run, refreshed live; tick runs to compare them.
"use strict";

(() => {
  const picked = new Set();
  const compare = document.getElementById("compare");

  function cell(content, cls) { return R.el("td", cls ? {class: cls} : {}, content); }

  function row(r) {
    const box = R.el("input", {type: "checkbox", "aria-label": "select " + r.id});
    box.checked = picked.has(r.id);
    box.addEventListener("change", () => {
      if (box.checked) picked.add(r.id); else picked.delete(r.id);
      compare.disabled = picked.size < 2;
    });
    const size = r.world_size === null ? "–"
      : `${r.world_size} (${r.world_size_min}–${r.world_size_max})`;
    return R.el("tr", {"data-run": r.id},
      cell(box),
      cell(R.el("a", {href: "/runs/" + encodeURIComponent(r.id)}, r.id)),
      cell(R.el("span", {class: "badge " + r.status}, r.status)),
      cell(r.job), cell(size, "num"), cell(R.fmt.num(r.throughput), "num"),
      cell(R.fmt.when(r.started_at)), cell(R.fmt.secs(r.duration_s), "num"),
      cell(`${r.failures_survived} / ${r.failures}`, "num"), cell(r.last_step, "num"));
  }

  async function refresh() {
    const {runs} = await R.api("runs");
    const body = document.querySelector("#runs tbody");
    body.replaceChildren(...(runs.length ? runs.map(row)
      : [R.el("tr", {}, R.el("td", {colspan: 10, class: "muted"},
          "No runs yet. Start one with `regatta local digits` or point a job at this server."))]));
  }

  compare.addEventListener("click", () => {
    location.href = "/compare?runs=" + [...picked].map(encodeURIComponent).join(",");
  });
  // Every 5 s at most: each run's summary scans all its step rows.
  refresh().catch(R.showError).finally(() => R.live(refresh, 5000));
})();
