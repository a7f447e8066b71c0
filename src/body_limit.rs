//! How a request body is read, for the [`ProtocolRouter`](crate::ProtocolRouter) and the
//! requests beside the calls: within a size ([`BodyLimits`]), with no long pause and before a
//! deadline, inside a memory budget shared by every request ([`BodyBudget`]), and, from a
//! caller who cannot pay for any model, no more than a small size.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::header;
use http_body::Body;
use http_body_util::BodyExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tower::BoxError;

use crate::call::Caller;
use crate::credits::Credits;
use crate::error::GatewayError;
use crate::store::Ledger;

/// Default body limit: 32 MiB, room for a few base64 images.
pub const DEFAULT_MAX_BODY_BYTES: usize = 32 * 1024 * 1024;

/// A body's declared length (`Content-Length`), refused at once if over the largest body.
pub(crate) fn declared_length(
    headers: &http::HeaderMap,
    limits: &BodyLimits,
) -> Result<Option<u64>, GatewayError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limits.max_bytes as u64) {
        return Err(GatewayError::PayloadTooLarge);
    }
    Ok(declared)
}

/// Reads the body of a request served beside the calls (`count_tokens`) within the calls'
/// `limits`: its declared length first, then size, pauses, deadline and memory budget as
/// [`read_body`] does; a caller (from [`ApiKeyAuth`](crate::ApiKeyAuth)) whose credits cannot
/// pay for `catalogue`'s cheapest model may send only the unfunded size.
#[cfg(feature = "server")]
pub(crate) async fn read_beside_calls<B>(
    request: http::Request<B>,
    catalogue: &crate::catalogue::Catalogue,
    limits: &BodyLimits,
    ledger: Arc<dyn Ledger>,
) -> Result<(http::request::Parts, Bytes, Option<BodyPermit>), GatewayError>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let declared_length = declared_length(request.headers(), limits)?;
    let (parts, body) = request.into_parts();
    let funds = catalogue
        .cheapest_charge()
        .map(|cheapest| Funds { ledger, cheapest });
    let payer = funds
        .as_ref()
        .zip(parts.extensions.get::<Caller>().copied());
    let (body, permit) = read_body(body, limits, declared_length, payer).await?;
    Ok((parts, body, permit))
}

/// Reads a whole request body within `limits`: no more than its size, no pause between chunks
/// longer than its idle time-out, all of it before its deadline, and no more at once than the
/// memory budget allows across every request (waiting up to the idle time-out for room). A
/// body of declared length takes its whole share of the budget before it is read, so that
/// bodies never hold parts of the budget while each waits for more. A caller that cannot pay
/// for any model may send only `unfunded_max_bytes`.
pub(crate) async fn read_body<B>(
    body: B,
    limits: &BodyLimits,
    declared_length: Option<u64>,
    payer: Option<(&Funds, Caller)>,
) -> Result<(Bytes, Option<BodyPermit>), GatewayError>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let deadline = Instant::now() + limits.deadline;
    let within = |now: Instant| deadline.min(now + limits.idle_timeout);
    let mut body = std::pin::pin!(body);
    let mut received = Received::Empty;
    let mut permit: Option<OwnedSemaphorePermit> = None;
    // Bytes of the budget held and not yet filled.
    let mut reserved = 0;
    if let (Some(budget), Some(length)) = (&limits.budget, declared_length)
        && length > 0
    {
        let length = usize::try_from(length).map_err(|_| GatewayError::PayloadTooLarge)?;
        permit = Some(budget.take(length, within(Instant::now())).await?);
        reserved = length;
    }
    let mut payer_checked = payer.is_none();
    loop {
        let frame = match tokio::time::timeout_at(within(Instant::now()), body.frame()).await {
            Err(_) => return Err(GatewayError::RequestTimeout),
            Ok(None) => break,
            Ok(Some(Err(_))) => return Err(GatewayError::UnreadableBody),
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let total = received.len() + data.remaining();
        if total > limits.max_bytes {
            return Err(GatewayError::PayloadTooLarge);
        }
        if !payer_checked && total > limits.unfunded_max_bytes {
            payer_checked = true;
            if let Some((funds, caller)) = payer
                && !funds.can_pay(caller).await
            {
                return Err(GatewayError::PayloadTooLarge);
            }
        }
        let unreserved = data.remaining().saturating_sub(reserved);
        reserved = reserved.saturating_sub(data.remaining());
        if let Some(budget) = &limits.budget
            && unreserved > 0
        {
            let more = budget.take(unreserved, within(Instant::now())).await?;
            match &mut permit {
                Some(held) => held.merge(more),
                None => permit = Some(more),
            }
        }
        received.push(data);
    }
    Ok((
        received.into_bytes(),
        permit.map(|held| BodyPermit {
            _held: Arc::new(held),
        }),
    ))
}

/// A body as it arrives: most are one chunk, kept without a copy.
enum Received {
    Empty,
    One(Bytes),
    Many(BytesMut),
}

impl Received {
    fn len(&self) -> usize {
        match self {
            Received::Empty => 0,
            Received::One(bytes) => bytes.len(),
            Received::Many(bytes) => bytes.len(),
        }
    }

    fn push(&mut self, mut data: impl Buf) {
        *self = match std::mem::replace(self, Received::Empty) {
            Received::Empty => Received::One(data.copy_to_bytes(data.remaining())),
            Received::One(first) => {
                let mut joined = BytesMut::with_capacity(first.len() + data.remaining());
                joined.extend_from_slice(&first);
                joined.put(data);
                Received::Many(joined)
            }
            Received::Many(mut joined) => {
                joined.put(data);
                Received::Many(joined)
            }
        };
    }

    fn into_bytes(self) -> Bytes {
        match self {
            Received::Empty => Bytes::new(),
            Received::One(bytes) => bytes,
            Received::Many(bytes) => bytes.freeze(),
        }
    }
}

/// How request bodies are read by [`ProtocolRouter`](crate::ProtocolRouter).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct BodyLimits {
    /// Largest body accepted (413 beyond).
    pub max_bytes: usize,
    /// Longest pause between two chunks of a body (408 beyond).
    pub idle_timeout: Duration,
    /// Longest time to receive a whole body (408 beyond).
    pub deadline: Duration,
    /// Memory for bodies being read, shared by every request through the same layer (and its
    /// clones); `None` for no budget.
    pub budget: Option<BodyBudget>,
    /// Largest body from a caller who cannot pay for any model (see
    /// [`ProtocolRouterLayer::unfunded_callers_through`](crate::ProtocolRouterLayer::unfunded_callers_through)).
    pub unfunded_max_bytes: usize,
}

impl BodyLimits {
    /// The defaults with a largest body of `max_bytes`.
    pub fn new(max_bytes: usize) -> BodyLimits {
        BodyLimits {
            max_bytes,
            ..BodyLimits::default()
        }
    }

    /// The same limits with a pause of at most `idle` between chunks.
    #[must_use]
    pub fn idle_timeout(mut self, idle: Duration) -> BodyLimits {
        self.idle_timeout = idle;
        self
    }

    /// The same limits with a whole body due within `deadline`.
    #[must_use]
    pub fn deadline(mut self, deadline: Duration) -> BodyLimits {
        self.deadline = deadline;
        self
    }

    /// The same limits with a memory budget of `bytes` for bodies being read (`None`: none).
    #[must_use]
    pub fn budget_bytes(mut self, bytes: Option<usize>) -> BodyLimits {
        self.budget = bytes.map(BodyBudget::new);
        self
    }

    /// The same limits letting unfunded callers send `bytes` at most.
    #[must_use]
    pub fn unfunded_max_bytes(mut self, bytes: usize) -> BodyLimits {
        self.unfunded_max_bytes = bytes;
        self
    }
}

impl Default for BodyLimits {
    fn default() -> BodyLimits {
        BodyLimits {
            max_bytes: DEFAULT_MAX_BODY_BYTES,
            idle_timeout: DEFAULT_BODY_IDLE_TIMEOUT,
            deadline: DEFAULT_BODY_DEADLINE,
            budget: Some(BodyBudget::new(DEFAULT_BODY_BUDGET_BYTES)),
            unfunded_max_bytes: DEFAULT_UNFUNDED_MAX_BODY_BYTES,
        }
    }
}

impl From<usize> for BodyLimits {
    /// The defaults with a largest body of `max_bytes`.
    fn from(max_bytes: usize) -> BodyLimits {
        BodyLimits::new(max_bytes)
    }
}

/// Memory for request bodies being read, shared by the requests that read through it.
#[derive(Debug, Clone)]
pub struct BodyBudget {
    bytes: Arc<Semaphore>,
}

impl BodyBudget {
    /// A budget of `bytes`.
    pub fn new(bytes: usize) -> BodyBudget {
        BodyBudget {
            bytes: Arc::new(Semaphore::new(bytes.min(Semaphore::MAX_PERMITS))),
        }
    }

    /// Bytes not held by any request now.
    pub fn available(&self) -> usize {
        self.bytes.available_permits()
    }

    /// Takes `bytes` of the budget, waiting until `until` for room; 503 if there is none.
    async fn take(
        &self,
        bytes: usize,
        until: Instant,
    ) -> Result<OwnedSemaphorePermit, GatewayError> {
        let count = u32::try_from(bytes).map_err(|_| GatewayError::PayloadTooLarge)?;
        if let Ok(permit) = self.bytes.clone().try_acquire_many_owned(count) {
            return Ok(permit);
        }
        match tokio::time::timeout_at(until, self.bytes.clone().acquire_many_owned(count)).await {
            Ok(Ok(permit)) => Ok(permit),
            _ => Err(GatewayError::Busy),
        }
    }
}

/// The share of the body budget a request holds, as a request extension, for as long as the
/// request (and so its buffered body) lives.
#[derive(Debug, Clone)]
pub struct BodyPermit {
    // Never read: dropping the last clone gives the bytes back to the budget.
    _held: Arc<OwnedSemaphorePermit>,
}

/// Whether a caller can pay for the catalogue's cheapest model.
#[derive(Debug, Clone)]
pub(crate) struct Funds {
    pub(crate) ledger: Arc<dyn Ledger>,
    pub(crate) cheapest: Credits,
}

impl Funds {
    /// A store that cannot answer (in time) does not stop the call: the charge decides later,
    /// and answers `503` itself within its own time-out.
    async fn can_pay(&self, caller: Caller) -> bool {
        let read = self.ledger.balance(caller.account);
        match tokio::time::timeout(crate::store::DEFAULT_LEDGER_TIMEOUT, read).await {
            Ok(Ok(balance)) => balance.total() >= self.cheapest,
            Ok(Err(_)) | Err(_) => true,
        }
    }
}

/// Default longest pause between two chunks of a request body.
pub const DEFAULT_BODY_IDLE_TIMEOUT: Duration = Duration::from_secs(15);

/// Default longest time to receive a whole request body.
pub const DEFAULT_BODY_DEADLINE: Duration = Duration::from_secs(60);

/// Default memory for request bodies being read at once, across every request: 256 MiB.
pub const DEFAULT_BODY_BUDGET_BYTES: usize = 256 * 1024 * 1024;

/// Default largest body from a caller who cannot pay for any model: 1 MiB.
pub const DEFAULT_UNFUNDED_MAX_BODY_BYTES: usize = 1024 * 1024;
