// The runs list: one row per run (its kept summary: fast however many steps), searched
// and filtered on the server, refreshed live; tick runs to compare them.
"use strict";

(() => {
  const picked = new Set();
  const compare = document.getElementById("compare");
  const query = new URLSearchParams(location.search);
  const filters = {q: query.get("q") || "", status: query.get("status") || "",
                   tag: query.get("tag") || ""};

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
    const title = R.el("div", {}, R.el("a", {href: "/runs/" + R.runPath(r.id)}, r.name || r.id));
    if (r.name) title.append(R.el("div", {class: "muted small"}, r.id));
    const tags = R.el("span", {class: "tags"}, ...r.tags.map((t) =>
      R.el("a", {class: "tag", href: "/?tag=" + encodeURIComponent(t)}, t)));
    const badge = R.el("span", {class: "badge " + r.status, title: r.error || ""}, r.status);
    return R.el("tr", {"data-run": r.id},
      cell(box), cell(title), cell(badge), cell(r.job), cell(tags), cell(size, "num"),
      cell(R.fmt.num(r.throughput), "num"), cell(R.fmt.when(r.started_at)),
      cell(R.fmt.secs(r.duration_s), "num"),
      cell(`${r.failures_survived} / ${r.failures}`, "num"), cell(r.last_step, "num"));
  }

  let asked = 0;    // a live refresh sent before a new filter may answer after it
  async function refresh() {
    const mine = ++asked;
    const {runs, total} = await R.api("runs", {q: filters.q || null,
      status: filters.status || null, tag: filters.tag || null});
    if (mine !== asked) return;
    const body = document.querySelector("#runs tbody");
    const filtered = filters.q || filters.status || filters.tag;
    body.replaceChildren(...(runs.length ? runs.map(row)
      : [R.el("tr", {}, R.el("td", {colspan: 11, class: "muted"}, filtered ? "No run matches."
          : "No runs yet. Start one with `regatta local digits` or point a job at this server."))]));
    document.getElementById("count").textContent =
      total > runs.length ? `${runs.length} of ${total}` : `${total} run${total === 1 ? "" : "s"}`;
  }

  // Filters live in the URL, so a filtered list can be shared.
  const form = document.getElementById("filters");
  form.elements.q.value = filters.q;
  form.elements.status.value = filters.status;
  form.elements.tag.value = filters.tag;
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    for (const k of ["q", "status", "tag"]) filters[k] = form.elements[k].value.trim();
    const params = new URLSearchParams(Object.entries(filters).filter(([, v]) => v));
    history.replaceState(null, "", "/" + (params.size ? "?" + params : ""));
    refresh().catch(R.showError);
  });
  form.elements.status.addEventListener("change", () => form.requestSubmit());

  compare.addEventListener("click", () => {
    location.href = "/compare?runs=" + [...picked].map(encodeURIComponent).join(",");
  });
  refresh().catch(R.showError).finally(() => R.live(refresh, 2000));
})();
