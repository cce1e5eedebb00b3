// The ringlet web console: the cluster live (GET /v1/console/events, server-sent events read
// with fetch so the API key can go in a header) and a chat (POST /v1/chat/completions, stream).
"use strict";

const $ = (sel) => document.querySelector(sel);
const KEY = "ringlet.key", CHATS = "ringlet.conversations", SETTINGS = "ringlet.settings";
const seen = new Map();  // node_id -> {member, gone_at}: a node that leaves stays, marked gone

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v; else if (k === "style") e.style.cssText = v; else e.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== undefined) e.append(c);
  return e;
}
const short = (id) => (id || "").slice(0, 8);
function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return `${n.toFixed(n < 10 && i ? 1 : 0)} ${units[i]}`;
}
const pct = (x) => `${Math.max(0, Math.min(100, 100 * x)).toFixed(0)}%`;
function bar(fraction, cls = "") {
  return el("div", {class: `bar ${cls}`}, el("span", {style: `width:${pct(fraction || 0)}`}));
}

function headers(extra = {}) {
  const key = localStorage.getItem(KEY);
  return key ? {...extra, Authorization: `Bearer ${key}`} : extra;
}
function askKey() { $("#key-form").hidden = false; $("#key-input").focus(); }

// ---------------------------------------------------------------- server-sent events, read with fetch
async function readSSE(response, onData) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (data) onData(data);
    }
  }
}

// ---------------------------------------------------------------- the cluster
function setLink(ok, text) {
  const link = $("#link");
  link.className = `pill ${ok ? "ok" : "bad"}`;
  link.textContent = text;
}

async function watch() {
  for (;;) {
    try {
      const response = await fetch("/v1/console/events", {headers: headers(), cache: "no-store"});
      if (response.status === 401) { setLink(false, "API key needed"); askKey(); await keySaved(); continue; }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      setLink(true, "live");
      await readSSE(response, (data) => render(JSON.parse(data)));
      setLink(false, "reconnecting…");
    } catch (err) {
      setLink(false, "disconnected");
    }
    await new Promise((r) => setTimeout(r, 1000));
  }
}
let keyWaiters = [];
const keySaved = () => new Promise((r) => keyWaiters.push(r));

function render(view) {
  window.ringletView = view;  // for the curious, in the browser's devtools
  $("#model").textContent = view.model || "";
  $("#epoch").textContent = `epoch ${view.epoch ?? "–"}`;
  $("#plan-id").textContent = view.plan_id ? `plan ${view.plan_id}` : "no plan";
  renderNodes(view);
  renderRing(view);
  renderRequests(view);
  renderEvents(view.events || []);
}

function nodeFigures(view, id) {
  return id === view.node_id ? view : (view.peers || {})[id] || null;
}

function renderNodes(view) {
  const now = Date.now();
  const present = new Set();
  for (const m of view.members || []) {
    present.add(m.node_id);
    seen.set(m.node_id, {member: m, gone_at: null});
  }
  for (const [id, s] of seen) if (!present.has(id) && s.gone_at === null) s.gone_at = now;
  const stageOf = new Map((view.plan || []).map((s, i) => [s.node_id, i]));
  const box = $("#nodes");
  box.replaceChildren();
  for (const [id, {member: m, gone_at}] of seen) {
    const f = gone_at === null ? nodeFigures(view, id) : null;
    const state = gone_at !== null ? "gone" : (f && f.state) || m.state;
    const used = f && f.memory ? (f.memory.rss_bytes ?? f.memory.mlx_active_bytes) : null;
    const usable = m.memory_usable_bytes;
    const card = el("div", {class: `node${gone_at !== null ? " gone" : ""}`, "data-node-id": id, "data-state": state},
      el("div", {class: "title"}, el("span", {}, `${m.name || "?"} · ${short(id)}`),
        el("span", {class: `state ${state}`}, state)),
      el("div", {class: "muted"}, `${m.chip || "?"} · ${m.release || "?"} · ${m.api_url || m.grpc_address || ""}`),
      el("div", {class: "muted"}, `memory ${bytes(used)} used of ${bytes(usable)} usable`),
      bar(used && usable ? used / usable : 0));
    if (stageOf.has(id)) {
      const s = view.plan[stageOf.get(id)];
      card.append(el("div", {class: "muted"}, `stage ${stageOf.get(id)}: layers [${s.start}, ${s.end})`));
    }
    const dl = f && f.download;
    if (dl && dl.bytes_total) {
      card.append(el("div", {class: "muted"}, `download ${bytes(dl.bytes_done)} of ${bytes(dl.bytes_total)}` +
        (dl.eta_s ? `, ${Math.round(dl.eta_s)} s left` : "")), bar(dl.bytes_done / dl.bytes_total, "download"));
    } else if (f && f.loading_progress !== null && f.loading_progress !== undefined) {
      const p = typeof f.loading_progress === "number" ? f.loading_progress : f.loading_progress.fraction;
      if (typeof p === "number") card.append(el("div", {class: "muted"}, `loading ${pct(p)}`), bar(p, "download"));
    }
    if (gone_at !== null) card.append(el("div", {class: "muted"}, `gone since ${new Date(gone_at).toLocaleTimeString()}`));
    box.append(card);
  }
}

function renderRing(view) {
  const ring = $("#ring");
  ring.replaceChildren();
  const stages = view.plan || [];
  const hops = ((view.plan_detail || {}).hops) || [];
  const names = new Map((view.members || []).map((m) => [m.node_id, m.name]));
  stages.forEach((s, i) => {
    const gone = seen.has(s.node_id) && seen.get(s.node_id).gone_at !== null;
    ring.append(el("li", {class: `stage${gone ? " gone" : ""}`, "data-node-id": s.node_id},
      el("b", {}, `${i}`), ` ${names.get(s.node_id) || ""} ${short(s.node_id)} `,
      el("span", {class: "muted"}, `layers [${s.start}, ${s.end})`)));
    if (stages.length > 1) {
      const next = stages[(i + 1) % stages.length];
      const hop = hops.find((h) => h.src === s.node_id && h.dst === next.node_id);
      const link = (view.links || []).find((l) => (l.a === s.node_id && l.b === next.node_id) ||
                                                   (l.b === s.node_id && l.a === next.node_id));
      const bw = (link && link.bandwidth_bytes_per_s) || (hop && hop.bandwidth_bytes_per_s);
      const rtt = link ? link.rtt_s : hop && hop.latency_s;
      ring.append(el("li", {class: "hop"}, `→ ${bw ? bytes(bw) + "/s" : "?"}` +
        (rtt ? `, ${(rtt * 1000).toFixed(1)} ms` : "") + (i === stages.length - 1 ? " (back to 0)" : "")));
    }
  });
  if (!stages.length) ring.append(el("li", {class: "muted"}, view.infeasible ? `no plan: ${view.infeasible}` : "no plan yet"));
}

function renderRequests(view) {
  // a request is counted where the ring's head (stage 0) runs it: add up every node's figures
  const all = [view, ...Object.values(view.peers || {})];
  const sum = (f) => all.reduce((a, n) => a + (f(n) || 0), 0);
  const running = sum((n) => n.requests_in_flight);
  const rate = sum((n) => (n.batching || {}).head_tokens_per_s);
  const spec = {trips: sum((n) => (n.speculation || {}).trips), drafted: sum((n) => (n.speculation || {}).drafted),
                accepted: sum((n) => (n.speculation || {}).accepted), tokens: sum((n) => (n.speculation || {}).tokens)};
  const box = $("#requests");
  const rows = [el("div", {id: "in-flight", "data-count": String(running)},
    `${running} in flight · ${rate.toFixed(1)} tokens/s · queued ${(view.api || {}).queued ?? 0}`)];
  if (spec.trips) {
    rows.push(el("div", {class: "muted"}, `speculation: ${spec.accepted}/${spec.drafted} drafts accepted` +
      (spec.drafted ? ` (${pct(spec.accepted / spec.drafted)})` : "") +
      `, ${(spec.tokens / spec.trips).toFixed(2)} tokens/trip`));
  }
  for (const p of all.flatMap((n) => n.prefilling || [])) {
    rows.push(el("div", {class: "muted"}, `prefill ${p.request_id.slice(0, 12)}: ${p.processed_tokens}/${p.prompt_tokens}` +
      ` tokens (${p.cached_tokens} cached)` + (p.eta_s ? `, ${p.eta_s.toFixed(1)} s left` : "")),
      bar(p.prompt_tokens ? p.processed_tokens / p.prompt_tokens : 0));
  }
  const recent = all.flatMap((n) => (n.recent_requests || []).slice(-5)).reverse().slice(0, 8);
  if (recent.length) {
    const table = el("table", {}, el("tr", {}, el("th", {}, "recent"), el("th", {}, "prompt"),
      el("th", {}, "out"), el("th", {}, "TTFT"), el("th", {}, "tokens/s")));
    for (const r of recent) {
      table.append(el("tr", {}, el("td", {}, (r.request_id || "").slice(0, 12)), el("td", {}, String(r.prompt_tokens)),
        el("td", {}, String(r.completion_tokens)), el("td", {}, r.ttft_s ? `${(r.ttft_s * 1000).toFixed(0)} ms` : "–"),
        el("td", {}, r.tokens_per_s ? r.tokens_per_s.toFixed(1) : "–")));
    }
    rows.push(table);
  }
  box.replaceChildren(...rows);
}

function renderEvents(events) {
  const list = $("#events");
  list.replaceChildren(...events.slice(-50).reverse().map((e) => el("li", {},
    el("span", {class: "muted"}, new Date(e.ts * 1000).toLocaleTimeString() + " "),
    el("span", {class: "kind"}, e.kind), e.message)));
}

// ---------------------------------------------------------------- several models (GET /v1/cluster's models)
// A node serving several models answers /v1/cluster itself (the live view above is its first
// model's): each model's state, ring and memory. A node serving one model has no `models`.
let modelIds = "";
async function watchModels() {
  for (;;) {
    let several = false;
    try {
      const response = await fetch("/v1/cluster", {headers: headers(), cache: "no-store"});
      if (response.ok) {
        const view = await response.json();
        several = Array.isArray(view.models) && view.models.length > 0;
        renderModels(several ? view : null);
        const ids = several ? view.models.map((m) => [m.served || m.key, ...(m.aliases || [])].join(",")).join(";") : "";
        if (ids !== modelIds) { modelIds = ids; await fillModelPicker(); }
      }
    } catch (err) { /* the live view says the link is down */ }
    await new Promise((r) => setTimeout(r, several ? 2000 : 15000));
  }
}

function machineOf(view, stage, priority) {
  // each model's ring has its own node ids: name a stage after the member at its address
  // (a model of priority i listens on the node's gRPC port + i), else the only one at its host
  const members = view.members || [];
  const byId = members.find((m) => m.node_id === stage.node_id);
  if (byId) return byId;
  const cut = (a) => { const i = (a || "").lastIndexOf(":"); return [(a || "").slice(0, i), Number((a || "").slice(i + 1))]; };
  const [host, port] = cut(stage.address);
  const atPort = members.find((m) => m.grpc_address === `${host}:${port - priority}`);
  if (atPort) return atPort;
  const atHost = members.filter((m) => cut(m.grpc_address)[0] === host);
  return atHost.length === 1 && !["127.0.0.1", "::1", "localhost"].includes(host) ? atHost[0] : null;
}

function renderModels(view) {
  window.ringletModels = view ? view.models : null;  // for the curious, and the tests
  $("#models-panel").hidden = !view;
  $("#ring-model").textContent = view && view.model ? `of ${view.model}` : "";
  if (!view) return;
  $("#models").replaceChildren(...view.models.map((m, i) => {
    const priority = m.priority ?? i;
    const state = m.state || "?";
    const ring = (m.plan || []).map((s) => {
      const member = machineOf(view, s, priority);
      return `${member ? `${member.name || "?"} ${short(member.node_id)}` : short(s.node_id)} [${s.start}, ${s.end})`;
    }).join(" → ");
    const aliases = (m.aliases || []).length ? ` (${m.aliases.join(", ")})` : "";
    const here = `this node holds ${bytes(m.footprint_bytes)} · offered ${m.share_bytes === null ? "all" : bytes(m.share_bytes)}` +
      (m.epoch !== null && m.epoch !== undefined ? ` · epoch ${m.epoch}` : "") +
      (m.requests_in_flight ? ` · ${m.requests_in_flight} in flight` : "") + (m.restarts ? ` · restarted ${m.restarts}×` : "");
    return el("div", {class: "model", "data-key": m.key, "data-state": state},
      el("div", {class: "title"}, el("span", {}, `${priority + 1} · ${m.served || m.key}`, el("span", {class: "muted"}, aliases)),
        el("span", {class: `state ${state.replace(/ /g, "-")}`}, state)),
      el("div", {class: "ring-line"}, ring ? `ring: ${ring}` : m.infeasible ? `left out: ${m.infeasible}` :
        state === "failed" ? "its process keeps exiting at start here (the node's log says why)" : "no plan yet"),
      el("div", {class: "muted"}, here));
  }));
}

async function fillModelPicker() {
  // the chat's model: any id or alias of GET /v1/models (shown when there is more than one)
  const pick = $("#model-pick");
  let ids = [];
  try {
    const response = await fetch("/v1/models", {headers: headers(), cache: "no-store"});
    if (response.ok) ids = ((await response.json()).data || []).map((m) => m.id);
  } catch (err) { return; }
  const wanted = pick.value || JSON.parse(localStorage.getItem(SETTINGS) || "{}").model || "";
  pick.replaceChildren(...ids.map((id) => el("option", {value: id}, id)));
  if (ids.includes(wanted)) pick.value = wanted;
  pick.hidden = ids.length < 2;
}
const chosenModel = () => ($("#model-pick").hidden ? "" : $("#model-pick").value) || (window.ringletView || {}).model;

// ---------------------------------------------------------------- the chat
let chats = JSON.parse(localStorage.getItem(CHATS) || "[]");
let current = null, controller = null;

function saveChats() { localStorage.setItem(CHATS, JSON.stringify(chats)); }
function newChat() {
  const chat = {id: String(Date.now()), title: "new conversation", messages: []};
  chats.unshift(chat);
  current = chat;
  saveChats();
  showChats();
}
function showChats() {
  const select = $("#conversations");
  select.replaceChildren(...chats.map((c) => {
    const o = el("option", {value: c.id}, c.title);
    if (c === current) o.selected = true;
    return o;
  }));
  showMessages();
}
function markdown(text) {
  return DOMPurify.sanitize(marked.parse(text || ""));
}
function usageLine(u) {
  if (!u) return "";
  if (u.prompt_tokens === undefined) return u.stopped ? `stopped after ${u.chunks || 0} chunks` : "";
  const cached = ((u.prompt_tokens_details || {}).cached_tokens) || 0;
  return `prompt ${u.prompt_tokens} tokens (${cached} cached) · reply ${u.completion_tokens} tokens` +
    (u.tokens_per_s ? ` · ${u.tokens_per_s.toFixed(1)} tokens/s` : "") + (u.stopped ? " · stopped" : "");
}
function messageView(m) {
  if (m.role === "user") return el("div", {class: "msg user"}, m.content);
  const box = el("div", {class: `msg assistant${m.error ? " error" : ""}`});
  const content = el("div", {class: "content"});
  content.innerHTML = markdown(m.content);
  box.append(content);
  if (m.error) box.append(el("div", {class: "usage"}, m.error));
  const line = usageLine(m.usage);
  if (line) box.append(el("div", {class: "usage"}, line));
  return box;
}
function showMessages() {
  const box = $("#messages");
  box.replaceChildren(...(current ? current.messages.map(messageView) : []));
  box.scrollTop = box.scrollHeight;
}
function settings() {
  return {system: $("#system").value, temperature: Number($("#temperature").value),
          max_tokens: Number($("#max-tokens").value), model: $("#model-pick").value || undefined};
}
function saveSettings() { localStorage.setItem(SETTINGS, JSON.stringify(settings())); }

async function send(text) {
  if (!current) newChat();
  const chat = current;
  if (!chat.messages.length) chat.title = text.slice(0, 40);
  chat.messages.push({role: "user", content: text});
  const reply = {role: "assistant", content: ""};
  const s = settings();
  const messages = (s.system ? [{role: "system", content: s.system}] : []).concat(
    chat.messages.filter((m) => !m.error).map((m) => ({role: m.role, content: m.content})));
  chat.messages.push(reply);
  saveChats();
  showChats();
  const box = $("#messages").lastElementChild;
  const content = box.querySelector(".content");
  controller = new AbortController();
  $("#send").hidden = true;
  $("#stop").hidden = false;
  const started = performance.now();
  let first = null, pending = false, chunks = 0;
  const paint = () => {
    pending = false;
    content.innerHTML = markdown(reply.content);
    $("#messages").scrollTop = $("#messages").scrollHeight;
  };
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", signal: controller.signal,
      headers: headers({"Content-Type": "application/json"}),
      body: JSON.stringify({model: chosenModel(), messages, stream: true, stream_options: {include_usage: true},
                            temperature: s.temperature, max_tokens: s.max_tokens}),
    });
    if (response.status === 401) askKey();
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      throw new Error(((body.error || {}).message) || `HTTP ${response.status}`);
    }
    await readSSE(response, (data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || "error");
      const delta = ((chunk.choices || [])[0] || {}).delta || {};
      if (delta.content) {
        if (first === null) first = performance.now();
        chunks++;
        reply.content += delta.content;
        if (!pending) { pending = true; requestAnimationFrame(paint); }
      }
      if (chunk.usage) reply.usage = chunk.usage;
    });
  } catch (err) {
    if (err.name === "AbortError") reply.usage = {...(reply.usage || {}), stopped: true, chunks};
    else reply.error = String(err.message || err);
  } finally {
    controller = null;
    $("#send").hidden = false;
    $("#stop").hidden = true;
    if (reply.usage && first !== null && reply.usage.completion_tokens > 1) {
      reply.usage.tokens_per_s = (reply.usage.completion_tokens - 1) / ((performance.now() - first) / 1000);
    }
    reply.elapsed_s = (performance.now() - started) / 1000;
    reply.done = true;
    saveChats();
    showMessages();
  }
}

// ---------------------------------------------------------------- wiring
function init() {
  const saved = JSON.parse(localStorage.getItem(SETTINGS) || "{}");
  if (saved.system !== undefined) $("#system").value = saved.system;
  if (saved.temperature !== undefined) $("#temperature").value = saved.temperature;
  if (saved.max_tokens !== undefined) $("#max-tokens").value = saved.max_tokens;
  for (const id of ["#system", "#temperature", "#max-tokens", "#model-pick"]) $(id).addEventListener("change", saveSettings);
  current = chats[0] || null;
  showChats();
  $("#key-button").addEventListener("click", askKey);
  $("#key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const key = $("#key-input").value.trim();
    if (key) localStorage.setItem(KEY, key); else localStorage.removeItem(KEY);
    $("#key-form").hidden = true;
    keyWaiters.splice(0).forEach((r) => r());
  });
  $("#new-chat").addEventListener("click", newChat);
  $("#delete-chat").addEventListener("click", () => {
    chats = chats.filter((c) => c !== current);
    current = chats[0] || null;
    saveChats();
    showChats();
  });
  $("#conversations").addEventListener("change", (e) => {
    current = chats.find((c) => c.id === e.target.value) || null;
    showMessages();
  });
  $("#chat-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("#chat-input").value.trim();
    if (!text || controller) return;
    $("#chat-input").value = "";
    send(text);
  });
  $("#chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("#chat-form").requestSubmit(); }
  });
  $("#stop").addEventListener("click", () => controller && controller.abort());
  watch();
  watchModels();
}
document.addEventListener("DOMContentLoaded", init);
