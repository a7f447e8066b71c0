//! Running the gateway as a business: the operator's operations on accounts, keys, grants, the
//! call log and the audit, in one place that both the admin HTTP API ([`router`], feature
//! `api`) and a command line call, so that the two always agree.
//!
//! Every operation takes and returns plain types ([`NewAccount`], [`KeyPatch`],
//! [`GrantRequest`]; [`AccountView`], [`KeyView`], ...) whose JSON is what the API answers and
//! what the example's command line prints. A refusal is a [`GatewayError`] (`404 账户不存在`,
//! `400` naming the field, ...); a store failure is kept whole for the operator's log.
//!
//! ```
//! use std::sync::Arc;
//! use model_gateway::admin::{Admin, GrantRequest, NewAccount};
//! use model_gateway::{credits::Bucket, Credits, MemoryStore};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let admin = Admin::new(Arc::new(MemoryStore::new()));
//! let created = admin
//!     .create_account(&NewAccount { name: "alice".into(), subscription: 100, topup: 0 })
//!     .await
//!     .unwrap();
//! assert!(created.key.starts_with("sk-mg-"));
//!
//! let grant = GrantRequest::new(Bucket::Topup, Credits::new(50)).reason("pack bought");
//! let granted = admin.grant(created.id, &grant, Some("order-17")).await.unwrap();
//! let again = admin.grant(created.id, &grant, Some("order-17")).await.unwrap();
//! assert_eq!(granted.balance.total, Credits::new(150));
//! assert_eq!(again.balance.total, Credits::new(150)); // applied once
//! assert!(!again.applied);
//! # }
//! ```

use std::sync::Arc;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::call::KeyRules;
use crate::catalogue::{Catalogue, LiveCatalogue};
use crate::credits::{Bucket, Credits};
use crate::error::GatewayError;
use crate::keys::{KeyHash, NewApiKey};
use crate::reload::CatalogueReloader;
use crate::store::{
    AccountAudit, AccountId, AccountQuery, AccountSummary, CallId, CallQuery, CallRecord,
    CallStatus, Grant, KeyId, KeyInfo, KeyStatus, Store, StoreError,
};

mod catalogue;
mod codes;
#[cfg(feature = "api")]
mod http;
mod reports;
mod requests;

pub use catalogue::catalogue_view;
pub use codes::{CodeBatchList, CodeBatchView, CreatedCodes, DeliveryList};
#[cfg(feature = "api")]
pub use http::{AdminToken, MIN_ADMIN_TOKEN_CHARS, metrics_router, router};
pub use reports::{REPORT_COLUMNS, UsageReport, report_query};
pub use requests::{
    AccountPatch, GrantRequest, KeyPatch, MAX_CODES_PER_BATCH, NewAccount, NewCodes,
};

/// Credits given to the demo account that mock mode creates on an empty database.
pub const DEMO_SUBSCRIPTION_CREDITS: i64 = 1_000;

/// Default and largest page of the listings.
pub const DEFAULT_PAGE: u64 = 20;
/// The largest page of the listings.
pub const LARGEST_PAGE: u64 = 1000;

/// An operation that could not be done: refused (with the status and text the API answers), or
/// failed in the store.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// Refused: unknown account or key, a bad field, a grant past the largest balance, an
    /// idempotency key reused.
    #[error(transparent)]
    Refused(GatewayError),
    /// The store failed.
    #[error(transparent)]
    Store(StoreError),
}

impl From<GatewayError> for AdminError {
    fn from(refusal: GatewayError) -> AdminError {
        AdminError::Refused(refusal)
    }
}

impl From<StoreError> for AdminError {
    fn from(error: StoreError) -> AdminError {
        // Refusals the store found are the operator's to fix, not outages.
        match error {
            StoreError::BalanceOverflow(_) => AdminError::Refused(GatewayError::BalanceOverflow),
            StoreError::IdempotencyKeyReused(_) => {
                AdminError::Refused(GatewayError::IdempotencyKeyReused)
            }
            error => AdminError::Store(error),
        }
    }
}

impl AdminError {
    /// What the API answers: the refusal, or `503` for a store failure (logged here).
    pub fn into_refusal(self) -> GatewayError {
        match self {
            AdminError::Refused(refusal) => refusal,
            AdminError::Store(error) => {
                tracing::error!(%error, "admin operation failed in the store");
                GatewayError::StoreUnavailable
            }
        }
    }
}

/// An account's credits as the API shows them: what calls can spend now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BalanceView {
    /// Subscription credits left (none once their period has ended).
    pub subscription: Credits,
    /// Top-up credits left.
    pub topup: Credits,
    /// Both together.
    pub total: Credits,
    /// When the subscription credits end; `null`: never.
    pub subscription_ends_at: Option<DateTime<Utc>>,
}

impl BalanceView {
    /// The account's credits as spendable at `now`.
    pub fn of(account: &AccountSummary, now: DateTime<Utc>) -> BalanceView {
        let spendable = account.spendable(now);
        BalanceView {
            subscription: spendable.subscription,
            topup: spendable.topup,
            total: spendable.total(),
            subscription_ends_at: account.subscription_ends_at,
        }
    }
}

/// One key as the API shows it (never the key itself).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KeyView {
    /// The key's id.
    pub id: KeyId,
    /// Its account.
    pub account: AccountId,
    /// Its first characters.
    pub prefix: String,
    /// `active`, `expired` or `revoked`.
    pub status: KeyStatus,
    /// The models it may call; `null`: all.
    pub models: Option<Vec<String>>,
    /// When it stops working; `null`: never.
    pub expires_at: Option<DateTime<Utc>>,
    /// Its requests per minute; `null`: no limit.
    pub rpm: Option<u32>,
    /// Its spending limit with what it spent in the current period; `null`: no limit.
    pub limit: Option<KeyLimitView>,
    /// When it was created.
    pub created_at: DateTime<Utc>,
    /// When it was revoked.
    pub revoked_at: Option<DateTime<Utc>>,
}

/// A key's spending limit as shown (`GET /v1/balance`'s `key_limit`, the admin API's keys):
/// the limit, what the key spent in the current period (calls under way included), and when
/// the period ends (`null` for `none`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct KeyLimitView {
    /// The most the key may spend in one period.
    pub credits: Credits,
    /// `day`, `week`, `month` or `none`.
    pub period: crate::call::LimitPeriod,
    /// What it spent in the current period.
    pub spent: Credits,
    /// When the current period ends and the allowance starts again; `null`: never.
    pub resets_at: Option<DateTime<Utc>>,
}

impl KeyLimitView {
    /// The limit of `info`, if it has one, as it stands at `now`.
    pub fn of(info: &KeyInfo, now: DateTime<Utc>) -> Option<KeyLimitView> {
        let limit = info.rules.limit?;
        Some(KeyLimitView {
            credits: limit.credits,
            period: limit.period,
            spent: info.spent,
            resets_at: limit.period.window_end(limit.period.window(now)),
        })
    }
}

impl KeyView {
    fn of(info: KeyInfo, now: DateTime<Utc>) -> KeyView {
        KeyView {
            id: info.id,
            account: info.account,
            status: info.status(now),
            limit: KeyLimitView::of(&info, now),
            models: info.rules.models.as_deref().map(<[String]>::to_vec),
            expires_at: info.rules.expires_at,
            rpm: info.rules.rpm,
            prefix: info.prefix,
            created_at: info.created_at,
            revoked_at: info.revoked_at,
        }
    }
}

/// An account as listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AccountListItem {
    /// The account's id.
    pub id: AccountId,
    /// Its name.
    pub name: String,
    /// Its credits.
    pub balance: BalanceView,
    /// When it was created.
    pub created_at: DateTime<Utc>,
}

impl AccountListItem {
    fn of(summary: AccountSummary, now: DateTime<Utc>) -> AccountListItem {
        AccountListItem {
            balance: BalanceView::of(&summary, now),
            id: summary.id,
            name: summary.name,
            created_at: summary.created_at,
        }
    }
}

/// One account with its keys.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AccountView {
    /// The account's id.
    pub id: AccountId,
    /// Its name.
    pub name: String,
    /// Its credits.
    pub balance: BalanceView,
    /// When it was created.
    pub created_at: DateTime<Utc>,
    /// Its own low-balance threshold; `null`: the gateway's default.
    pub low_balance_credits: Option<Credits>,
    /// Its keys, oldest first.
    pub keys: Vec<KeyView>,
}

/// A page of accounts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AccountList {
    /// The accounts, ascending by id.
    pub data: Vec<AccountListItem>,
    /// Whether there are more after this page.
    pub has_more: bool,
    /// The `after` that asks for the next page.
    pub next_after: Option<AccountId>,
}

/// A new account and its first key, shown once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CreatedAccount {
    /// The account's id.
    pub id: AccountId,
    /// Its name.
    pub name: String,
    /// Its first key, in clear: shown this once.
    pub key: String,
    /// The key's id.
    pub key_id: KeyId,
    /// Its credits.
    pub balance: BalanceView,
}

/// A new key, shown once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CreatedKey {
    /// The key's id.
    pub id: KeyId,
    /// The key in clear: shown this once.
    pub key: String,
    /// Its first characters, as listings show them.
    pub prefix: String,
    /// Its account.
    pub account: AccountId,
}

/// What a grant did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct GrantView {
    /// The account.
    pub account: AccountId,
    /// Its credits afterwards.
    pub balance: BalanceView,
    /// `false` when the same idempotency key had been applied before and nothing moved.
    pub applied: bool,
    /// What was left of the previous subscription period and lapsed because this grant started
    /// a new one; zero otherwise.
    pub lapsed: Credits,
}

/// A page of the call log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CallList {
    /// Always `"list"`.
    pub object: &'static str,
    /// The entries, newest first.
    pub data: Vec<CallRecord>,
    /// Whether there are older entries.
    pub has_more: bool,
    /// The `before` that asks for the next page.
    pub next_before: Option<CallId>,
}

/// The audit: whether every account's books balance.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AuditView {
    /// `true` when every account's books balance.
    pub ok: bool,
    /// One line per account.
    pub accounts: Vec<serde_json::Value>,
    /// Reservations still not ended past the longest a call can take ([`crate::recovery::recovery_age`]
    /// of the catalogue), in the database and held in this gateway's memory: credits held by
    /// no live call. The books balance with them (they count as charged until refunded), but
    /// there should be none: each is for the operator to look at.
    pub overdue_reservations: crate::store::Overdue,
}

/// Which calls [`Admin::calls`] lists.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CallFilter {
    /// Most entries (default [`DEFAULT_PAGE`], at most [`LARGEST_PAGE`]).
    pub limit: Option<u64>,
    /// Entries older than this one.
    pub before: Option<CallId>,
    /// Only this status.
    pub status: Option<CallStatus>,
    /// Only this model.
    pub model: Option<String>,
}

/// The operator's operations over a store; see the module docs.
#[derive(Debug)]
pub struct Admin<S> {
    store: Arc<S>,
    catalogue: Option<LiveCatalogue>,
    reloader: Option<CatalogueReloader>,
}

impl<S> Clone for Admin<S> {
    fn clone(&self) -> Self {
        Admin {
            store: self.store.clone(),
            catalogue: self.catalogue.clone(),
            reloader: self.reloader.clone(),
        }
    }
}

fn page_size(limit: Option<u64>) -> u64 {
    limit.unwrap_or(DEFAULT_PAGE).clamp(1, LARGEST_PAGE)
}

impl<S: Store> Admin<S> {
    /// Operations on `store`.
    pub fn new(store: Arc<S>) -> Admin<S> {
        Admin {
            store,
            catalogue: None,
            reloader: None,
        }
    }

    /// Checks the models that keys are limited to against `catalogue` (an unknown name is a
    /// `400` rather than a key that can call nothing), and shows it ([`Admin::catalogue`]).
    #[must_use]
    pub fn with_catalogue(mut self, catalogue: impl Into<LiveCatalogue>) -> Admin<S> {
        self.catalogue = Some(catalogue.into());
        self
    }

    /// Reloads the catalogue with `reloader` ([`Admin::reload_catalogue`]), and shows the one
    /// it serves.
    #[must_use]
    pub fn with_reloader(mut self, reloader: CatalogueReloader) -> Admin<S> {
        self.catalogue = Some(reloader.live().clone());
        self.reloader = Some(reloader);
        self
    }

    /// The store.
    pub fn store(&self) -> &Arc<S> {
        &self.store
    }

    /// Creates an account with one key and the given credits.
    pub async fn create_account(&self, new: &NewAccount) -> Result<CreatedAccount, AdminError> {
        new.check()?;
        let account = self.store.create_account(&new.name).await?;
        let key = NewApiKey::generate();
        let key_id = self.store.add_key(account, &key).await?;
        for (bucket, amount) in [
            (Bucket::Subscription, new.subscription),
            (Bucket::Topup, new.topup),
        ] {
            if amount > 0 {
                self.store.grant(account, bucket, Credits(amount)).await?;
            }
        }
        let created = self.existing(account).await?;
        Ok(CreatedAccount {
            id: account,
            name: new.name.clone(),
            key: key.reveal().to_owned(),
            key_id,
            balance: BalanceView::of(&created, Utc::now()),
        })
    }

    /// One page of accounts, ascending by id; `search` matches part of a name, the start of a
    /// key's prefix, or a whole key.
    pub async fn accounts(
        &self,
        after: Option<AccountId>,
        limit: Option<u64>,
        search: Option<&str>,
    ) -> Result<AccountList, AdminError> {
        let limit = page_size(limit);
        // One more than asked tells whether there is another page.
        let mut found = self
            .store
            .accounts(AccountQuery {
                after,
                limit: limit + 1,
                search,
            })
            .await?;
        let has_more = found.len() as u64 > limit;
        found.truncate(limit as usize);
        let next_after = has_more
            .then(|| found.last().map(|account| account.id))
            .flatten();
        Ok(AccountList {
            data: found
                .into_iter()
                .map(|summary| AccountListItem::of(summary, Utc::now()))
                .collect(),
            has_more,
            next_after,
        })
    }

    /// One account with its keys.
    pub async fn account(&self, account: AccountId) -> Result<AccountView, AdminError> {
        let summary = self.existing(account).await?;
        let now = Utc::now();
        let keys = self.store.keys_of(account).await?;
        Ok(AccountView {
            id: summary.id,
            balance: BalanceView::of(&summary, now),
            name: summary.name,
            created_at: summary.created_at,
            low_balance_credits: summary.low_balance_credits,
            keys: keys.into_iter().map(|key| KeyView::of(key, now)).collect(),
        })
    }

    /// Changes what `patch` names of the account.
    pub async fn update_account(
        &self,
        account: AccountId,
        patch: &AccountPatch,
    ) -> Result<AccountView, AdminError> {
        if let Some(threshold) = patch.low_balance_credits
            && !self.store.set_low_balance(account, threshold).await?
        {
            return Err(GatewayError::NoSuchAccount.into());
        }
        self.account(account).await
    }

    /// A new key for the account.
    pub async fn create_key(&self, account: AccountId) -> Result<CreatedKey, AdminError> {
        self.existing(account).await?;
        let key = NewApiKey::generate();
        let id = self.store.add_key(account, &key).await?;
        Ok(CreatedKey {
            id,
            key: key.reveal().to_owned(),
            prefix: key.display_prefix().to_owned(),
            account,
        })
    }

    /// Changes the fields of the key's rules that `patch` names.
    pub async fn update_key(&self, key: KeyId, patch: &KeyPatch) -> Result<KeyView, AdminError> {
        if let (Some(Some(models)), Some(catalogue)) = (&patch.models, &self.catalogue)
            && models
                .iter()
                .any(|model| catalogue.current().model(model).is_none())
        {
            return Err(GatewayError::InvalidField {
                field: "models".into(),
                reason: "含有目录中没有的模型",
            }
            .into());
        }
        let info = self
            .store
            .key_info(key)
            .await?
            .ok_or(GatewayError::NoSuchKey)?;
        let rules = patch.applied_to(&info.rules);
        let info = self
            .store
            .set_key_rules(key, &rules)
            .await?
            .ok_or(GatewayError::NoSuchKey)?;
        Ok(KeyView::of(info, Utc::now()))
    }

    /// Revokes the key: refused from its next call on, on every gateway sharing the database.
    pub async fn revoke_key(&self, key: KeyId) -> Result<KeyView, AdminError> {
        let info = self
            .store
            .revoke_key_id(key)
            .await?
            .ok_or(GatewayError::NoSuchKey)?;
        Ok(KeyView::of(info, Utc::now()))
    }

    /// Revokes a key given in clear (the command line's `keys revoke --key`).
    pub async fn revoke_clear_key(&self, key: &str) -> Result<(), AdminError> {
        if self.store.revoke_key(&KeyHash::of(key)).await? {
            Ok(())
        } else {
            Err(GatewayError::NoSuchKey.into())
        }
    }

    /// Grants credits; with an `idempotency_key`, at most once per account and key.
    pub async fn grant(
        &self,
        account: AccountId,
        grant: &GrantRequest,
        idempotency_key: Option<&str>,
    ) -> Result<GrantView, AdminError> {
        grant.check()?;
        requests::check_idempotency_key(idempotency_key)?;
        self.existing(account).await?;
        let now = Utc::now();
        let granted = self
            .store
            .grant_once(
                account,
                Grant {
                    bucket: grant.bucket,
                    amount: grant.credits,
                    reason: grant.reason.as_deref(),
                    idempotency_key,
                    period_end: grant.period_end(now),
                    at: now,
                },
            )
            .await?;
        let after = self.existing(account).await?;
        Ok(GrantView {
            account,
            balance: BalanceView::of(&after, Utc::now()),
            applied: granted.applied,
            lapsed: granted.lapsed,
        })
    }

    /// Grants subscription and top-up credits together (the command line's `credits add`):
    /// either both fit in the balance or neither is granted. Zero amounts are skipped; at least
    /// one must be positive.
    pub async fn add_credits(
        &self,
        account: AccountId,
        subscription: i64,
        topup: i64,
    ) -> Result<BalanceView, AdminError> {
        if subscription < 0 || topup < 0 || (subscription == 0 && topup == 0) {
            return Err(GatewayError::InvalidField {
                field: "credits".into(),
                reason: "须给出正的 subscription 和/或 topup",
            }
            .into());
        }
        let summary = self.existing(account).await?;
        // Checked for both together so that one is not written without the other; the store
        // refuses each alone too.
        requests::both_fit(summary.balance, subscription, topup)?;
        for (bucket, amount) in [(Bucket::Subscription, subscription), (Bucket::Topup, topup)] {
            if amount > 0 {
                self.store.grant(account, bucket, Credits(amount)).await?;
            }
        }
        Ok(BalanceView::of(&self.existing(account).await?, Utc::now()))
    }

    /// One page of the account's call log, newest first.
    pub async fn calls(
        &self,
        account: AccountId,
        filter: &CallFilter,
    ) -> Result<CallList, AdminError> {
        self.existing(account).await?;
        let limit = page_size(filter.limit);
        let mut data = self
            .store
            .calls(
                account,
                CallQuery {
                    before: filter.before,
                    limit: limit + 1,
                    status: filter.status,
                    model: filter.model.as_deref(),
                },
            )
            .await?;
        let has_more = data.len() as u64 > limit;
        data.truncate(limit as usize);
        let next_before = has_more.then(|| data.last().map(|call| call.id)).flatten();
        Ok(CallList {
            object: "list",
            data,
            has_more,
            next_before,
        })
    }

    /// Checks every account's books: `grants - charges of ok and pending calls = balance`, per
    /// bucket, no negative bucket, a total that can be represented.
    pub async fn audit(&self) -> Result<AuditView, AdminError> {
        let audits = self.store.audit().await?;
        let longest_call = match &self.catalogue {
            Some(catalogue) => crate::recovery::recovery_age(&catalogue.current()),
            None => crate::recovery::recovery_age(&Catalogue::default()),
        };
        let cutoff = chrono::Utc::now()
            - chrono::Duration::from_std(longest_call).unwrap_or(chrono::Duration::MAX);
        Ok(AuditView {
            ok: audits.iter().all(AccountAudit::holds),
            accounts: audits.iter().map(audit_line).collect(),
            overdue_reservations: self.store.overdue_reservations(cutoff).await?,
        })
    }

    /// The account a key (in clear) belongs to, if the key works.
    pub async fn account_of_key(&self, key: &str) -> Result<AccountId, AdminError> {
        self.store
            .caller_for_key(&KeyHash::of(key))
            .await?
            .map(|caller| caller.account)
            .ok_or(GatewayError::NoSuchKey.into())
    }

    /// On an empty store, creates the demo account (so mock mode can be called at once).
    pub async fn ensure_demo_account(&self) -> Result<Option<CreatedAccount>, AdminError> {
        if self.store.account_count().await? > 0 {
            return Ok(None);
        }
        let demo = NewAccount {
            name: "demo".into(),
            subscription: DEMO_SUBSCRIPTION_CREDITS,
            topup: 0,
        };
        self.create_account(&demo).await.map(Some)
    }

    async fn existing(&self, account: AccountId) -> Result<AccountSummary, AdminError> {
        Ok(self
            .store
            .account(account)
            .await?
            .ok_or(GatewayError::NoSuchAccount)?)
    }
}

/// One account's audit as JSON. Sums may pass what a JSON number holds exactly in every reader:
/// those are written as text.
fn audit_line(audit: &AccountAudit) -> serde_json::Value {
    let exact = |sum: i128| {
        i64::try_from(sum).map_or_else(
            |_| serde_json::json!(sum.to_string()),
            serde_json::Value::from,
        )
    };
    let sums = |sums: crate::store::Sums| serde_json::json!({ "subscription": exact(sums.subscription), "topup": exact(sums.topup) });
    serde_json::json!({
        "account": audit.account,
        "granted": sums(audit.granted),
        "charged": sums(audit.charged),
        "shortfall": exact(audit.shortfall),
        "balance": { "subscription": audit.balance.subscription, "topup": audit.balance.topup },
        "ok": audit.holds(),
        "problem": audit.problem(),
    })
}

/// Rules with `patch` applied: used by [`Admin::update_key`].
impl KeyPatch {
    fn applied_to(&self, rules: &KeyRules) -> KeyRules {
        KeyRules {
            models: match &self.models {
                Some(models) => models.as_ref().map(|models| models.clone().into()),
                None => rules.models.clone(),
            },
            expires_at: self.expires_at.unwrap_or(rules.expires_at),
            rpm: self.rpm.unwrap_or(rules.rpm),
            limit: self.limit.unwrap_or(rules.limit),
        }
    }
}
