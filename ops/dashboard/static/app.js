// The dashboard's page: follows /api/events (server-sent events), falls back
// to polling /api/state, and renders the state into the board and panels.
// Cards are kept per order id and moved between columns, so a button does not
// vanish under the pointer when the next update arrives. Clicking a card opens
// the order's journey (/api/orders/{id}/journey), read again with every update
// while it is open.
"use strict";

const STATES = ["PENDING", "WAIT_PAY", "PAID", "FULFILLING", "COMPLETED", "REJECTED", "CLOSED"];
const $ = (sel) => document.querySelector(sel);
const cards = new Map(); // order id -> <li>
const traceURLs = new Map(); // order id -> its trace in the trace UI (TRACE_UI_URL), when known
const mine = new Set();  // orders placed from this page
let canPay = false;      // the payment service's fake provider is on (state.can_pay)
let canOrder = null;     // the dashboard runs as a demo and may place orders (state.can_order); null until known
const columns = {};

function el(tag, props = {}, ...children) {
  const e = document.createElement(tag);
  Object.assign(e, props);
  for (const c of children) e.append(c);
  return e;
}

function buildBoard() {
  for (const s of STATES) {
    const count = el("span", { className: "count", textContent: "0" });
    const list = el("ul", { className: "cards" });
    const col = el("section", { className: "col", id: "col-" + s }, el("h2", {}, s, count), list);
    col.dataset.state = s;
    $("#board").append(col);
    columns[s] = { count, list };
  }
}

// Every time on the page is local, 24 h, to the millisecond (HH:MM:SS.mmm),
// so a card, an event and a journey hop can be compared at a glance.
const clock = (t) => new Date(t).toLocaleTimeString("en-GB",
  { hour12: false, hour: "2-digit", minute: "2-digit", second: "2-digit", fractionalSecondDigits: 3 });

// Totals are integer cents, as the API carries them, in the state's
// currency (the shop trades in one).
let currency = "EUR";
const money = (cents) => new Intl.NumberFormat("en", { style: "currency", currency }).format(cents / 100);
const itemsText = (items) => (items || []).map((i) => i.quantity + "× " + i.sku).join(", ");

function duration(seconds) {
  if (!seconds) return "–";
  return seconds < 60 ? seconds.toFixed(1) + "s" : Math.floor(seconds / 60) + "m " + Math.round(seconds % 60) + "s";
}

function card(o) {
  let c = cards.get(o.order_id);
  if (!c) {
    const pay = el("button", { className: "pay", type: "button", textContent: "Pay" });
    pay.addEventListener("click", (e) => { e.stopPropagation(); payOrder(o.order_id, pay); });
    c = el("li", { className: "card" },
      el("span", { className: "id", title: o.order_id, textContent: "…" + o.order_id.slice(-8) }),
      el("span", { className: "total" }), pay,
      el("span", { className: "who" }), el("span", { className: "items" }),
      el("span", { className: "reason" }), el("span", { className: "meta" }),
      el("a", { className: "trace", target: "_blank", rel: "noopener", textContent: "trace ↗", hidden: true }));
    // The link opens the trace UI; it must not also open the journey.
    c.querySelector(".trace").addEventListener("click", (e) => e.stopPropagation());
    c.dataset.orderId = o.order_id;
    c.title = "Show the journey of order " + o.order_id;
    c.addEventListener("click", () => openJourney(o.order_id));
    cards.set(o.order_id, c);
  }
  c.dataset.status = o.status;
  c.classList.toggle("mine", mine.has(o.order_id));
  c.classList.toggle("open", journeyOf === o.order_id);
  c.querySelector(".total").textContent = money(o.total);
  c.querySelector(".who").textContent = o.customer_id;
  c.querySelector(".items").textContent = itemsText(o.items);
  const reason = c.querySelector(".reason");
  reason.textContent = o.reason ? "reason: " + o.reason : "";
  reason.hidden = !o.reason;
  c.querySelector(".meta").textContent = "updated " + clock(o.updated_at);
  if (o.trace_url) traceURLs.set(o.order_id, o.trace_url);
  const trace = c.querySelector(".trace");
  trace.hidden = !o.trace_url;
  if (o.trace_url) { trace.href = o.trace_url; trace.title = "Open the trace of order " + o.order_id; }
  const pay = c.querySelector(".pay");
  pay.hidden = !canPay || o.status !== "WAIT_PAY";
  return c;
}

function rows(tbody, items, cells) {
  tbody.replaceChildren(...items.map((it) => el("tr", {}, ...cells(it))));
}

function td(text, className = "") {
  return el("td", { textContent: String(text), className });
}

// relayText is a service's relay in words: its mode and, for a replication
// slot, how much WAL it holds and since when, and its wal_status.
function relayText(r) {
  let text = "relay " + r.mode;
  if (r.slot) {
    const age = r.slot.lag_age_seconds > 0 ? ", " + Math.round(r.slot.lag_age_seconds) + "s" : "";
    text += " · slot lag " + bytes(r.slot.lag_bytes) + age + " · " + (r.slot.wal_status || "no slot yet");
  }
  return text;
}

function bytes(n) {
  if (n < 1024) return n + " B";
  const units = ["KiB", "MiB", "GiB", "TiB"];
  let i = -1;
  do { n /= 1024; i++; } while (n >= 1024 && i < units.length - 1);
  return n.toFixed(1) + " " + units[i];
}

// The health strip: one chip per service, from its GET /readyz as the
// server last asked it (every few seconds).
function renderHealth(health) {
  if (!health || health.length === 0) return;
  $("#health").replaceChildren(...health.map((h) => {
    const li = el("li", { className: h.ok ? "ok" : "down", title: "GET /readyz at " + clock(h.at) },
      el("b", { textContent: h.service }), " " + (h.ok ? "ok" : "not ready"),
      el("span", { className: "detail", textContent: h.detail }));
    if (h.relay) li.append(el("span", { className: "relay", textContent: relayText(h.relay) }));
    li.dataset.service = h.service;
    li.dataset.ok = h.ok;
    return li;
  }));
}

function render(st) {
  $("#timeout").textContent = st.payment_timeout;
  renderHealth(st.health);
  canPay = st.can_pay === true;
  if (canOrder !== (st.can_order === true)) {
    canOrder = st.can_order === true;
    $("#place").hidden = !canOrder;
    if (!canOrder) say("Read-only: outside a demo this dashboard places and pays no orders " +
      "(run shop all -demo, or set DASHBOARD_DEMO=true, for the buttons).");
  }
  currency = st.currency || currency;
  const seen = new Set();
  const by = Object.fromEntries(STATES.map((s) => [s, []]));
  for (const o of st.orders) (by[o.status] ||= []).push(o);
  for (const s of STATES) {
    columns[s].count.textContent = st.counts[s] ?? 0;
    const list = columns[s].list;
    by[s].forEach((o, i) => {
      seen.add(o.order_id);
      const c = card(o);
      if (list.children[i] !== c) list.insertBefore(c, list.children[i] || null);
    });
  }
  for (const [id, c] of cards) {
    if (!seen.has(id)) { c.remove(); cards.delete(id); }
  }
  rows($("#outbox"), st.outbox, (b) => [
    td(b.service), td(b.pending, "num"), td(duration(b.oldest_pending_seconds), "num"),
    td(b.dead, b.dead > 0 ? "num alert" : "num"),
  ]);
  rows($("#deadletters"), st.dead_letters, (d) => [
    td(d.service), td(d.open, d.open > 0 ? "num alert" : "num"),
    td(d.conflicts, d.conflicts > 0 ? "num alert" : "num"),
    td(d.parked, "num"), td(d.parked > 0 ? duration(d.oldest_parked_seconds) : "", "num"),
  ]);
  rows($("#events"), st.events, (e) => [
    td(clock(e.published_at)), td(e.subject), td(e.type),
  ]);
  if (journeyOf) loadJourney();
}

// ---- the journey of one order ----

let journeyOf = "";      // the order whose journey is open, "" when closed
let journeyBusy = false; // a read is in flight: updates do not pile up

function span(seconds) {
  if (seconds === undefined || seconds === null) return "";
  const sign = seconds < 0 ? "−" : "";
  const s = Math.abs(seconds);
  if (s < 1) return sign + (s * 1000).toFixed(s < 0.01 ? 1 : 0) + " ms";
  return sign + duration(s);
}

function openJourney(id) {
  journeyOf = id;
  for (const [cid, c] of cards) c.classList.toggle("open", cid === id);
  $("#journey-id").textContent = id;
  $("#journey-status").textContent = "";
  $("#journey-entries").replaceChildren();
  $("#journey-notes").replaceChildren();
  $("#journey-problem").hidden = true;
  $("#journey").hidden = false;
  $("#journey").scrollIntoView({ block: "nearest" });
  loadJourney();
}

function closeJourney() {
  journeyOf = "";
  $("#journey").hidden = true;
  for (const c of cards.values()) c.classList.remove("open");
}

async function loadJourney() {
  if (journeyBusy) return;
  journeyBusy = true;
  const id = journeyOf;
  try {
    const res = await fetch("/api/orders/" + encodeURIComponent(id) + "/journey", { cache: "no-store" });
    const j = await res.json();
    if (!res.ok) throw new Error(j.error || res.statusText);
    if (id === journeyOf) renderJourney(j);
  } catch (e) {
    if (id === journeyOf) {
      const p = $("#journey-problem");
      p.textContent = "Cannot read the journey: " + e.message;
      p.hidden = false;
    }
  } finally {
    journeyBusy = false;
  }
}

function renderJourney(j) {
  $("#journey-problem").hidden = true;
  $("#journey-status").textContent = j.status || "(no order row)";
  const trace = $("#journey-trace");
  trace.hidden = !traceURLs.has(j.order_id);
  if (!trace.hidden) trace.href = traceURLs.get(j.order_id);
  const tbody = $("#journey-entries");
  tbody.replaceChildren(...j.entries.map((e, i) => {
    const hop = e.hop_from ? span(e.hop_seconds) + " after " + e.hop_from : "";
    const tr = el("tr", {},
      td(clock(e.at), "time"), td(i === 0 ? "" : "+" + span(e.since_previous_seconds), "num"),
      td(hop, "num"), td(e.service), td(e.what));
    tr.dataset.kind = e.kind;
    if (e.consumer) tr.dataset.consumer = e.consumer;
    if (e.event_type) tr.dataset.eventType = e.event_type;
    if (e.state) tr.dataset.state = e.state;
    return tr;
  }));
  renderWaterfall(j.entries);
  const notes = j.notes.slice();
  for (const t of j.timeouts) notes.push("the saga's " + t.name + " timeout is armed: due " + clock(t.due_at));
  $("#journey-notes").replaceChildren(...notes.map((n) => el("li", { textContent: n })));
}

// renderWaterfall draws the journey on a time axis: a row per event with a
// bar from its commit to its publish, under it a row per consumer with a
// bar from the publish (or the commit, when the consumer was first) to its
// processing, and the order's states as marks across all rows.
function renderWaterfall(entries) {
  const wf = $("#waterfall");
  if (entries.length === 0) { wf.replaceChildren(); return; }
  const ms = (e) => Date.parse(e.at);
  const t0 = Math.min(...entries.map(ms));
  const t1 = Math.max(...entries.map(ms));
  const spanMs = Math.max(t1 - t0, 1);
  const pct = (t) => ((t - t0) / spanMs) * 100;
  const rows = [];  // { label, sub, bars: [{from, to, kind, title}] }
  const byEvent = new Map();
  for (const e of entries) {
    if (e.kind === "committed") {
      const r = { label: e.event_type, sub: e.service, bars: [], kids: [] };
      r.commit = ms(e);
      byEvent.set(e.event_id, r);
      rows.push(r);
    }
  }
  for (const e of entries) {
    const r = byEvent.get(e.event_id);
    if (!r) continue;
    if (e.kind === "published" || e.kind === "dead") {
      r.bars.push({ from: r.commit, to: ms(e), kind: e.kind === "published" ? "publish" : "failing", title: e.what + " · " + span(e.hop_seconds) });
    } else if (["processed", "failing", "dead_letter", "parked"].includes(e.kind)) {
      const to = ms(e);
      const from = e.hop_seconds != null ? to - e.hop_seconds * 1000 : to;
      r.kids.push({ label: "→ " + e.consumer, sub: e.service, consumer: e.consumer,
        bars: [{ from, to, kind: e.kind === "processed" ? "processed" : "failing",
          title: e.what + (e.hop_from ? " · " + span(e.hop_seconds) + " after " + e.hop_from : "") }] });
    }
  }
  const track = (bars) => el("div", { className: "track" }, ...bars.map((b) => {
    const bar = el("span", { className: "bar " + b.kind, title: b.title });
    bar.style.left = pct(b.from) + "%";
    bar.style.width = Math.max(pct(b.to) - pct(b.from), 0) + "%";
    return bar;
  }));
  const out = [];
  for (const r of rows) {
    const row = el("div", { className: "wrow event" },
      el("div", { className: "wlabel" }, el("b", { textContent: r.label }), " ", el("span", { className: "sub", textContent: r.sub })),
      track(r.bars));
    row.dataset.eventType = r.label;
    out.push(row);
    for (const k of r.kids) {
      const kid = el("div", { className: "wrow hop" }, el("div", { className: "wlabel", textContent: k.label }), track(k.bars));
      kid.dataset.eventType = r.label;
      kid.dataset.consumer = k.consumer;
      out.push(kid);
    }
  }
  // The axis: ticks at a round step, labelled from the order's first entry.
  const steps = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000, 60000, 300000, 600000];
  const step = steps.find((s) => spanMs / s <= 8) || 600000;
  const axis = el("div", { className: "track axis" });
  for (let t = 0; t <= spanMs; t += step) {
    const tick = el("span", { className: "tick", textContent: t === 0 ? "0" : "+" + span(t / 1000) });
    tick.style.left = pct(t0 + t) + "%";
    axis.append(tick);
  }
  const head = el("div", { className: "wrow head" }, el("div", { className: "wlabel", textContent: "from " + clock(t0) }), axis);
  // State marks span every row.
  const marks = el("div", { className: "marks" });
  let n = 0;
  for (const e of entries) {
    if (e.kind !== "state") continue;
    const m = el("span", { className: "mark", title: clock(e.at) + " " + e.what });
    m.style.left = pct(ms(e)) + "%";
    m.dataset.state = e.state;
    // States a few ms apart would print over each other: the labels step down.
    const label = el("span", { className: "mlabel", textContent: e.state });
    label.style.top = (n++ % 3) * 1.3 + "em";
    if (pct(ms(e)) > 85) { label.style.left = "auto"; label.style.right = "3px"; } // stays inside the panel
    m.append(label);
    marks.append(m);
  }
  const body = el("div", { className: "wbody" }, ...out, marks);
  wf.replaceChildren(head, body);
}

function say(text, error = false, orderId = "") {
  const m = $("#message");
  m.textContent = text;
  m.classList.toggle("error", error);
  m.dataset.orderId = orderId;
}

async function post(url) {
  const res = await fetch(url, { method: "POST" });
  let body = {};
  try { body = await res.json(); } catch { /* not JSON */ }
  if (!res.ok) throw new Error(body.detail || body.error || res.status + " " + res.statusText);
  return body;
}

async function placeOrder() {
  const b = $("#place");
  b.disabled = true;
  try {
    const o = await post("/api/demo/order");
    mine.add(o.order_id);
    say("Placed order " + o.order_id + " (" + (o.status || "PENDING") + "). " +
      (canPay ? "Pay it once it is in WAIT_PAY." : "Paying needs the fake provider (shop all -demo); unpaid, it closes after the payment timeout."),
      false, o.order_id);
    refresh();
  } catch (e) {
    say("Could not place an order: " + e.message + " (is SKU-1 stocked? `shop all -demo` stocks it)", true);
  } finally {
    b.disabled = false;
  }
}

async function payOrder(id, button) {
  button.disabled = true;
  button.textContent = "Paying…";
  try {
    await post("/api/demo/pay/" + id);
    say("Paid order " + id + ".", false, id);
    refresh();
  } catch (e) {
    say("Could not pay order " + id + ": " + e.message, true, id);
  } finally {
    button.disabled = false;
    button.textContent = "Pay";
  }
}

function status(text, cls) {
  const c = $("#conn");
  c.textContent = text;
  c.className = "conn " + cls;
}

async function refresh() {
  try {
    const res = await fetch("/api/state", { cache: "no-store" });
    const st = await res.json();
    if (!res.ok) throw new Error(st.error || res.statusText);
    render(st);
    return true;
  } catch (e) {
    status("cannot read the state: " + e.message, "down");
    return false;
  }
}

let polling = false;
function poll() {
  if (polling) return;
  polling = true;
  const tick = async () => {
    if (await refresh()) status("live (polling every second)", "poll");
    setTimeout(tick, 1000);
  };
  tick();
}

function follow() {
  if (!window.EventSource) return poll();
  const es = new EventSource("/api/events");
  es.onmessage = (e) => {
    render(JSON.parse(e.data));
    status("live (server-sent events)", "live");
  };
  es.addEventListener("problem", (e) => status("cannot read the state: " + JSON.parse(e.data).error, "down"));
  // A stream that breaks (a proxy that buffers it, a restart) is replaced by
  // polling, which works wherever plain requests do.
  es.onerror = () => {
    es.close();
    poll();
  };
}

// ---- the charts of the last minutes (uPlot, from /api/series) ----

const PALETTE = ["#2563eb", "#15803d", "#b45309", "#b91c1c", "#7c3aed", "#0891b2", "#be185d"];
const charts = {};      // id -> { plot, keys }
window.chartData = {};  // the data each chart plots, for the browser test and the curious

function chartWidth(id) {
  return Math.max(240, document.getElementById(id).clientWidth);
}

// chart draws data (x first) in #id with the named series, made anew when
// the series change (a service appears) and updated in place otherwise.
function chart(id, names, data, unit, floor = 1) {
  window.chartData[id] = data;
  const key = names.join(",");
  const have = charts[id];
  if (have && have.key === key) {
    have.plot.setData(data);
    return;
  }
  if (have) have.plot.destroy();
  const opts = {
    width: chartWidth(id), height: 170,
    // At least a minute across, so the first samples are not stretched
    // over the whole width as if they were the window.
    // Counts start at 0 and a quiet shop's flat zero sits at the bottom.
    scales: {
      x: { time: true, range: (u, min, max) => [Math.min(min, max - 60), max] },
      y: { range: (u, min, max) => [0, Math.max(max ?? 0, floor) * 1.1] },
    },
    legend: { live: true },
    series: [
      { label: "time", value: (u, v) => (v == null ? "–" : clock(v * 1000)) },
      ...names.map((n, i) => ({
        label: n, stroke: PALETTE[i % PALETTE.length], width: 2, spanGaps: false,
        value: (u, v) => (v == null ? "–" : (Math.round(v * 10) / 10) + unit),
      })),
    ],
    axes: [
      // One time format: 24 h, local, as everywhere on the page.
      { values: (u, splits) => splits.map((v) => clock(v * 1000).slice(0, 8)), space: 70 },
      { size: 50 },
    ],
  };
  const el = document.getElementById(id);
  el.replaceChildren();
  charts[id] = { key, plot: new uPlot(opts, data, el) };
}

function renderSeries(sr) {
  $("#window").textContent = Math.round(sr.window_seconds / 60);
  const t = sr.t;
  chart("chart-completed", ["completed/s"], [t, sr.completed_per_second], "/s");
  chart("chart-latency", ["p50", "p99"], [t, sr.latency_p50_ms, sr.latency_p99_ms], " ms", 100);
  const per = (m) => Object.keys(m).sort((a, b) => a.localeCompare(b));
  const backlog = per(sr.backlog);
  chart("chart-backlog", backlog, [t, ...backlog.map((n) => sr.backlog[n])], "", 5);
  const lag = per(sr.lag);
  chart("chart-lag", lag, [t, ...lag.map((n) => sr.lag[n])], "", 5);
}

let seriesBusy = false;
async function loadSeries() {
  if (seriesBusy) return;
  seriesBusy = true;
  try {
    const res = await fetch("/api/series", { cache: "no-store" });
    if (res.ok) renderSeries(await res.json());
  } catch (e) {
    /* the state's connection line already says when the server is away */
  } finally {
    seriesBusy = false;
  }
}

window.addEventListener("resize", () => {
  for (const [id, c] of Object.entries(charts)) c.plot.setSize({ width: chartWidth(id), height: 170 });
});

buildBoard();
loadSeries();
setInterval(loadSeries, 2000);
$("#place").addEventListener("click", placeOrder);
$("#journey-close").addEventListener("click", closeJourney);
follow();
