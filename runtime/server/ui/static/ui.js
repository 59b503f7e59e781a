// Arbor's live page: polls /ui/api/live, draws the gauges, runs programs from a form
// built from their JSON schemas, and shows trace timelines. Hand-written, no libraries.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { programs: {}, history: [], selectedRun: null, lastRunIds: "" };
const HISTORY_S = 120;

function fmtMs(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const ms = seconds * 1000;
  return ms >= 100 ? ms.toFixed(0) + " ms" : ms.toFixed(1) + " ms";
}
function pct(x) { return (100 * (x || 0)).toFixed(1) + "%"; }
function num(x) { return x === undefined || x === null ? "–" : String(Math.round(x)); }
function setText(id, value) { const el = $(id); if (el) el.textContent = value; }

async function getJSON(url, options) {
  const response = await fetch(url, Object.assign({ credentials: "same-origin" }, options || {}));
  if (response.status === 401) { window.location.href = "/ui"; throw new Error("unauthorized"); }
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error((body.error && body.error.message) || ("HTTP " + response.status));
  return body;
}

// ---- live figures -----------------------------------------------------------------------

function drawLive(live) {
  setText("model", live.model);
  const r = live.requests;
  setText("g-running", num(r.running));
  setText("g-waiting", num(r.waiting));
  setText("g-inflight", num(r.requests_inflight));
  setText("g-finished", num(r.finished));
  const kv = live.kv_pages;
  setText("g-kv-used", num(kv.used));
  setText("g-kv-evictable", num(kv.evictable));
  setText("g-kv-free", num(kv.free));
  setText("g-kv-total", num(kv.total));
  const share = (x) => (kv.total ? (100 * x / kv.total) : 0) + "%";
  $("kv-used-bar").style.width = share(kv.used);
  $("kv-evictable-bar").style.width = share(kv.evictable);
  $("kv-free-bar").style.width = share(kv.free);
  setText("g-hit", pct(live.prefix_cache.hit_rate));
  setText("g-cached-tokens", num(live.prefix_cache.cached_prompt_tokens));
  setText("g-prompt-tokens", num(live.prefix_cache.prompt_tokens));
  const spec = live.speculation;
  setText("g-spec", spec.draft_tokens ? pct(spec.acceptance_rate) : "no drafts yet");
  setText("g-accepted", num(spec.accepted_tokens));
  setText("g-drafted", num(spec.draft_tokens));
  setText("g-forced", num(spec.forced_tokens));
  drawLatency(live.latency);
  state.history.push({ t: live.time, running: r.running, waiting: r.waiting,
                       kv: kv.total ? kv.used / kv.total : 0 });
  state.history = state.history.filter((h) => h.t >= live.time - HISTORY_S);
  drawHistory(live.time);
  const ids = live.runs.map((x) => x.run_id + x.status).join(",");
  if (ids !== state.lastRunIds) { state.lastRunIds = ids; drawRuns(live.runs); }
}

function drawLatency(latency) {
  const rows = [];
  for (const metric of ["ttft", "itl"]) {
    for (const [window, figures] of Object.entries(latency)) {
      const f = figures[metric];
      rows.push(`<tr data-metric="${metric}" data-window="${window}"><td>${metric.toUpperCase()}</td>` +
                `<td>${window}</td><td>${f.count}</td><td>${fmtMs(f.p50)}</td><td>${fmtMs(f.p95)}</td>` +
                `<td>${fmtMs(f.p99)}</td></tr>`);
    }
  }
  $("lat-table").tBodies[0].innerHTML = rows.join("");
}

function drawHistory(now) {
  const svg = $("history");
  const h = state.history;
  const maxCount = Math.max(1, ...h.map((p) => Math.max(p.running, p.waiting)));
  const x = (t) => 400 * (1 - (now - t) / HISTORY_S);
  const line = (key, scale, color) => {
    const pts = h.map((p) => `${x(p.t).toFixed(1)},${(86 - 80 * p[key] / scale).toFixed(1)}`).join(" ");
    return `<polyline points="${pts}" fill="none" stroke="${color}" stroke-width="1.5"/>`;
  };
  svg.innerHTML = `<line x1="0" x2="400" y1="86" y2="86" stroke="#e2e8f0"/>` +
    line("running", maxCount, "#2563eb") + line("waiting", maxCount, "#f59e0b") + line("kv", 1, "#16a34a") +
    `<text x="2" y="10" font-size="9" fill="#64748b">max ${maxCount} req</text>`;
}

function drawRuns(runs) {
  const body = $("runs-table").tBodies[0];
  body.innerHTML = "";
  for (const run of runs) {
    const t = run.totals || {};
    const tr = document.createElement("tr");
    tr.dataset.run = run.run_id;
    if (run.run_id === state.selectedRun) tr.classList.add("selected");
    tr.innerHTML = `<td>${run.run_id}</td><td>${escapeHtml(run.program)}</td>` +
      `<td class="st-${run.status}">${run.status}</td><td>${(1000 * run.latency_s).toFixed(0)}</td>` +
      `<td>${num(t.prompt_tokens)}</td><td>${num(t.cached_tokens)}</td><td>${num(t.output_tokens)}</td>`;
    tr.title = run.error || JSON.stringify(run.arguments);
    tr.addEventListener("click", () => showTimeline(run.run_id));
    body.appendChild(tr);
  }
}

async function showTimeline(runId) {
  state.selectedRun = runId;
  for (const tr of $("runs-table").tBodies[0].rows) tr.classList.toggle("selected", tr.dataset.run === runId);
  setText("timeline-title", runId);
  const response = await fetch(`/ui/api/runs/${encodeURIComponent(runId)}/timeline.svg`, { credentials: "same-origin" });
  const box = $("timeline");
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    box.className = "muted";
    box.textContent = (body.error && body.error.message) || ("no timeline (HTTP " + response.status + ")");
    return;
  }
  box.className = "";
  box.innerHTML = await response.text();  // our own SVG, every text escaped by the server
}

function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

async function poll() {
  try {
    drawLive(await getJSON("/ui/api/live"));
    $("status").textContent = "live · " + new Date().toLocaleTimeString();
    $("status").className = "status ok";
  } catch (err) {
    $("status").textContent = "disconnected: " + err.message;
    $("status").className = "status bad";
  }
  setTimeout(poll, 1000);
}

// ---- the program form -------------------------------------------------------------------

async function loadPrograms() {
  const listing = await getJSON("/ui/api/programs");
  const select = $("program-select");
  select.innerHTML = "";
  for (const p of listing.programs) {
    state.programs[p.name] = p;
    const option = document.createElement("option");
    option.value = option.textContent = p.name;
    select.appendChild(option);
  }
  if (!listing.programs.length) {
    $("run-status").textContent = "No programs are registered (start the server with --programs FILE).";
    $("run-button").disabled = true;
  }
  buildFields();
}

function buildFields() {
  const program = state.programs[$("program-select").value];
  const box = $("arg-fields");
  box.innerHTML = "";
  if (!program) return;
  setText("program-description", program.description);
  const schema = program.arguments_schema || {};
  const required = new Set(schema.required || []);
  for (const [name, prop] of Object.entries(schema.properties || {})) {
    const type = prop.type || "json";  // anyOf (optional values...) and objects: a JSON field
    const label = document.createElement("label");
    const hint = `${type}${required.has(name) ? ", required" : ""}` +
      (prop.default !== undefined ? `, default ${JSON.stringify(prop.default)}` : "");
    label.innerHTML = `${escapeHtml(prop.title || name)} <span class="hint">(${escapeHtml(hint)})</span>`;
    let input;
    if (type === "boolean") {
      input = document.createElement("input");
      input.type = "checkbox";
      input.checked = prop.default === true;
    } else if (type === "integer" || type === "number") {
      input = document.createElement("input");
      input.type = "number";
      input.step = type === "integer" ? "1" : "any";
      if (prop.default !== undefined) input.value = prop.default;
    } else if (type === "string") {
      input = document.createElement("input");
      input.type = "text";
      if (prop.default !== undefined) input.value = prop.default;
    } else {
      input = document.createElement("textarea");
      input.rows = 2;
      input.placeholder = "JSON";
      if (prop.default !== undefined) input.value = JSON.stringify(prop.default);
    }
    input.name = name;
    input.dataset.type = type;
    input.id = "arg-" + name;
    label.appendChild(input);
    box.appendChild(label);
  }
}

function readArguments() {
  const args = {};
  for (const input of $("arg-fields").querySelectorAll("input, textarea")) {
    const type = input.dataset.type;
    if (type === "boolean") { args[input.name] = input.checked; continue; }
    if (input.value === "") continue;  // absent: the program's default (or a 422 if required)
    if (type === "integer" || type === "number") args[input.name] = Number(input.value);
    else if (type === "string") args[input.name] = input.value;
    else args[input.name] = JSON.parse(input.value);
  }
  return args;
}

async function runProgram(event) {
  event.preventDefault();
  const name = $("program-select").value;
  const events = $("events");
  events.innerHTML = "";
  setText("run-result", "");
  let args;
  try { args = readArguments(); } catch (err) { setText("run-status", "bad JSON argument: " + err.message); return; }
  $("run-button").disabled = true;
  setText("run-status", `running ${name}…`);
  const started = performance.now();
  try {
    const response = await fetch(`/ui/api/programs/${encodeURIComponent(name)}`, {
      method: "POST", credentials: "same-origin", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ arguments: args, stream: true }),
    });
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || ("HTTP " + response.status));
    }
    await readEvents(response, (data) => onRunEvent(data, started));
  } catch (err) {
    setText("run-status", "failed: " + err.message);
    $("run-status").className = "error";
  } finally {
    $("run-button").disabled = false;
  }
}

async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (line.startsWith("data: ") && line !== "data: [DONE]") onEvent(JSON.parse(line.slice(6)));
      }
    }
  }
}

function onRunEvent(data, started) {
  const ms = (performance.now() - started).toFixed(0);
  const li = document.createElement("li");
  if (data.event === "gen") {
    li.textContent = `+${ms} ms gen #${data.index}: ${JSON.stringify(data.text)} ` +
      `(${data.completion_tokens} tokens, ${data.finish_reason})`;
  } else if (data.event === "result") {
    li.textContent = `+${ms} ms result (${data.run_id}, ${(1000 * data.latency).toFixed(0)} ms)`;
    li.className = "result";
    setText("run-result", JSON.stringify(data.variables, null, 1));
    setText("run-status", `${data.program} finished in ${(1000 * data.latency).toFixed(0)} ms`);
    $("run-status").className = "muted";
    if (data.run_id) showTimeline(data.run_id);
  } else if (data.event === "error") {
    li.textContent = `+${ms} ms error: ${(data.error && data.error.message) || JSON.stringify(data)}`;
    li.className = "error";
    setText("run-status", "failed");
  }
  $("events").appendChild(li);
}

$("program-select").addEventListener("change", buildFields);
$("run-form").addEventListener("submit", runProgram);
loadPrograms().catch((err) => setText("run-status", "could not list programs: " + err.message));
poll();
