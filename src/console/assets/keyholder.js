// The key holder's page: balance, redeeming a code, usage per day and model, and the call log,
// with the key from this tab's session storage only.
"use strict";

const KEY_ITEM = "mg_key";
let nextBefore = null;
let usage = [];

function key() {
  return sessionStorage.getItem(KEY_ITEM);
}

async function signIn(event) {
  event.preventDefault();
  const presented = document.getElementById("key").value.trim();
  document.getElementById("sign-in-error").textContent = "";
  try {
    await callApi(presented, "/v1/balance");
  } catch (error) {
    document.getElementById("sign-in-error").textContent = error.message;
    return;
  }
  sessionStorage.setItem(KEY_ITEM, presented);
  document.getElementById("key").value = "";
  await enter();
}

function signOut() {
  sessionStorage.removeItem(KEY_ITEM);
  show("account", false);
  show("sign-out", false);
  show("sign-in-panel", true);
}

async function enter() {
  show("sign-in-panel", false);
  show("account", true);
  show("sign-out", true);
  await refresh();
}

/** How many refreshes were asked for: only the last one asked is drawn. */
let refreshes = 0;

async function refresh() {
  const asked = ++refreshes;
  document.getElementById("account-error").textContent = "";
  try {
    const [balance, usageAnswer, calls, models] = await Promise.all([
      callApi(key(), "/v1/balance"),
      callApi(key(), "/v1/usage?days=30"),
      callApi(key(), "/v1/calls?limit=20"),
      callApi(key(), "/v1/models"),
    ]);
    // A refresh asked for later draws instead, even if this one's answers come last.
    if (asked !== refreshes) return;
    showBalance(balance);
    showKeyLimit(balance.key_limit);
    showModels(models);
    usage = usageAnswer;
    drawChart();
    document.getElementById("calls").replaceChildren();
    showCalls(calls);
  } catch (error) {
    if (asked !== refreshes) return;
    if (error.status === 401) {
      signOut();
      document.getElementById("sign-in-error").textContent = error.message;
    } else {
      document.getElementById("account-error").textContent = error.message;
    }
  }
}

function showBalance(balance) {
  document.getElementById("subscription").textContent = balance.subscription;
  document.getElementById("topup").textContent = balance.topup;
  document.getElementById("total").textContent = balance.total;
  document.getElementById("ends-at").textContent = balance.subscription_ends_at
    ? formatTime(balance.subscription_ends_at)
    : t("never");
}

/** The key's spending limit, if it has one (from `GET /v1/balance`). */
function showKeyLimit(limit) {
  show("key-limit-card", Boolean(limit));
  document.getElementById("key-limit").textContent = limitText(limit);
  document.getElementById("key-limit-resets").textContent =
    limit && limit.resets_at ? t("resets") + " " + formatTime(limit.resets_at) : "";
}

function showModels(models) {
  const body = document.getElementById("models");
  body.replaceChildren();
  for (const model of models.data) {
    body.append(row([model.id, model.protocol, pricesText(model)]));
  }
}

function showCalls(page) {
  const body = document.getElementById("calls");
  for (const call of page.data) {
    const status = el("span", call.status, "status-" + call.status);
    body.append(
      row([
        formatTime(call.created_at),
        call.model,
        call.protocol,
        call.price,
        tokensText(call),
        status,
        call.request_id,
        call.status === "refunded" ? call.upstream_error : "",
      ]),
    );
    body.lastChild.lastChild.className = "wrap";
  }
  nextBefore = page.has_more ? page.next_before : null;
  show("older", nextBefore !== null);
  show("no-calls", body.children.length === 0);
}

async function older() {
  const asked = refreshes;
  try {
    const page = await callApi(key(), "/v1/calls?limit=20&before=" + encodeURIComponent(nextBefore));
    // A refresh since drew the newest calls: this older page belongs to the list before it.
    if (asked !== refreshes) return;
    showCalls(page);
  } catch (error) {
    document.getElementById("account-error").textContent = error.message;
  }
}

async function redeem(event) {
  event.preventDefault();
  const result = document.getElementById("redeem-result");
  result.textContent = "";
  result.className = "";
  try {
    const code = document.getElementById("redeem-code").value.trim();
    const redeemed = await callApi(key(), "/v1/redeem", { method: "POST", body: { code } });
    document.getElementById("redeem").reset();
    result.textContent = t("redeemed") + " " + redeemed.credits + " (" + t(redeemed.bucket) + ")";
    result.className = "status-ok";
    showBalance(redeemed.balance);
  } catch (error) {
    result.textContent = error.message;
    result.className = "error";
    if (error.status === 401) signOut();
  }
}

const SVG = "http://www.w3.org/2000/svg";

/** Stacked bars: one per day of the window, one colour per model. */
function drawChart() {
  const svg = document.getElementById("chart");
  const legend = document.getElementById("legend");
  svg.replaceChildren();
  legend.replaceChildren();
  if (!usage || !usage.since) return;
  const measure = document.getElementById("measure").value;
  const days = [];
  const first = new Date(usage.since + "T00:00:00Z");
  for (let i = 0; i < usage.days; i++) {
    days.push(new Date(first.getTime() + i * 86400000).toISOString().slice(0, 10));
  }
  const models = [...new Set(usage.data.map((entry) => entry.model))].sort();
  const totals = new Map(days.map((day) => [day, 0]));
  for (const entry of usage.data) totals.set(entry.day, (totals.get(entry.day) || 0) + entry[measure]);
  const highest = Math.max(1, ...totals.values());
  const width = 600 / days.length;
  const height = 160;
  const stacked = new Map(days.map((day) => [day, 0]));
  for (const entry of usage.data) {
    const index = days.indexOf(entry.day);
    if (index < 0) continue;
    const value = entry[measure];
    const below = stacked.get(entry.day);
    stacked.set(entry.day, below + value);
    const bar = document.createElementNS(SVG, "rect");
    bar.setAttribute("x", String(index * width + 1));
    bar.setAttribute("width", String(Math.max(1, width - 2)));
    bar.setAttribute("y", String(height - ((below + value) / highest) * height));
    bar.setAttribute("height", String((value / highest) * height));
    bar.setAttribute("class", "fill-" + (models.indexOf(entry.model) % 6));
    const title = document.createElementNS(SVG, "title");
    title.textContent = entry.day + " " + entry.model + ": " + value;
    bar.append(title);
    svg.append(bar);
  }
  for (const [x, anchor, text] of [[0, "start", days[0]], [600, "end", days[days.length - 1]]]) {
    const label = document.createElementNS(SVG, "text");
    label.setAttribute("x", String(x));
    label.setAttribute("y", "176");
    label.setAttribute("text-anchor", anchor);
    label.setAttribute("class", "axis");
    label.textContent = text;
    svg.append(label);
  }
  const top = document.createElementNS(SVG, "text");
  top.setAttribute("x", "0");
  top.setAttribute("y", "10");
  top.setAttribute("class", "axis");
  top.setAttribute("id", "chart-max");
  top.textContent = String(highest);
  svg.append(top);
  models.forEach((model, index) => {
    const item = el("span");
    item.append(el("span", null, "swatch swatch-" + (index % 6)), document.createTextNode(model));
    legend.append(item);
  });
}

document.addEventListener("DOMContentLoaded", () => {
  translatePage();
  document.getElementById("sign-in").addEventListener("submit", signIn);
  document.getElementById("sign-out").addEventListener("click", signOut);
  document.getElementById("refresh").addEventListener("click", refresh);
  document.getElementById("older").addEventListener("click", older);
  document.getElementById("redeem").addEventListener("submit", redeem);
  document.getElementById("measure").addEventListener("change", drawChart);
  document.getElementById("language").addEventListener("click", () => {
    toggleLanguage();
    translatePage();
    if (key()) refresh();
  });
  if (key()) enter();
});
