//! The audit of every account: its books against its balance.

use sea_orm::sea_query::Expr;
use sea_orm::{
    AccessMode, ColumnTrait, DbBackend, EntityTrait, IsolationLevel, QueryFilter, QueryOrder,
    QuerySelect, TransactionTrait,
};

use crate::credits::Bucket;
use crate::store::{AccountAudit, AccountId, CallStatus, StoreError, Sums};

use super::entity::{account, call, credit_grant, subscription_lapse};
use super::rows::{balance_of, escrowed, with_escrowed};
use super::store::SeaOrmStore;

impl SeaOrmStore {
    pub(super) async fn audit_accounts(&self) -> Result<Vec<AccountAudit>, StoreError> {
        // Every read from one snapshot: a call settled, or an escrow given back to its
        // account, between two of them would set one moment's books against another's
        // balance, and the audit would fail a ledger that holds. A SQLite transaction reads
        // one snapshot as it is (and takes no isolation level).
        let snapshot = match self.db.get_database_backend() {
            DbBackend::Sqlite => (None, None),
            _ => (
                Some(IsolationLevel::RepeatableRead),
                Some(AccessMode::ReadOnly),
            ),
        };
        let txn = self.db.begin_with_config(snapshot.0, snapshot.1).await?;
        let mut audits: Vec<AccountAudit> = account::Entity::find()
            .order_by_asc(account::Column::Id)
            .all(&txn)
            .await?
            .into_iter()
            .map(|row| AccountAudit {
                account: AccountId(row.id),
                balance: balance_of(&row),
                granted: Sums::default(),
                charged: Sums::default(),
                lapsed: 0,
                shortfall: 0,
            })
            .collect();
        let index = |audits: &[AccountAudit], id: i64| {
            audits.binary_search_by_key(&AccountId(id), |audit| audit.account)
        };
        // Escrowed credits are the account's (see `with_escrow`).
        for (account, escrowed) in escrowed(&txn, None).await? {
            let Ok(at) = index(&audits, account) else {
                return Err(StoreError::msg(format!(
                    "escrow for missing account {account}"
                )));
            };
            audits[at].balance = with_escrowed(audits[at].balance, escrowed);
        }

        // Sums of many 64-bit amounts may pass 64 bits (SQLite then fails, PostgreSQL cannot
        // cast back): each is summed as its high and low 32 bits, which fit for up to 2^31
        // rows, and put together here exactly. SUM widens to a decimal on some databases;
        // bring each half back to a 64-bit integer.
        let integer = match self.db.get_database_backend() {
            DbBackend::MySql => "SIGNED",
            _ => "BIGINT",
        };
        let sum = |column: &str, half: &str| {
            let part = match half {
                "high" => format!("({column} >> 32)"),
                _ => format!("({column} & 4294967295)"),
            };
            Expr::cust(format!("CAST(COALESCE(SUM({part}), 0) AS {integer})"))
        };
        let exact = |high: i64, low: i64| (i128::from(high) << 32) + i128::from(low);
        let grants: Vec<(i64, String, i64, i64)> = credit_grant::Entity::find()
            .select_only()
            .column(credit_grant::Column::AccountId)
            .column(credit_grant::Column::Bucket)
            .column_as(sum("amount", "high"), "high")
            .column_as(sum("amount", "low"), "low")
            .group_by(credit_grant::Column::AccountId)
            .group_by(credit_grant::Column::Bucket)
            .into_tuple()
            .all(&txn)
            .await?;
        for (account, bucket, high, low) in grants {
            let Ok(at) = index(&audits, account) else {
                return Err(StoreError::msg(format!(
                    "grant for missing account {account}"
                )));
            };
            match Bucket::parse(&bucket) {
                Some(Bucket::Subscription) => audits[at].granted.subscription = exact(high, low),
                Some(Bucket::Topup) => audits[at].granted.topup = exact(high, low),
                None => return Err(StoreError::msg(format!("unknown bucket {bucket}"))),
            }
        }

        let charges: Vec<(i64, i64, i64, i64, i64, i64, i64)> = call::Entity::find()
            .select_only()
            .column(call::Column::AccountId)
            .column_as(sum("charged_subscription", "high"), "subscription_high")
            .column_as(sum("charged_subscription", "low"), "subscription_low")
            .column_as(sum("charged_topup", "high"), "topup_high")
            .column_as(sum("charged_topup", "low"), "topup_low")
            .column_as(sum("shortfall", "high"), "shortfall_high")
            .column_as(sum("shortfall", "low"), "shortfall_low")
            .filter(
                call::Column::Status.is_in([CallStatus::Ok.as_str(), CallStatus::Pending.as_str()]),
            )
            .group_by(call::Column::AccountId)
            .into_tuple()
            .all(&txn)
            .await?;
        for (
            account,
            subscription_high,
            subscription_low,
            topup_high,
            topup_low,
            short_high,
            short_low,
        ) in charges
        {
            let Ok(at) = index(&audits, account) else {
                return Err(StoreError::msg(format!(
                    "call for missing account {account}"
                )));
            };
            audits[at].charged = Sums {
                subscription: exact(subscription_high, subscription_low),
                topup: exact(topup_high, topup_low),
            };
            audits[at].shortfall = exact(short_high, short_low);
        }
        let lapses: Vec<(i64, i64, i64)> = subscription_lapse::Entity::find()
            .select_only()
            .column(subscription_lapse::Column::AccountId)
            .column_as(sum("amount", "high"), "high")
            .column_as(sum("amount", "low"), "low")
            .group_by(subscription_lapse::Column::AccountId)
            .into_tuple()
            .all(&txn)
            .await?;
        for (account, high, low) in lapses {
            let Ok(at) = index(&audits, account) else {
                return Err(StoreError::msg(format!(
                    "lapse for missing account {account}"
                )));
            };
            audits[at].lapsed = exact(high, low);
        }
        txn.commit().await?;
        Ok(audits)
    }
}
