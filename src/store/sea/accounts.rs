//! Administration on the sea-orm backend: accounts, keys and their rules, grants, the audit.
//! Grants lock the account's row before anything else, so grants to one account queue, and an
//! idempotency key checked under that lock is applied once however many gateways send it.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sea_orm::sea_query::{Expr, ExprTrait, Func, LikeExpr, Query};
use sea_orm::{
    ColumnTrait, EntityTrait, NotSet, PaginatorTrait, QueryFilter, QueryOrder, QuerySelect, Set,
};

use super::entity::{account, api_key, call, escrow};
use super::lapses::lapse;
use super::rows::{
    balance_of, escrowed, insert_event, locked_account, moment_value, stored_allowance,
    stored_limit, with_escrowed,
};
use super::store::SeaOrmStore;
use crate::call::KeyLimit;
use crate::credits::Credits;
use crate::events::{EventType, WebhookEvent};
use crate::keys::{KeyHash, NewApiKey};
use crate::store::{
    AccountAudit, AccountId, AccountQuery, AccountSummary, Accounts, CallStatus, Grant, Granted,
    KeyId, KeyInfo, KeyRules, Lapse, StoreError,
};

/// The rules stored on a key's row.
pub(super) fn key_rules(row: &api_key::Model) -> Result<KeyRules, StoreError> {
    let models = row
        .models
        .as_deref()
        .map(|models| {
            serde_json::from_str::<Vec<String>>(models).map_err(|error| {
                StoreError::msg(format!("key {}: unreadable models: {error}", row.id))
            })
        })
        .transpose()?;
    Ok(KeyRules {
        models: models.map(Into::into),
        expires_at: row.expires_at,
        rpm: row.rpm.and_then(|rpm| u32::try_from(rpm).ok()),
        limit: stored_limit(row.limit_credits, row.limit_period.as_deref()),
    })
}

/// `limit_alerted_window` as it is left when a key's limit is set to `limit`: kept if the
/// limit is the one stored, forgotten otherwise.
fn same_limit_keeps_alert(limit: Option<KeyLimit>) -> sea_orm::sea_query::SimpleExpr {
    let Some(limit) = limit else {
        return Expr::value(Option::<i64>::None);
    };
    let same = api_key::Column::LimitCredits
        .eq(limit.credits.get())
        .and(api_key::Column::LimitPeriod.eq(limit.period.as_str()));
    sea_orm::sea_query::CaseStatement::new()
        .case(same, Expr::col(api_key::Column::LimitAlertedWindow))
        .finally(Expr::value(Option::<i64>::None))
        .into()
}

/// The key as its row stores it; `held` is what its calls held in memory hold (counted as
/// spent).
fn key_info(row: api_key::Model, held: Credits) -> Result<KeyInfo, StoreError> {
    let allowance = stored_allowance(
        row.limit_credits,
        row.limit_period.as_deref(),
        row.limit_spent,
        row.limit_window,
    );
    let spent = allowance.map_or(Credits::ZERO, |allowance| {
        Credits(allowance.spent_at(Utc::now()).saturating_add(held.get()))
    });
    Ok(KeyInfo {
        id: KeyId(row.id),
        account: AccountId(row.account_id),
        rules: key_rules(&row)?,
        spent,
        prefix: row.display_prefix,
        created_at: row.created_at,
        revoked_at: row.revoked_at,
    })
}

fn summary(row: account::Model) -> AccountSummary {
    AccountSummary {
        id: AccountId(row.id),
        balance: balance_of(&row),
        subscription_ends_at: row.subscription_ends_at,
        name: row.name,
        created_at: row.created_at,
        low_balance_credits: row.low_balance_credits.map(Credits),
    }
}

/// `text` for a `LIKE` pattern, its wildcards taken literally.
fn like_escaped(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '%' | '_' | '\\') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

/// How long a readiness check waits for the database.
const READY_WITHIN: std::time::Duration = std::time::Duration::from_secs(2);

impl SeaOrmStore {
    /// Whether a `SQLite` file takes a write now (a full disk does not): one transaction that
    /// writes the header's `user_version` back as it was.
    async fn write_probe(&self) -> Result<(), sea_orm::DbErr> {
        use sea_orm::{ConnectionTrait, TransactionTrait};
        let txn = self.db.begin().await?;
        let version: i64 = txn
            .query_one_raw(sea_orm::Statement::from_string(
                txn.get_database_backend(),
                "PRAGMA user_version",
            ))
            .await?
            .map(|row| row.try_get_by_index(0))
            .transpose()?
            .unwrap_or(0);
        txn.execute_unprepared(&format!("PRAGMA user_version = {version}"))
            .await?;
        txn.commit().await
    }

    /// The first `limit` accounts after `after`, by id, whose name folded to lower case
    /// contains `lowered`, matched in Rust with Unicode's case folding.
    async fn names_containing(
        &self,
        after: Option<AccountId>,
        lowered: &str,
        limit: u64,
    ) -> Result<Vec<i64>, StoreError> {
        let mut select = account::Entity::find()
            .select_only()
            .column(account::Column::Id)
            .column(account::Column::Name)
            .order_by_asc(account::Column::Id);
        if let Some(after) = after {
            select = select.filter(account::Column::Id.gt(after.0));
        }
        let rows: Vec<(i64, String)> = select.into_tuple().all(&self.db).await?;
        Ok(rows
            .into_iter()
            .filter(|(_, name)| name.to_lowercase().contains(lowered))
            .map(|(id, _)| id)
            .take(usize::try_from(limit).unwrap_or(usize::MAX))
            .collect())
    }

    /// Accounts as read, with their escrowed credits, less what calls hold on them in memory
    /// (see [`SeaOrmStore::own_file`] and [`SeaOrmStore::with_escrow`]): what they have to
    /// spend. A display, so read outside the
    /// holds' lock; a batch ending in between can make it one call off.
    async fn net_of_holds(
        &self,
        mut summaries: Vec<AccountSummary>,
    ) -> Result<Vec<AccountSummary>, StoreError> {
        // Escrowed credits are the account's, whichever instance holds them (see
        // `with_escrow`); what this one holds against its escrow is spent.
        let ids: Vec<i64> = summaries.iter().map(|summary| summary.id.0).collect();
        let escrowed = escrowed(&self.db, Some(&ids)).await?;
        for summary in &mut summaries {
            let extra = escrowed.get(&summary.id.0).copied().unwrap_or_default();
            summary.balance = self
                .mode
                .net(summary.id, with_escrowed(summary.balance, extra));
        }
        Ok(summaries)
    }

    async fn key_row(&self, key: KeyId) -> Result<Option<KeyInfo>, StoreError> {
        api_key::Entity::find_by_id(key.0)
            .one(&self.db)
            .await?
            .map(|row| key_info(row, self.mode.held_on_key(key)))
            .transpose()
    }
}

#[async_trait]
impl Accounts for SeaOrmStore {
    async fn create_account(&self, name: &str) -> Result<AccountId, StoreError> {
        let row = account::ActiveModel {
            id: NotSet,
            name: Set(name.to_owned()),
            subscription_credits: Set(0),
            topup_credits: Set(0),
            created_at: Set(Utc::now()),
            subscription_ends_at: Set(None),
            low_balance_credits: Set(None),
        };
        let id = account::Entity::insert(row)
            .exec(&self.db)
            .await?
            .last_insert_id;
        Ok(AccountId(id))
    }

    async fn add_key(&self, account: AccountId, key: &NewApiKey) -> Result<KeyId, StoreError> {
        let row = api_key::ActiveModel {
            id: NotSet,
            account_id: Set(account.0),
            key_hash: Set(key.hash().as_str().to_owned()),
            display_prefix: Set(key.display_prefix().to_owned()),
            revoked_at: Set(None),
            created_at: Set(Utc::now()),
            models: Set(None),
            expires_at: Set(None),
            rpm: Set(None),
            limit_credits: Set(None),
            limit_period: Set(None),
            limit_spent: Set(0),
            limit_window: Set(0),
            limit_alerted_window: Set(None),
        };
        let id = api_key::Entity::insert(row)
            .exec(&self.db)
            .await?
            .last_insert_id;
        Ok(KeyId(id))
    }

    async fn revoke_key(&self, key: &KeyHash) -> Result<bool, StoreError> {
        let revoked = api_key::Entity::update_many()
            .col_expr(api_key::Column::RevokedAt, Expr::value(Utc::now()))
            .filter(api_key::Column::KeyHash.eq(key.as_str()))
            .filter(api_key::Column::RevokedAt.is_null())
            .exec(&self.db)
            .await?;
        self.keys.forget(key);
        Ok(revoked.rows_affected > 0)
    }

    async fn revoke_key_id(&self, key: KeyId) -> Result<Option<KeyInfo>, StoreError> {
        api_key::Entity::update_many()
            .col_expr(api_key::Column::RevokedAt, Expr::value(Utc::now()))
            .filter(api_key::Column::Id.eq(key.0))
            .filter(api_key::Column::RevokedAt.is_null())
            .exec(&self.db)
            .await?;
        self.keys.forget_id(key);
        self.key_row(key).await
    }

    async fn set_key_rules(
        &self,
        key: KeyId,
        rules: &KeyRules,
    ) -> Result<Option<KeyInfo>, StoreError> {
        let models = rules
            .models
            .as_ref()
            .map(|models| {
                serde_json::to_string(&models[..]).map_err(|e| StoreError::Database(Box::new(e)))
            })
            .transpose()?;
        let rpm = rules
            .rpm
            .map(|rpm| {
                i32::try_from(rpm).map_err(|_| StoreError::Invalid("rpm is too large".into()))
            })
            .transpose()?;
        api_key::Entity::update_many()
            // A changed limit is told again once reached; an unchanged one keeps its window.
            // First: MySQL sees the columns set before it in the same statement as changed.
            .col_expr(
                api_key::Column::LimitAlertedWindow,
                same_limit_keeps_alert(rules.limit),
            )
            .col_expr(api_key::Column::Models, Expr::value(models))
            .col_expr(
                api_key::Column::ExpiresAt,
                Expr::value(moment_value(
                    self.db.get_database_backend(),
                    rules.expires_at,
                )),
            )
            .col_expr(api_key::Column::Rpm, Expr::value(rpm))
            // What the key spent stays: a lower limit counts it at once.
            .col_expr(
                api_key::Column::LimitCredits,
                Expr::value(rules.limit.map(|limit| limit.credits.get())),
            )
            .col_expr(
                api_key::Column::LimitPeriod,
                Expr::value(rules.limit.map(|limit| limit.period.as_str())),
            )
            .filter(api_key::Column::Id.eq(key.0))
            .exec(&self.db)
            .await?;
        self.keys.forget_id(key);
        self.key_row(key).await
    }

    async fn key_info(&self, key: KeyId) -> Result<Option<KeyInfo>, StoreError> {
        self.key_row(key).await
    }

    async fn keys_of(&self, account: AccountId) -> Result<Vec<KeyInfo>, StoreError> {
        api_key::Entity::find()
            .filter(api_key::Column::AccountId.eq(account.0))
            .order_by_asc(api_key::Column::Id)
            .all(&self.db)
            .await?
            .into_iter()
            .map(|row| {
                let held = self.mode.held_on_key(KeyId(row.id));
                key_info(row, held)
            })
            .collect()
    }

    async fn grant_once(
        &self,
        account: AccountId,
        grant: Grant<'_>,
    ) -> Result<Granted, StoreError> {
        let granted = self.grant_claiming(account, grant, None).await?;
        Ok(granted.expect("a grant without a code to claim is never lost"))
    }

    async fn set_low_balance(
        &self,
        account: AccountId,
        threshold: Option<Credits>,
    ) -> Result<bool, StoreError> {
        if threshold.is_some_and(|threshold| threshold < Credits::ZERO) {
            return Err(StoreError::Invalid(
                "a low-balance threshold cannot be negative".into(),
            ));
        }
        let changed = account::Entity::update_many()
            .col_expr(
                account::Column::LowBalanceCredits,
                Expr::value(threshold.map(Credits::get)),
            )
            .filter(account::Column::Id.eq(account.0))
            .exec(&self.db)
            .await?
            .rows_affected;
        Ok(changed == 1)
    }

    async fn account(&self, account: AccountId) -> Result<Option<AccountSummary>, StoreError> {
        let row = account::Entity::find_by_id(account.0).one(&self.db).await?;
        Ok(self
            .net_of_holds(row.into_iter().map(summary).collect())
            .await?
            .pop())
    }

    async fn accounts(&self, query: AccountQuery<'_>) -> Result<Vec<AccountSummary>, StoreError> {
        let mut select = account::Entity::find();
        if let Some(after) = query.after {
            select = select.filter(account::Column::Id.gt(after.0));
        }
        if let Some(search) = query.search.filter(|search| !search.is_empty()) {
            // No name or key holds a NUL (PostgreSQL cannot even take one as a parameter).
            if search.contains('\0') {
                return Ok(Vec::new());
            }
            let lowered = search.to_lowercase();
            let name = if self.db.get_database_backend() == sea_orm::DbBackend::Sqlite
                && !lowered.chars().all(|c| c.is_ascii_graphic() || c == ' ')
            {
                // SQLite's `lower()` folds ASCII only, and a NUL ends its strings: such a
                // search is matched here, as PostgreSQL and MariaDB match it.
                let ids = self
                    .names_containing(query.after, &lowered, query.limit)
                    .await?;
                account::Column::Id.is_in(ids)
            } else {
                Expr::expr(Func::lower(Expr::col((
                    account::Entity,
                    account::Column::Name,
                ))))
                .like(LikeExpr::new(format!("%{}%", like_escaped(&lowered))).escape('\\'))
            };
            // A key's display prefix, or the whole key pasted in.
            let key_matches =
                Query::select()
                    .column(api_key::Column::AccountId)
                    .from(api_key::Entity)
                    .cond_where(
                        sea_orm::Condition::any()
                            .add(Expr::col(api_key::Column::DisplayPrefix).like(
                                LikeExpr::new(format!("{}%", like_escaped(search))).escape('\\'),
                            ))
                            .add(api_key::Column::KeyHash.eq(KeyHash::of(search).as_str())),
                    )
                    .to_owned();
            select = select.filter(
                sea_orm::Condition::any()
                    .add(name)
                    .add(account::Column::Id.in_subquery(key_matches)),
            );
        }
        let summaries = select
            .order_by_asc(account::Column::Id)
            .limit(query.limit)
            .all(&self.db)
            .await?
            .into_iter()
            .map(summary)
            .collect();
        self.net_of_holds(summaries).await
    }

    async fn account_count(&self) -> Result<u64, StoreError> {
        Ok(account::Entity::find().count(&self.db).await?)
    }

    async fn lapse_ended_subscriptions(
        &self,
        now: DateTime<Utc>,
    ) -> Result<Vec<Lapse>, StoreError> {
        // Few accounts have credits in a period: find them, then judge each under its lock.
        let candidates: Vec<(i64, Option<DateTime<Utc>>)> = account::Entity::find()
            .select_only()
            .column(account::Column::Id)
            .column(account::Column::SubscriptionEndsAt)
            .filter(account::Column::SubscriptionEndsAt.is_not_null())
            .filter(
                sea_orm::Condition::any()
                    .add(account::Column::SubscriptionCredits.gt(0))
                    .add(
                        account::Column::Id.in_subquery(
                            Query::select()
                                .column(escrow::Column::AccountId)
                                .from(escrow::Entity)
                                .and_where(escrow::Column::SubscriptionCredits.gt(0))
                                .to_owned(),
                        ),
                    ),
            )
            .into_tuple()
            .all(&self.db)
            .await?;
        let mut lapses = Vec::new();
        for (id, _) in candidates
            .into_iter()
            .filter(|(_, end)| end.is_some_and(|end| end <= now))
        {
            // Held calls must not change while the lapse leaves what they hold.
            let holds = self.freeze_holds().await;
            let held = holds
                .as_ref()
                .map(|holds| holds.on(AccountId(id)))
                .unwrap_or_default();
            let _writes = self.mode.pause_escrow_writes().await;
            let escrow_held = self.mode.escrow_held(AccountId(id));
            let txn = self.begin_write().await?;
            let row = locked_account(&txn, AccountId(id)).await?;
            let lapsed = match row.subscription_ends_at {
                Some(end) if end <= now => {
                    lapse(&txn, &row, end, held.subscription, &escrow_held).await?
                }
                _ => None,
            };
            if let Some(lapsed) =
                lapsed.filter(|_| self.events.writes(EventType::SubscriptionLapsed))
            {
                let data = serde_json::json!({
                    "account": lapsed.account,
                    "credits": lapsed.amount,
                    "period_end": lapsed.period_end,
                });
                let event = WebhookEvent::new(EventType::SubscriptionLapsed, data, now);
                insert_event(&txn, &event).await?;
            }
            txn.commit().await?;
            lapses.extend(lapsed);
        }
        Ok(lapses)
    }

    async fn audit(&self) -> Result<Vec<AccountAudit>, StoreError> {
        self.audit_accounts().await
    }

    async fn overdue_reservations(
        &self,
        cutoff: chrono::DateTime<Utc>,
    ) -> Result<crate::store::Overdue, StoreError> {
        let pending: Vec<(i64, i64)> = call::Entity::find()
            .select_only()
            .column(call::Column::ChargedSubscription)
            .column(call::Column::ChargedTopup)
            .filter(call::Column::Status.eq(CallStatus::Pending.as_str()))
            .filter(call::Column::CreatedAt.lt(cutoff))
            .into_tuple()
            .all(&self.db)
            .await?;
        let mut overdue = crate::store::Overdue::default();
        for (subscription, topup) in pending {
            overdue.calls += 1;
            overdue.credits += i128::from(subscription) + i128::from(topup);
        }
        let held = self.mode.held_before(cutoff);
        overdue.calls += held.calls;
        overdue.credits += held.credits;
        Ok(overdue)
    }

    async fn ready(&self) -> Result<(), StoreError> {
        // Calls are refused (503) under a lease that could not be renewed in time: on a
        // database server, the renewals are the writes a full disk or a lost primary stops.
        self.lease.for_reservation()?;
        if self.committer.halted() {
            return Err(StoreError::msg(
                "a ledger flush (fsync) failed: the committer refuses every write until the \
                 gateway restarts",
            ));
        }
        // A store that cannot be reached makes the pool wait for its connect time-out: answer
        // within a few seconds either way.
        let probe = async {
            sea_orm::ConnectionTrait::execute_unprepared(&self.db, "SELECT 1").await?;
            if self.sqlite_file.is_some() {
                self.write_probe().await?;
            }
            Ok::<(), sea_orm::DbErr>(())
        };
        match tokio::time::timeout(READY_WITHIN, probe).await {
            Ok(probed) => probed.map_err(Into::into),
            Err(_) => Err(StoreError::msg(format!(
                "the database did not answer within {:?}",
                READY_WITHIN
            ))),
        }
    }
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_store_whose_committer_a_failed_flush_stopped_is_not_ready() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!(
            "sqlite://{}?mode=rwc",
            dir.path().join("ledger.db").display()
        );
        let store = SeaOrmStore::connect(&url).await.unwrap();
        store.ready().await.unwrap();
        store.committer.halt();
        let refused = store.ready().await.unwrap_err();
        assert!(refused.to_string().contains("flush"), "{refused}");
    }
}
