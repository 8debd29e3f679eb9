// Shared by every page: API access, theme-aware Plotly layouts, the x-axis / log-y
// controls, live polling with a pause button, and event markers for time charts.
// Vanilla JS + Plotly (served by this server at /vendor/plotly.min.js).
"use strict";

const R = (() => {
  const query = new URLSearchParams(location.search);
  // ?poll=MS overrides the polling period (tests poll fast; people need not).
  const pollMs = Math.max(200, Number(query.get("poll")) || 2000);
  const state = {
    x: localStorage.getItem("regatta.x") === "time" ? "time" : "step",
    logY: localStorage.getItem("regatta.logy") === "1",
    minor: localStorage.getItem("regatta.minor") !== "0",   // the rug of minor events
    paused: false,
  };

  async function api(path, params, init) {
    const url = new URL("/api/v1/" + path, location.origin);
    for (const [k, v] of Object.entries(params || {})) {
      if (v !== null && v !== undefined) url.searchParams.set(k, v);
    }
    const response = await fetch(url, Object.assign({cache: "no-store"}, init || {}));
    let body = {};
    try { body = await response.json(); } catch (err) { body = {error: response.statusText}; }
    if (!response.ok) throw new Error(body.error || response.statusText);
    return body;
  }

  // A write (run edits): the write token is asked once and kept for this tab only.
  async function write(path, method, payload) {
    let token = sessionStorage.getItem("regatta.token");
    if (!token) {
      token = prompt("Write token of this dashboard (the server's ingest token):") || "";
      if (!token) throw new Error("no token given");
    }
    try {
      const body = await api(path, null, {method, headers: {"Content-Type": "application/json",
        Authorization: "Bearer " + token}, body: payload ? JSON.stringify(payload) : undefined});
      sessionStorage.setItem("regatta.token", token);
      return body;
    } catch (err) {
      sessionStorage.removeItem("regatta.token");
      throw err;
    }
  }

  // A run id as one URL path segment (webui/run_paths.py writes the same): "/" and "~"
  // escaped, a leading "." too, so an id from an older store still has its own page.
  function runPath(id) {
    const segment = id.replace(/[~/]/g, (c) => (c === "~" ? "~7E" : "~2F"));
    return encodeURIComponent(segment.startsWith(".") ? "~2E" + segment.slice(1) : segment);
  }

  const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();

  // A Plotly layout in the page's colours (light or dark, from style.css).
  function layout(title, extra) {
    const axis = {gridcolor: css("--grid"), zerolinecolor: css("--line"), linecolor: css("--line"),
                  automargin: true};
    return Object.assign({
      title: {text: title, x: 0.01, xanchor: "left", font: {size: 14}},
      paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)",
      font: {color: css("--fg"), size: 11, family: "system-ui, sans-serif"},
      margin: {l: 56, r: 16, t: 36, b: 40},
      xaxis: Object.assign({title: {text: xTitle()}}, axis),
      yaxis: Object.assign({type: state.logY ? "log" : "linear"}, axis),
      legend: {orientation: "h", y: -0.2, x: 0, font: {size: 10}},
      hovermode: "closest", uirevision: state.x + state.logY,
      colorway: ["#2563eb", "#f97316", "#16a34a", "#a855f7", "#e11d48", "#0891b2",
                 "#ca8a04", "#64748b", "#db2777", "#4f46e5"],
    }, extra || {});
  }

  const plotConfig = {displaylogo: false, responsive: true,
                      modeBarButtonsToRemove: ["select2d", "lasso2d", "autoScale2d"]};

  function draw(id, traces, lay) {
    const div = document.getElementById(id);
    if (div) Plotly.react(div, traces, lay, plotConfig);
  }

  const xTitle = () => (state.x === "time" ? "seconds since start" : "step");

  // x of points given their steps and wall times, in the current x mode.
  function xs(steps, times, t0) {
    return state.x === "time" ? times.map((t) => (t === null ? null : t - t0)) : steps;
  }

  const fmt = {
    num(v, digits = 3) {
      if (v === null || v === undefined || Number.isNaN(v)) return "–";
      const a = Math.abs(v);
      if (a >= 1e9) return (v / 1e9).toFixed(1) + " G";
      if (a >= 1e6) return (v / 1e6).toFixed(1) + " M";
      if (a >= 1e4) return (v / 1e3).toFixed(1) + " k";
      return Number(v.toPrecision(digits)).toString();
    },
    secs(v) {
      if (v === null || v === undefined) return "–";
      if (v < 60) return v.toFixed(v < 10 ? 2 : 1) + " s";
      if (v < 3600) return Math.floor(v / 60) + " m " + Math.round(v % 60) + " s";
      return Math.floor(v / 3600) + " h " + Math.round((v % 3600) / 60) + " m";
    },
    when: (t) => (t ? new Date(t * 1000).toLocaleString([], {month: "short", day: "numeric",
      hour: "2-digit", minute: "2-digit"}) : "–"),
  };

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v; else node.setAttribute(k, v);
    }
    for (const c of children) node.append(c instanceof Node ? c : String(c ?? "–"));
    return node;
  }

  // Plotly renders hover text as (a subset of) HTML: names and details come from workers.
  const esc = (text) => String(text).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

  function showError(err) {
    const box = document.getElementById("error");
    box.hidden = !err;
    box.textContent = err ? "Could not load data: " + err.message : "";
    document.getElementById("live-dot").classList.toggle("error", !!err);
  }

  // Live updates: every pollMs (or minMs if longer), unless paused, run ``refresh``.
  function live(refresh, minMs = 0) {
    const dot = document.getElementById("live-dot");
    const label = document.getElementById("live-label");
    const button = document.getElementById("pause");
    button.addEventListener("click", () => {
      state.paused = !state.paused;
      button.textContent = state.paused ? "Resume" : "Pause";
      label.textContent = state.paused ? "paused" : "live";
      dot.classList.toggle("paused", state.paused);
    });
    let stopped = false, running = Promise.resolve();
    async function tick() {
      if (stopped) return;
      if (!state.paused) {
        dot.classList.add("busy");
        running = refresh().then(() => showError(null), showError);
        await running;
        dot.classList.remove("busy");
      }
      if (!stopped) setTimeout(tick, Math.max(pollMs, minMs));
    }
    setTimeout(tick, Math.max(pollMs, minMs));
    // Before the page deletes what it polls: no poll after it, and none still in flight
    // (its answer would be a 404 for the deleted run).
    return {stop() { stopped = true; return running; }};
  }

  // The Step/Time toggle and the log-y box; ``redraw`` re-renders from loaded data.
  function controls(redraw) {
    const buttons = document.querySelectorAll("[data-x]");
    const sync = () => buttons.forEach((b) => b.classList.toggle("on", b.dataset.x === state.x));
    buttons.forEach((b) => b.addEventListener("click", () => {
      state.x = b.dataset.x;
      localStorage.setItem("regatta.x", state.x);
      sync();
      redraw();
    }));
    const minor = document.getElementById("minor");
    if (minor) {
      minor.checked = state.minor;
      minor.addEventListener("change", () => {
        state.minor = minor.checked;
        localStorage.setItem("regatta.minor", state.minor ? "1" : "0");
        redraw();
      });
    }
    const logy = document.getElementById("logy");
    if (logy) {
      logy.checked = state.logY;
      logy.addEventListener("change", () => {
        state.logY = logy.checked;
        localStorage.setItem("regatta.logy", state.logY ? "1" : "0");
        redraw();
      });
    }
    sync();
  }

  return {api, write, runPath, css, layout, draw, xs, xTitle, fmt, el, esc, live, controls, showError, state,
          pollMs, plotConfig};
})();
