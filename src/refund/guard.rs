//! [`UnsettledCall`]: a reservation that writes its outcome once, however the call ends.

use std::sync::Arc;
use std::time::Duration;

use super::CANCELLED_BEFORE_ANSWER;
use crate::call::AccessEntry;
use crate::catalogue::ModelRoute;
use crate::credits::Credits;
use crate::error::GatewayError;
use crate::pricing::Metered;
use crate::protocol::{Protocol, ServiceTier, TokenUsage};
pub(super) use crate::store::outcome::Outcome;
use crate::store::outcome::{finish_later, within};
use crate::store::rules;
use crate::store::{
    CallFailure, CallId, CallStatus, CallSuccess, Ledger, OperatorCost, SettleClaim,
};

/// How long a call whose ledger time-out ran out while a store was committing its settle waits
/// for that commit to fail for certain ([`SettleClaim::release`]) before it treats the call as
/// billed: a local file's commit ends in far less; a network database's unanswered one does not.
const CLAIM_GRACE: std::time::Duration = std::time::Duration::from_millis(250);

/// What a call's entry says when its settle could not be written in time: the client got `503`
/// and no reply, so the call is refunded once the database answers again.
pub const SETTLE_NOT_WRITTEN: &str = "the settle could not be written in time (the database was \
     out of reach); the reply was withheld and the call refunded";

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
    /// How long the call waits for the ledger before it answers `503` and the write goes on in
    /// the background.
    timeout: Duration,
    /// For a model priced by tokens: what a settle's cost is worked out from.
    metered: Option<Metered>,
    /// Whether a metered call may be charged beyond its reservation (the operator's choice).
    beyond_reservation: bool,
    /// The service tier the client asked for: what a report that names none was served at.
    asked_tier: Option<ServiceTier>,
    /// The usage the last settle was priced by (the tier and any estimate filled in).
    billed_usage: TokenUsage,
}

/// A call as the metrics and the log count it: its model, protocol, the credits it took and
/// when it was charged.
#[derive(Debug, Clone)]
pub(super) struct Meter {
    pub(super) model: Option<Arc<ModelRoute>>,
    pub(super) protocol: Protocol,
    pub(super) credits: i64,
    pub(super) charged_at: std::time::Instant,
    /// The request's access-log line, told how the call ended.
    pub(super) access: Option<AccessEntry>,
    /// What a settled call cost beyond what it was charged.
    pub(super) shortfall: i64,
    /// Whether its provider's usage report failed the checks.
    pub(super) usage_rejected: bool,
}

impl Meter {
    /// The call is no longer pending here: it ended as `status` (`None`: unknown, or not ended
    /// by anyone, which a guarded write that moved nothing rules out). The request's access
    /// line says so (a stream's end writes it); a debug line says it for the call alone.
    fn ended(&self, call: CallId, status: Option<CallStatus>) {
        crate::telemetry::pending(-1.0);
        let model = self
            .model
            .as_ref()
            .map_or("unknown", |model| model.name.as_str());
        let settled = match status {
            Some(CallStatus::Ok) => true,
            Some(CallStatus::Refunded) => false,
            Some(CallStatus::Pending) | None => {
                tracing::error!(call = call.0, ?status, "a call's end could not be read");
                return;
            }
        };
        crate::telemetry::call_ended(model, self.protocol.as_str(), settled, self.credits);
        if settled {
            crate::telemetry::charged_short(model, self.shortfall, self.usage_rejected);
        }
        if let Some(access) = &self.access {
            access.call_ended(call, settled, self.credits);
        }
        tracing::debug!(
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

impl UnsettledCall {
    pub(super) fn new(
        ledger: Arc<dyn Ledger>,
        call: CallId,
        meter: Meter,
        timeout: Duration,
    ) -> UnsettledCall {
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
            timeout,
            metered: None,
            beyond_reservation: false,
            asked_tier: None,
            billed_usage: TokenUsage::default(),
        }
    }

    /// The call asked for `tier` (see [`RoutedCall::asked_tier`](crate::call::RoutedCall::asked_tier)).
    pub(super) fn asked_tier(mut self, tier: Option<ServiceTier>) -> UnsettledCall {
        self.asked_tier = tier;
        self
    }

    /// The call is of a model priced by tokens: each settle is charged what its usage costs
    /// (see [`rules::usage::charge`]), not what the reservation holds; beyond the reservation only
    /// if `beyond_reservation`.
    pub(super) fn metered(
        mut self,
        metered: Option<Metered>,
        beyond_reservation: bool,
    ) -> UnsettledCall {
        self.metered = metered;
        self.beyond_reservation = beyond_reservation;
        self
    }

    /// Whether the call is of a model priced by tokens.
    pub(super) fn is_metered(&self) -> bool {
        self.metered.is_some()
    }

    /// What the call is charged: its reservation, or once settled, a metered call's cost.
    pub(super) fn credits(&self) -> i64 {
        self.meter.credits
    }

    /// `success` with its cost, for a metered call. What the call is reported charged (the
    /// response header, the metrics) is what the settle rule charges: the cost up to the
    /// reservation, unless the call may be charged beyond it.
    fn priced(&mut self, mut success: CallSuccess) -> CallSuccess {
        // A provider that says nothing of its tier served the one asked for.
        success.usage.service_tier = success.usage.service_tier.or(self.asked_tier);
        let mut priced_usage = success.usage;
        if let Some(metered) = &self.metered {
            let charge = rules::usage::charge(metered, &success.usage);
            priced_usage = charge.usage;
            success.usage.estimated = charge.usage.estimated;
            success.cost = Some(charge.cost);
            success.usage_rejected = charge.usage_rejected;
            success.beyond_reservation = self.beyond_reservation;
            // Beyond the reservation the settle may charge less than the cost (the account and
            // the key's limit decide): read back once settled (see `read_charged`).
            let charged = charge.cost.min(metered.reserved);
            self.meter.credits = charged.get();
            self.meter.shortfall = charge.cost.get() - charged.get();
            self.meter.usage_rejected = charge.usage_rejected;
        }
        // A report the gateway does not trust says nothing reliable of the provider's bill.
        success.operator_cost = if success.usage_rejected {
            None
        } else {
            self.operator_cost(success.channel.as_deref(), &priced_usage)
        };
        self.billed_usage = priced_usage;
        success
    }

    /// What the call is charged, in credits, if it ends with `usage` (a stream's usage so far):
    /// for a call priced by tokens, the settle rule's charge within the reservation (beyond
    /// it only when the operator allows, and then what the account can pay is the settle's to
    /// say); otherwise the reservation. With the usage as it is priced.
    pub(super) fn charge_if_ended(&self, usage: &TokenUsage) -> (i64, TokenUsage) {
        let mut usage = *usage;
        usage.service_tier = usage.service_tier.or(self.asked_tier);
        match &self.metered {
            Some(metered) => {
                let charge = rules::usage::charge(metered, &usage);
                let cost = if self.beyond_reservation {
                    charge.cost
                } else {
                    charge.cost.min(metered.reserved)
                };
                (cost.get(), charge.usage)
            }
            None => (self.meter.credits, usage),
        }
    }

    /// The usage the call was priced by, once settled: its tier, and the input estimated where
    /// the provider reported none.
    pub(super) fn billed_usage(&self) -> TokenUsage {
        self.billed_usage
    }

    /// What a call served by `channel` with `usage` cost the operator: at the channel's cost
    /// prices, when the catalogue gives them (and the value of a credit).
    fn operator_cost(&self, channel: Option<&str>, usage: &TokenUsage) -> Option<OperatorCost> {
        let model = self.meter.model.as_ref()?;
        let credit_value = model.credit_value?;
        let channel = channel?;
        let prices = model
            .channels
            .iter()
            .find(|served| served.upstream.name == channel)?
            .cost?;
        Some(OperatorCost {
            cost: prices.cost(usage),
            credit_value,
        })
    }

    /// Chooses what is written if the call is dropped before [`settle`](Self::settle) or
    /// [`refund`](Self::refund) finishes.
    pub(super) fn if_dropped(&mut self, outcome: Outcome) {
        self.if_dropped = match outcome {
            Outcome::Settle(success) => Outcome::Settle(self.priced(success)),
            refund @ Outcome::Refund(_) => refund,
        };
    }

    /// Settles. `Ok` once the call is billed; otherwise the reply must not be handed out, and
    /// the error says why: the ledger did not answer in time (`503`; the call is refunded in
    /// the background once it does), or the call was refunded meanwhile (`502`).
    pub(super) async fn settle(&mut self, success: CallSuccess) -> Result<(), GatewayError> {
        self.settle_then(success, Later::Refund).await
    }

    /// Settles a call whose content already reached its client (a stream that ended): if the
    /// ledger does not answer in time, the settle goes on in the background, since the client
    /// has what it pays for.
    pub(super) async fn settle_delivered(
        &mut self,
        success: CallSuccess,
    ) -> Result<(), GatewayError> {
        self.settle_then(success, Later::Settle).await
    }

    async fn settle_then(
        &mut self,
        success: CallSuccess,
        later: Later,
    ) -> Result<(), GatewayError> {
        let mut success = self.priced(success);
        // One decision between this settle's commit and this call giving up on it, shared by
        // every attempt (see `SettleClaim`).
        let claim = SettleClaim::default();
        success.claim = claim.clone();
        let if_late = match later {
            Later::Refund => Outcome::Refund(not_written()),
            Later::Settle => Outcome::Settle(success.clone()),
        };
        self.if_dropped = Outcome::Settle(success.clone());
        let (ledger, call) = (self.ledger.clone(), self.call);
        let settled = within(self.timeout, call, "settle", || {
            ledger.settle(call, success.clone())
        })
        .await;
        self.written = true;
        match settled {
            Some(true) => {
                if self.meter.shortfall > 0 && self.beyond_reservation {
                    // Beyond its reservation, what it was charged is the ledger's to say.
                    self.read_charged(success.cost).await;
                }
                self.meter.ended(call, Some(CallStatus::Ok));
                Ok(())
            }
            // Not `pending` any more: billed by an earlier attempt whose answer was lost, or
            // refunded meanwhile (by recovery, after this gateway lost its lease). Only a
            // billed call may have its reply.
            Some(false) => {
                match within(self.timeout, call, "read", || ledger.call_status(call)).await {
                    Some(status) => {
                        self.meter.ended(call, status);
                        if status == Some(CallStatus::Ok) {
                            return Ok(());
                        }
                        tracing::error!(
                            call = call.0,
                            ?status,
                            "the call was finished by someone else while its upstream answered \
                         (its lease ended?); its reply is withheld"
                        );
                        Err(GatewayError::UpstreamUnavailable)
                    }
                    None => {
                        // Finished, but how is unknown: a guarded write moves nothing and reads it.
                        self.finish_later(if_late);
                        Err(GatewayError::StoreUnavailable)
                    }
                }
            }
            // The store claimed the settle for a commit already on its way: the call is
            // billed, so the reply is handed out, and the settle goes on until it is written.
            None if matches!(later, Later::Refund) && !claim.abandon_within(CLAIM_GRACE).await => {
                tracing::warn!(
                    call = call.0,
                    "the ledger answered late, its commit under way; the reply is handed out and \
                     the settle finished in the background"
                );
                self.finish_later(Outcome::Settle(success));
                Ok(())
            }
            // Given up before any commit took it (a store that claims settles then writes it
            // never; one that does not claim may still, its answer lost: the refund then
            // finds it `ok` and moves nothing). A complete reply is withheld, so the call is
            // refunded once the ledger answers. A stream's content was delivered: its settle
            // goes on.
            None => {
                self.finish_later(if_late);
                Err(GatewayError::StoreUnavailable)
            }
        }
    }

    /// Reads what a settled call was charged, for one whose cost passed its reservation where
    /// that may be charged beyond it (the account and the key's limit decided how far).
    async fn read_charged(&mut self, cost: Option<Credits>) {
        let (ledger, call) = (self.ledger.clone(), self.call);
        if let Some(Some(charged)) =
            within(self.timeout, call, "read", || ledger.charged(call)).await
        {
            self.meter.credits = charged.get();
            self.meter.shortfall = cost.map_or(0, |cost| cost.get() - charged.get()).max(0);
        }
    }

    /// Refunds; `false` if the ledger did not answer in time (the refund goes on in the
    /// background until it does). A refund that finds its entry no longer `pending` is done:
    /// its credits are back, or were never to be.
    pub(super) async fn refund(&mut self, failure: CallFailure) -> bool {
        self.if_dropped = Outcome::Refund(failure.clone());
        let (ledger, call) = (self.ledger.clone(), self.call);
        let refunded = within(self.timeout, call, "refund", || {
            ledger.refund(call, &failure)
        })
        .await;
        self.written = true;
        match refunded {
            Some(true) => self.meter.ended(call, Some(CallStatus::Refunded)),
            // Finished by someone else: the background reads how, for the metrics.
            Some(false) | None => self.finish_later(Outcome::Refund(failure)),
        }
        refunded.is_some()
    }

    /// Hands `outcome` to a task that writes it however long the ledger takes.
    fn finish_later(&self, outcome: Outcome) {
        let meter = self.meter.clone();
        let call = self.call;
        finish_later(self.ledger.clone(), call, outcome, move |status| {
            meter.ended(call, status);
        });
    }
}

/// What a settle that the ledger did not take in time becomes.
#[derive(Debug, Clone, Copy)]
enum Later {
    /// The reply was withheld: refund.
    Refund,
    /// The content reached the client: settle.
    Settle,
}

fn not_written() -> CallFailure {
    CallFailure {
        upstream_status: None,
        error: SETTLE_NOT_WRITTEN.to_owned(),
    }
}

impl Drop for UnsettledCall {
    fn drop(&mut self) {
        if !self.written {
            self.finish_later(self.if_dropped.clone());
        }
    }
}
