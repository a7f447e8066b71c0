//! [`RefundOnUpstreamErrorLayer`]: the configuration.

use std::sync::Arc;
use std::time::Duration;

use tower_layer::Layer;

use super::DEFAULT_UPSTREAM_BOUND;
use super::body::StreamLimits;
use super::service::RefundOnUpstreamError;
use crate::catalogue::{
    DEFAULT_MAX_EVENT_BYTES, DEFAULT_STREAM_DEADLINE, DEFAULT_STREAM_IDLE_TIMEOUT,
};
use crate::store::{DEFAULT_LEDGER_TIMEOUT, Ledger};

/// Configuration of [`RefundOnUpstreamError`]: the ledger that settles and refunds, and the
/// longest an upstream may take.
#[derive(Debug, Clone)]
#[must_use]
pub struct RefundOnUpstreamErrorLayer {
    ledger: Arc<dyn Ledger>,
    upstream_bound: Duration,
    stream_limits: StreamLimits,
    ledger_timeout: Duration,
    beyond_reservation: bool,
    usage_cost: bool,
}

impl RefundOnUpstreamErrorLayer {
    /// Settles and refunds through `ledger`.
    pub fn new(ledger: Arc<dyn Ledger>) -> RefundOnUpstreamErrorLayer {
        RefundOnUpstreamErrorLayer {
            ledger,
            upstream_bound: DEFAULT_UPSTREAM_BOUND,
            stream_limits: StreamLimits {
                deadline: DEFAULT_STREAM_DEADLINE,
                idle: DEFAULT_STREAM_IDLE_TIMEOUT,
                max_event: DEFAULT_MAX_EVENT_BYTES,
            },
            ledger_timeout: DEFAULT_LEDGER_TIMEOUT,
            beyond_reservation: false,
            usage_cost: false,
        }
    }

    /// Whether a complete reply's usage object says what the call was charged (`cost`, in
    /// credits, and `cost_details`: the credits and the tokens by kind as billed). Off by
    /// default.
    pub fn usage_cost(mut self, on: bool) -> RefundOnUpstreamErrorLayer {
        self.usage_cost = on;
        self
    }

    /// Whether a token-priced call whose cost exceeds its reservation (its ceiling) may be
    /// charged more than the reservation: what its account can pay, within what its key's
    /// spending limit still allows (see [`CallSuccess::beyond_reservation`]). Off by default:
    /// the ceiling is the most a call costs, and what it cost beyond is the entry's
    /// `shortfall`, the operator's loss.
    ///
    /// [`CallSuccess::beyond_reservation`]: crate::store::CallSuccess::beyond_reservation
    pub fn charge_beyond_reservation(mut self, allowed: bool) -> RefundOnUpstreamErrorLayer {
        self.beyond_reservation = allowed;
        self
    }

    /// How long a call waits for its settle or refund (quick retries included) before the
    /// client is answered `503` without a reply (default [`DEFAULT_LEDGER_TIMEOUT`]). The
    /// write is not given up: it goes on in the background until the ledger takes it, a settle
    /// whose reply was withheld as a refund.
    pub fn ledger_timeout(mut self, timeout: Duration) -> RefundOnUpstreamErrorLayer {
        self.ledger_timeout = timeout;
        self
    }

    /// Refunds a call whose upstream has not answered within `bound`. With every call bounded,
    /// a reservation still `pending` after the bound plus a margin belongs to no live call,
    /// which is what makes [`recover_stale_reservations`](crate::recovery::recover_stale_reservations)
    /// safe beside running gateways.
    pub fn upstream_bound(mut self, bound: Duration) -> RefundOnUpstreamErrorLayer {
        self.upstream_bound = bound;
        self
    }

    /// Ends a streamed reply that has lasted `deadline` since its first event: the provider
    /// failed, so the call is refunded and the client gets an error event. Recovery must not
    /// take back a reservation younger than this (see [`crate::recovery::recovery_age`]).
    pub fn stream_deadline(mut self, deadline: Duration) -> RefundOnUpstreamErrorLayer {
        self.stream_limits.deadline = deadline;
        self
    }

    /// Ends a streamed reply, as a failure, whose provider sends an event larger than `bytes`
    /// (or holds that many unfinished), so that memory stays bounded.
    pub fn stream_max_event_bytes(mut self, bytes: usize) -> RefundOnUpstreamErrorLayer {
        self.stream_limits.max_event = bytes;
        self
    }

    /// Ends a streamed reply whose provider sent no complete event for `idle`, as a failure.
    pub fn stream_idle_timeout(mut self, idle: Duration) -> RefundOnUpstreamErrorLayer {
        self.stream_limits.idle = idle;
        self
    }
}

impl<U> Layer<U> for RefundOnUpstreamErrorLayer {
    type Service = RefundOnUpstreamError<U>;

    fn layer(&self, upstream: U) -> RefundOnUpstreamError<U> {
        RefundOnUpstreamError::configured(
            upstream,
            self.ledger.clone(),
            self.upstream_bound,
            self.stream_limits,
            self.ledger_timeout,
            self.beyond_reservation,
        )
        .with_usage_cost(self.usage_cost)
    }
}
