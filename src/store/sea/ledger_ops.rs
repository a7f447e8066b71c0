//! The ledger's writes, applied a batch at a time inside one write transaction that the caller
//! opens and commits (group commit; a batch may hold a single write). A batch costs the same
//! handful of statements whatever its size:
//!
//! 1. lock the entries that its settles and refunds finish (`SELECT ... FOR UPDATE`, id order);
//! 2. lock the accounts that its reservations and refunds touch (id order, so two gateway
//!    instances never wait on each other in a cycle);
//! 3. read which of its callers' keys are still active: revocation is checked here, in the
//!    transaction that reserves, so a key answered from the auth cache cannot spend once revoked;
//! 4. decide every write in queue order, in memory, against the locked rows — the same
//!    decisions the in-memory model makes, so nobody else can change what they rest on;
//! 5. write: one `INSERT` for the new `pending` entries, one `UPDATE ... WHERE status =
//!    'pending'` for the finished ones, one `UPDATE` for the accounts' net changes, each
//!    checked to touch exactly the rows it must (and the `CHECK (bucket >= 0)` constraints
//!    behind the accounts' guard).
//!
//! Nothing here commits or rolls back. On an error the caller rolls the whole transaction back,
//! so no partial batch is ever written.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use sea_orm::sea_query::{CaseStatement, Expr, ExprTrait};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DbBackend, EntityTrait, QueryFilter, QueryOrder, QuerySelect,
    Set, Statement,
};

use super::entity::{account, api_key, call};
use super::unknown_account;
use crate::credits::{Balance, Credits, Split};
use crate::protocol::Protocol;
use crate::store::{
    AccountId, CallFailure, CallId, CallStatus, CallSuccess, Caller, ChargeRequest, Reservation,
    ReserveError, StoreError,
};

/// A [`ChargeRequest`] that can wait in a queue.
#[derive(Debug, Clone)]
pub(super) struct OwnedCharge {
    pub(super) caller: Caller,
    pub(super) protocol: Protocol,
    pub(super) model: String,
    pub(super) price: Credits,
}

impl From<ChargeRequest<'_>> for OwnedCharge {
    fn from(request: ChargeRequest<'_>) -> OwnedCharge {
        OwnedCharge {
            caller: request.caller,
            protocol: request.protocol,
            model: request.model.to_owned(),
            price: request.price,
        }
    }
}

/// One ledger write waiting for its batch.
#[derive(Debug)]
pub(super) enum Write {
    Reserve(OwnedCharge),
    Settle(CallId, CallSuccess),
    Refund(CallId, CallFailure),
}

/// What one write came to, once its batch is written (and, for the caller to hear it,
/// committed).
#[derive(Debug)]
pub(super) enum Outcome {
    Reserved(Result<Reservation, ReserveError>),
    /// A settle or refund: `true` if it finished a `pending` entry.
    Finished(bool),
}

/// Applies `writes` in order inside `txn`; see the module documentation.
pub(super) async fn apply_in<C: ConnectionTrait>(
    txn: &C,
    writes: &[&Write],
) -> Result<Vec<Outcome>, StoreError> {
    let finishing = writes.iter().filter_map(|write| match write {
        Write::Settle(call, _) | Write::Refund(call, _) => Some(call.0),
        Write::Reserve(_) => None,
    });
    let mut entries = lock_entries(txn, finishing.collect()).await?;

    let mut touched: BTreeSet<i64> = writes
        .iter()
        .filter_map(|write| match write {
            Write::Reserve(charge) => Some(charge.caller.account.0),
            _ => None,
        })
        .collect();
    touched.extend(entries.values().map(|entry| entry.account));
    let mut plan = Plan {
        accounts: lock_accounts(txn, touched).await?,
        ..Plan::default()
    };

    let keys = writes.iter().filter_map(|write| match write {
        Write::Reserve(charge) => Some(charge.caller.key.0),
        _ => None,
    });
    let active_keys = active_keys(txn, keys.collect()).await?;

    let decisions: Vec<Decision> = writes
        .iter()
        .map(|write| plan.decide(write, &mut entries, &active_keys))
        .collect::<Result<_, _>>()?;

    let ids = insert_entries(txn, &plan.new_entries).await?;
    finish_entries(txn, &plan.finished).await?;
    write_accounts(txn, &plan.accounts).await?;

    Ok(decisions
        .into_iter()
        .map(|decision| match decision {
            Decision::Reserved(new) => {
                let entry = &plan.new_entries[new];
                Outcome::Reserved(Ok(Reservation {
                    call: CallId(ids[new]),
                    account: AccountId(entry.account),
                    taken: entry.taken,
                }))
            }
            Decision::Refused(error) => Outcome::Reserved(Err(error)),
            Decision::Finished(finished) => Outcome::Finished(finished),
        })
        .collect())
}

/// A locked account: its balance as this transaction sees it, and the change not yet written.
#[derive(Debug)]
struct Held {
    balance: Balance,
    change: Balance,
}

impl Held {
    fn take(&mut self, split: Split) {
        self.balance.subscription.0 -= split.subscription.0;
        self.balance.topup.0 -= split.topup.0;
        self.change.subscription.0 -= split.subscription.0;
        self.change.topup.0 -= split.topup.0;
    }

    fn give_back(&mut self, split: Split) {
        self.balance.subscription.0 += split.subscription.0;
        self.balance.topup.0 += split.topup.0;
        self.change.subscription.0 += split.subscription.0;
        self.change.topup.0 += split.topup.0;
    }
}

/// A locked call-log entry that a settle or refund may finish.
#[derive(Debug)]
struct Entry {
    account: i64,
    pending: bool,
    taken: Split,
}

/// A `pending` entry to insert.
#[derive(Debug)]
struct NewEntry<'a> {
    account: i64,
    charge: &'a OwnedCharge,
    taken: Split,
}

/// How a finished entry ends.
#[derive(Debug)]
enum Finish<'a> {
    Settled(&'a CallSuccess),
    Refunded(&'a CallFailure),
}

/// The batch's decisions so far and the writes they call for.
#[derive(Debug, Default)]
struct Plan<'a> {
    accounts: BTreeMap<i64, Held>,
    new_entries: Vec<NewEntry<'a>>,
    finished: Vec<(i64, Finish<'a>)>,
}

enum Decision {
    /// Index into [`Plan::new_entries`].
    Reserved(usize),
    Refused(ReserveError),
    Finished(bool),
}

impl<'a> Plan<'a> {
    fn decide(
        &mut self,
        write: &'a Write,
        entries: &mut BTreeMap<i64, Entry>,
        active_keys: &BTreeSet<i64>,
    ) -> Result<Decision, StoreError> {
        Ok(match write {
            Write::Reserve(charge) => self.reserve(charge, active_keys),
            Write::Settle(call, success) => match entries.get_mut(&call.0) {
                Some(entry) if entry.pending => {
                    entry.pending = false;
                    self.finished.push((call.0, Finish::Settled(success)));
                    Decision::Finished(true)
                }
                _ => Decision::Finished(false),
            },
            Write::Refund(call, failure) => match entries.get_mut(&call.0) {
                Some(entry) if entry.pending => {
                    let held = self
                        .accounts
                        .get_mut(&entry.account)
                        .ok_or_else(|| unknown_account(AccountId(entry.account)))?;
                    held.give_back(entry.taken);
                    entry.pending = false;
                    self.finished.push((call.0, Finish::Refunded(failure)));
                    Decision::Finished(true)
                }
                _ => Decision::Finished(false),
            },
        })
    }

    fn reserve(&mut self, charge: &'a OwnedCharge, active_keys: &BTreeSet<i64>) -> Decision {
        let account = charge.caller.account;
        if !active_keys.contains(&charge.caller.key.0) {
            return Decision::Refused(ReserveError::KeyRevoked);
        }
        let Some(held) = self.accounts.get_mut(&account.0) else {
            return Decision::Refused(unknown_account(account).into());
        };
        let Some(taken) = held.balance.split_charge(charge.price) else {
            return Decision::Refused(ReserveError::InsufficientCredits);
        };
        held.take(taken);
        self.new_entries.push(NewEntry {
            account: account.0,
            charge,
            taken,
        });
        Decision::Reserved(self.new_entries.len() - 1)
    }
}

async fn lock_entries<C: ConnectionTrait>(
    txn: &C,
    ids: BTreeSet<i64>,
) -> Result<BTreeMap<i64, Entry>, StoreError> {
    if ids.is_empty() {
        return Ok(BTreeMap::new());
    }
    let rows: Vec<(i64, i64, String, i64, i64)> = call::Entity::find()
        .select_only()
        .columns([
            call::Column::Id,
            call::Column::AccountId,
            call::Column::Status,
            call::Column::ChargedSubscription,
            call::Column::ChargedTopup,
        ])
        .filter(call::Column::Id.is_in(ids))
        .order_by_asc(call::Column::Id)
        .lock_exclusive()
        .into_tuple()
        .all(txn)
        .await?;
    Ok(rows
        .into_iter()
        .map(|(id, account, status, subscription, topup)| {
            let entry = Entry {
                account,
                pending: status == CallStatus::Pending.as_str(),
                taken: Split {
                    subscription: Credits(subscription),
                    topup: Credits(topup),
                },
            };
            (id, entry)
        })
        .collect())
}

async fn lock_accounts<C: ConnectionTrait>(
    txn: &C,
    ids: BTreeSet<i64>,
) -> Result<BTreeMap<i64, Held>, StoreError> {
    if ids.is_empty() {
        return Ok(BTreeMap::new());
    }
    let rows: Vec<(i64, i64, i64)> = account::Entity::find()
        .select_only()
        .columns([
            account::Column::Id,
            account::Column::SubscriptionCredits,
            account::Column::TopupCredits,
        ])
        .filter(account::Column::Id.is_in(ids))
        .order_by_asc(account::Column::Id)
        .lock_exclusive()
        .into_tuple()
        .all(txn)
        .await?;
    Ok(rows
        .into_iter()
        .map(|(id, subscription, topup)| {
            let held = Held {
                balance: Balance {
                    subscription: Credits(subscription),
                    topup: Credits(topup),
                },
                change: Balance::default(),
            };
            (id, held)
        })
        .collect())
}

async fn active_keys<C: ConnectionTrait>(
    txn: &C,
    ids: BTreeSet<i64>,
) -> Result<BTreeSet<i64>, StoreError> {
    if ids.is_empty() {
        return Ok(BTreeSet::new());
    }
    let active: Vec<i64> = api_key::Entity::find()
        .select_only()
        .column(api_key::Column::Id)
        .filter(api_key::Column::Id.is_in(ids))
        .filter(api_key::Column::RevokedAt.is_null())
        .into_tuple()
        .all(txn)
        .await?;
    Ok(active.into_iter().collect())
}

/// Inserts the new `pending` entries and returns their ids, in order.
async fn insert_entries<C: ConnectionTrait>(
    txn: &C,
    entries: &[NewEntry<'_>],
) -> Result<Vec<i64>, StoreError> {
    if entries.is_empty() {
        return Ok(Vec::new());
    }
    let now = Utc::now();
    let row = |entry: &NewEntry<'_>, id: Option<i64>| call::ActiveModel {
        id: id.map_or(sea_orm::NotSet, Set),
        account_id: Set(entry.account),
        key_id: Set(entry.charge.caller.key.0),
        protocol: Set(entry.charge.protocol.as_str().to_owned()),
        model: Set(entry.charge.model.clone()),
        price: Set(entry.charge.price.0),
        charged_subscription: Set(entry.taken.subscription.0),
        charged_topup: Set(entry.taken.topup.0),
        status: Set(CallStatus::Pending.as_str().to_owned()),
        upstream_status: Set(None),
        upstream_channel: Set(None),
        upstream_error: Set(None),
        input_tokens: Set(None),
        output_tokens: Set(None),
        created_at: Set(now),
        finished_at: Set(None),
    };
    let Some(ids) = new_ids(txn, entries.len()).await? else {
        // No way to know a multi-row insert's ids here: one insert per entry.
        let mut ids = Vec::with_capacity(entries.len());
        for entry in entries {
            let inserted = call::Entity::insert(row(entry, None)).exec(txn).await?;
            ids.push(inserted.last_insert_id);
        }
        return Ok(ids);
    };
    let rows = entries
        .iter()
        .zip(&ids)
        .map(|(entry, id)| row(entry, Some(*id)));
    let inserted = call::Entity::insert_many(rows)
        .exec_without_returning(txn)
        .await?;
    if inserted != entries.len() as u64 {
        return Err(StoreError::msg(format!(
            "inserted {inserted} of {} call-log entries",
            entries.len()
        )));
    }
    Ok(ids)
}

/// `count` ids for new entries, taken before they are inserted, where the database allows it:
/// PostgreSQL hands out sequence values (never reused, whoever else inserts); SQLite is read
/// under the write lock this transaction holds since `BEGIN IMMEDIATE`, so nobody else can
/// insert until it commits. `None` on MySQL, whose auto-increment values are not reserved
/// ahead.
async fn new_ids<C: ConnectionTrait>(
    txn: &C,
    count: usize,
) -> Result<Option<Vec<i64>>, StoreError> {
    let count = i64::try_from(count).map_err(|_| StoreError::msg("batch too large"))?;
    let backend = txn.get_database_backend();
    Ok(Some(match backend {
        DbBackend::Postgres => {
            let sql = "SELECT nextval(pg_get_serial_sequence('mg_calls', 'id')) \
                       FROM generate_series(1, $1::bigint)";
            let rows = txn
                .query_all_raw(Statement::from_sql_and_values(backend, sql, [count.into()]))
                .await?;
            let ids = rows
                .iter()
                .map(|row| row.try_get_by_index::<i64>(0))
                .collect::<Result<Vec<_>, _>>()?;
            if ids.len() as i64 != count {
                return Err(StoreError::msg("the sequence gave too few ids"));
            }
            ids
        }
        DbBackend::Sqlite => {
            // With AUTOINCREMENT, `sqlite_sequence` remembers ids above today's largest.
            let sql = "SELECT MAX(top) FROM (SELECT MAX(id) AS top FROM mg_calls \
                       UNION ALL SELECT seq FROM sqlite_sequence WHERE name = 'mg_calls')";
            let row = txn
                .query_one_raw(Statement::from_string(backend, sql))
                .await?;
            let top: Option<i64> = match row {
                Some(row) => row.try_get_by_index(0)?,
                None => None,
            };
            let first = top.unwrap_or(0) + 1;
            (first..first + count).collect()
        }
        _ => return Ok(None),
    }))
}

/// The value a finished entry gets in one column, or `None` to keep what it has.
type FinishValue = fn(&Finish<'_>) -> Option<Expr>;

/// Finishes the settled and refunded entries with one `UPDATE`, each row's values chosen by
/// its id; guarded by `status = 'pending'` and checked to change every one of them.
async fn finish_entries<C: ConnectionTrait>(
    txn: &C,
    finished: &[(i64, Finish<'_>)],
) -> Result<(), StoreError> {
    if finished.is_empty() {
        return Ok(());
    }
    let now: DateTime<Utc> = Utc::now();
    let mut update = call::Entity::update_many()
        .col_expr(call::Column::FinishedAt, Expr::value(now))
        .filter(call::Column::Id.is_in(finished.iter().map(|(id, _)| *id)))
        .filter(call::Column::Status.eq(CallStatus::Pending.as_str()));
    let columns: [(call::Column, FinishValue); 6] = [
        (call::Column::Status, |finish| {
            Some(Expr::value(match finish {
                Finish::Settled(_) => CallStatus::Ok.as_str(),
                Finish::Refunded(_) => CallStatus::Refunded.as_str(),
            }))
        }),
        (call::Column::UpstreamStatus, |finish| {
            Some(Expr::value(match finish {
                Finish::Settled(success) => Some(i32::from(success.upstream_status)),
                Finish::Refunded(failure) => failure.upstream_status.map(i32::from),
            }))
        }),
        (call::Column::UpstreamChannel, |finish| match finish {
            Finish::Settled(success) => Some(Expr::value(success.channel.clone())),
            Finish::Refunded(_) => None,
        }),
        (call::Column::UpstreamError, |finish| match finish {
            Finish::Settled(_) => None,
            Finish::Refunded(failure) => Some(Expr::value(failure.error.clone())),
        }),
        (call::Column::InputTokens, |finish| match finish {
            Finish::Settled(success) => Some(Expr::value(success.usage.input_tokens)),
            Finish::Refunded(_) => None,
        }),
        (call::Column::OutputTokens, |finish| match finish {
            Finish::Settled(success) => Some(Expr::value(success.usage.output_tokens)),
            Finish::Refunded(_) => None,
        }),
    ];
    for (column, value) in columns {
        let mut case = CaseStatement::new();
        let mut arms = 0;
        for (id, finish) in finished {
            if let Some(value) = value(finish) {
                case = case.case(call::Column::Id.eq(*id), value);
                arms += 1;
            }
        }
        if arms > 0 {
            update = update.col_expr(column, case.finally(Expr::col(column)).into());
        }
    }
    let changed = update.exec(txn).await?.rows_affected;
    if changed != finished.len() as u64 {
        // Unreachable while the row locks hold; refuse rather than guess.
        return Err(StoreError::msg(format!(
            "finished {changed} of {} locked pending entries; batch refused",
            finished.len()
        )));
    }
    Ok(())
}

/// Writes each locked account's net change with one `UPDATE`, guarded so that no bucket goes
/// negative; it must change every account it names, or the transaction is rolled back.
async fn write_accounts<C: ConnectionTrait>(
    txn: &C,
    accounts: &BTreeMap<i64, Held>,
) -> Result<(), StoreError> {
    let changed: Vec<(i64, Balance)> = accounts
        .iter()
        .filter(|(_, held)| held.change != Balance::default())
        .map(|(id, held)| (*id, held.change))
        .collect();
    if changed.is_empty() {
        return Ok(());
    }
    let delta = |bucket: fn(&Balance) -> Credits| -> Expr {
        changed
            .iter()
            .fold(CaseStatement::new(), |case, (id, change)| {
                case.case(account::Column::Id.eq(*id), bucket(change).0)
            })
            .finally(0)
            .into()
    };
    let sub = Expr::col(account::Column::SubscriptionCredits).add(delta(|b| b.subscription));
    let top = Expr::col(account::Column::TopupCredits).add(delta(|b| b.topup));
    let written = account::Entity::update_many()
        .col_expr(account::Column::SubscriptionCredits, sub.clone())
        .col_expr(account::Column::TopupCredits, top.clone())
        .filter(account::Column::Id.is_in(changed.iter().map(|(id, _)| *id)))
        .filter(sub.gte(0))
        .filter(top.gte(0))
        .exec(txn)
        .await?
        .rows_affected;
    if written != changed.len() as u64 {
        // Unreachable while the row locks hold; refuse rather than over-spend.
        return Err(StoreError::msg(format!(
            "wrote {written} of {} locked accounts; batch refused",
            changed.len()
        )));
    }
    Ok(())
}
