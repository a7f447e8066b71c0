// The operator's page: redemption codes, accounts, keys, grants, calls and the audit, through
// the admin API with the admin token from this tab's session storage only.
"use strict";

const TOKEN_ITEM = "mg_admin";
let current = null;

function token() {
  return sessionStorage.getItem(TOKEN_ITEM);
}

function admin(path, options) {
  return callApi(token(), path, options);
}

function failed(error) {
  if (error.status === 401) {
    signOut();
    document.getElementById("sign-in-error").textContent = error.message;
  } else {
    document.getElementById("error").textContent = error.message;
  }
}

async function signIn(event) {
  event.preventDefault();
  const presented = document.getElementById("token").value.trim();
  document.getElementById("sign-in-error").textContent = "";
  try {
    await callApi(presented, "/admin/accounts?limit=1");
  } catch (error) {
    document.getElementById("sign-in-error").textContent = error.message;
    return;
  }
  sessionStorage.setItem(TOKEN_ITEM, presented);
  document.getElementById("token").value = "";
  enter();
}

function signOut() {
  sessionStorage.removeItem(TOKEN_ITEM);
  show("console", false);
  show("sign-out", false);
  show("sign-in-panel", true);
}

function enter() {
  show("sign-in-panel", false);
  show("console", true);
  show("sign-out", true);
  listAccounts();
  listCodeBatches();
}

async function listCodeBatches() {
  try {
    const page = await admin("/admin/codes");
    const body = document.getElementById("code-batches");
    body.replaceChildren();
    for (const batch of page.data) {
      let action = "";
      if (batch.unused > 0) {
        action = el("button", t("revokeUnused"), "danger");
        action.type = "button";
        action.dataset.batch = batch.batch;
        action.addEventListener("click", () => revokeCodes(batch.batch));
      }
      body.append(
        row([
          batch.batch,
          batch.label,
          batch.credits,
          t(batch.bucket) + (batch.period_days ? " · " + batch.period_days + "d" : ""),
          batch.used,
          batch.unused,
          batch.revoked,
          batch.expires_at ? formatTime(batch.expires_at) : t("never"),
          action,
        ]),
      );
    }
  } catch (error) {
    failed(error);
  }
}

async function createCodes(event) {
  event.preventDefault();
  const body = {
    count: Number(document.getElementById("codes-count").value),
    credits: Number(document.getElementById("codes-credits").value),
    bucket: document.getElementById("codes-bucket").value,
  };
  const days = document.getElementById("codes-days").value;
  if (days) body.period_days = Number(days);
  const expires = document.getElementById("codes-expires").value;
  if (expires) body.expires_at = new Date(expires).toISOString();
  const label = document.getElementById("codes-label").value;
  if (label) body.label = label;
  try {
    const created = await admin("/admin/codes", { method: "POST", body });
    const container = document.getElementById("created-codes");
    const codes = el("pre", created.codes.join("\n"));
    codes.id = "created-codes-value";
    container.replaceChildren(el("div", t("codesOnce")), codes);
    container.hidden = false;
    document.getElementById("create-codes").reset();
    await listCodeBatches();
  } catch (error) {
    failed(error);
  }
}

async function revokeCodes(batch) {
  if (!window.confirm(t("confirmRevokeCodes"))) return;
  try {
    await admin("/admin/codes/" + batch + "/revoke", { method: "POST" });
    await listCodeBatches();
  } catch (error) {
    failed(error);
  }
}

/** How many account lists were asked for: only the last one asked is drawn. */
let listings = 0;

async function listAccounts(event) {
  if (event) event.preventDefault();
  document.getElementById("error").textContent = "";
  const search = document.getElementById("search").value.trim();
  const query = "/admin/accounts?limit=100" + (search ? "&search=" + encodeURIComponent(search) : "");
  const listing = ++listings;
  try {
    const page = await admin(query);
    // Each typed letter asks again; an earlier letter's answer that comes last is not drawn.
    if (listing !== listings) return;
    const body = document.getElementById("accounts");
    body.replaceChildren();
    for (const account of page.data) {
      const tr = row([account.id, account.name, account.balance.subscription, account.balance.topup, account.balance.total]);
      tr.className = "clickable";
      tr.addEventListener("click", () => openAccount(account.id));
      body.append(tr);
    }
  } catch (error) {
    failed(error);
  }
}

/** A key shown once, with a button that copies it. */
function showOnce(container, key) {
  container.replaceChildren(el("div", t("keyOnce")));
  const code = el("code", key);
  code.id = container.id + "-value";
  const copy = el("button", t("copy"), "plain");
  copy.type = "button";
  copy.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(key);
      copy.textContent = t("copied");
    } catch (_) {
      copy.textContent = "-";
    }
  });
  container.append(code, document.createTextNode(" "), copy);
  container.hidden = false;
}

async function createAccount(event) {
  event.preventDefault();
  const body = {
    name: document.getElementById("new-name").value,
    subscription: Number(document.getElementById("new-subscription").value || 0),
    topup: Number(document.getElementById("new-topup").value || 0),
  };
  try {
    const created = await admin("/admin/accounts", { method: "POST", body });
    showOnce(document.getElementById("created-key"), created.key);
    document.getElementById("create-account").reset();
    await listAccounts();
  } catch (error) {
    failed(error);
  }
}

async function openAccount(id) {
  document.getElementById("error").textContent = "";
  document.getElementById("new-key-once").hidden = true;
  try {
    const [account, calls] = await Promise.all([
      admin("/admin/accounts/" + id),
      admin("/admin/accounts/" + id + "/calls?limit=20"),
    ]);
    current = id;
    show("list-view", false);
    show("account-view", true);
    document.getElementById("account-name").textContent = account.name;
    document.getElementById("subscription").textContent = account.balance.subscription;
    document.getElementById("topup").textContent = account.balance.topup;
    document.getElementById("total").textContent = account.balance.total;
    document.getElementById("ends-at").textContent = account.balance.subscription_ends_at
      ? formatTime(account.balance.subscription_ends_at)
      : t("never");
    document.getElementById("low-balance").textContent =
      account.low_balance_credits === null ? t("gatewayDefault") : account.low_balance_credits;
    const keys = document.getElementById("keys");
    keys.replaceChildren();
    const limitKey = document.getElementById("limit-key");
    const chosen = limitKey.value;
    limitKey.replaceChildren();
    for (const key of account.keys) {
      if (key.status !== "revoked") {
        const option = el("option", key.id + " · " + key.prefix + "…");
        option.value = key.id;
        limitKey.append(option);
      }
      let action = "";
      if (key.status !== "revoked") {
        action = el("button", t("revoke"), "danger");
        action.type = "button";
        action.dataset.key = key.id;
        action.addEventListener("click", () => revoke(key.id));
      }
      keys.append(
        row([
          key.id,
          key.prefix + "…",
          el("span", key.status, "status-" + key.status),
          key.models ? key.models.join(", ") : t("all"),
          key.expires_at ? formatTime(key.expires_at) : t("never"),
          key.rpm === null ? "" : key.rpm,
          limitText(key.limit),
          action,
        ]),
      );
    }
    if ([...limitKey.options].some((option) => option.value === chosen)) limitKey.value = chosen;
    const body = document.getElementById("account-calls");
    body.replaceChildren();
    for (const call of calls.data) {
      body.append(
        row([
          formatTime(call.created_at),
          call.model,
          call.price,
          tokensText(call),
          el("span", call.status, "status-" + call.status),
          call.request_id,
          call.status === "refunded" ? call.upstream_error : "",
        ]),
      );
    }
  } catch (error) {
    failed(error);
  }
}

async function revoke(id) {
  if (!window.confirm(t("confirmRevoke"))) return;
  try {
    await admin("/admin/keys/" + id + "/revoke", { method: "POST" });
    await openAccount(current);
  } catch (error) {
    failed(error);
  }
}

async function newKey() {
  try {
    const created = await admin("/admin/accounts/" + current + "/keys", { method: "POST" });
    await openAccount(current);
    showOnce(document.getElementById("new-key-once"), created.key);
  } catch (error) {
    failed(error);
  }
}

async function grant(event) {
  event.preventDefault();
  const body = {
    bucket: document.getElementById("grant-bucket").value,
    credits: Number(document.getElementById("grant-credits").value),
  };
  const days = document.getElementById("grant-days").value;
  if (days) body.period_days = Number(days);
  const reason = document.getElementById("grant-reason").value;
  if (reason) body.reason = reason;
  try {
    await admin("/admin/accounts/" + current + "/grants", { method: "POST", body });
    document.getElementById("grant").reset();
    await openAccount(current);
  } catch (error) {
    failed(error);
  }
}

async function setLimit(event) {
  event.preventDefault();
  const key = document.getElementById("limit-key").value;
  const credits = Number(document.getElementById("limit-credits").value);
  const period = document.getElementById("limit-period").value;
  await patchLimit(key, { credits, period });
}

async function patchLimit(key, limit) {
  if (!key) return;
  try {
    await admin("/admin/keys/" + key, { method: "PATCH", body: { limit } });
    document.getElementById("limit-credits").value = "";
    await openAccount(current);
  } catch (error) {
    failed(error);
  }
}

async function patchLowBalance(threshold) {
  try {
    await admin("/admin/accounts/" + current, {
      method: "PATCH",
      body: { low_balance_credits: threshold },
    });
    document.getElementById("low-balance-credits").value = "";
    await openAccount(current);
  } catch (error) {
    failed(error);
  }
}

async function audit() {
  try {
    const report = await admin("/admin/audit");
    const failing = report.accounts.filter((account) => !account.ok).length;
    const result = document.getElementById("audit-result");
    result.textContent = report.ok ? t("auditOk") : t("auditFailed") + " " + failing;
    result.className = report.ok ? "status-ok" : "error";
  } catch (error) {
    failed(error);
  }
}

function back() {
  current = null;
  show("account-view", false);
  show("list-view", true);
  listAccounts();
  listCodeBatches();
}

document.addEventListener("DOMContentLoaded", () => {
  translatePage();
  document.getElementById("sign-in").addEventListener("submit", signIn);
  document.getElementById("sign-out").addEventListener("click", signOut);
  document.getElementById("search-form").addEventListener("submit", listAccounts);
  document.getElementById("search").addEventListener("input", () => listAccounts());
  document.getElementById("create-account").addEventListener("submit", createAccount);
  document.getElementById("back").addEventListener("click", back);
  document.getElementById("new-key").addEventListener("click", newKey);
  document.getElementById("grant").addEventListener("submit", grant);
  document.getElementById("create-codes").addEventListener("submit", createCodes);
  document.getElementById("key-limit").addEventListener("submit", setLimit);
  document.getElementById("lift-limit").addEventListener("click", () =>
    patchLimit(document.getElementById("limit-key").value, null),
  );
  document.getElementById("low-balance-form").addEventListener("submit", (event) => {
    event.preventDefault();
    patchLowBalance(Number(document.getElementById("low-balance-credits").value));
  });
  document.getElementById("default-low-balance").addEventListener("click", () =>
    patchLowBalance(null),
  );
  document.getElementById("audit").addEventListener("click", audit);
  document.getElementById("language").addEventListener("click", () => {
    toggleLanguage();
    translatePage();
    if (current !== null) openAccount(current);
    else listCodeBatches();
  });
  if (token()) enter();
});
