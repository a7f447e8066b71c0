//! The writer of endings: the task beside an instance's escrow that bills and refunds its
//! held calls (the key reader is in `reserve`).

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement};
use tokio::sync::mpsc;

use super::rows::escrow_row;
use super::state::{EndJob, Ending, Escrow, MAX_BATCH, PotKey};
use crate::credits::{Balance, Credits, Split};
use crate::events::EventType;
use crate::store::DeliveryStatus;
use crate::store::rules::holds;
use crate::store::rules::settle::{Beyond, decide_settle};
use crate::store::sea::commit::batch::{Finish, shortfall_event};
use crate::store::sea::held::HeldCall;
use crate::store::{AccountId, CallId, CallStatus, CallSuccess, LeaseId, StoreError};

/// The writer of endings: each batch inserts its entries, finished, and debits the escrow
/// rows of its settles, in one transaction.
pub(super) async fn write_endings(
    escrow: std::sync::Weak<Escrow>,
    mut queue: mpsc::Receiver<EndJob>,
) {
    let mut jobs = Vec::with_capacity(MAX_BATCH);
    while queue.recv_many(&mut jobs, MAX_BATCH).await > 0 {
        let Some(escrow) = escrow.upgrade() else {
            return;
        };
        let answers = match write_batch(&escrow, &jobs).await {
            Ok(answers) => answers.into_iter().map(Ok).collect(),
            Err(error) => {
                let message = error.to_string();
                jobs.iter()
                    .map(|_| Err(StoreError::msg(message.clone())))
                    .collect::<Vec<_>>()
            }
        };
        for (job, answer) in jobs.drain(..).zip(answers) {
            let _ = job.answer.send(answer);
        }
    }
}

/// The escrow pot a held call was held against.
pub(super) fn pot_of(held: &HeldCall) -> PotKey {
    PotKey::new(held.charge.instance.unwrap_or(LeaseId(0)), held.account)
}

/// How one held call ends in a batch.
pub(super) struct Decided<'a> {
    /// Its job's index in the batch.
    job: usize,
    call: CallId,
    held: HeldCall,
    finish: Finish<'a>,
}

impl Decided<'_> {
    /// Its escrow pot.
    fn pot(&self) -> PotKey {
        pot_of(&self.held)
    }

    /// Whether it debits its escrow row (a settle billed from it).
    fn debits(&self) -> bool {
        matches!(self.finish, Finish::Settled(..))
    }
}

pub(super) async fn write_batch(escrow: &Escrow, jobs: &[EndJob]) -> Result<Vec<bool>, StoreError> {
    let _writer = escrow.writer.lock().await;
    let mut answers = vec![false; jobs.len()];
    // The jobs still to write, by index, and the rows read again after a failed guard.
    let mut pending: Vec<usize> = (0..jobs.len()).collect();
    let mut rows_read: HashMap<PotKey, Balance> = HashMap::new();
    while !pending.is_empty() {
        // The connection first (the pool checks it answers): a database out of reach fails
        // here, before any settle is claimed, and its calls are refused unbilled.
        let mut connection = (escrow.db.get_postgres_connection_pool())
            .acquire()
            .await
            .map_err(|error| StoreError::Database(Box::new(error)))?;
        // A pooled connection the server no longer answers on (cut, or the server silent)
        // fails here, before any settle is claimed for a statement that could not go out.
        sea_orm::sqlx::Connection::ping(&mut *connection)
            .await
            .map_err(|error| StoreError::Database(Box::new(error)))?;
        // A settle whose caller gave up on it while it waited (for the writer, a connection,
        // or a batch before it) is not written: its caller refunds it (see `SettleClaim`). The
        // others are claimed here, just before the one statement that writes and commits them.
        pending.retain(|&job| match &jobs[job].ending {
            Ending::Settle(success) => success.claim.claim(),
            Ending::Refund(_) => true,
        });
        let (decided, debits) = decide(escrow, jobs, &pending, &rows_read);
        let tell_shortfalls =
            (escrow.events.alerting()).is_some_and(|alerting| alerting.shortfalls);
        let written = write_sql(&mut connection, &decided, &debits, tell_shortfalls).await;
        drop(connection);
        let short = match written {
            Ok(short) => short,
            Err(error) => {
                // The statement may have committed with its reply lost, this time or in an
                // earlier batch whose callers now retry (then this one failed on their ids).
                let Ok(written) = written_entries(&escrow.db, &decided).await else {
                    return Err(error);
                };
                if written.is_empty() {
                    // Nothing was written, for certain: the claims go back.
                    for decided in &decided {
                        if let Finish::Settled(success, _) | Finish::CreditsGone(success) =
                            &decided.finish
                        {
                            success.claim.release();
                        }
                    }
                    return Err(error);
                }
                pending = finish_written(escrow, jobs, &decided, &written, &mut answers).await?;
                rows_read.clear();
                continue;
            }
        };
        {
            let mut state = escrow.state();
            // What was written: every row debited and the entries of its calls, and every
            // unbilled ending.
            for (pot_key, debited) in &debits {
                if short.contains(pot_key) {
                    continue;
                }
                let pot = state.pots.entry(*pot_key).or_default();
                let before = rows_read.remove(pot_key).unwrap_or(pot.row);
                pot.row = before.minus(*debited);
            }
            for (pot_key, row) in rows_read.drain() {
                state.pots.entry(pot_key).or_default().row = row;
            }
            pending.clear();
            for decided in &decided {
                if decided.debits() && short.contains(&decided.pot()) {
                    pending.push(decided.job);
                    continue;
                }
                if state.calls.remove(&decided.call).is_some() {
                    let pot = state.pots.entry(decided.pot()).or_default();
                    pot.held = holds::release(pot.held, decided.held.taken);
                }
                answers[decided.job] =
                    matches!(decided.finish, Finish::Settled(..) | Finish::Refunded(_));
            }
            debug_assert!(
                state.sums_agree(),
                "what a pot holds is not the sum of its held calls"
            );
        }
        // Rows short of their debits (a lapse took their credits): read again and decide
        // their settles once more.
        for pot in short {
            let stored = escrow_row(&escrow.db, pot).await?;
            rows_read.insert(pot, stored);
        }
    }
    Ok(answers)
}

/// Settles and refunds whose entries are already written (`written`: call id to status), as
/// a batch whose reply was lost wrote them: each is answered by whether its entry is what it
/// asked for, no longer held, and its escrow row is read again (the lost batch debited it).
/// Returns the jobs left to write.
pub(super) async fn finish_written(
    escrow: &Escrow,
    jobs: &[EndJob],
    decided: &[Decided<'_>],
    written: &HashMap<i64, String>,
    answers: &mut [bool],
) -> Result<Vec<usize>, StoreError> {
    let mut pending = Vec::new();
    let mut pots = Vec::new();
    {
        let mut state = escrow.state();
        for decided in decided {
            let Some(status) = written.get(&decided.call.0) else {
                pending.push(decided.job);
                continue;
            };
            let asked = match jobs[decided.job].ending {
                Ending::Settle(_) => CallStatus::Ok,
                Ending::Refund(_) => CallStatus::Refunded,
            };
            answers[decided.job] = status == asked.as_str();
            if state.calls.remove(&decided.call).is_some() {
                let pot = state.pots.entry(decided.pot()).or_default();
                pot.held = holds::release(pot.held, decided.held.taken);
            }
            pots.push(decided.pot());
        }
        debug_assert!(
            state.sums_agree(),
            "what a pot holds is not the sum of its held calls"
        );
    }
    pots.sort_unstable();
    pots.dedup();
    for pot in pots {
        let row = escrow_row(&escrow.db, pot).await?;
        escrow.state().pots.entry(pot).or_default().row = row;
    }
    Ok(pending)
}

/// Which of a batch's calls have an entry already, and its status.
pub(super) async fn written_entries(
    db: &DatabaseConnection,
    decided: &[Decided<'_>],
) -> Result<HashMap<i64, String>, StoreError> {
    let list = decided
        .iter()
        .map(|decided| decided.call.0.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let rows = db
        .query_all_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            "SELECT id, status FROM mg_calls WHERE id = ANY($1::bigint[])",
            [format!("{{{list}}}").into()],
        ))
        .await?;
    rows.iter()
        .map(|row| Ok((row.try_get_by_index(0)?, row.try_get_by_index(1)?)))
        .collect()
}

/// Writes a decided batch in one statement, so one round trip and one transaction, its text
/// the same whatever the batch's size (its rows passed as arrays), so that each connection
/// prepares it once: each escrow row's debit, guarded by its buckets, and the entries, finished,
/// of the settles on the rows debited and of every unbilled ending. Returns the pots
/// found short: neither they nor the entries of their settles were written.
pub(super) async fn write_sql(
    connection: &mut sea_orm::sqlx::PgConnection,
    decided: &[Decided<'_>],
    debits: &HashMap<PotKey, Split>,
    tell_shortfalls: bool,
) -> Result<Vec<PotKey>, StoreError> {
    use sea_orm::sqlx;
    if decided.is_empty() {
        return Ok(Vec::new());
    }
    let (mut leases, mut accounts, mut subscription, mut topup) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (pot, debit) in debits {
        leases.push(pot.lease.0);
        accounts.push(pot.account.0);
        subscription.push(debit.subscription.0);
        topup.push(debit.topup.0);
    }
    let now = Utc::now();
    let mut rows = Entries::default();
    let mut told = Told::default();
    for decided in decided {
        rows.push(decided, now);
        if tell_shortfalls {
            told.push(decided, now);
        }
    }
    let (debited_leases, debited_accounts, inserted): (Option<Vec<i64>>, Option<Vec<i64>>, i64) =
        sqlx::query_as(
            "WITH debited AS ( \
               UPDATE mg_escrows e SET subscription_credits = e.subscription_credits - v.s, \
               topup_credits = e.topup_credits - v.t \
               FROM unnest($1::bigint[], $2::bigint[], $3::bigint[], $4::bigint[]) \
               AS v(l, a, s, t) \
               WHERE e.instance_id = v.l AND e.account_id = v.a \
               AND e.subscription_credits >= v.s AND e.topup_credits >= v.t \
               RETURNING e.instance_id, e.account_id \
             ), entered AS ( \
               INSERT INTO mg_calls (id, account_id, key_id, protocol, model, price, \
               charged_subscription, charged_topup, status, upstream_status, upstream_channel, \
               upstream_error, input_tokens, output_tokens, created_at, finished_at, \
               request_id, instance_id, requested_model, cache_read_tokens, \
               cache_write_tokens, cache_write_1h_tokens, reasoning_tokens, shortfall, \
               usage_rejected, dropped_tools, upstream_protocol, cost, credit_value, raw_usage, \
               usage_estimated, service_tier) \
               SELECT u.id, u.account_id, u.key_id, u.protocol, u.model, u.price, u.cs, u.ct, \
               u.status, u.upstream_status, u.upstream_channel, u.upstream_error, \
               u.input_tokens, u.output_tokens, u.created_at, u.finished_at, u.request_id, \
               u.instance_id, u.requested_model, u.cache_read, u.cache_write, u.cache_write_1h, \
               u.reasoning, u.shortfall, u.usage_rejected, u.dropped_tools, u.upstream_protocol, \
               u.cost, u.credit_value, u.raw_usage, u.usage_estimated, u.service_tier \
               FROM unnest($5::bigint[], $6::bigint[], $7::bigint[], $8::text[], $9::text[], \
               $10::bigint[], $11::bigint[], $12::bigint[], $13::text[], $14::int[], \
               $15::text[], $16::text[], $17::bigint[], $18::bigint[], $19::timestamptz[], \
               $20::timestamptz[], $21::text[], $22::bigint[], $23::bool[], $24::text[], \
               $25::bigint[], $26::bigint[], $27::bigint[], $28::bigint[], $29::bigint[], \
               $30::bool[], $31::text[], $32::text[], $33::bigint[], $34::bigint[], \
               $35::text[], $36::bool[], $37::text[]) \
               AS u(id, account_id, key_id, protocol, model, price, cs, ct, status, \
               upstream_status, upstream_channel, upstream_error, input_tokens, \
               output_tokens, created_at, finished_at, request_id, instance_id, debits, \
               requested_model, cache_read, cache_write, cache_write_1h, reasoning, shortfall, \
               usage_rejected, dropped_tools, upstream_protocol, cost, credit_value, raw_usage, \
               usage_estimated, service_tier) \
               WHERE NOT u.debits OR EXISTS (SELECT 1 FROM debited d \
                 WHERE d.instance_id = u.instance_id AND d.account_id = u.account_id) \
               RETURNING id \
             ), told AS ( \
               INSERT INTO mg_webhook_events (event_id, event_type, body, status, attempts, \
               next_attempt_at, created_at) \
               SELECT w.event_id, $42, w.body, $43, 0, $41, $41 \
               FROM unnest($38::bigint[], $39::text[], $40::text[]) AS w(call, event_id, body) \
               WHERE w.call IN (SELECT id FROM entered) \
             ) \
             SELECT (SELECT array_agg(instance_id) FROM debited), \
             (SELECT array_agg(account_id) FROM debited), (SELECT count(*) FROM entered)",
        )
        .bind(leases)
        .bind(accounts)
        .bind(subscription)
        .bind(topup)
        .bind(rows.id)
        .bind(rows.account)
        .bind(rows.key)
        .bind(rows.protocol)
        .bind(rows.model)
        .bind(rows.price)
        .bind(rows.subscription)
        .bind(rows.topup)
        .bind(rows.status)
        .bind(rows.upstream_status)
        .bind(rows.channel)
        .bind(rows.error)
        .bind(rows.input_tokens)
        .bind(rows.output_tokens)
        .bind(rows.created_at)
        .bind(rows.finished_at)
        .bind(rows.request_id)
        .bind(rows.instance)
        .bind(rows.debits)
        .bind(rows.requested_model)
        .bind(rows.cache_read_tokens)
        .bind(rows.cache_write_tokens)
        .bind(rows.cache_write_1h_tokens)
        .bind(rows.reasoning_tokens)
        .bind(rows.shortfall)
        .bind(rows.usage_rejected)
        .bind(rows.dropped_tools)
        .bind(rows.upstream_protocol)
        .bind(rows.cost)
        .bind(rows.credit_value)
        .bind(rows.raw_usage)
        .bind(rows.usage_estimated)
        .bind(rows.service_tier)
        .bind(told.call)
        .bind(told.event_id)
        .bind(told.body)
        .bind(now)
        .bind(EventType::CallShortfall.as_str())
        .bind(DeliveryStatus::Pending.as_str())
        .fetch_one(connection)
        .await
        .map_err(|error| StoreError::Database(Box::new(error)))?;
    let debited: Vec<PotKey> = debited_leases
        .unwrap_or_default()
        .into_iter()
        .zip(debited_accounts.unwrap_or_default())
        .map(|(lease, account)| PotKey::new(LeaseId(lease), AccountId(account)))
        .collect();
    let short: Vec<PotKey> = debits
        .keys()
        .filter(|pot| !debited.contains(pot))
        .copied()
        .collect();
    let expected = decided
        .iter()
        .filter(|decided| !(decided.debits() && short.contains(&decided.pot())))
        .count();
    if usize::try_from(inserted).ok() != Some(expected) {
        return Err(StoreError::msg(format!(
            "inserted {inserted} of {expected} call-log entries"
        )));
    }
    Ok(short)
}

/// The `call.shortfall` events of a batch's settles that charged less than they cost, column
/// by column: each written in the statement that writes its entry, if it does.
#[derive(Default)]
struct Told {
    call: Vec<i64>,
    event_id: Vec<String>,
    body: Vec<String>,
}

impl Told {
    fn push(&mut self, decided: &Decided<'_>, now: DateTime<Utc>) {
        let Finish::Settled(success, settled) = &decided.finish else {
            return;
        };
        let caller = decided.held.charge.caller;
        if let Some(event) = shortfall_event(caller, decided.call, success, settled, now) {
            self.call.push(decided.call.0);
            self.body.push(event.body());
            self.event_id.push(event.id);
        }
    }
}

/// A batch's entries, column by column.
#[derive(Default)]
pub(super) struct Entries {
    id: Vec<i64>,
    account: Vec<i64>,
    key: Vec<i64>,
    protocol: Vec<&'static str>,
    model: Vec<String>,
    price: Vec<i64>,
    subscription: Vec<i64>,
    topup: Vec<i64>,
    status: Vec<&'static str>,
    upstream_status: Vec<Option<i32>>,
    channel: Vec<Option<String>>,
    error: Vec<Option<String>>,
    input_tokens: Vec<Option<i64>>,
    output_tokens: Vec<Option<i64>>,
    created_at: Vec<DateTime<Utc>>,
    finished_at: Vec<DateTime<Utc>>,
    request_id: Vec<Option<String>>,
    instance: Vec<Option<i64>>,
    debits: Vec<bool>,
    requested_model: Vec<Option<String>>,
    cache_read_tokens: Vec<Option<i64>>,
    cache_write_tokens: Vec<Option<i64>>,
    cache_write_1h_tokens: Vec<Option<i64>>,
    reasoning_tokens: Vec<Option<i64>>,
    shortfall: Vec<i64>,
    usage_rejected: Vec<bool>,
    dropped_tools: Vec<Option<String>>,
    upstream_protocol: Vec<Option<&'static str>>,
    cost: Vec<Option<i64>>,
    credit_value: Vec<Option<i64>>,
    raw_usage: Vec<Option<String>>,
    usage_estimated: Vec<bool>,
    service_tier: Vec<Option<&'static str>>,
}
impl Entries {
    fn push(&mut self, decided: &Decided<'_>, now: DateTime<Utc>) {
        let held = &decided.held;
        let billed = decided.finish.billed();
        self.id.push(decided.call.0);
        self.account.push(held.account.0);
        self.key.push(held.charge.caller.key.0);
        self.protocol.push(held.charge.protocol.as_str());
        self.model.push(held.charge.model.clone());

        // A billed call's entry records what it was charged; the others', what they held.
        let (charged, shortfall) = decided
            .finish
            .charged()
            .unwrap_or((held.taken, Credits::ZERO));
        // The entry's price is what it holds or was charged (`charged_adds_up_to_price`).
        self.price.push(charged.total().0);
        self.subscription.push(charged.subscription.0);
        self.topup.push(charged.topup.0);
        self.shortfall.push(shortfall.0);
        self.usage_rejected
            .push(billed.is_some_and(|success| success.usage_rejected));
        let usage = billed.map(|success| success.usage);
        self.cache_read_tokens
            .push(usage.and_then(|usage| usage.cache_read_tokens));
        self.cache_write_tokens
            .push(usage.and_then(|usage| usage.cache_write_tokens));
        self.cache_write_1h_tokens
            .push(usage.and_then(|usage| usage.cache_write_1h_tokens));
        self.reasoning_tokens
            .push(usage.and_then(|usage| usage.reasoning_tokens));
        self.status.push(decided.finish.status().as_str());
        self.upstream_status.push(decided.finish.upstream_status());
        self.channel
            .push(billed.and_then(|success| success.channel.clone()));
        self.error.push(decided.finish.error().map(str::to_owned));
        self.input_tokens
            .push(billed.and_then(|success| success.usage.input_tokens));
        self.output_tokens
            .push(billed.and_then(|success| success.usage.output_tokens));
        self.created_at.push(held.reserved_at);
        self.finished_at.push(now);
        self.request_id.push(held.charge.request_id.clone());
        self.instance
            .push(held.charge.instance.map(|lease| lease.0));
        self.debits.push(decided.debits());
        self.requested_model
            .push(held.charge.requested_model.clone());
        self.dropped_tools.push(held.charge.dropped_tools.clone());
        self.upstream_protocol.push(
            billed
                .and_then(|success| success.upstream_protocol)
                .map(crate::protocol::Protocol::as_str),
        );
        let (cost, credit_value, tier, estimated) =
            billed.map_or((None, None, None, false), CallSuccess::economics_columns);
        self.cost.push(cost);
        self.credit_value.push(credit_value);
        self.raw_usage
            .push(billed.and_then(|success| success.raw_usage.clone()));
        self.usage_estimated.push(estimated);
        self.service_tier.push(tier);
    }
}

/// Decides each job in order against the rows in memory (or as read again): a settle whose
/// credits are still in the escrow debits it; one whose credits are gone ends unbilled.
pub(super) fn decide<'a>(
    escrow: &Escrow,
    jobs: &'a [EndJob],
    pending: &[usize],
    rows_read: &HashMap<PotKey, Balance>,
) -> (Vec<Decided<'a>>, HashMap<PotKey, Split>) {
    let state = escrow.state();
    let mut rows: HashMap<PotKey, Balance> = HashMap::new();
    let mut debits: HashMap<PotKey, Split> = HashMap::new();
    // What the calls decided so far in this batch held: debited from `rows` already, still in
    // their pots' `held` until the batch is written.
    let mut ended: HashMap<PotKey, Split> = HashMap::new();
    let now = Utc::now();
    let mut decided: Vec<Decided<'a>> = Vec::with_capacity(pending.len());
    for &index in pending {
        let job = &jobs[index];
        let Some(held) = state.calls.get(&job.call) else {
            continue;
        };
        if decided.iter().any(|done| done.call == job.call) {
            continue;
        }
        let pot_key = pot_of(held);
        let finish = match &job.ending {
            Ending::Refund(failure) => Finish::Refunded(failure),
            Ending::Settle(success) => {
                let row = rows.entry(pot_key).or_insert_with(|| {
                    rows_read
                        .get(&pot_key)
                        .copied()
                        .or_else(|| state.pots.get(&pot_key).map(|pot| pot.row))
                        .unwrap_or_default()
                });
                // Beyond its hold, a call may take what the pot holds free of every hold still
                // standing (its own too: it is in the row).
                let pot = state.pots.get(&pot_key);
                let standing = pot
                    .map_or_else(Balance::default, |pot| pot.held)
                    .minus(ended.get(&pot_key).copied().unwrap_or_default());
                let ends_at = pot.and_then(|pot| pot.period_end);
                let free = row.free_of(standing).spendable(ends_at, now);
                // A key with a spending limit reserves in the database, never here.
                let beyond = Beyond::of(success.beyond_reservation, None);
                let settled = decide_settle(held.taken, success.cost, free, beyond);
                let ending = ended.entry(pot_key).or_default();
                *ending = ending.plus(held.taken);
                match holds::debit_held(*row, settled.charged) {
                    Some(after) => {
                        *row = after;
                        let debit = debits.entry(pot_key).or_default();
                        *debit = debit.plus(settled.charged);
                        Finish::Settled(success, settled)
                    }
                    None => Finish::CreditsGone(success),
                }
            }
        };
        decided.push(Decided {
            job: index,
            call: job.call,
            held: held.clone(),
            finish,
        });
    }
    (decided, debits)
}
