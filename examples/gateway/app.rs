//! The gateway application: the axum router around the model-gateway stack, and the operator
//! commands. `main.rs` wires these to the command line; the integration tests mount the same
//! router, so what they check is what `cargo run --example gateway` serves.

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use model_gateway::{
    Accounts, Balance, BodyLimits, Bucket, CallLog, CallRecord, Catalogue, Credits, GatewayError,
    KeyHash, KeyStore, Ledger, NewApiKey, RequestIdLayer, SeaOrmStore, Store, Sums, Upstream,
};

/// Credits given to the demo account that mock mode creates on an empty database.
pub const DEMO_SUBSCRIPTION_CREDITS: i64 = 1_000;

/// The whole HTTP surface: the two call endpoints through the stack, the key holders'
/// endpoints and probes, and a JSON 404 for the rest, every answer with an `x-request-id`.
pub fn router<S: Store + 'static>(
    store: Arc<S>,
    catalogue: Arc<Catalogue>,
    upstream: Upstream,
    body: impl Into<BodyLimits>,
) -> Router {
    let stack = model_gateway::stack(store.clone(), catalogue.clone(), body, upstream.clone());
    Router::new()
        .route_service("/v1/chat/completions", stack.clone())
        .route_service("/v1/messages", stack)
        .merge(model_gateway::key_holder::router(
            store, catalogue, upstream,
        ))
        .fallback(|| async { GatewayError::UnknownPath.into_response::<Body>() })
        .layer(RequestIdLayer::new())
}

/// An operator command that could not be done.
#[derive(Debug)]
pub struct CommandError(pub String);

impl std::fmt::Display for CommandError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CommandError {}

impl From<model_gateway::StoreError> for CommandError {
    fn from(error: model_gateway::StoreError) -> CommandError {
        CommandError(error.to_string())
    }
}

/// Creates an account with one key and the given credits; returns the key (shown once).
pub async fn create_key(
    store: &SeaOrmStore,
    name: &str,
    subscription: i64,
    topup: i64,
) -> Result<NewApiKey, CommandError> {
    check_amounts(subscription, topup)?;
    granted_together(Balance::default(), subscription, topup)?;
    let account = store.create_account(name).await?;
    let key = NewApiKey::generate();
    store.add_key(account, &key).await?;
    grant_both(store, account, subscription, topup).await?;
    Ok(key)
}

/// Grants credits to the account of `key`.
pub async fn add_credits(
    store: &SeaOrmStore,
    key: &str,
    subscription: i64,
    topup: i64,
) -> Result<Balance, CommandError> {
    check_amounts(subscription, topup)?;
    if subscription == 0 && topup == 0 {
        return Err(CommandError(
            "give --subscription N and/or --topup N".into(),
        ));
    }
    let account = account_of(store, key).await?;
    // Checked here for both grants together so that one is not written without the other; the
    // store refuses each alone too.
    granted_together(store.balance(account).await?, subscription, topup)?;
    grant_both(store, account, subscription, topup).await?;
    Ok(store.balance(account).await?)
}

/// The balance of the account of `key`, as printed by `balance`.
pub async fn balance_json(
    store: &SeaOrmStore,
    key: &str,
) -> Result<serde_json::Value, CommandError> {
    let balance = store.balance(account_of(store, key).await?).await?;
    Ok(serde_json::json!({
        "subscription": balance.subscription,
        "topup": balance.topup,
        "total": balance.total(),
    }))
}

/// The newest call-log entries of the account of `key`.
pub async fn logs(
    store: &SeaOrmStore,
    key: &str,
    limit: u64,
) -> Result<Vec<CallRecord>, CommandError> {
    let account = account_of(store, key).await?;
    Ok(store.recent_calls(account, limit).await?)
}

/// Revokes `key`: it is refused from its very next call, on every gateway sharing the database.
pub async fn revoke(store: &SeaOrmStore, key: &str) -> Result<(), CommandError> {
    if store.revoke_key(&KeyHash::of(key)).await? {
        Ok(())
    } else {
        Err(CommandError("unknown or already revoked key".into()))
    }
}

/// What `audit` found.
pub struct AuditReport {
    /// One line per account.
    pub lines: Vec<serde_json::Value>,
    /// Accounts whose books do not balance.
    pub failures: usize,
}

/// Checks every account: `grants - charges of ok and pending calls = balance`, per bucket, no
/// negative bucket, and a total that can be represented. A refund that returned other than what its call took would break the first
/// equation for that account, since refunded calls are not counted as charges.
pub async fn audit(store: &SeaOrmStore) -> Result<AuditReport, CommandError> {
    let audits = store.audit().await?;
    let failures = audits.iter().filter(|audit| !audit.holds()).count();
    // Sums may pass what a JSON number holds exactly in every reader: those are written as text.
    let exact = |sum: i128| {
        i64::try_from(sum).map_or_else(
            |_| serde_json::json!(sum.to_string()),
            serde_json::Value::from,
        )
    };
    let sums = |sums: Sums| serde_json::json!({ "subscription": exact(sums.subscription), "topup": exact(sums.topup) });
    let lines = audits
        .iter()
        .map(|audit| {
            let balance = audit.balance;
            serde_json::json!({
                "account": audit.account,
                "granted": sums(audit.granted),
                "charged": sums(audit.charged),
                "balance": { "subscription": balance.subscription, "topup": balance.topup },
                "ok": audit.holds(),
                "problem": audit.problem(),
            })
        })
        .collect();
    Ok(AuditReport { lines, failures })
}

/// In mock mode on an empty database, creates a demo account so a new user can call at once.
pub async fn ensure_demo_account(store: &SeaOrmStore) -> Result<Option<NewApiKey>, CommandError> {
    if store.account_count().await? > 0 {
        return Ok(None);
    }
    create_key(store, "demo", DEMO_SUBSCRIPTION_CREDITS, 0)
        .await
        .map(Some)
}

async fn account_of(
    store: &SeaOrmStore,
    key: &str,
) -> Result<model_gateway::AccountId, CommandError> {
    store
        .caller_for_key(&KeyHash::of(key))
        .await?
        .map(|caller| caller.account)
        .ok_or_else(|| CommandError("unknown or revoked key".into()))
}

/// `balance` with both grants, or why it cannot hold them.
fn granted_together(
    balance: Balance,
    subscription: i64,
    topup: i64,
) -> Result<Balance, CommandError> {
    balance
        .checked_grant(Bucket::Subscription, Credits(subscription))
        .and_then(|balance| balance.checked_grant(Bucket::Topup, Credits(topup)))
        .ok_or_else(|| {
            CommandError(format!(
                "granting {subscription} subscription and {topup} top-up credits would take the \
                 balance past the largest value a balance can hold ({}); nothing was granted",
                Credits::MAX
            ))
        })
}

fn check_amounts(subscription: i64, topup: i64) -> Result<(), CommandError> {
    if subscription < 0 || topup < 0 {
        return Err(CommandError("credit amounts cannot be negative".into()));
    }
    Ok(())
}

async fn grant_both(
    store: &SeaOrmStore,
    account: model_gateway::AccountId,
    subscription: i64,
    topup: i64,
) -> Result<(), CommandError> {
    for (bucket, amount) in [(Bucket::Subscription, subscription), (Bucket::Topup, topup)] {
        if amount > 0 {
            store.grant(account, bucket, Credits(amount)).await?;
        }
    }
    Ok(())
}
