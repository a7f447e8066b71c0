//! What the gateway counts, for operators: calls and their outcomes, credits, refusals, upstream
//! attempts and latency, breakers, pending reservations, ledger batches.
//!
//! The crate records through the [`metrics`](https://docs.rs/metrics) facade (feature
//! `metrics`), so nothing is kept until a recorder is installed; [`install_prometheus`]
//! installs one whose [`render`](PrometheusHandle::render) is the Prometheus text format that
//! `GET /metrics` serves. Without the feature every recording here compiles to nothing.
//!
//! | Metric | Kind | Labels |
//! |---|---|---|
//! | `mg_calls_total` | counter | `model`, `protocol`, `outcome` (`ok`, `refunded`) |
//! | `mg_credits_charged_total`, `mg_credits_refunded_total` | counter | `model` |
//! | `mg_refusals_total` | counter | `status`, `reason` (every `{"detail"}` answer) |
//! | `mg_idempotent_replays_total` | counter | (replies given again, uncharged, for a retry with the same `Idempotency-Key`) |
//! | `mg_upstream_attempts_total` | counter | `upstream`, `outcome` (`ok`, `retryable`, `rejected`) |
//! | `mg_upstream_seconds` | histogram | `upstream` |
//! | `mg_breaker_open` | gauge | `upstream` (1 open, 0 closed) |
//! | `mg_pending_reservations` | gauge | (this process's reservations not yet settled or refunded) |
//! | `mg_overdue_reservations` | gauge | (reservations still not ended past the longest a call can take, as the upkeep last counted them; should be 0) |
//! | `mg_outcomes_unwritten` | gauge | (settles and refunds this process goes on trying while the database is out of reach) |
//! | `mg_ledger_batch_writes` | histogram | (writes per ledger transaction) |
//! | `mg_ledger_batch_seconds` | histogram | (one batch: statements and commit) |

#[cfg(feature = "metrics")]
pub use metrics_exporter_prometheus::PrometheusHandle;

/// Whether to record at all: until a recorder is installed, recording would only build labels
/// to throw away, on every call.
#[cfg(feature = "metrics")]
static RECORDING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

#[cfg(feature = "metrics")]
fn recording() -> bool {
    RECORDING.load(std::sync::atomic::Ordering::Relaxed)
}

/// Records to whatever `metrics` recorder the embedder installed itself (one it installed with
/// [`install_prometheus`] records without this).
#[cfg(feature = "metrics")]
pub fn record_to_installed_recorder() {
    RECORDING.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Installs a Prometheus recorder for this process (once) and returns its handle, whose
/// `render()` is the text `GET /metrics` answers.
#[cfg(feature = "metrics")]
pub fn install_prometheus() -> Result<PrometheusHandle, metrics_exporter_prometheus::BuildError> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    let seconds = [
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
        60.0,
    ];
    let writes = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0];
    PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &seconds)?
        .set_buckets_for_metric(Matcher::Full("mg_ledger_batch_writes".into()), &writes)?
        .install_recorder()
        .inspect(|_| record_to_installed_recorder())
}

/// A charged call ended: settled (`ok`, `credits` charged) or refunded (`credits` returned).
pub(crate) fn call_ended(model: &str, protocol: &'static str, settled: bool, credits: i64) {
    #[cfg(feature = "metrics")]
    if recording() {
        let outcome = if settled { "ok" } else { "refunded" };
        metrics::counter!(
            "mg_calls_total",
            "model" => model.to_owned(),
            "protocol" => protocol,
            "outcome" => outcome
        )
        .increment(1);
        let credits = u64::try_from(credits).unwrap_or(0);
        let name = if settled {
            "mg_credits_charged_total"
        } else {
            "mg_credits_refunded_total"
        };
        metrics::counter!(name, "model" => model.to_owned()).increment(credits);
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (model, protocol, settled, credits);
}

/// A billed call cost more than it was charged (`mg_credits_shortfall_total`, the credits), and
/// whether its provider's usage report failed the checks (`mg_usage_rejected_total`).
pub(crate) fn charged_short(model: &str, shortfall: i64, usage_rejected: bool) {
    #[cfg(feature = "metrics")]
    if recording() {
        if shortfall > 0 {
            let credits = u64::try_from(shortfall).unwrap_or(0);
            metrics::counter!("mg_credits_shortfall_total", "model" => model.to_owned())
                .increment(credits);
        }
        if usage_rejected {
            metrics::counter!("mg_usage_rejected_total", "model" => model.to_owned()).increment(1);
        }
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (model, shortfall, usage_rejected);
}

/// A request was refused (or a call failed) with `status`, for `reason`.
pub(crate) fn refused(status: u16, reason: &'static str) {
    #[cfg(feature = "metrics")]
    if recording() {
        metrics::counter!("mg_refusals_total", "status" => status.to_string(), "reason" => reason)
            .increment(1);
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (status, reason);
}

/// A billed call's reply was given again for a retry with its idempotency key.
pub(crate) fn replayed() {
    #[cfg(feature = "metrics")]
    if recording() {
        metrics::counter!("mg_idempotent_replays_total").increment(1);
    }
}

/// One attempt on one upstream ended with `outcome` after `seconds`.
pub(crate) fn upstream_attempt(upstream: &str, outcome: &'static str, seconds: f64) {
    #[cfg(feature = "metrics")]
    if recording() {
        metrics::counter!(
            "mg_upstream_attempts_total",
            "upstream" => upstream.to_owned(),
            "outcome" => outcome
        )
        .increment(1);
        metrics::histogram!("mg_upstream_seconds", "upstream" => upstream.to_owned())
            .record(seconds);
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (upstream, outcome, seconds);
}

/// Whether an upstream's breaker is open now.
pub(crate) fn breaker(upstream: &str, open: bool) {
    #[cfg(feature = "metrics")]
    if recording() {
        metrics::gauge!("mg_breaker_open", "upstream" => upstream.to_owned()).set(if open {
            1.0
        } else {
            0.0
        });
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (upstream, open);
}

/// A reservation was made (`+1`) or ended (`-1`) in this process.
pub(crate) fn pending(change: f64) {
    #[cfg(feature = "metrics")]
    if recording() {
        metrics::gauge!("mg_pending_reservations").increment(change);
    }
    #[cfg(not(feature = "metrics"))]
    let _ = change;
}

/// How many reservations the upkeep last found overdue.
pub(crate) fn overdue(calls: u64) {
    #[cfg(feature = "metrics")]
    if recording() {
        metrics::gauge!("mg_overdue_reservations").set(calls as f64);
    }
    #[cfg(not(feature = "metrics"))]
    let _ = calls;
}

/// An outcome the ledger did not take in time is being written in the background (`+1`), or
/// was (`-1`).
pub(crate) fn unwritten(change: f64) {
    #[cfg(feature = "metrics")]
    if recording() {
        metrics::gauge!("mg_outcomes_unwritten").increment(change);
    }
    #[cfg(not(feature = "metrics"))]
    let _ = change;
}

/// A ledger batch of `writes` took `seconds` from being taken to being concluded.
pub(crate) fn ledger_batch(writes: usize, seconds: f64) {
    #[cfg(feature = "metrics")]
    if recording() {
        metrics::histogram!("mg_ledger_batch_writes").record(writes as f64);
        metrics::histogram!("mg_ledger_batch_seconds").record(seconds);
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (writes, seconds);
}
