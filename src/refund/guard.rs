//! [`UnsettledCall`]: a reservation that writes its outcome once, however the call ends.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::CANCELLED_BEFORE_ANSWER;
use crate::catalogue::ModelRoute;
use crate::error::GatewayError;
use crate::protocol::Protocol;
use crate::store::{CallFailure, CallId, CallStatus, CallSuccess, Ledger};

/// A reservation whose outcome is not written yet. If it is dropped unwritten (the request
/// future or the stream was dropped because the client went away or a time-out above gave up,
/// or a panic unwound through it), the outcome is still written, on a spawned task: by default
/// a refund; a settle once the call is to be billed whatever happens (the upstream answered, or
/// a stream's content reached the client). Settle and refund are guarded by the entry's status,
/// so writing twice (a drop during a write) changes nothing the second time.
pub(super) struct UnsettledCall {
    ledger: Arc<dyn Ledger>,
    pub(super) call: CallId,
    /// What the metrics say of this call when it ends.
    meter: Meter,
    /// What to write if this is dropped unwritten.
    if_dropped: Outcome,
    written: bool,
}

/// A call as the metrics and the log count it: its model, protocol, the credits it took and
/// when it was charged.
#[derive(Debug, Clone)]
pub(super) struct Meter {
    pub(super) model: Option<Arc<ModelRoute>>,
    pub(super) protocol: Protocol,
    pub(super) credits: i64,
    pub(super) charged_at: std::time::Instant,
}

impl Meter {
    /// The outcome was written: the call is no longer pending here. One log line per call,
    /// with what an operator looks for (the request's id is in the span).
    fn ended(&self, call: CallId, settled: bool) {
        let model = self
            .model
            .as_ref()
            .map_or("unknown", |model| model.name.as_str());
        crate::telemetry::call_ended(model, self.protocol, settled, self.credits);
        crate::telemetry::pending(-1.0);
        tracing::info!(
            call = call.0,
            model,
            protocol = self.protocol.as_str(),
            status = if settled {
                CallStatus::Ok
            } else {
                CallStatus::Refunded
            }
            .as_str(),
            credits = if settled { self.credits } else { 0 },
            duration_ms = self.charged_at.elapsed().as_millis() as u64,
            "call ended"
        );
    }
}

/// An outcome to write.
#[derive(Debug, Clone)]
pub(super) enum Outcome {
    Settle(CallSuccess),
    Refund(CallFailure),
}

impl UnsettledCall {
    pub(super) fn new(ledger: Arc<dyn Ledger>, call: CallId, meter: Meter) -> UnsettledCall {
        crate::telemetry::pending(1.0);
        UnsettledCall {
            ledger,
            call,
            meter,
            if_dropped: Outcome::Refund(CallFailure {
                upstream_status: None,
                error: CANCELLED_BEFORE_ANSWER.to_owned(),
            }),
            written: false,
        }
    }

    /// Chooses what is written if the call is dropped before [`settle`](Self::settle) or
    /// [`refund`](Self::refund) finishes.
    pub(super) fn if_dropped(&mut self, outcome: Outcome) {
        self.if_dropped = outcome;
    }

    /// Settles. `Ok` once the call is billed; otherwise the reply must not be handed out, and
    /// the error says why: the store stayed unreachable through every retry (the entry stays
    /// `pending` until recovery refunds it), or the call was refunded meanwhile.
    pub(super) async fn settle(&mut self, success: CallSuccess) -> Result<(), GatewayError> {
        self.if_dropped = Outcome::Settle(success.clone());
        let (ledger, call) = (self.ledger.clone(), self.call);
        let settled = with_retries(call, "settle", || ledger.settle(call, success.clone())).await;
        self.written = true;
        match settled {
            Some(true) => {
                self.meter.ended(self.call, true);
                Ok(())
            }
            // Not `pending` any more: billed by an earlier attempt whose answer was lost, or
            // refunded meanwhile (by recovery, if its age is shorter than this call lasted).
            // Only a billed call may have its reply.
            Some(false) => match with_retries(call, "read", || ledger.call_status(call)).await {
                Some(Some(CallStatus::Ok)) => Ok(()),
                Some(status) => {
                    tracing::error!(
                        call = call.0,
                        ?status,
                        "the call was finished by someone else while its upstream answered \
                         (a recovery age shorter than the call?); its reply is withheld"
                    );
                    Err(GatewayError::UpstreamUnavailable)
                }
                None => Err(GatewayError::StoreUnavailable),
            },
            None => Err(GatewayError::StoreUnavailable),
        }
    }

    /// Refunds; `false` if the store stayed unreachable through every retry. A refund that
    /// finds its entry no longer `pending` is done: its credits are back, or were never to be.
    pub(super) async fn refund(&mut self, failure: CallFailure) -> bool {
        self.if_dropped = Outcome::Refund(failure.clone());
        let (ledger, call) = (self.ledger.clone(), self.call);
        let refunded = with_retries(call, "refund", || ledger.refund(call, &failure)).await;
        self.written = true;
        if refunded == Some(true) {
            self.meter.ended(self.call, false);
        }
        refunded.is_some()
    }
}

impl Drop for UnsettledCall {
    fn drop(&mut self) {
        if self.written {
            return;
        }
        let (ledger, call, meter) = (self.ledger.clone(), self.call, self.meter.clone());
        let outcome = self.if_dropped.clone();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::error!(
                call = call.0,
                "no runtime to finish a dropped call; left for recovery"
            );
            return;
        };
        runtime.spawn(async move {
            let settling = matches!(outcome, Outcome::Settle(_));
            let written = match outcome {
                Outcome::Settle(success) => ledger.settle(call, success).await,
                Outcome::Refund(failure) => ledger.refund(call, &failure).await,
            };
            match written {
                Ok(true) => meter.ended(call, settling),
                Ok(false) => {}
                Err(error) => {
                    tracing::error!(call = call.0, %error, "finishing a dropped call failed; left for recovery");
                }
            }
        });
    }
}

/// Pauses between attempts to write an outcome while the store is unreachable (a dropped
/// connection is replaced by the pool within these).
const WRITE_RETRY_PAUSES: [Duration; 3] = [
    Duration::from_millis(50),
    Duration::from_millis(250),
    Duration::from_secs(1),
];

/// Runs a settle, a refund or a read until the store answers; `None` if it never does. Settles
/// and refunds are guarded by the entry's status, so repeating one whose first attempt did land
/// changes nothing. An entry whose write never lands stays `pending`, and recovery refunds it
/// later.
async fn with_retries<F, Fut, T>(call: CallId, what: &str, mut write: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, crate::StoreError>>,
{
    for pause in WRITE_RETRY_PAUSES.iter().map(Some).chain([None]) {
        match write().await {
            Ok(answer) => return Some(answer),
            Err(error) => {
                tracing::error!(call = call.0, %error, "{what} failed");
                match pause {
                    Some(pause) => tokio::time::sleep(*pause).await,
                    None => {
                        tracing::error!(call = call.0, "{what} given up after retries");
                        return None;
                    }
                }
            }
        }
    }
    None
}
