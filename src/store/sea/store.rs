//! [`SeaOrmStore`], the façade: what every part of the sea-orm backend shares about a store.
//! A leaf: its parts (`super::ledger`, `super::accounts`, ...) implement the store's traits
//! beside it, and it delegates what differs between charging modes to [`Mode`].

use std::path::Path;
use std::sync::Arc;

use sea_orm::DatabaseConnection;

use super::alerting::EventSettings;
use super::commit::group_commit::Committer;
use super::key_cache::KeyCache;
use super::leases;
use super::mode::Mode;

/// A [`Store`](crate::store::Store) on a relational database through sea-orm.
///
/// Reservations, settles and refunds go through one committer task per store, which applies up
/// to [`DEFAULT_MAX_BATCH`](crate::store::DEFAULT_MAX_BATCH) queued ones in a single transaction (group commit) and answers each
/// only after that transaction committed. Key lookups are answered from a cache of active keys
/// after the first; reservations check the key in their transaction, so a revoked key is
/// refused on its next charged call on every store sharing the database. The store must be
/// created inside the Tokio runtime that will use it.
#[derive(Debug, Clone)]
pub struct SeaOrmStore {
    pub(super) db: DatabaseConnection,
    pub(super) committer: Committer,
    pub(super) keys: Arc<KeyCache>,
    /// The database file, when it is a `SQLite` file: its ledger writes bypass sqlx.
    pub(super) sqlite_file: Option<Arc<Path>>,
    /// On `PostgreSQL`, whether the ledger's batches may commit asynchronously and be made
    /// durable by the flusher (see [`flush::postgres_flush_allowed`]).
    pub(super) postgres_flusher: bool,
    /// The instance lease this store's reservations record, shared by its clones.
    pub(super) lease: Arc<leases::HeldLease>,
    /// How long an idempotency key holds after its call.
    pub(super) idempotency_window: std::time::Duration,
    /// How it charges, and what it keeps for that ([`SeaOrmStore::in_mode`]).
    pub(super) mode: Mode,
    /// Which webhook events it writes to its outbox ([`SeaOrmStore::with_webhook_events`]),
    /// shared with its committer.
    pub(super) events: Arc<EventSettings>,
}
