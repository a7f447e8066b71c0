//! Writing a call's outcome (settle or refund) until the ledger takes it.
//!
//! A call's outcome is written on the call's own task, with a few quick retries, all within
//! the ledger time-out: the client is answered within a bound even when the database is out of
//! reach ([`within`]). What could not be written then is not left to recovery, which never
//! touches a live gateway's reservations: it goes on, on a task of its own, until the ledger
//! takes it ([`finish_later`]), so no credit stays held once the database answers again.
//! Settles and refunds are guarded by the entry's status, so a write that landed but whose
//! answer was lost is harmless to repeat.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::traits::Ledger;
use super::types::{CallFailure, CallStatus, CallSuccess, StoreError};
use crate::call::CallId;

/// How long a call waits for the ledger, by default, for any one thing it asks of it (a key's
/// lookup, a reservation, a settle or refund with its retries), before it answers `503`: a
/// database that stops answering costs a client this long, not minutes.
pub const DEFAULT_LEDGER_TIMEOUT: Duration = Duration::from_secs(5);

/// Pauses between the retries of a write on the call's own task; the last repeats until the
/// ledger time-out, so an outage shorter than it costs a call a delay, not its reply.
const QUICK_PAUSES: [Duration; 3] = [
    Duration::from_millis(50),
    Duration::from_millis(250),
    Duration::from_secs(1),
];

/// Pauses between the attempts of a write finished later; the last repeats. An outcome lands at
/// most this long (plus one write) after the database answers again.
const LATER_PAUSES: [Duration; 4] = [
    Duration::from_millis(250),
    Duration::from_secs(1),
    Duration::from_secs(2),
    Duration::from_secs(5),
];

/// How long one attempt of a write finished later may take: a connection the database went
/// silent on is given up on and another attempt made.
const LATER_ATTEMPT: Duration = Duration::from_secs(30);

/// An outcome to write.
// Most calls settle: boxing the settle would allocate on every call to save space on refunds.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub(crate) enum Outcome {
    /// The call is billed.
    Settle(CallSuccess),
    /// The call's credits go back.
    Refund(CallFailure),
}

impl Outcome {
    /// The status the entry takes when this is written.
    pub(crate) fn status(&self) -> CallStatus {
        match self {
            Outcome::Settle(_) => CallStatus::Ok,
            Outcome::Refund(_) => CallStatus::Refunded,
        }
    }

    /// One attempt: `true` if this wrote it, `false` if the entry was no longer `pending`.
    pub(crate) async fn write(
        &self,
        ledger: &dyn Ledger,
        call: CallId,
    ) -> Result<bool, StoreError> {
        match self {
            Outcome::Settle(success) => ledger.settle(call, success.clone()).await,
            Outcome::Refund(failure) => ledger.refund(call, failure).await,
        }
    }
}

/// Runs `attempt` until it answers, with quick pauses between failures (the last repeating),
/// all within `timeout` (an attempt still running then is dropped); `None` if it never
/// answered in time. Retrying to the end matters: a settle whose commit landed with its answer
/// lost (the connection cut) is found billed by the next attempt once the database is back,
/// and its reply handed out, rather than its client answered `503` for a billed call.
pub(crate) async fn within<T, F, Fut>(
    timeout: Duration,
    call: CallId,
    what: &str,
    mut attempt: F,
) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StoreError>>,
{
    let tries = async {
        let last = QUICK_PAUSES[QUICK_PAUSES.len() - 1];
        let mut pauses = QUICK_PAUSES.into_iter().chain(std::iter::repeat(last));
        loop {
            match attempt().await {
                Ok(answer) => return answer,
                Err(error) => {
                    tracing::error!(call = call.0, %error, "{what} failed");
                    tokio::time::sleep(pauses.next().unwrap_or(last)).await;
                }
            }
        }
    };
    let answer = crate::time_limit::within(timeout, tries).await.ok();
    if answer.is_none() {
        tracing::error!(
            call = call.0,
            "{what} could not be written within {timeout:?}; it goes on in the background"
        );
    }
    answer
}

/// Writes `outcome` on a task of its own, however long the ledger takes to answer again, then
/// calls `ended` with the status the entry ended in: `outcome`'s if this wrote it, or what the
/// entry says if someone else finished it first (an earlier attempt whose answer was lost, or
/// recovery after this gateway lost its lease). Outcomes waiting to be written are counted in
/// the `mg_outcomes_unwritten` gauge.
pub(crate) fn finish_later(
    ledger: Arc<dyn Ledger>,
    call: CallId,
    outcome: Outcome,
    ended: impl FnOnce(Option<CallStatus>) + Send + 'static,
) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        tracing::error!(
            call = call.0,
            "no runtime to finish a call; its lease's end will refund it"
        );
        return;
    };
    crate::telemetry::unwritten(1.0);
    runtime.spawn(async move {
        let status = until_written(&*ledger, call, &outcome).await;
        crate::telemetry::unwritten(-1.0);
        ended(status);
    });
}

/// Writes `outcome` until the ledger answers; the status the entry ended in.
async fn until_written(ledger: &dyn Ledger, call: CallId, outcome: &Outcome) -> Option<CallStatus> {
    let mut pauses = LATER_PAUSES.iter().copied();
    let mut pause = || {
        pauses
            .next()
            .unwrap_or(LATER_PAUSES[LATER_PAUSES.len() - 1])
    };
    let mut failures = 0_u32;
    let written = loop {
        match tokio::time::timeout(LATER_ATTEMPT, outcome.write(ledger, call)).await {
            Ok(Ok(written)) => break written,
            Ok(Err(error)) => {
                failures += 1;
                // Once a minute or so is enough for an operator to see it is still waiting.
                if failures.is_power_of_two() || failures.is_multiple_of(12) {
                    tracing::error!(call = call.0, %error, failures, "an outcome still waits to be written");
                }
            }
            Err(_) => failures += 1,
        }
        tokio::time::sleep(pause()).await;
    };
    if written {
        tracing::info!(
            call = call.0,
            status = outcome.status().as_str(),
            "an outcome that had waited is written"
        );
        return Some(outcome.status());
    }
    loop {
        match tokio::time::timeout(LATER_ATTEMPT, ledger.call_status(call)).await {
            Ok(Ok(status)) => return status,
            Ok(Err(_)) | Err(_) => tokio::time::sleep(pause()).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    /// A database out for 3 s (past the quick pauses) but back within the 5 s time-out: the
    /// write is retried until it answers, not given up after the quick pauses.
    #[tokio::test(start_paused = true)]
    async fn a_write_is_retried_until_the_time_out_not_only_the_quick_pauses() {
        let started = tokio::time::Instant::now();
        let attempts = AtomicU32::new(0);
        let answer = within(Duration::from_secs(5), CallId(1), "settle", || {
            attempts.fetch_add(1, Ordering::SeqCst);
            let back = started.elapsed() >= Duration::from_secs(3);
            async move {
                if back {
                    Ok("billed")
                } else {
                    Err(StoreError::msg("connection refused"))
                }
            }
        })
        .await;
        assert_eq!(answer, Some("billed"));
        // 0, 0.05, 0.3, 1.3, 2.3 s refused; 3.3 s answered.
        assert_eq!(attempts.load(Ordering::SeqCst), 6);
    }

    /// An outage longer than the time-out: `None` at the time-out, not later.
    #[tokio::test(start_paused = true)]
    async fn a_write_that_never_answers_gives_up_at_the_time_out() {
        let started = tokio::time::Instant::now();
        let answer: Option<()> = within(Duration::from_secs(5), CallId(1), "settle", || async {
            Err(StoreError::msg("connection refused"))
        })
        .await;
        assert_eq!(answer, None);
        assert_eq!(started.elapsed(), Duration::from_secs(5));
    }
}
