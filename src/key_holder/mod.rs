//! What key holders and their clients can ask the gateway with their own key, and the probes
//! that load balancers and clients' start-up checks call: an axum [`Router`] to merge with the
//! one that serves the calls.
//!
//! | Endpoint | Key | Answer |
//! |---|---|---|
//! | `GET /v1/models` | yes | the catalogue's models that the key may call, by catalogue name: Anthropic's list shape when the request has `anthropic-version` (`limit`, `after_id`, `before_id` honoured), else `OpenAI`'s; each item also has `protocol`, `price` (credits per call) and `aliases` |
//! | `GET /v1/models/{id}` | yes | one model in the same shapes, by its name or an alias; `404 模型不存在` |
//! | `GET /v1/balance` | yes | `{"subscription", "topup", "total", "subscription_ends_at"}` of the key's account: what calls can spend now |
//! | `GET /v1/calls?limit=&before=` | yes | the account's own call-log entries, newest first, a page at a time |
//! | `GET /v1/usage?days=30` | yes | the account's billed calls and credits per UTC day and model over the last `days` days (1 to 366), summed by the database |
//! | `GET`, `DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`, `GET /v1/responses/{id}/input_items` | yes | passed to the native Responses upstream that keeps the response, when the key's account made it (as recorded when it was made); else `404 响应不存在`, the same for an unknown id and another account's; free, no call-log entry |
//! | `POST /v1/redeem` | yes | `{"code"}`: redeems a redemption code for the key's account: `{"credits", "bucket", "balance", "batch"}`; `400 兑换码无效` for a code that is unknown, used, expired or revoked alike; after [`FAILED_REDEMPTIONS_PER_KEY`] failures of a key or [`FAILED_REDEMPTIONS_PER_ADDRESS`] from one client address in a minute, `429` until the minute ends |
//! | `POST /v1/messages/count_tokens` | yes | the provider's token count for a messages request (the mock estimates); free, no call-log entry |
//! | `GET /v1beta/models`, `GET /v1beta/models/{model}`, `POST /v1beta/models/{model}:countTokens` | yes | the Gemini API's: see [`gemini`] (its calls are the stack's) |
//! | `GET /health` | no | 200 while the process runs (the database is not touched) |
//! | `GET /ready` | no | 200 when the database answers (and a `SQLite` file takes a write), else `503 {"detail"}` |
//! | `GET /`, `HEAD /` | no | 200 |
//!
//! Nothing here is charged or written to the call log (a redemption is recorded as a grant). Errors are `{"detail": ...}` like the
//! rest of the gateway.

pub mod gemini;

use std::sync::Arc;

use axum::Router;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Extension, Path, Query, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::auth::ApiKeyAuthLayer;
use crate::call::{Caller, KeyRules};
use crate::catalogue::{Catalogue, LiveCatalogue, ModelRoute};
use crate::error::GatewayError;
use crate::ledger_deadline::LedgerDeadlineLayer;
use crate::protocol::Protocol;
use crate::rate_limit::{Counted, Decision, RateLimitLayer, RateLimiter};
use crate::router::{BodyLimits, read_beside_calls, route_model};
use crate::store::{CallId, DEFAULT_LEDGER_TIMEOUT, Store, StoreError};
use crate::upstream::Upstream;

/// When the models were "created", as the list shapes require a date: the catalogue has none.
const MODELS_CREATED: i64 = 1_735_689_600; // 2025-01-01T00:00:00Z
const MODELS_CREATED_AT: &str = "2025-01-01T00:00:00Z";

/// Default and largest page of `GET /v1/calls` and of Anthropic's model list.
const DEFAULT_PAGE: u64 = 20;
const LARGEST_PAGE: u64 = 1000;

/// Failed redemptions a key may make in a minute.
pub const FAILED_REDEMPTIONS_PER_KEY: u32 = 5;
/// Failed redemptions one client address may make in a minute, whatever the key.
pub const FAILED_REDEMPTIONS_PER_ADDRESS: u32 = 20;

struct Shared<S> {
    store: Arc<S>,
    catalogue: LiveCatalogue,
    upstream: Upstream,
    body: BodyLimits,
    limiter: RateLimiter,
}

/// The key holders' endpoints and the probes; see the module docs. Requests with a key count
/// against its requests per minute in `limiter`, as calls do.
pub fn router<S: Store + 'static>(
    store: Arc<S>,
    catalogue: impl Into<LiveCatalogue>,
    upstream: Upstream,
    limiter: RateLimiter,
) -> Router {
    router_with_body_limits(store, catalogue, upstream, limiter, BodyLimits::default())
}

/// [`router`], reading `count_tokens` bodies within `body`: the same size limit, pause and
/// deadline time-outs, memory budget and cap for keys that cannot pay as the calls' (give it
/// the calls' [`BodyLimits`], whose budget is then shared).
pub fn router_with_body_limits<S: Store + 'static>(
    store: Arc<S>,
    catalogue: impl Into<LiveCatalogue>,
    upstream: Upstream,
    limiter: RateLimiter,
    body: BodyLimits,
) -> Router {
    let shared = shared(store.clone(), catalogue, upstream, limiter.clone(), body);
    // Bounded like the ledger's part of a call; `count_tokens` waits for its provider instead.
    let reads = Router::new()
        .route("/v1/models", get(list_models::<S>))
        .route("/v1/models/{id}", get(one_model::<S>))
        .route("/v1/balance", get(balance::<S>))
        .route("/v1/calls", get(calls::<S>))
        .route("/v1/usage", get(usage::<S>))
        .route("/v1/redeem", post(redeem::<S>))
        .route_layer(LedgerDeadlineLayer {
            timeout: DEFAULT_LEDGER_TIMEOUT,
        });
    let with_key = reads
        .route("/v1/messages/count_tokens", post(count_tokens::<S>))
        .route(
            "/v1/responses/{id}",
            get(stored_response::<S>).delete(stored_response::<S>),
        )
        .route("/v1/responses/{id}/cancel", post(stored_response::<S>))
        .route("/v1/responses/{id}/input_items", get(stored_response::<S>))
        .merge(gemini::routes::<S>())
        .method_not_allowed_fallback(method_not_allowed)
        .route_layer(RateLimitLayer::new(limiter))
        .route_layer(ApiKeyAuthLayer::new(store))
        .with_state(shared.clone());
    let probes = Router::new()
        .route(
            "/health",
            get(|| async { axum::Json(json!({ "status": "ok" })) }),
        )
        .route("/ready", get(ready::<S>))
        .route(
            "/",
            get(|| async { axum::Json(json!({ "name": "model-gateway" })) }),
        )
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(shared);
    with_key.merge(probes)
}

fn shared<S>(
    store: Arc<S>,
    catalogue: impl Into<LiveCatalogue>,
    upstream: Upstream,
    limiter: RateLimiter,
    body: BodyLimits,
) -> Arc<Shared<S>> {
    Arc::new(Shared {
        store,
        catalogue: catalogue.into(),
        upstream,
        body,
        limiter,
    })
}

/// 405 with a detail; axum adds the `Allow` header of the route.
pub(crate) async fn method_not_allowed() -> Response {
    let mut answer = refuse(GatewayError::MethodNotAllowed);
    answer.headers_mut().remove(axum::http::header::ALLOW);
    answer
}

fn refuse(error: GatewayError) -> Response {
    error.into_response::<axum::body::Body>()
}

/// The model as an `OpenAI` list item, with the gateway's fields.
fn openai_model(model: &ModelRoute) -> Value {
    let item = json!({
        "id": model.name,
        "object": "model",
        "created": MODELS_CREATED,
        "owned_by": "model-gateway",
        "protocol": model.protocol,
        "price": model.pricing.per_call,
        "aliases": model.aliases,
        "endpoints": model.endpoints,
    });
    with_token_prices(item, model)
}

/// The model as an Anthropic list item, with the gateway's fields.
fn anthropic_model(model: &ModelRoute) -> Value {
    let item = json!({
        "type": "model",
        "id": model.name,
        "display_name": model.name,
        "created_at": MODELS_CREATED_AT,
        "protocol": model.protocol,
        "price": model.pricing.per_call,
        "aliases": model.aliases,
        "endpoints": model.endpoints,
    });
    with_token_prices(item, model)
}

/// `item` with a token-priced model's prices (credits per million tokens) and the output a
/// call reserves for when the client sets no limit.
fn with_token_prices(mut item: Value, model: &ModelRoute) -> Value {
    if let Some(tokens) = model.pricing.tokens {
        item["token_prices"] = json!(tokens);
        item["max_output_tokens"] = json!(model.max_output_tokens);
    }
    item
}

fn wants_anthropic(headers: &HeaderMap) -> bool {
    headers.contains_key("anthropic-version")
}

/// The models the key may call, by name.
fn sorted_models<'a>(catalogue: &'a Catalogue, rules: &KeyRules) -> Vec<&'a Arc<ModelRoute>> {
    let mut models: Vec<_> = catalogue
        .models()
        .filter(|model| rules.allows(&model.name))
        .collect();
    models.sort_by(|a, b| a.name.cmp(&b.name));
    models
}

#[derive(Deserialize)]
struct ModelPage {
    limit: Option<u64>,
    after_id: Option<String>,
    before_id: Option<String>,
}

async fn list_models<S>(
    State(shared): State<Arc<Shared<S>>>,
    Extension(rules): Extension<KeyRules>,
    headers: HeaderMap,
    uri: Uri,
    page: Result<Query<ModelPage>, QueryRejection>,
) -> Response {
    let catalogue = shared.catalogue.current();
    if gemini::asked_by_google(&headers, &uri) {
        return gemini::model_list(&catalogue, &rules, &uri);
    }
    let models = sorted_models(&catalogue, &rules);
    if !wants_anthropic(&headers) {
        let data: Vec<Value> = models.iter().map(|model| openai_model(model)).collect();
        return axum::Json(json!({ "object": "list", "data": data })).into_response();
    }
    let Ok(Query(page)) = page else {
        return refuse(GatewayError::InvalidQuery);
    };
    let limit = page.limit.unwrap_or(DEFAULT_PAGE).clamp(1, LARGEST_PAGE) as usize;
    let position = |id: &str| models.iter().position(|model| model.name == id);
    let window: Vec<_> = match (&page.after_id, &page.before_id) {
        (Some(after), _) => {
            let start = position(after).map_or(models.len(), |at| at + 1);
            models[start..].iter().take(limit + 1).collect()
        }
        (None, Some(before)) => {
            let end = position(before).unwrap_or(0);
            let start = end.saturating_sub(limit + 1);
            models[start..end].iter().collect()
        }
        (None, None) => models.iter().take(limit + 1).collect(),
    };
    // One more than the page tells whether there is more in the direction of travel.
    let has_more = window.len() > limit;
    let window: Vec<_> = if page.before_id.is_some() && page.after_id.is_none() {
        window[window.len().saturating_sub(limit)..].to_vec()
    } else {
        window.into_iter().take(limit).collect()
    };
    let data: Vec<Value> = window.iter().map(|model| anthropic_model(model)).collect();
    axum::Json(json!({
        "data": data,
        "has_more": has_more,
        "first_id": window.first().map(|model| &model.name),
        "last_id": window.last().map(|model| &model.name),
    }))
    .into_response()
}

async fn one_model<S>(
    State(shared): State<Arc<Shared<S>>>,
    Extension(rules): Extension<KeyRules>,
    headers: HeaderMap,
    uri: Uri,
    Path(id): Path<String>,
) -> Response {
    // A model the key may not call is not there for it; an alias finds its model.
    let catalogue = shared.catalogue.current();
    if gemini::asked_by_google(&headers, &uri) {
        return gemini::one(&catalogue, &rules, &id);
    }
    let model = catalogue.model(&id);
    match model.filter(|model| rules.allows(&model.name)) {
        Some(model) if wants_anthropic(&headers) => {
            axum::Json(anthropic_model(model)).into_response()
        }
        Some(model) => axum::Json(openai_model(model)).into_response(),
        None => refuse(GatewayError::ModelNotFound),
    }
}

async fn balance<S: Store>(
    State(shared): State<Arc<Shared<S>>>,
    Extension(caller): Extension<Caller>,
    Extension(rules): Extension<KeyRules>,
) -> Response {
    let now = chrono::Utc::now();
    // Only a limited key's own row is read again, for what it spent.
    let key_limit = match rules.limit {
        None => Ok(None),
        Some(_) => shared
            .store
            .key_info(caller.key)
            .await
            .map(|info| info.and_then(|info| crate::admin::KeyLimitView::of(&info, now))),
    };
    match (shared.store.account(caller.account).await, key_limit) {
        (Ok(Some(account)), Ok(key_limit)) => {
            let balance = account.spendable(now);
            let mut answer = json!({
                "subscription": balance.subscription,
                "topup": balance.topup,
                "total": balance.total(),
                "subscription_ends_at": account.subscription_ends_at,
            });
            if let Some(key_limit) = key_limit {
                answer["key_limit"] = json!(key_limit);
            }
            axum::Json(answer).into_response()
        }
        (Ok(None), _) => refuse(GatewayError::InvalidApiKey),
        (Err(error), _) | (_, Err(error)) => {
            tracing::error!(%error, "balance unavailable");
            refuse(GatewayError::StoreUnavailable)
        }
    }
}

/// `POST /v1/redeem`: see the module docs. Each attempt counts against the key and the client
/// address while it runs, and stays counted if it fails, so that guessing stays out of reach.
async fn redeem<S: Store>(
    State(shared): State<Arc<Shared<S>>>,
    Extension(caller): Extension<Caller>,
    request: axum::extract::Request,
) -> Response {
    let address = request
        .extensions()
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
        .map(|info| info.0.ip());
    let mut counted = vec![(
        Counted::FailedRedemptions(caller.key),
        FAILED_REDEMPTIONS_PER_KEY,
    )];
    if let Some(address) = address {
        counted.push((
            Counted::FailedRedemptionsFrom(address),
            FAILED_REDEMPTIONS_PER_ADDRESS,
        ));
    }
    for (index, &(attempt, limit)) in counted.iter().enumerate() {
        if let Decision::Limited { retry_after } = shared.limiter.attempt(attempt, limit).await {
            for &(taken, _) in &counted[..index] {
                shared.limiter.forgive(taken).await;
            }
            return refuse(GatewayError::RateLimited(retry_after.as_secs().max(1)));
        }
    }
    let answer = redeem_counted(&shared, caller, request).await;
    // A success, or a failure that is not the caller's (a body too large, the store down),
    // does not count.
    if !matches!(answer, Err(GatewayError::InvalidCode)) {
        for &(attempt, _) in &counted {
            shared.limiter.forgive(attempt).await;
        }
    }
    answer.unwrap_or_else(refuse)
}

async fn redeem_counted<S: Store>(
    shared: &Shared<S>,
    caller: Caller,
    request: axum::extract::Request,
) -> Result<Response, GatewayError> {
    let body = axum::body::to_bytes(request.into_body(), REDEEM_BODY_BYTES)
        .await
        .map_err(|_| GatewayError::PayloadTooLarge)?;
    let code = match serde_json::from_slice::<Value>(&body) {
        Ok(Value::Object(object)) => match object.get("code") {
            Some(Value::String(code)) => code.clone(),
            _ => {
                return Err(GatewayError::InvalidField {
                    field: "code".into(),
                    reason: "必须是字符串",
                });
            }
        },
        _ => return Err(GatewayError::InvalidJson),
    };
    let now = chrono::Utc::now();
    let redeemed = match crate::codes::CodeHash::of(&code) {
        Some(hash) => shared.store.redeem_code(caller.account, &hash, now).await,
        None => Ok(None),
    };
    match redeemed {
        Ok(Some(redeemed)) => {
            let ends_at = match shared.store.account(caller.account).await {
                Ok(account) => account.and_then(|account| account.subscription_ends_at),
                Err(_) => None,
            };
            let balance = redeemed.balance.spendable(ends_at, now);
            Ok(axum::Json(json!({
                "credits": redeemed.credits,
                "bucket": redeemed.bucket,
                "balance": {
                    "subscription": balance.subscription,
                    "topup": balance.topup,
                    "total": balance.total(),
                    "subscription_ends_at": ends_at,
                },
                "batch": redeemed.batch,
                "lapsed": redeemed.lapsed,
            }))
            .into_response())
        }
        Ok(None) => Err(GatewayError::InvalidCode),
        Err(StoreError::BalanceOverflow(_)) => Err(GatewayError::BalanceOverflow),
        Err(error) => {
            tracing::error!(%error, "redemption failed in the store");
            Err(GatewayError::StoreUnavailable)
        }
    }
}

/// Largest `POST /v1/redeem` body.
const REDEEM_BODY_BYTES: usize = 4096;

#[derive(Deserialize)]
struct CallsPage {
    limit: Option<u64>,
    before: Option<i64>,
}

async fn calls<S: Store>(
    State(shared): State<Arc<Shared<S>>>,
    Extension(caller): Extension<Caller>,
    page: Result<Query<CallsPage>, QueryRejection>,
) -> Response {
    let Ok(Query(page)) = page else {
        return refuse(GatewayError::InvalidQuery);
    };
    let limit = page.limit.unwrap_or(DEFAULT_PAGE).clamp(1, LARGEST_PAGE);
    // One more than asked tells whether there is another page.
    let read = shared
        .store
        .calls_before(caller.account, page.before.map(CallId), limit + 1)
        .await;
    match read {
        Ok(mut entries) => {
            let has_more = entries.len() as u64 > limit;
            entries.truncate(limit as usize);
            let next_before = has_more
                .then(|| entries.last().map(|entry| entry.id))
                .flatten();
            let entries: Vec<Value> = entries.iter().map(for_key_holder).collect();
            axum::Json(json!({
                "object": "list",
                "data": entries,
                "has_more": has_more,
                "next_before": next_before,
            }))
            .into_response()
        }
        Err(error) => {
            tracing::error!(%error, "call log unavailable");
            refuse(GatewayError::StoreUnavailable)
        }
    }
}

/// An entry as its key holder reads it: the operator's record of why a call was refunded (a
/// provider's body, channel and variable names) is replaced by a reason the key holder can act
/// on, and what the call cost the operator and earned him is left out; the admin API keeps
/// both.
fn for_key_holder(entry: &crate::store::CallRecord) -> Value {
    let mut value = serde_json::to_value(entry).unwrap_or(Value::Null);
    if let Some(error) = &entry.upstream_error {
        value["upstream_error"] = Value::from(refund_reason(error));
    }
    if let Some(fields) = value.as_object_mut() {
        for operators_own in OPERATORS_OWN {
            fields.remove(*operators_own);
        }
    }
    value
}

/// The fields of a call-log entry that are the operator's business alone.
pub const OPERATORS_OWN: &[&str] = &["cost", "credit_value", "margin"];

/// Why a call was refunded, in the key holder's terms.
fn refund_reason(error: &str) -> &'static str {
    use crate::refund::{CANCELLED_BEFORE_ANSWER, CLIENT_LEFT_BEFORE_CONTENT, SETTLE_NOT_WRITTEN};
    if [
        CANCELLED_BEFORE_ANSWER,
        crate::charge::CANCELLED_WHILE_RESERVING,
        CLIENT_LEFT_BEFORE_CONTENT,
    ]
    .contains(&error)
    {
        "请求在回复前被取消 (客户端断开), 已退款"
    } else if error == SETTLE_NOT_WRITTEN || error.starts_with("recovered") {
        "网关未能完成这次调用 (数据库暂时不可用或网关重启), 已退款"
    } else {
        "上游服务暂时不可用, 已退款"
    }
}

#[derive(Deserialize)]
struct UsageQuery {
    days: Option<u32>,
}

/// Longest usage window, in days.
const LONGEST_USAGE_DAYS: u32 = 366;

async fn usage<S: Store>(
    State(shared): State<Arc<Shared<S>>>,
    Extension(caller): Extension<Caller>,
    query: Result<Query<UsageQuery>, QueryRejection>,
) -> Response {
    let days = match query {
        Ok(Query(UsageQuery { days: None })) => 30,
        Ok(Query(UsageQuery { days: Some(days) })) if (1..=LONGEST_USAGE_DAYS).contains(&days) => {
            days
        }
        _ => return refuse(GatewayError::InvalidQuery),
    };
    let today = chrono::Utc::now().date_naive();
    let first = today - chrono::Duration::days(i64::from(days) - 1);
    let since = first.and_time(chrono::NaiveTime::MIN).and_utc();
    match shared.store.usage(caller.account, since).await {
        Ok(data) => axum::Json(json!({
            "object": "usage",
            "days": days,
            "since": first.to_string(),
            "data": data,
        }))
        .into_response(),
        Err(error) => {
            tracing::error!(%error, "usage unavailable");
            refuse(GatewayError::StoreUnavailable)
        }
    }
}

async fn count_tokens<S: Store + 'static>(
    State(shared): State<Arc<Shared<S>>>,
    Extension(rules): Extension<KeyRules>,
    Extension(caller): Extension<Caller>,
    request: axum::extract::Request,
) -> Response {
    let ledger: Arc<dyn crate::store::Ledger> = shared.store.clone();
    let catalogue = shared.catalogue.current();
    let read = read_beside_calls(request, &catalogue, &shared.body, ledger).await;
    let (headers, body, _permit) = match read {
        Ok((parts, body, permit)) => (parts.headers, body, permit),
        Err(refusal) => return refuse(refusal),
    };
    let routed = match route_model(&catalogue, Protocol::Messages, &body) {
        Ok(routed) if !rules.allows(&routed.model.name) => {
            return refuse(GatewayError::ModelNotAllowed);
        }
        Ok(routed) => routed,
        Err(refusal) => return refuse(refusal),
    };
    if let Err(refusal) = crate::router::check_translates(&routed, &body) {
        return refuse(refusal);
    }
    counted(&shared, caller, &routed, &headers, &body).await
}

/// A count request's answer for `routed`'s model: free, but only for a key that could pay for
/// a call of the model (a key without credits gets no free line to the provider; its requests
/// per minute limit the rest), counted where [`Upstream::count_tokens`] says.
async fn counted<S: Store>(
    shared: &Shared<S>,
    caller: Caller,
    routed: &crate::call::RoutedCall,
    headers: &HeaderMap,
    body: &bytes::Bytes,
) -> Response {
    let balance =
        tokio::time::timeout(DEFAULT_LEDGER_TIMEOUT, shared.store.balance(caller.account));
    match balance.await {
        Ok(Ok(balance)) if balance.total() >= routed.model.least_charge() => {}
        Ok(Ok(_)) => return refuse(GatewayError::InsufficientCredits),
        Ok(Err(_)) | Err(_) => return refuse(GatewayError::StoreUnavailable),
    }
    match shared.upstream.count_tokens(routed, headers, body).await {
        Ok(answer) => answer.map(axum::body::Body::from).into_response(),
        Err(error) => {
            tracing::warn!(%error, "a token count failed upstream");
            refuse(GatewayError::UpstreamUnavailable)
        }
    }
}

/// A request about a stored response, passed to the upstream that keeps it when the key's
/// account made it; else `404 响应不存在`, the same for an unknown id and another account's.
async fn stored_response<S: Store + 'static>(
    State(shared): State<Arc<Shared<S>>>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let owner = tokio::time::timeout(DEFAULT_LEDGER_TIMEOUT, shared.store.response_owner(&id));
    let owner = match owner.await {
        Ok(Ok(Some(owner))) if owner.account == caller.account => owner,
        Ok(Ok(_)) => return refuse(GatewayError::ResponseNotFound),
        Ok(Err(_)) | Err(_) => return refuse(GatewayError::StoreUnavailable),
    };
    let path = uri
        .path_and_query()
        .map_or(uri.path(), |path| path.as_str());
    let answer = shared
        .upstream
        .stored_response(&owner.upstream, method, path, &headers)
        .await;
    match answer {
        Some(Ok(answer)) => answer.map(axum::body::Body::from).into_response(),
        Some(Err(error)) => {
            tracing::warn!(%error, "a stored response's provider failed");
            refuse(GatewayError::UpstreamUnavailable)
        }
        None => refuse(GatewayError::ResponseNotFound),
    }
}

async fn ready<S: Store>(State(shared): State<Arc<Shared<S>>>) -> Response {
    match shared.store.ready().await {
        Ok(()) => axum::Json(json!({ "status": "ready" })).into_response(),
        Err(error) => {
            tracing::warn!(%error, "not ready: the database does not answer");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                refuse(GatewayError::StoreUnavailable),
            )
                .into_response()
        }
    }
}
