// Arbor router's rollout page: polls /ui/api/rollout (the JSON of GET /rollout) every
// second and draws the plan, the pools side by side, the shadow figures, the gates and
// the event log. Hand-written, no libraries.
"use strict";

const $ = (id) => document.getElementById(id);
const LATENCIES = [["ttft_s", "TTFT"], ["itl_s", "ITL"], ["e2e_s", "end-to-end"]];

function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}
function fmtMs(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const ms = seconds * 1000;
  return ms >= 100 ? ms.toFixed(0) + " ms" : ms.toFixed(1) + " ms";
}
function pct(x) { return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%"; }
function fmtNum(x, digits) {
  if (x === null || x === undefined) return "–";
  return Math.abs(x) >= 0.01 || x === 0 ? x.toFixed(digits) : x.toExponential(2);
}
function fmtDuration(s) { return s >= 120 ? (s / 60).toFixed(1) + " min" : s.toFixed(0) + " s"; }
function setText(id, value) { const el = $(id); if (el) el.textContent = value; }

// ---- the plan and the pools ---------------------------------------------------------------

function drawPlan(r) {
  const badge = $("plan-state");
  badge.textContent = r.state.replace("_", " ");
  badge.className = "badge " + r.state;
  setText("g-step", r.step + 1);
  setText("g-num-steps", r.num_steps);
  const cand = r.weights[r.candidate] || 0;
  const base = r.weights[r.baseline] || 0;
  $("share-candidate-bar").style.width = cand + "%";
  $("share-baseline-bar").style.width = base + "%";
  setText("g-weights", Object.entries(r.weights).map(([p, w]) => `${p} ${w}%`).join(" · ") +
          (r.weight_override !== null ? " (set through the API)" : ""));
  setText("g-in-step", fmtDuration(Math.max(0, Date.now() / 1000 - r.step_started)));
  setText("g-dwell", fmtDuration(r.dwell_s));
  setText("g-failed-checks", r.failed_checks);
  setText("g-reason", r.reason ? "reason: " + r.reason : "");
}

function drawPools(r) {
  const rows = Object.entries(r.pools).map(([name, p]) => {
    const role = name === r.baseline ? "baseline" : name === r.candidate ? "candidate" : "";
    return `<tr data-pool="${escapeHtml(name)}"><td>${escapeHtml(name)}</td><td>${role}</td>` +
           `<td>${escapeHtml(p.version || "–")}</td><td class="${p.healthy ? "ok" : "down"}">${p.healthy ? "yes" : "no"}</td>` +
           `<td>${p.workers.map(escapeHtml).join(", ")}</td></tr>`;
  });
  $("pools-table").tBodies[0].innerHTML = rows.join("");
}

// ---- side by side -------------------------------------------------------------------------

function panelPools(r) {
  // baseline and candidate first (even before they have traffic), then any other pool seen
  const names = [r.baseline, r.candidate];
  for (const name of Object.keys(r.panel)) if (!names.includes(name)) names.push(name);
  return names;
}

function drawPanel(r) {
  const names = panelPools(r);
  const table = $("panel-table");
  table.tHead.rows[0].innerHTML = "<th></th>" + names.map((n) => `<th>${escapeHtml(n)}</th>`).join("");
  const cell = (pool, metric, q, html) =>
    `<td data-pool="${escapeHtml(pool)}" data-metric="${metric}" data-q="${q}">${html}</td>`;
  const rows = [];
  const count = (label, key) => {
    rows.push(`<tr><td>${label}</td>` + names.map((n) => {
      const p = r.panel[n];
      return cell(n, key, "", p ? String(p[key]) : "0");
    }).join("") + "</tr>");
  };
  count("requests", "requests");
  count("errors (5xx)", "errors");
  for (const [key, label] of LATENCIES) {
    for (const q of ["p50", "p99"]) {
      rows.push(`<tr><td>${label} ${q}</td>` + names.map((n) => {
        const f = r.panel[n] && r.panel[n][key];
        const html = f && f.samples ? `${fmtMs(f[q])} <span class="samples">(${f.samples})</span>` : "–";
        return cell(n, key, q, html);
      }).join("") + "</tr>");
    }
  }
  rows.push("<tr><td>versions</td>" + names.map((n) => {
    const p = r.panel[n];
    return cell(n, "versions", "", p ? p.versions.map(escapeHtml).join(", ") : "–");
  }).join("") + "</tr>");
  table.tBodies[0].innerHTML = rows.join("");
}

function drawShadow(s) {
  const jobs = s.jobs || {};
  const valid = Object.entries(s.constraint_valid || {}).map(([side, v]) => `${side} ${pct(v)}`).join(" · ");
  const rows = [
    ["pairs", "pairs compared", String(s.pairs)],
    ["exact_match", "exact match (greedy)", s.greedy_pairs ? `${pct(s.exact_match)} <span class="samples">(${s.greedy_pairs})</span>` : "–"],
    ["mean_kl", "mean KL, nats", s.kl_pairs ? `${fmtNum(s.mean_kl, 4)} <span class="samples">(${s.kl_pairs})</span>` : "–"],
    ["prefix_share", "before 1st divergence", pct(s.prefix_share)],
    ["length_ratio", "length ratio", fmtNum(s.length_ratio, 3)],
    ["constraint_valid", "constraint valid", valid || "–"],
    ["units", "compared on", Object.entries(s.units || {}).map(([u, n]) => `${u} ${n}`).join(" · ") || "–"],
    ["jobs", "jobs", ["offered", "compared", "failed", "dropped_full", "dropped_load"]
      .map((k) => `${k.replace("_", " ")} ${jobs[k] || 0}`).join(" · ")],
  ];
  $("shadow-table").tBodies[0].innerHTML = rows.map(([key, label, html]) =>
    `<tr data-shadow="${key}"><td>${label}</td><td>${html}</td></tr>`).join("");
}

// ---- gates and events ---------------------------------------------------------------------

function drawGates(gates) {
  const rows = gates.map((g) =>
    `<tr data-gate="${escapeHtml(g.metric)}"><td>${escapeHtml(g.gate)}</td><td>${fmtNum(g.bound, 3)}</td>` +
    `<td>${fmtNum(g.value, 3)}</td><td>${g.samples} / ${g.min_samples}</td>` +
    `<td class="v-${g.verdict}">${g.verdict}</td></tr>`);
  $("gates-table").tBodies[0].innerHTML = rows.join("") ||
    '<tr><td colspan="5" class="muted">no check at this step (rolled back, complete, or 0% candidate)</td></tr>';
}

function eventDetail(e) {
  const d = e.detail || {};
  if (e.kind === "rollback" && d.gate && d.value !== undefined) {
    return `gate ${escapeHtml(d.gate)} = ${fmtNum(d.value, 3)} (${escapeHtml(d.side || "bound")} ${fmtNum(d.bound, 3)}) over ${d.samples} samples`;
  }
  return escapeHtml(d.why || Object.entries(d).map(([k, v]) => `${k} ${v}`).join(", "));
}

function drawEvents(events) {
  const rows = events.slice().reverse().map((e) =>
    `<tr class="ev-${escapeHtml(e.kind)}" data-kind="${escapeHtml(e.kind)}">` +
    `<td>${new Date(e.t * 1000).toLocaleTimeString()}</td><td>${escapeHtml(e.kind.replace("_", " "))}</td>` +
    `<td>${e.step + 1}</td><td>${e.weight}%</td><td>${eventDetail(e)}</td></tr>`);
  $("events-table").tBodies[0].innerHTML = rows.join("");
}

// ---- polling ------------------------------------------------------------------------------

function draw(r) {
  $("no-plan").hidden = true;
  $("rollout").hidden = false;
  drawPlan(r);
  drawPools(r);
  drawPanel(r);
  drawShadow(r.shadow);
  drawGates(r.gates);
  drawEvents(r.events);
}

async function poll() {
  try {
    const response = await fetch("/ui/api/rollout", { credentials: "same-origin" });
    if (response.status === 401) { window.location.href = "/ui"; return; }
    const body = await response.json().catch(() => ({}));
    if (response.status === 404) {
      $("no-plan").hidden = false;
      $("rollout").hidden = true;
      setText("plan-state", "no plan");
    } else if (!response.ok) {
      throw new Error((body.error && body.error.message) || ("HTTP " + response.status));
    } else {
      draw(body);
    }
    $("status").textContent = "live · " + new Date().toLocaleTimeString();
    $("status").className = "status ok";
  } catch (err) {
    $("status").textContent = "disconnected: " + err.message;
    $("status").className = "status bad";
  }
  setTimeout(poll, 1000);
}

poll();
