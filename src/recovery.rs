//! Recovery of reservations that no call will ever finish: the gateway process was killed, or
//! the database was unreachable when the call tried to settle or refund.
//!
//! Every call is bounded ([`RefundOnUpstreamErrorLayer::upstream_bound`]), so a reservation still
//! `pending` well after that bound belongs to no live call, on this gateway or any other sharing
//! the database. [`recover_stale_reservations`] refunds those, each through
//! [`Ledger::refund`], whose status guard makes it safe to run on several instances at once: a
//! reservation is refunded by exactly one of them.
//!
//! [`RefundOnUpstreamErrorLayer::upstream_bound`]: crate::RefundOnUpstreamErrorLayer::upstream_bound

use std::time::Duration;

use chrono::Utc;

use crate::store::{CallFailure, CallId, Ledger, StoreError};

/// How many stale reservations one pass looks at.
const BATCH: u64 = 500;

/// Refunds every reservation still `pending` that was made more than `older_than` ago. Returns
/// the calls this pass refunded (not those another instance refunded first).
pub async fn recover_stale_reservations(
    ledger: &dyn Ledger,
    older_than: Duration,
) -> Result<Vec<CallId>, StoreError> {
    let age = chrono::Duration::from_std(older_than)
        .map_err(|_| StoreError::msg("recovery age out of range"))?;
    let cutoff = Utc::now() - age;
    let failure = CallFailure {
        upstream_status: None,
        error: format!(
            "recovered: still pending {}s after it was reserved (the gateway stopped mid-call or \
             could not reach the database)",
            older_than.as_secs()
        ),
    };
    let mut refunded = Vec::new();
    loop {
        let stale = ledger.stale_reservations(cutoff, BATCH).await?;
        let batch_len = stale.len() as u64;
        for call in stale {
            if ledger.refund(call, &failure).await? {
                refunded.push(call);
            }
        }
        if batch_len < BATCH {
            return Ok(refunded);
        }
    }
}
