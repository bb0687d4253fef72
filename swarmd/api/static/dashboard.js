// The swarmd dashboard: polls this daemon's JSON endpoints and draws the swarm. No libraries, no
// network fetches beyond this daemon; every value from the network is set as text, never as HTML.
"use strict";

const REFRESH_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function fmt(value, digits) {
  if (value === null || value === undefined || Number.isNaN(value)) return "-";
  return typeof value === "number" ? value.toFixed(digits === undefined ? 1 : digits) : String(value);
}

function ago(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  return seconds < 90 ? `${seconds.toFixed(0)} s ago` : `${(seconds / 60).toFixed(0)} min ago`;
}

// Off loopback the daemon's reads need its API token (docs/SECURITY.md). It is given once in the
// address's fragment, http://host:8080/#token=..., which browsers never send to the server; the page
// keeps it for this tab only (sessionStorage) and removes it from the address bar.
function apiToken() {
  const match = /(?:^#|&)token=([^&]+)/.exec(window.location.hash);
  if (match) {
    sessionStorage.setItem("swarmd-token", decodeURIComponent(match[1]));
    history.replaceState(null, "", window.location.pathname + window.location.search);
  }
  return sessionStorage.getItem("swarmd-token");
}

let needsToken = false;  // the last read was refused for want of the token

async function getJSON(path) {
  try {
    const token = apiToken();
    const headers = token ? { Authorization: `Bearer ${token}` } : {};
    const response = await fetch(path, { cache: "no-store", credentials: "same-origin", headers });
    if (response.status === 401) {
      needsToken = true;
      return null;
    }
    if (!response.ok) return null;
    return await response.json();
  } catch (err) {
    return null;
  }
}

function kv(pairs) {
  const dl = el("dl", { class: "kv" });
  for (const [k, v] of pairs) dl.append(el("dt", {}, k), el("dd", {}, v));
  return dl;
}

function drawStages(swarm, status) {
  const root = document.getElementById("stages");
  if (!swarm) {
    if (!root.dataset.loaded) root.replaceChildren(el("p", { class: "muted" }, "the stage map is not available yet (this peer is " + (status ? status.state : "unreachable") + ")"));
    return;
  }
  root.dataset.loaded = "1";
  const columns = swarm.stages.map((stage) => {
    // the stage's health and newest step, from its peers' own reports, with how old that report is
    const health = stage.health || { health: "ok", hint: "", step: null, step_age_s: null };
    const serving = stage.peers.filter((p) => p.state === "serving").length;
    const trouble = health.health !== "ok";
    const step = health.step === null ? "" : ` · step ${health.step} (${ago(health.step_age_s)})`;
    const column = el("article", { class: "stage" + (trouble ? " thin" : ""), "data-stage": stage.stage, "data-health": health.health, "aria-label": `stage ${stage.stage}` });
    column.append(el("h3", {}, `Stage ${stage.stage}`, el("span", { class: "muted" }, ` · ${health.health}${step} · ${serving} serving · ${fmt(stage.throughput)} samples/s`)));
    if (trouble) column.append(el("p", { class: "warning", role: "status" }, health.hint));
    if (!stage.peers.length) column.append(el("p", { class: "muted" }, "no live peer"));
    for (const peer of stage.peers) {
      const self = status && peer.peer_id === status.peer_id;
      const card = el("div", { class: "peer" + (self ? " self" : ""), "data-peer-id": peer.peer_id });
      const relayed = peer.data_addr.includes("@");
      const badges = el("div", {}, el("span", { class: "badge " + peer.state }, peer.state), " ");
      if (peer.reachable === "no") badges.append(el("span", { class: "badge unreachable" }, "unreachable"), " ");
      if (relayed) badges.append(el("span", { class: "badge relayed" }, "relayed"), " ");
      card.append(el("div", { class: "id", title: peer.peer_id }, peer.peer_id.slice(0, 12)), badges,
        kv([["throughput", `${fmt(peer.throughput)} samples/s`], ["queue", peer.queue], ["step", peer.step],
            ["reachable", peer.reachable + (relayed ? " (relayed)" : "")], ["last seen", ago(peer.age_s)],
            ["data", peer.data_addr], ["control", peer.api_addr]]));
      column.append(card);
    }
    return column;
  });
  root.replaceChildren(...columns);
}

function scale(values, lo, hi) {
  let min = Math.min(...values), max = Math.max(...values);
  if (!Number.isFinite(min) || !Number.isFinite(max)) { min = 0; max = 1; }
  if (max === min) { max += 0.5; min -= 0.5; }
  return (v) => hi - ((v - min) / (max - min)) * (hi - lo);
}

function pathOf(points, x, y) {
  return points.map((p, i) => `${i ? "L" : "M"}${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" ");
}

// series: [{name, cls, points: [[x, y], ...]}]; xLabel formats x ticks
function drawChart(id, series, xLabel, describe) {
  const chart = document.getElementById(id);
  const [W, H, L, R, T, B] = [480, 220, 46, 10, 10, 28];
  const all = series.flatMap((s) => s.points);
  const title = chart.querySelector("title");
  chart.replaceChildren(title);
  chart.append(svg("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }),
               svg("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }));
  if (!all.length) {
    title.textContent = describe(null);
    chart.append(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no data yet"));
    return;
  }
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  const yScale = scale(ys, T, H - B);
  const xMin = Math.min(...xs), xMax = Math.max(...xs) === xMin ? xMin + 1 : Math.max(...xs);
  const xScale = (v) => L + ((v - xMin) / (xMax - xMin)) * (W - L - R);
  const yMin = Math.min(...ys), yMax = Math.max(...ys);
  chart.append(svg("text", { x: L - 4, y: T + 8, "text-anchor": "end" }, fmt(yMax, 2)),
               svg("text", { x: L - 4, y: H - B, "text-anchor": "end" }, fmt(yMin, 2)),
               svg("text", { x: L, y: H - 8 }, xLabel(xMin)),
               svg("text", { x: W - R, y: H - 8, "text-anchor": "end" }, xLabel(xMax)));
  for (const s of series) {
    if (!s.points.length) continue;
    const d = s.points.length === 1 ? `M${xScale(s.points[0][0]) - 3},${yScale(s.points[0][1])} h6` : pathOf(s.points, xScale, yScale);
    chart.append(svg("path", { class: s.cls, d, "data-points": s.points.length }, undefined));
  }
  title.textContent = describe(series);
}

function lossSeries(training) {
  // The swarm's curve (merged from every daemon's DHT record, one point per merge) when other daemons' trainers
  // report too, or when it has as many steps as this daemon's trainers' (one point per step); else theirs.
  const swarm = (training && training.swarm) || [];
  const local = (training && training.local) || [];
  const byStep = (rows, key) => {
    const seen = new Map();
    for (const p of rows) if (p[key] !== null && p[key] !== undefined) seen.set(p.step, p[key]);
    return [...seen.entries()].sort((a, b) => a[0] - b[0]);
  };
  const swarmSteps = byStep(swarm, "loss").length;
  const others = swarm.length && swarm[swarm.length - 1].publishers > 1;
  const useSwarm = !local.length || (swarmSteps >= 2 && (others || swarmSteps >= byStep(local, "loss").length));
  const rows = useSwarm ? swarm : local;
  return { source: useSwarm ? "swarm" : "local", loss: byStep(rows, "loss"), val: byStep(rows, "val_loss"),
           rate: (useSwarm ? swarm : local).map((p) => [p.t, p.samples_per_s]) };
}

function drawTraining(training) {
  const s = lossSeries(training);
  const summary = document.getElementById("loss-summary");
  const last = s.loss.length ? s.loss[s.loss.length - 1] : null;
  const first = s.loss.length ? s.loss[0] : null;
  const val = s.val.length ? s.val[s.val.length - 1] : null;
  const pubs = (training && training.publishers) || [];
  const rows = (training && (s.source === "swarm" ? training.swarm : training.local)) || [];
  const newest = rows.length ? rows[rows.length - 1].t : null;
  const age = newest === null ? "" : `; reported ${ago(Math.max(0, Date.now() / 1000 - newest))}`;
  summary.textContent = last
    ? (s.loss.length > 1 ? `loss ${fmt(first[1], 3)} → ${fmt(last[1], 3)} at step ${last[0]}` : `loss ${fmt(last[1], 3)} at step ${last[0]}`) +
      (val ? `, validation ${fmt(val[1], 3)}` : "") +
      ` (${s.source === "swarm" ? `the swarm: ${pubs.length} daemon(s) with trainers` : "trainers registered with this daemon"}${age})`
    : "no trainer has reported yet";
  summary.className = last ? "" : "muted";
  const chart = document.getElementById("loss-chart");
  chart.dataset.source = s.source;
  drawChart("loss-chart", [{ cls: "loss", points: s.loss }, { cls: "val", points: s.val }], (v) => `step ${v.toFixed(0)}`,
    (series) => series ? `Loss by step: training ${fmt(first[1], 3)} to ${fmt(last[1], 3)} over ${s.loss.length} points` +
      (val ? `, validation ${fmt(val[1], 3)}` : "") : "Training and validation loss by step: no data yet");
  const t0 = s.rate.length ? s.rate[0][0] : 0;
  drawChart("rate-chart", [{ cls: "rate", points: s.rate.map((p) => [p[0] - t0, p[1]]) }], (v) => `${v.toFixed(0)} s`,
    (series) => series ? `Samples per second: ${fmt(s.rate[s.rate.length - 1][1])} now` : "Samples per second over time: no data yet");
}

// a round's status, with the contributions its robust mean clipped and the peers it convicted (issue 29)
function roundStatus(r) {
  const notes = [];
  if (r.clipped && r.clipped.length) notes.push(`${r.clipped.length} clipped`);
  if (r.struck && r.struck.length) notes.push(`${r.struck.length} left out`);
  if (r.convicted && Object.keys(r.convicted).length) notes.push(`convicted ${Object.keys(r.convicted).map((p) => p.slice(0, 8)).join(", ")}`);
  return notes.length ? `${r.status} (${notes.join("; ")})` : String(r.status);
}

function drawPeer(status, trainers) {
  const rounds = document.querySelector("#rounds tbody");
  const recent = ((status && status.averaging && status.averaging.recent) || []).slice(-10).reverse();
  rounds.replaceChildren(...(recent.length ? recent.map((r) => el("tr", {}, el("td", {}, r.step), el("td", {}, roundStatus(r)),
    el("td", { class: "num" }, r.samples), el("td", { class: "num" }, r.contributors),
    el("td", { class: "num" }, r.duration_s === undefined || r.duration_s === null ? "-" : `${fmt(r.duration_s, 2)} s`), el("td", {}, String(r.leader || "").slice(0, 12))))
    : [el("tr", {}, el("td", { colspan: 6, class: "muted" }, "none yet"))]));
  const m = status && status.migration;
  const migration = document.getElementById("migration");
  const counts = Object.entries((status && status.migrations) || {}).filter(([, n]) => n > 0).map(([k, n]) => `${n} ${k}`);
  migration.textContent = (m ? `stage ${m.from} → ${m.to}: ${m.phase} (${m.reason})${m.error ? ", " + m.error : ""}` +
    (m.duration_s !== null && m.duration_s !== undefined ? ` in ${fmt(m.duration_s, 1)} s` : "") : "none") +
    (counts.length ? `; moves so far: ${counts.join(", ")}` : "");
  migration.className = m ? "" : "muted";
  // stage-mates this peer leaves out: caught by its round checks or convicted of hostile contributions
  // (its own conviction, or a stage-mate's it seconded: issue 29), peers the trainers' reports exclude,
  // and mates that kept naming another leader past the stage's patience (left out until they agree)
  const excluded = document.getElementById("excluded");
  const avg = (status && status.averaging) || {};
  const caught = Object.entries(avg.excluded || {}).map(([p, e]) => `${p.slice(0, 12)}: ${String((e && e.reason) || "").split(":")[0]}`);
  const reported = ((status && status.reports && status.reports.excluded) || []).map((p) => `${p.slice(0, 12)}: reported`);
  const dissent = (avg.dissenting || []).map((p) => `${p.slice(0, 12)}: names another leader`);
  const out = caught.concat(reported, dissent);
  const acc = Object.entries(avg.accusations || {}).filter(([, n]) => n > 0).map(([k, n]) => `${n} ${k}`);
  // audits of part owners (all-reduce): an owner convicted by one shows as "hostile" above
  const audits = Object.entries(avg.audits || {}).filter(([, n]) => n > 0).map(([k, n]) => `${n} ${k}`);
  excluded.textContent = (out.join("; ") || "none") + (acc.length ? ` (accusations: ${acc.join(", ")})` : "")
    + (audits.length ? ` (audits: ${audits.join(", ")})` : "");
  excluded.className = out.length ? "" : "muted";
  const body = document.querySelector("#trainers tbody");
  body.replaceChildren(...((trainers && trainers.length) ? trainers.map((t) => el("tr", {}, el("td", {}, t.name + " " + t.trainer_id.slice(0, 8)),
    el("td", { class: "num" }, fmt(t.step, 0)), el("td", { class: "num" }, fmt(t.loss, 3)), el("td", { class: "num" }, fmt(t.samples_per_s)),
    el("td", {}, ago(t.last_seen_s)))) : [el("tr", {}, el("td", { colspan: 5, class: "muted" }, "none"))]));
}

// --precision (fp32 | bf16 | fp16) and, for fp16, the stage's loss scale and overflows so far
function precisionText(p) {
  if (!p) return "";
  const scale = p.loss_scale !== null && p.loss_scale !== undefined ? `, loss scale ${p.loss_scale} (${p.overflows || 0} overflows)` : "";
  return `, computing in ${p.mode}${scale}`;
}

async function refresh() {
  needsToken = false;
  const [status, swarm, training, trainers] = await Promise.all([getJSON("/status"), getJSON("/swarm"), getJSON("/training"), getJSON("/trainers")]);
  if (status) {
    document.getElementById("swarm-name").textContent = `swarm ${status.swarm}`;
    document.getElementById("summary").textContent = `This peer ${String(status.peer_id || "").slice(0, 12)} is ${status.state} on stage ` +
      `${status.stage} of ${status.n_stages} (its own step ${status.step}), ${fmt(status.throughput)} samples/s, model ${status.model ? status.model.name : "-"}` +
      `${precisionText(status.precision)}.`;
  } else if (needsToken) {
    document.getElementById("summary").textContent =
      "This daemon's status needs its API token when read from another machine: open this page as " +
      `${window.location.origin}/#token=<the token in its --api-token-file>.`;
  } else {
    document.getElementById("summary").textContent = "This daemon does not answer /status.";
  }
  drawStages(swarm, status);
  drawTraining(training);
  drawPeer(status, trainers);
  document.getElementById("updated").textContent = `Updated ${new Date().toLocaleTimeString()}.`;
  document.body.dataset.refreshed = String(Number(document.body.dataset.refreshed || 0) + 1);
}

refresh();
setInterval(refresh, REFRESH_MS);
