//! Storage: the traits an embedder implements over its own database, and the types the layers
//! exchange with it.
//!
//! - [`KeyStore`]: who is calling (key hash → [`Caller`]).
//! - [`Ledger`]: credits: [`reserve`](Ledger::reserve) a call's price and write its `pending`
//!   call-log entry in one transaction, then [`settle`](Ledger::settle) it (`ok`) or
//!   [`refund`](Ledger::refund) it (`refunded`, credits back to the buckets they came from), each
//!   once, guarded by the entry's status.
//! - [`CallLog`]: reading the call log back.
//! - [`Leases`]: which gateway instance serves which reservation, so that recovery refunds a
//!   dead instance's reservations at once and never a live one's.
//! - [`ResponseOwners`]: which account made which response a provider keeps (the Responses
//!   API), so that only that account reaches it again.
//! - [`RedemptionCodes`]: batches of codes an operator sells, each redeemed for credits once.
//! - [`EventOutbox`]: webhook events, written with what caused them, delivered at least once.
//! - [`Accounts`]: administration (accounts, keys and their rules, grants, the audit), used by
//!   the admin API and the command line rather than per call.
//!
//! Two implementations ship: [`SeaOrmStore`] (`SQLite`, `PostgreSQL`, `MySQL`/`MariaDB`) and
//! [`MemoryStore`], the reference model the database backends are tested against.
//!
#![doc = include_str!("../docs/ledger.md")]

pub use crate::call::{AccountId, CallId, Caller, KeyId, KeyRules, Reservation};
pub use crate::protocol::TokenUsage;
/// The sea-orm this crate is built on: [`SeaOrmStore::connection`] and [`Migrator`] are its
/// types, so an embedder that runs its own queries or migrations beside the store uses this
/// one rather than a version of its own.
pub use sea_orm;
/// sea-orm's migrations, for [`Migrator`] (`MigratorTrait`).
pub use sea_orm_migration;

#[cfg(feature = "testing")]
pub mod conformance;
mod memory;
pub(crate) mod outcome;
mod records;
pub mod rules;
mod sea;
mod traits;
mod types;

pub use crate::call::IdempotencyKey;
pub use memory::MemoryStore;
pub use outcome::DEFAULT_LEDGER_TIMEOUT;
pub use records::{
    AccountAudit, AccountQuery, AccountSummary, Attempted, CallQuery, CodeBatch, DailyUsage,
    Delivery, DeliveryStatus, Grant, Granted, KeyInfo, KeyStatus, Lapse, NewCodeBatch, Overdue,
    Redeemed, ReportGroup, ReportQuery, ReportRow, Sums,
};
pub use rules::idempotency::DEFAULT_IDEMPOTENCY_WINDOW;

/// How long the owner of a stored response is kept: providers keep responses 30 days.
pub const RESPONSE_RETENTION: std::time::Duration = std::time::Duration::from_secs(30 * 24 * 3600);
pub(crate) use rules::idempotency::{
    KeyedCall, KeyedDecision, decide as decide_keyed, window_cutoff,
};
#[cfg(feature = "postgres")]
pub use sea::DEFAULT_ESCROW_IDLE;
pub use sea::{ChargingMode, DEFAULT_MAX_BATCH, GroupCommitStats, Migrator, SeaOrmStore};
pub use traits::{
    Accounts, CallLog, EventOutbox, KeyStore, Leases, Ledger, RedemptionCodes, ResponseOwners,
    Store,
};
pub use types::{
    ActiveKey, BalanceOverflow, CallFailure, CallRecord, CallStatus, CallSuccess, ChargeRequest,
    IdempotencyKeyReused, KeptReply, LeaseId, MAX_KEPT_REPLY_BYTES, OperatorCost, ReserveError,
    ResponseOwner, SettleClaim, StoreError,
};
pub(crate) use types::{check_grant_amount, unknown_account};
