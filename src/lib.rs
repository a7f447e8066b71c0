//! # model-gateway
//!
//! Tower layers and storage for a gateway that sells access to large language models: clients
//! call OpenAI-style `POST /v1/chat/completions` (or `/v1/responses`, `/v1/embeddings`) or
//! Anthropic-style `POST /v1/messages` with one API key and one credit pool, and every
//! successful call is charged its model's price.
//!
//! ## The stack
//!
//! Outermost first, as [`ServiceBuilder`](tower::ServiceBuilder) lists them (see [`stack`]):
//!
//! 0. [`RequestIdLayer`]: every request gets an id, every answer carries it (`x-request-id`,
//!    and `request-id` for the Anthropic SDKs). Then [`AccessLog`]: one
//!    log line per request, refused ones included; and [`ErrorBodyService`]:
//!    refusals in the client's own error object when the operator chose
//!    [`ErrorBody::Compatible`](error::ErrorBody::Compatible).
//! 1. [`ApiKeyAuth`]: who is calling, and what the key may do (401).
//!    Then [`RateLimit`](rate_limit::RateLimit): the key's requests per minute (429).
//! 2. [`ProtocolRouter`]: which endpoint and model, at what price (413, 405, 400, 404), and
//!    whether the key may call that model (403).
//! 3. [`CreditCharge`]: reserve the price and write a `pending` call-log entry (402).
//! 4. [`RefundOnUpstreamError`]: settle on success, refund on failure (502).
//! 5. The upstream: [`Upstream`] ([`MockUpstream`](crate::upstream::MockUpstream) or [`HttpUpstream`](crate::upstream::HttpUpstream)), or your own service.
//!
//! So every request gets one clear answer, in this order: 401, then 429, then 400/413, then 404,
//! then 403, then 402, then the upstream. A request refused at any step is never charged.
//!
//! ## Request extensions
//!
//! Layers talk to each other only through typed request extensions, defined in one module below
//! the layers (`call`), so that the upstreams read them without knowing any layer:
//!
//! | Extension        | Added by            | Read by                                   |
//! |------------------|---------------------|-------------------------------------------|
//! | [`Caller`](crate::store::Caller)       | [`ApiKeyAuth`]      | [`RateLimit`](rate_limit::RateLimit), [`CreditCharge`] |
//! | [`KeyRules`](crate::call::KeyRules)     | [`ApiKeyAuth`]      | [`RateLimit`](rate_limit::RateLimit), [`ProtocolRouter`] |
//! | [`RoutedCall`](crate::call::RoutedCall)   | [`ProtocolRouter`]  | [`CreditCharge`], [`RefundOnUpstreamError`] (streams), the upstream |
//! | [`Reservation`](crate::store::Reservation)  | [`CreditCharge`]    | [`RefundOnUpstreamError`]                 |
//! | [`IdempotencyKey`](crate::call::IdempotencyKey) | [`ProtocolRouter`] (the client's `Idempotency-Key`) | [`CreditCharge`] (billed at most once), [`RefundOnUpstreamError`] (keeps the reply) |
//! | [`ServedBy`](crate::upstream::ServedBy) (on the response) | [`HttpUpstream`](crate::upstream::HttpUpstream) | [`RefundOnUpstreamError`]     |
//! | [`AccessEntry`](crate::call::AccessEntry) | [`AccessLog`] | noted by [`ApiKeyAuth`], [`ProtocolRouter`], [`RefundOnUpstreamError`] (a stream's end writes it) |
//! | [`GatewayError`] (on the response) | whoever refuses ([`GatewayError::into_response`]) | [`AccessLog`] (the reason), [`ErrorBodyService`] (the body) |
//!
//! [`ProtocolRouter`] also turns the body into [`Bytes`](bytes::Bytes), exactly as the client
//! sent it; layers inside it see `Request<Bytes>`.
//!
//! ## Where things live
//!
//! Dependencies run one way, from the bottom up; a module uses only what is below it:
//!
//! 1. Plain types: `credits`, `keys`, `protocol`, `call` (the extensions and ids), `error`
//!    ([`GatewayError`], [`UpstreamError`](crate::error::UpstreamError)), `classify` (what a
//!    provider's answer means: billable, retry elsewhere, refused; `Retry-After`),
//!    `catalogue`. In `protocol`, **one folder per wire protocol**: `chat_completions/`,
//!    `messages/`, `responses/` (with its translation to chat completions), `embeddings/`;
//!    each implements the crate's `Dialect` trait (`protocol/dialect.rs`): its route, the
//!    envelope of its requests (model, stream flag, output limit, what the gateway asks of
//!    the provider), which upstream kinds serve it and where, the headers an upstream of its
//!    kind takes, how its stream events read for billing (usage, content, end, error), its
//!    error event, and the mock's reply. [`Protocol`] is the enum the call log stores; its one
//!    `match` names each dialect. `protocol::sse` keeps only the event framing, and
//!    `protocol/mod.rs` the usage every protocol reports ([`TokenUsage`](crate::protocol::TokenUsage)).
//! 2. Storage: the traits in `store`; `store::rules`, the pure core that every backend and
//!    charging mode calls (the reservation rule, what a hold takes and gives back, what a call
//!    may hold of an escrow pot, keyed calls), with no database, runtime or clock inside; and
//!    the backends `store::memory` and `store::sea`. Inside `store::sea`, from the bottom up:
//!    the leaves (`entity`, `rows`, `writes`, `held`: the vocabulary, the row helpers and the
//!    held calls); `commit/`, the committer every mode writes through, naming none (`jobs` its
//!    vocabulary, with the `BatchWriter` a `SQLite` file's batches go through: the committer's
//!    own connection, or the owned file's beside its holds; `batch` decides a batch against
//!    the rules, `ledger_ops` and `sqlite_direct` write it
//!    through sqlx or to a `SQLite` file directly, `batches` and `flush` answer once durable,
//!    `group_commit` runs it); the charging modes above it, each a type in `mode::Mode`:
//!    shared (the committer alone), `owned/` (a `SQLite` file one gateway owns, behind the
//!    `sqlite` feature) and `escrow/` (`PostgreSQL` only, behind `postgres`); then `store` (the
//!    [`SeaOrmStore`] façade, which delegates to its mode) and the trait implementations beside
//!    it (`ledger`, `accounts`, `grants`, `reads`, `audit`, `upkeep`).
//! 3. Upstreams: `upstream`: [`MockUpstream`](crate::upstream::MockUpstream) (each dialect
//!    writes its reply) and [`HttpUpstream`](crate::upstream::HttpUpstream), which is a
//!    channel (`channel.rs`: one provider endpoint, one attempt), a failover
//!    (`failover.rs`: order, breaker, `Retry-After`, the deadline; tested with fake channels
//!    and no HTTP client), the channels of each catalogue (`channels.rs`) and the requests
//!    beside the calls (`beside.rs`: stored responses, `count_tokens`).
//! 4. The body budget (`body_limit`: size, pauses, deadline and the memory every request
//!    shares), read by the router and the requests beside the calls.
//! 5. The layers, each in its own module: `auth`, [`rate_limit`], `router`, `charge`, and
//!    `refund` (a folder: layer, service, the guard that writes a call's outcome once, the
//!    streaming body).
//! 6. The layers every answer passes on its way out: [`request_id`], [`access_log`],
//!    [`error_body`]. The stack ([`stack`]) and [`recovery`] (instance leases, the age rule, and [`Upkeep`](crate::recovery::Upkeep),
//!    which runs them for a serving gateway); [`admin`] (the operator's operations, and their HTTP
//!    API), [`key_holder`] (the key holders' endpoints), [`Gateway`] (all of it as one axum
//!    router), [`server`] (the front door) and [`telemetry`] (metrics).
//!
//! ## Adding a wire protocol
//!
//! A contributor's checklist, for a protocol such as Google's Gemini API:
//!
//! 1. A folder `src/protocol/<name>/` whose `mod.rs` implements `Dialect` for a unit struct:
//!    `path` and `matches` (a protocol that puts the model or the verb in the path matches
//!    more than one path), `envelope` (check the fields the gateway reads, in the contract's
//!    order), `metering` where the default's output limit is not enough, `served_by` and
//!    `upstream` (which upstream kinds serve it, at which path, translated or not),
//!    `read_event`, `content_text` and `error_event` (its event stream), and `mock_reply` and
//!    `mock_events`. Keep its stream reading in `stream.rs` and its mock in `mock.rs`, as the
//!    others do; a translation to another protocol lives with the pair it joins.
//! 2. One arm in [`Protocol`] (its stored name is what the call log keeps: never rename
//!    one) and one in the enum's `dialect` method; add it to the enum's `ALL` list.
//! 3. Where providers speak it natively, an [`UpstreamKind`](crate::catalogue::UpstreamKind)
//!    arm, the dialect it `speaks` (its headers and key: `UpstreamDialect`), and the
//!    `served_by` and `upstream` answers of the dialects it serves.
//! 4. Tests: the dialect's own (envelope refusals, stream reading, the mock's usage read back),
//!    an integration test through the whole stack on the mock and on a fake provider, and
//!    the official SDK's test where there is one.
//!
//! Nothing else changes: the router, the charge, the refund, the channel and the mock ask the
//! dialect, and the arms of the enum named outside `src/protocol/` stay few (the call log's
//! storage, the path lookup, tests).
//!
//! The layers' modules are public by topic ([`auth`], [`router`], [`charge`], [`refund`],
//! [`request_id`], [`upstream`]), each with its service's named `ResponseFuture`; the headline
//! types are also at the crate root.

//! ## Errors
//!
//! Every refusal is a [`GatewayError`], mapped to its status and `{"detail": ...}` body in one
//! place ([`GatewayError::into_response`]). Rejections are `Ok(response)`: no layer fails the
//! connection.
//!
//! ## Storage
//!
//! [`KeyStore`], [`Ledger`], [`CallLog`] and [`Accounts`] (in [`store`]) are the traits an
//! embedder can implement over its own database. [`SeaOrmStore`] implements them on `SQLite`, `PostgreSQL` and MySQL/MariaDB,
//! grouping the ledger's writes into shared transactions (group commit); [`MemoryStore`] is an
//! in-memory implementation and the reference model in tests.
//!
//! A reservation always ends: settled, refunded, or, if its gateway died or its database was
//! unreachable, refunded later: at once once its gateway's lease ended
//! ([`recover_orphaned_reservations`](crate::recovery::recover_orphaned_reservations)), or by age if it was made under no lease
//! ([`recover_stale_reservations`](crate::recovery::recover_stale_reservations)).

#![warn(missing_docs)]

use std::sync::Arc;

#[macro_use]
mod macros;
pub mod access_log;
pub mod admin;
pub mod auth;
mod body_limit;
pub mod call;
pub mod catalogue;
pub mod charge;
mod classify;
pub mod codes;
#[cfg(feature = "api")]
pub mod console;
pub mod credits;
pub mod error;
pub mod error_body;
pub mod events;
#[cfg(feature = "server")]
mod gateway;
#[cfg(feature = "server")]
pub mod key_holder;
pub mod keys;
#[cfg(feature = "server")]
mod ledger_deadline;
pub mod money;
pub mod pricing;
pub mod protocol;
pub mod rate_limit;
pub mod reconcile;
pub mod recovery;
pub mod refund;
pub mod reload;
mod reply;
pub mod request_id;
pub mod router;
#[cfg(feature = "server")]
pub mod server;
pub mod store;
pub mod telemetry;
mod time_limit;
pub mod upstream;
pub mod webhooks;

// The headline types; everything else lives in its topic module.
pub use auth::{ApiKeyAuth, ApiKeyAuthLayer};
pub use catalogue::Catalogue;
pub use charge::{CreditCharge, CreditChargeLayer};
pub use credits::{Balance, Credits};
pub use error::GatewayError;
#[cfg(feature = "server")]
pub use gateway::Gateway;
pub use protocol::Protocol;
pub use refund::{RefundOnUpstreamError, RefundOnUpstreamErrorLayer};
pub use router::{ProtocolRouter, ProtocolRouterLayer};
pub use store::{
    AccountId, Accounts, CallId, CallLog, KeyId, KeyStore, Ledger, MemoryStore, SeaOrmStore, Store,
};
pub use upstream::Upstream;

use access_log::{AccessLog, AccessLogLayer};
use error_body::{ErrorBodyLayer, ErrorBodyService};
use request_id::{RequestIdLayer, RequestIdService};
use router::BodyLimits;

/// The full gateway service: the layers around upstream `U`.
pub type GatewayStack<U> = RequestIdService<
    AccessLog<
        ErrorBodyService<
            ApiKeyAuth<
                rate_limit::RateLimit<ProtocolRouter<CreditCharge<RefundOnUpstreamError<U>>>>,
            >,
        >,
    >,
>;

/// Builds the whole gateway around `upstream`, outermost first:
///
/// | Layer                       | Reads                       | Adds            | Refuses with   |
/// |-----------------------------|-----------------------------|-----------------|----------------|
/// | [`RequestIdLayer`]          | `x-request-id`              | [`RequestId`](crate::call::RequestId)   |                |
/// | [`AccessLogLayer`]          | the answer, [`GatewayError`] on it | [`AccessEntry`](crate::call::AccessEntry) (one log line) |   |
/// | [`ErrorBodyLayer`]          | path, `anthropic-version`, [`GatewayError`] on the answer | | (rewrites refusals' bodies when the catalogue says `error_body = "compatible"`) |
/// | [`ApiKeyAuth`]              | `Authorization`/`x-api-key` | [`Caller`](crate::store::Caller), [`KeyRules`](crate::call::KeyRules) | 401   |
/// | [`RateLimit`](rate_limit::RateLimit) | [`Caller`](crate::store::Caller), [`KeyRules`](crate::call::KeyRules) |       | 429            |
/// | [`ProtocolRouter`]          | path, method, body, [`KeyRules`](crate::call::KeyRules) | [`RoutedCall`](crate::call::RoutedCall) | 404, 405, 413, 400, 403 |
/// | [`CreditCharge`]            | [`Caller`](crate::store::Caller), [`RoutedCall`](crate::call::RoutedCall)  | [`Reservation`](crate::store::Reservation) | 402            |
/// | [`RefundOnUpstreamError`]   | [`Reservation`](crate::store::Reservation)             |                 | 502 (refunded) |
/// | `upstream`                  | [`RoutedCall`](crate::call::RoutedCall), body        |                 |                |
///
/// `body` says how request bodies are read ([`BodyLimits`]; a number is the largest body, with
/// the default time-outs and memory budget), and callers who cannot pay for any model may send
/// only a small body ([`ProtocolRouterLayer::unfunded_callers_through`]).
///
/// The result is a `Service<Request<B>>` for any request body `B`, answering
/// `Response<`[`ResponseBody`](refund::ResponseBody)`>` and never failing, so it mounts directly in an axum `Router` or on
/// bare hyper. Every call is bounded by the catalogue's call deadline plus
/// [`UPSTREAM_BOUND_MARGIN`](crate::recovery::UPSTREAM_BOUND_MARGIN) until its reply (or first event) arrives, and a stream by the
/// catalogue's stream deadline after that; see [`recovery_age`](crate::recovery::recovery_age) for what that means for
/// recovery. Streaming (`stream: true` answered with server-sent events) is on when the
/// catalogue says so ([`Catalogue::with_streaming`]). Keys' requests per minute are counted in
/// this process ([`RateLimiter::local`](rate_limit::RateLimiter::local)); see
/// [`stack_with_limiter`] to share them.
pub fn stack<S, U>(
    store: Arc<S>,
    catalogue: impl Into<catalogue::LiveCatalogue>,
    body: impl Into<BodyLimits>,
    upstream: U,
) -> GatewayStack<U>
where
    S: Store + 'static,
{
    stack_with_limiter(
        store,
        catalogue,
        body,
        upstream,
        rate_limit::RateLimiter::local(),
    )
}

/// [`stack`], counting keys' requests per minute with `limiter` (e.g. in Redis, so that the
/// limits hold across gateway instances).
pub fn stack_with_limiter<S, U>(
    store: Arc<S>,
    catalogue: impl Into<catalogue::LiveCatalogue>,
    body: impl Into<BodyLimits>,
    upstream: U,
    limiter: rate_limit::RateLimiter,
) -> GatewayStack<U>
where
    S: Store + 'static,
{
    // The models are read per request from `live`; the settings of the whole gateway, once
    // (a reload cannot change them).
    let live = catalogue.into();
    let catalogue = live.current();
    let upstream_bound = catalogue.call_deadline() + recovery::UPSTREAM_BOUND_MARGIN;
    tower::ServiceBuilder::new()
        .layer(RequestIdLayer::new())
        .layer(AccessLogLayer::new())
        .layer(ErrorBodyLayer::new(catalogue.error_body()))
        .layer(ApiKeyAuthLayer::new(store.clone()))
        .layer(rate_limit::RateLimitLayer::new(limiter))
        .layer(
            ProtocolRouterLayer::new(live)
                .body_limits(body)
                .unfunded_callers_through(store.clone())
                .response_owners(store.clone()),
        )
        .layer(CreditChargeLayer::new(store.clone()))
        .layer(
            RefundOnUpstreamErrorLayer::new(store)
                .upstream_bound(upstream_bound)
                .stream_deadline(catalogue.stream_deadline())
                .stream_idle_timeout(catalogue.stream_idle_timeout())
                .stream_max_event_bytes(catalogue.max_event_bytes())
                .charge_beyond_reservation(catalogue.charge_beyond_ceiling())
                .usage_cost(catalogue.usage_cost()),
        )
        .service(upstream)
}
