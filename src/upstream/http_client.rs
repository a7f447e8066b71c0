//! The HTTP upstream: the channels of the catalogue served now (see [`channels`](super::channels)),
//! one call tried across a model's channels by [`Failover`] (ascending priority, equals in
//! weighted random order; what moves on and what ends the call is said there), one attempt
//! sent by [`Channel::attempt`](super::channel::Channel), and the owner of a response a native
//! Responses upstream keeps recorded around it. A provider's 4xx about the request itself is
//! passed on to the client; a 429's `Retry-After` (seconds, milliseconds or an HTTP date) is
//! honoured within the call's deadline.
//!
//! A streamed call's wait for the answer and its first event is bounded here; the rest of the
//! stream is not: its deadline and idle time-out are kept by the layer that bills it
//! ([`RefundOnUpstreamError`](crate::RefundOnUpstreamError)), with one timer per stream.

use std::collections::HashMap;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{Request, Response};
use tower_service::Service;

use super::ResponseFuture;
use super::breaker::CircuitBreaker;
use super::channel::{Channel, ProviderResponseId};
use super::channels::{Channels, GENERATIONS, KeySource, build_channels, channel_for};
use super::failover::{self, Failover, attempt_order};
use crate::call::{AccountId, Caller, RoutedCall};
use crate::catalogue::{Catalogue, ModelChannel};
use crate::error::UpstreamError;
use crate::reply::UpstreamBody;
use crate::store::{EventOutbox, ResponseOwner, ResponseOwners};
/// Calls the providers named in the catalogue.
#[derive(Clone)]
pub struct HttpUpstream {
    /// The upstreams of the catalogue served now, then of the ones before it (see
    /// [`GENERATIONS`]); replaced whole by [`HttpUpstream::reload`].
    channels: Arc<ArcSwap<Vec<Arc<Channels>>>>,
    keys: KeySource,
    call_deadline: Duration,
    /// Where the owners of the responses native upstreams keep are recorded, if anywhere.
    owners: Option<Arc<dyn ResponseOwners>>,
    /// Where breakers opening and closing are recorded as webhook events, if anywhere.
    events: Option<Arc<dyn EventOutbox>>,
}

impl std::fmt::Debug for HttpUpstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let channels = self.current();
        let mut names: Vec<_> = channels.keys().collect();
        names.sort();
        f.debug_struct("HttpUpstream")
            .field("upstreams", &names)
            .field("call_deadline", &self.call_deadline)
            .finish()
    }
}

impl HttpUpstream {
    /// Builds a client for each upstream, reading each provider key from the environment
    /// variable the catalogue names.
    pub fn from_env(catalogue: &Catalogue) -> Result<HttpUpstream, reqwest::Error> {
        HttpUpstream::with_keys(catalogue, |variable| std::env::var(variable).ok())
    }

    /// Builds a client for each upstream, asking `key_for` for the value of each key variable.
    pub fn with_keys(
        catalogue: &Catalogue,
        key_for: impl Fn(&str) -> Option<String> + Send + Sync + 'static,
    ) -> Result<HttpUpstream, reqwest::Error> {
        let keys: KeySource = Arc::new(key_for);
        let channels = build_channels(catalogue, &*keys, &HashMap::new())?;
        Ok(HttpUpstream {
            channels: Arc::new(ArcSwap::from_pointee(vec![Arc::new(channels)])),
            keys,
            call_deadline: catalogue.call_deadline(),
            owners: None,
            events: None,
        })
    }

    /// Calls the upstreams `catalogue` names from now on (a reload), reading their keys again.
    /// An upstream whose settings and key are unchanged keeps its client and its breaker's
    /// state; calls under way finish on the upstreams they began with.
    pub fn reload(&self, catalogue: &Catalogue) -> Result<(), reqwest::Error> {
        let generations = self.channels.load_full();
        let channels = build_channels(catalogue, &*self.keys, &generations[0])?;
        let mut kept = vec![Arc::new(channels)];
        kept.extend(generations.iter().take(GENERATIONS - 1).cloned());
        self.channels.store(Arc::new(kept));
        Ok(())
    }

    /// The upstreams of the catalogue served now.
    pub(super) fn current(&self) -> Arc<Channels> {
        self.channels.load()[0].clone()
    }

    /// Records each upstream's breaker opening and closing in `events` (webhook events
    /// `upstream.breaker_opened` and `upstream.breaker_closed`), aside from the call.
    #[must_use]
    pub fn reporting_breakers(mut self, events: Arc<dyn EventOutbox>) -> HttpUpstream {
        self.events = Some(events);
        self
    }

    /// Records in `owners` who made each response that a native Responses upstream keeps (a
    /// call without `store: false`), so that `previous_response_id` and `/v1/responses/{id}`
    /// reach it for that account only (see
    /// [`ProtocolRouterLayer::response_owners`](crate::ProtocolRouterLayer::response_owners)).
    /// [`Gateway`](crate::Gateway) sets it to its store.
    #[must_use]
    pub fn remembering_responses(mut self, owners: Arc<dyn ResponseOwners>) -> HttpUpstream {
        self.owners = Some(owners);
        self
    }
}

/// One channel a call may try: the model's entry for it, and the upstream it names.
#[derive(Clone, Copy)]
struct Planned<'a> {
    model: &'a ModelChannel,
    channel: &'a Channel,
}

impl failover::Channel for Planned<'_> {
    fn name(&self) -> &str {
        &self.channel.config.name
    }

    fn breaker(&self) -> &CircuitBreaker {
        &self.channel.breaker
    }
}

/// For whom to record who made the response a native Responses upstream answers `request`
/// with: `None` when nothing is recorded (another protocol, no store of owners or no caller),
/// or the client asked the provider not to keep the response (`store: false`). A channel that
/// translates the call keeps nothing, and reads no id.
fn owner_record<'a>(
    owners: Option<&'a dyn ResponseOwners>,
    routed: &RoutedCall,
    request: &Request<Bytes>,
) -> Option<(&'a dyn ResponseOwners, AccountId)> {
    let owners = owners?;
    if !routed.protocol.dialect().provider_keeps_replies() {
        return None;
    }
    let caller = request.extensions().get::<Caller>()?;
    routed
        .kept_by_provider(request.body())
        .then_some((owners, caller.account))
}

/// Records that `account` made the response the upstream told (see [`owner_record`]). A
/// record that fails is logged: the call goes on, and the response cannot be reached again
/// through the gateway.
async fn remember((owners, account): (&dyn ResponseOwners, AccountId), told: ProviderResponseId) {
    let owner = ResponseOwner {
        response_id: told.id,
        account,
        upstream: told.upstream,
    };
    let recorded = owners.record_response(&owner);
    match tokio::time::timeout(crate::store::DEFAULT_LEDGER_TIMEOUT, recorded).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => {
            tracing::warn!(response = %owner.response_id, %error, "the response's owner was not recorded");
        }
        Err(_) => {
            tracing::warn!(response = %owner.response_id, "the response's owner was not recorded in time");
        }
    }
}

impl Service<Request<Bytes>> for HttpUpstream {
    type Response = Response<UpstreamBody>;
    type Error = UpstreamError;
    type Future = ResponseFuture<Result<Response<UpstreamBody>, UpstreamError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), UpstreamError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Bytes>) -> Self::Future {
        let generations = self.channels.load_full();
        let owners = self.owners.clone();
        let events = self.events.clone();
        let deadline = Instant::now() + self.call_deadline;
        ResponseFuture::new(async move {
            let routed = request
                .extensions()
                .get::<RoutedCall>()
                .cloned()
                .ok_or_else(|| UpstreamError::transport("no RoutedCall extension"))?;
            let mut order = attempt_order(&routed.model.channels);
            // A call that continues a stored response goes only where it is kept.
            if let Some(upstream) = &routed.upstream {
                order.retain(|channel| *channel.upstream.name == **upstream);
            }
            let planned = (order.into_iter())
                .map(|model| {
                    let channel = channel_for(&generations, model);
                    let planned = channel.map(|channel| Planned { model, channel });
                    (&*model.upstream.name, planned)
                })
                .collect();
            let record = owner_record(owners.as_deref(), &routed, &request);
            let read_id = record.is_some();
            let failover = Failover::new(planned, deadline, events.as_ref());
            let mut response = failover
                .run(|planned: Planned<'_>| {
                    (planned.channel).attempt(planned.model, &routed, &request, deadline, read_id)
                })
                .await?;
            if let (Some(record), Some(told)) = (
                record,
                response.extensions_mut().remove::<ProviderResponseId>(),
            ) {
                remember(record, told).await;
            }
            Ok(response)
        })
    }
}
