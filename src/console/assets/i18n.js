// Labels in both languages, from one table. Error texts come from the gateway (Chinese).
"use strict";

const LABELS = {
  title: ["模型网关控制台", "Model gateway console"],
  adminTitle: ["模型网关管理", "Model gateway admin"],
  apiKey: ["API Key", "API key"],
  adminToken: ["管理员令牌", "Admin token"],
  signIn: ["登录", "Sign in"],
  signOut: ["退出", "Sign out"],
  refresh: ["刷新", "Refresh"],
  balance: ["余额", "Balance"],
  subscription: ["订阅积分", "Subscription credits"],
  topup: ["充值积分", "Top-up credits"],
  total: ["合计", "Total"],
  endsAt: ["订阅到期", "Subscription ends"],
  never: ["无", "never"],
  usage: ["近 30 天用量", "Last 30 days"],
  credits: ["积分", "Credits"],
  calls: ["调用", "Calls"],
  recentCalls: ["最近调用", "Recent calls"],
  time: ["时间", "Time"],
  model: ["模型", "Model"],
  protocol: ["协议", "Protocol"],
  price: ["价格", "Price"],
  charged: ["扣除积分", "Charged"],
  tokens: ["Tokens", "Tokens"],
  tokenIn: ["输入", "in"],
  tokenOut: ["输出", "out"],
  tokenCacheRead: ["缓存读", "cache read"],
  tokenCacheWrite: ["缓存写", "cache write"],
  shortfall: ["欠额", "unpaid"],
  perCall: ["每次", "per call"],
  perMillion: ["每百万 Token", "per million tokens"],
  modelPrices: ["模型与价格", "Models and prices"],
  status: ["状态", "Status"],
  requestId: ["请求 ID", "Request id"],
  error: ["上游错误", "Upstream error"],
  older: ["更早", "Older"],
  noCalls: ["暂无调用", "No calls yet"],
  accounts: ["账户", "Accounts"],
  search: ["搜索名称或 Key 前缀", "Search name or key prefix"],
  name: ["名称", "Name"],
  newAccount: ["新建账户", "New account"],
  create: ["创建", "Create"],
  keys: ["API Keys", "API keys"],
  prefix: ["前缀", "Prefix"],
  models: ["模型", "Models"],
  all: ["全部", "all"],
  expires: ["过期时间", "Expires"],
  rpm: ["每分钟请求", "Requests/min"],
  newKey: ["新建 Key", "New key"],
  revoke: ["吊销", "Revoke"],
  confirmRevoke: ["确定吊销此 Key? 它将立即失效。", "Revoke this key? It stops working at once."],
  keyOnce: ["新 Key (只显示这一次):", "New key (shown this once):"],
  copy: ["复制", "Copy"],
  copied: ["已复制", "Copied"],
  grant: ["发放积分", "Grant credits"],
  bucket: ["类别", "Bucket"],
  amount: ["数量", "Amount"],
  periodDays: ["订阅天数 (可选)", "Period in days (optional)"],
  reason: ["原因 (可选)", "Reason (optional)"],
  audit: ["对账", "Audit"],
  auditOk: ["账目平衡", "The books balance"],
  auditFailed: ["账目不平衡的账户数:", "Accounts whose books do not balance:"],
  back: ["返回", "Back"],
  keyLimit: ["本 Key 额度", "This key's limit"],
  limit: ["额度", "Limit"],
  setLimit: ["设置额度", "Set limit"],
  lowBalance: ["余额提醒阈值", "Low-balance alert below"],
  lowBalanceCredits: ["低于多少积分时提醒 (0: 不提醒)", "Alert below credits (0: never)"],
  setLowBalance: ["设置余额提醒", "Set alert"],
  defaultLowBalance: ["用默认值", "Use the default"],
  gatewayDefault: ["网关默认值", "the gateway's default"],
  liftLimit: ["取消额度", "Remove limit"],
  limitCredits: ["每期积分", "Credits per period"],
  periodDay: ["每天", "per day"],
  periodWeek: ["每周", "per week"],
  periodMonth: ["每月", "per month"],
  periodNone: ["总计", "in total"],
  resets: ["重置于", "resets"],
  redeem: ["兑换", "Redeem"],
  redeemTitle: ["兑换码", "Redeem a code"],
  redeemCode: ["输入兑换码", "Enter a code"],
  redeemed: ["已兑换积分:", "Credits added:"],
  codes: ["兑换码", "Redemption codes"],
  count: ["数量", "Count"],
  creditsEach: ["每个积分", "Credits each"],
  label: ["标签 (可选)", "Label (optional)"],
  labelColumn: ["标签", "Label"],
  expiresAt: ["过期时间 (可选)", "Expires (optional)"],
  used: ["已用", "Used"],
  unused: ["未用", "Unused"],
  revoked: ["已吊销", "Revoked"],
  codesOnce: ["新兑换码 (只显示这一次):", "New codes (shown this once):"],
  revokeUnused: ["吊销未用", "Revoke unused"],
  confirmRevokeCodes: ["确定吊销此批次中未用的兑换码?", "Revoke the unused codes of this batch?"],
  language: ["English", "中文"],
};

function lang() {
  return localStorage.getItem("mg_lang") === "en" ? 1 : 0;
}

function t(label) {
  const entry = LABELS[label];
  return entry ? entry[lang()] : label;
}

/** Fills every element with a data-i18n (text) or data-i18n-placeholder attribute. */
function translatePage() {
  document.documentElement.lang = lang() === 1 ? "en" : "zh";
  for (const element of document.querySelectorAll("[data-i18n]")) {
    element.textContent = t(element.dataset.i18n);
  }
  for (const element of document.querySelectorAll("[data-i18n-placeholder]")) {
    element.placeholder = t(element.dataset.i18nPlaceholder);
  }
}

function toggleLanguage() {
  localStorage.setItem("mg_lang", lang() === 1 ? "zh" : "en");
}

/** An element with text (never HTML) and optional class. */
function el(tag, text, className) {
  const element = document.createElement(tag);
  if (text !== undefined && text !== null) element.textContent = String(text);
  if (className) element.className = className;
  return element;
}

/** A call's tokens by kind, as one line ("in 10 · out 12 · cache read 20"), and what it could
 * not pay; empty when its provider reported none. */
function tokensText(call) {
  const kinds = [
    ["tokenIn", call.input_tokens],
    ["tokenOut", call.output_tokens],
    ["tokenCacheRead", call.cache_read_tokens],
    ["tokenCacheWrite", (call.cache_write_tokens || 0) + (call.cache_write_1h_tokens || 0) || null],
    ["shortfall", call.shortfall || null],
  ];
  return kinds
    .filter(([, count]) => count !== null && count !== undefined)
    .map(([name, count]) => t(name) + " " + count)
    .join(" · ");
}

/** A model's prices: per call, and per million tokens by kind, as one line. */
function pricesText(model) {
  const parts = [];
  if (model.price > 0) parts.push(model.price + " " + t("perCall"));
  const tokens = model.token_prices;
  if (tokens) {
    const kinds = [
      ["tokenIn", tokens.input],
      ["tokenOut", tokens.output],
      ["tokenCacheRead", tokens.cache_read],
      ["tokenCacheWrite", tokens.cache_write],
    ];
    parts.push(kinds.map(([name, rate]) => t(name) + " " + rate).join(" / ") + " " + t("perMillion"));
  }
  return parts.join(" + ");
}

/** A key's limit as one line: "4 / 10 per day", or "" without one. */
function limitText(limit) {
  if (!limit) return "";
  const period = { day: "periodDay", week: "periodWeek", month: "periodMonth", none: "periodNone" }[limit.period];
  return limit.spent + " / " + limit.credits + " " + t(period);
}

/** A table row of text cells. */
function row(cells) {
  const tr = document.createElement("tr");
  for (const cell of cells) {
    const td = document.createElement("td");
    if (cell instanceof Node) td.append(cell);
    else td.textContent = cell === null || cell === undefined ? "" : String(cell);
    tr.append(td);
  }
  return tr;
}

/** Calls the gateway with a bearer secret; throws the gateway's detail text on an error. */
async function callApi(secret, path, options = {}) {
  const headers = Object.assign({ Authorization: "Bearer " + secret }, options.headers || {});
  if (options.body !== undefined) headers["content-type"] = "application/json";
  const response = await fetch(path, {
    method: options.method || "GET",
    headers,
    body: options.body === undefined ? undefined : JSON.stringify(options.body),
  });
  let answer = null;
  try {
    answer = await response.json();
  } catch (_) {
    answer = null;
  }
  if (!response.ok) {
    const error = new Error((answer && answer.detail) || String(response.status));
    error.status = response.status;
    throw error;
  }
  return answer;
}

function formatTime(text) {
  if (!text) return "";
  const date = new Date(text);
  return isNaN(date) ? text : date.toLocaleString(lang() === 1 ? "en-GB" : "zh-CN");
}

function show(id, visible) {
  document.getElementById(id).hidden = !visible;
}
