//! The admin HTTP API: the [`Admin`] operations as JSON resources under `/admin`, for the
//! holder of the admin token only.
//!
//! | Method and path | Body | Answer |
//! |---|---|---|
//! | `POST /admin/accounts` | `{"name", "subscription", "topup"}` | `201` [`CreatedAccount`](super::CreatedAccount) (the key, shown once) |
//! | `GET /admin/accounts?limit=&after=&search=` | | [`AccountList`](super::AccountList) |
//! | `GET /admin/accounts/{id}` | | [`AccountView`](super::AccountView) (balance and keys) |
//! | `POST /admin/accounts/{id}/keys` | | `201` [`CreatedKey`](super::CreatedKey) |
//! | `POST /admin/accounts/{id}/grants` | `{"bucket", "credits", "reason"}`; header `Idempotency-Key` | [`GrantView`](super::GrantView) |
//! | `GET /admin/accounts/{id}/calls?limit=&before=&status=&model=` | | [`CallList`](super::CallList) |
//! | `PATCH /admin/keys/{id}` | any of `{"models", "expires_at", "rpm"}` | [`KeyView`](super::KeyView) |
//! | `POST /admin/keys/{id}/revoke` | | [`KeyView`](super::KeyView) |
//! | `GET /admin/audit` | | [`AuditView`](super::AuditView), `200` whether or not it holds |
//! | `GET /admin/catalogue` | | the catalogue served now ([`catalogue_view`](super::catalogue_view)) |
//! | `POST /admin/catalogue/reload` | | the catalogue read again and served: what serves now; `400 {"detail"}` naming the problem, the old one serving on |
//! | `GET /admin/webhooks/deliveries?status=&limit=` | | [`DeliveryList`](super::DeliveryList), newest first |
//! | `POST /admin/webhooks/deliveries/{id}/retry` | | the delivery, pending again and due at once |
//! | `POST /admin/codes` | `{"count", "credits", "bucket", "period_days"?, "expires_at"?, "label"?}` | `201` [`CreatedCodes`](super::CreatedCodes) (the codes, shown once) |
//! | `GET /admin/codes` | | [`CodeBatchList`](super::CodeBatchList) (`used` and `unused` per batch) |
//! | `POST /admin/codes/{batch}/revoke` | | [`CodeBatchView`](super::CodeBatchView) (its unused codes revoked) |
//!
//! Every request needs `Authorization: Bearer <admin token>` (compared in constant time);
//! anything else is `401 {"detail":"无效的管理员令牌"}`. Unknown accounts and keys are `404`, a
//! bad field `400` naming it, a reused idempotency key `422`.

use std::collections::HashMap;
use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, patch, post};
use bytes::Bytes;
use serde::Serialize;
use subtle::ConstantTimeEq;

use super::{
    AccountPatch, Admin, AdminError, CallFilter, GrantRequest, KeyPatch, NewAccount, NewCodes,
};
use crate::error::GatewayError;
use crate::ledger_deadline::LedgerDeadlineLayer;
use crate::store::{AccountId, CallId, CallStatus, DEFAULT_LEDGER_TIMEOUT, KeyId, Store};

/// Shortest admin token accepted: guessing it must be out of reach.
pub const MIN_ADMIN_TOKEN_CHARS: usize = 16;

/// The secret that opens the admin API. Its `Debug` never shows it.
#[derive(Clone)]
pub struct AdminToken(Arc<str>);

impl AdminToken {
    /// The token, if it is at least [`MIN_ADMIN_TOKEN_CHARS`] characters long.
    pub fn new(token: impl Into<String>) -> Result<AdminToken, tower::BoxError> {
        let token = token.into();
        if token.chars().count() < MIN_ADMIN_TOKEN_CHARS {
            return Err(format!(
                "the admin token must be at least {MIN_ADMIN_TOKEN_CHARS} characters long"
            )
            .into());
        }
        Ok(AdminToken(token.into()))
    }

    /// Whether the request carries `Authorization: Bearer <this token>`.
    fn opens(&self, headers: &HeaderMap) -> bool {
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim());
        presented.is_some_and(|presented| bool::from(presented.as_bytes().ct_eq(self.0.as_bytes())))
    }
}

/// Lets through only requests carrying the admin token.
async fn require_token(State(token): State<AdminToken>, request: Request, next: Next) -> Response {
    if token.opens(request.headers()) {
        next.run(request).await
    } else {
        refuse(GatewayError::InvalidAdminToken)
    }
}

/// `GET /metrics` (Prometheus text, from `render`) behind the admin token, for an operator who
/// scrapes the gateway's own address rather than a separate one.
pub fn metrics_router<F>(render: F, token: AdminToken) -> Router
where
    F: Fn() -> String + Clone + Send + Sync + 'static,
{
    Router::new()
        .route("/metrics", get(move || async move { render() }))
        .route_layer(middleware::from_fn_with_state(token, require_token))
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(..)")
    }
}

fn refuse(error: GatewayError) -> Response {
    error.into_response::<axum::body::Body>()
}

fn answer<T: Serialize>(status: StatusCode, result: Result<T, AdminError>) -> Response {
    match result {
        Ok(value) => (status, axum::Json(value)).into_response(),
        Err(error) => refuse(error.into_refusal()),
    }
}

/// An admin request's body: axum's `Bytes` (at most its default 2 MiB), refused as
/// `{"detail"}` JSON like every other refusal, 413 included.
struct AdminBody(Bytes);

impl<S: Send + Sync> axum::extract::FromRequest<S> for AdminBody {
    type Rejection = Response;

    async fn from_request(request: axum::extract::Request, state: &S) -> Result<Self, Response> {
        match Bytes::from_request(request, state).await {
            Ok(body) => Ok(AdminBody(body)),
            Err(rejection) if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                Err(refuse(GatewayError::PayloadTooLarge))
            }
            Err(_) => Err(refuse(GatewayError::UnreadableBody)),
        }
    }
}

fn json_body(body: &Bytes) -> Result<serde_json::Value, GatewayError> {
    serde_json::from_slice(body).map_err(|_| GatewayError::InvalidJson)
}

fn account_id(id: &str) -> Result<AccountId, GatewayError> {
    id.parse()
        .map(AccountId)
        .map_err(|_| GatewayError::NoSuchAccount)
}

fn key_id(id: &str) -> Result<KeyId, GatewayError> {
    id.parse().map(KeyId).map_err(|_| GatewayError::NoSuchKey)
}

/// A query parameter as a number, the field named when it is not one.
fn number(
    query: &HashMap<String, String>,
    field: &'static str,
) -> Result<Option<i64>, GatewayError> {
    query
        .get(field)
        .map(|value| {
            value.parse().map_err(|_| GatewayError::InvalidField {
                field: field.into(),
                reason: "必须是整数",
            })
        })
        .transpose()
}

fn limit(query: &HashMap<String, String>) -> Result<Option<u64>, GatewayError> {
    number(query, "limit")?
        .map(|limit| {
            u64::try_from(limit).map_err(|_| GatewayError::InvalidField {
                field: "limit".into(),
                reason: "必须是正整数",
            })
        })
        .transpose()
}

/// How long `GET /admin/audit` may take before it answers `503`.
const AUDIT_DEADLINE: std::time::Duration = std::time::Duration::from_secs(60);

/// The admin API over `admin`, opened by `token`; see the module docs. Merge it into the
/// gateway's router only when an admin token is configured: without one, `/admin` does not
/// exist.
pub fn router<S: Store + 'static>(admin: Admin<S>, token: AdminToken) -> Router {
    Router::new()
        .route(
            "/admin/accounts",
            post(create_account::<S>).get(list_accounts::<S>),
        )
        .route(
            "/admin/accounts/{id}",
            get(one_account::<S>).patch(update_account::<S>),
        )
        .route("/admin/accounts/{id}/keys", post(create_key::<S>))
        .route("/admin/accounts/{id}/grants", post(grant::<S>))
        .route("/admin/accounts/{id}/calls", get(calls::<S>))
        .route("/admin/keys/{id}", patch(update_key::<S>))
        .route("/admin/keys/{id}/revoke", post(revoke_key::<S>))
        .route("/admin/webhooks/deliveries", get(deliveries::<S>))
        .route(
            "/admin/webhooks/deliveries/{id}/retry",
            post(retry_delivery::<S>),
        )
        .route("/admin/catalogue", get(catalogue::<S>))
        .route("/admin/catalogue/reload", post(reload_catalogue::<S>))
        .route(
            "/admin/codes",
            post(create_codes::<S>).get(code_batches::<S>),
        )
        .route("/admin/codes/{batch}/revoke", post(revoke_codes::<S>))
        .route_layer(LedgerDeadlineLayer {
            timeout: DEFAULT_LEDGER_TIMEOUT,
        })
        // The audit reads every account and entry: bounded, but longer; a report sums a
        // window of the call log in the database, as long at most.
        .route(
            "/admin/audit",
            get(audit::<S>).layer(LedgerDeadlineLayer {
                timeout: AUDIT_DEADLINE,
            }),
        )
        .route(
            "/admin/reports/usage",
            get(usage_report::<S>).layer(LedgerDeadlineLayer {
                timeout: AUDIT_DEADLINE,
            }),
        )
        .method_not_allowed_fallback(crate::key_holder::method_not_allowed)
        .route_layer(middleware::from_fn_with_state(token, require_token))
        .with_state(admin)
}

/// `GET /admin/reports/usage?from=&to=&group_by=`: JSON, or CSV when the request accepts
/// `text/csv`.
async fn usage_report<S: Store>(
    State(admin): State<Admin<S>>,
    headers: http::HeaderMap,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let asked = super::report_query(
        query.get("from").map(String::as_str),
        query.get("to").map(String::as_str),
        query.get("group_by").map(String::as_str),
        chrono::Utc::now(),
    );
    let report = match asked {
        Ok(asked) => admin.usage_report(asked).await,
        Err(refusal) => return refuse(refusal),
    };
    let wants_csv = headers
        .get(http::header::ACCEPT)
        .and_then(|accept| accept.to_str().ok())
        .is_some_and(|accept| accept.contains("text/csv"));
    match report {
        Ok(report) if wants_csv => (
            StatusCode::OK,
            [(http::header::CONTENT_TYPE, "text/csv; charset=utf-8")],
            report.csv(),
        )
            .into_response(),
        report => answer(StatusCode::OK, report),
    }
}

async fn create_account<S: Store>(
    State(admin): State<Admin<S>>,
    AdminBody(body): AdminBody,
) -> Response {
    let new = match json_body(&body).and_then(|body| NewAccount::from_json(&body)) {
        Ok(new) => new,
        Err(refusal) => return refuse(refusal),
    };
    answer(StatusCode::CREATED, admin.create_account(&new).await)
}

async fn list_accounts<S: Store>(
    State(admin): State<Admin<S>>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let page = number(&query, "after").and_then(|after| Ok((after, limit(&query)?)));
    let (after, limit) = match page {
        Ok(page) => page,
        Err(refusal) => return refuse(refusal),
    };
    let search = query.get("search").map(String::as_str);
    if search.is_some_and(|search| search.chars().any(char::is_control)) {
        return refuse(GatewayError::InvalidField {
            field: "search".into(),
            reason: "不能含控制字符",
        });
    }
    answer(
        StatusCode::OK,
        admin.accounts(after.map(AccountId), limit, search).await,
    )
}

async fn one_account<S: Store>(State(admin): State<Admin<S>>, Path(id): Path<String>) -> Response {
    match account_id(&id) {
        Ok(account) => answer(StatusCode::OK, admin.account(account).await),
        Err(refusal) => refuse(refusal),
    }
}

async fn update_account<S: Store>(
    State(admin): State<Admin<S>>,
    Path(id): Path<String>,
    AdminBody(body): AdminBody,
) -> Response {
    let read = account_id(&id)
        .and_then(|account| Ok((account, AccountPatch::from_json(&json_body(&body)?)?)));
    match read {
        Ok((account, patch)) => answer(StatusCode::OK, admin.update_account(account, &patch).await),
        Err(refusal) => refuse(refusal),
    }
}

async fn create_key<S: Store>(State(admin): State<Admin<S>>, Path(id): Path<String>) -> Response {
    match account_id(&id) {
        Ok(account) => answer(StatusCode::CREATED, admin.create_key(account).await),
        Err(refusal) => refuse(refusal),
    }
}

async fn grant<S: Store>(
    State(admin): State<Admin<S>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    AdminBody(body): AdminBody,
) -> Response {
    let read = account_id(&id).and_then(|account| {
        let grant = GrantRequest::from_json(&json_body(&body)?)?;
        let key = match headers.get("idempotency-key") {
            None => None,
            Some(key) => Some(key.to_str().map_err(|_| GatewayError::InvalidField {
                field: "Idempotency-Key".into(),
                reason: "必须是可见 ASCII 字符",
            })?),
        };
        Ok((account, grant, key))
    });
    match read {
        Ok((account, grant, key)) => {
            answer(StatusCode::OK, admin.grant(account, &grant, key).await)
        }
        Err(refusal) => refuse(refusal),
    }
}

async fn calls<S: Store>(
    State(admin): State<Admin<S>>,
    Path(id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let read = account_id(&id).and_then(|account| {
        let status = query
            .get("status")
            .map(|status| {
                CallStatus::parse(status).ok_or(GatewayError::InvalidField {
                    field: "status".into(),
                    reason: "必须是 pending, ok 或 refunded",
                })
            })
            .transpose()?;
        let filter = CallFilter {
            limit: limit(&query)?,
            before: number(&query, "before")?.map(CallId),
            status,
            model: query.get("model").cloned(),
        };
        Ok((account, filter))
    });
    match read {
        Ok((account, filter)) => answer(StatusCode::OK, admin.calls(account, &filter).await),
        Err(refusal) => refuse(refusal),
    }
}

async fn update_key<S: Store>(
    State(admin): State<Admin<S>>,
    Path(id): Path<String>,
    AdminBody(body): AdminBody,
) -> Response {
    let read = key_id(&id).and_then(|key| Ok((key, KeyPatch::from_json(&json_body(&body)?)?)));
    match read {
        Ok((key, patch)) => answer(StatusCode::OK, admin.update_key(key, &patch).await),
        Err(refusal) => refuse(refusal),
    }
}

async fn revoke_key<S: Store>(State(admin): State<Admin<S>>, Path(id): Path<String>) -> Response {
    match key_id(&id) {
        Ok(key) => answer(StatusCode::OK, admin.revoke_key(key).await),
        Err(refusal) => refuse(refusal),
    }
}

async fn audit<S: Store>(State(admin): State<Admin<S>>) -> Response {
    answer(StatusCode::OK, admin.audit().await)
}

async fn create_codes<S: Store>(
    State(admin): State<Admin<S>>,
    AdminBody(body): AdminBody,
) -> Response {
    match json_body(&body).and_then(|body| NewCodes::from_json(&body)) {
        Ok(new) => answer(StatusCode::CREATED, admin.create_codes(&new).await),
        Err(refusal) => refuse(refusal),
    }
}

async fn code_batches<S: Store>(State(admin): State<Admin<S>>) -> Response {
    answer(StatusCode::OK, admin.code_batches().await)
}

async fn revoke_codes<S: Store>(
    State(admin): State<Admin<S>>,
    Path(batch): Path<String>,
) -> Response {
    match batch.parse() {
        Ok(batch) => answer(StatusCode::OK, admin.revoke_codes(batch).await),
        Err(_) => refuse(GatewayError::NoSuchCodeBatch),
    }
}

async fn catalogue<S: Store>(State(admin): State<Admin<S>>) -> Response {
    answer(StatusCode::OK, admin.catalogue())
}

async fn reload_catalogue<S: Store>(State(admin): State<Admin<S>>) -> Response {
    answer(StatusCode::OK, admin.reload_catalogue().await)
}

async fn deliveries<S: Store>(
    State(admin): State<Admin<S>>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let status = query
        .get("status")
        .map(|status| {
            crate::store::DeliveryStatus::parse(status).ok_or(GatewayError::InvalidField {
                field: "status".into(),
                reason: "必须是 pending, delivered 或 failed",
            })
        })
        .transpose();
    match status.and_then(|status| Ok((status, limit(&query)?))) {
        Ok((status, limit)) => answer(StatusCode::OK, admin.deliveries(status, limit).await),
        Err(refusal) => refuse(refusal),
    }
}

async fn retry_delivery<S: Store>(
    State(admin): State<Admin<S>>,
    Path(id): Path<String>,
) -> Response {
    match id.parse() {
        Ok(id) => answer(StatusCode::OK, admin.retry_delivery(id).await),
        Err(_) => refuse(GatewayError::NoSuchDelivery),
    }
}
