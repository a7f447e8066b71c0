//! [`RefundOnUpstreamErrorLayer`]: the configuration.

use std::sync::Arc;
use std::time::Duration;

use tower_layer::Layer;

use super::DEFAULT_UPSTREAM_BOUND;
use super::service::RefundOnUpstreamError;
use crate::store::Ledger;

/// Configuration of [`RefundOnUpstreamError`]: the ledger that settles and refunds, and the
/// longest an upstream may take.
#[derive(Clone)]
#[must_use]
pub struct RefundOnUpstreamErrorLayer {
    ledger: Arc<dyn Ledger>,
    upstream_bound: Duration,
}

impl RefundOnUpstreamErrorLayer {
    /// Settles and refunds through `ledger`.
    pub fn new(ledger: Arc<dyn Ledger>) -> RefundOnUpstreamErrorLayer {
        RefundOnUpstreamErrorLayer {
            ledger,
            upstream_bound: DEFAULT_UPSTREAM_BOUND,
        }
    }

    /// Refunds a call whose upstream has not answered within `bound`. With every call bounded,
    /// a reservation still `pending` after the bound plus a margin belongs to no live call,
    /// which is what makes [`recover_stale_reservations`](crate::recover_stale_reservations)
    /// safe beside running gateways.
    pub fn upstream_bound(mut self, bound: Duration) -> RefundOnUpstreamErrorLayer {
        self.upstream_bound = bound;
        self
    }
}

impl std::fmt::Debug for RefundOnUpstreamErrorLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RefundOnUpstreamErrorLayer")
            .finish_non_exhaustive()
    }
}

impl<U> Layer<U> for RefundOnUpstreamErrorLayer {
    type Service = RefundOnUpstreamError<U>;

    fn layer(&self, upstream: U) -> RefundOnUpstreamError<U> {
        RefundOnUpstreamError::new(upstream, self.ledger.clone(), self.upstream_bound)
    }
}
