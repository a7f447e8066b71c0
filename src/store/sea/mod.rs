//! The sea-orm backend: `SQLite` (the embedded default), `PostgreSQL` and `MySQL` through the same
//! code, except that a `SQLite` file's ledger writes bypass sqlx (see `sqlite_direct`).
//!
//! How each money movement stays atomic: reserves, settles and refunds go through the store's
//! committer, which applies them in batches, one write transaction per batch, and answers each
//! only after the commit (`group_commit`). A batch reads what it needs under lock (`SELECT ...
//! FOR UPDATE` on `PostgreSQL` and `MySQL`; `BEGIN IMMEDIATE` takes the database write lock on
//! `SQLite`), decides every write in queue order in memory (`batch`), then writes:
//! - **reserve**: subscription-first split of the locked balance, the debit as an `UPDATE`
//!   guarded by `bucket + change >= 0` whose affected-row count must match, the `pending` entry
//!   inserted; refused if the key was revoked. The `CHECK (bucket >= 0)` constraints back the
//!   guard up.
//! - **refund**: only an entry still `pending` (as locked, and as earlier writes in the batch
//!   left it) flips to `refunded`, with an `UPDATE ... WHERE status = 'pending'`, and its
//!   buckets get back what it took: a second refund finds nothing pending and moves nothing.
//! - **settle**: the same guarded flip to `ok`; no money moves.
//!
//! No transaction is held open across an upstream call, and on `SQLite` files and `PostgreSQL` no
//! lock is held through an fsync: batches commit without waiting for the disk and a flusher
//! makes them durable before the writes that need it are answered (`flush`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use chrono::Utc;
use sea_orm::sea_query::Expr;
use sea_orm::{
    ColumnTrait, ConnectOptions, ConnectionTrait, Database, DatabaseConnection,
    DatabaseTransaction, DbErr, EntityTrait, QueryFilter, QueryOrder, QuerySelect,
    TransactionTrait,
};
use sea_orm_migration::MigratorTrait;

use super::{
    AccountAudit, AccountId, ActiveKey, CallFailure, CallId, CallLog, CallQuery, CallRecord,
    CallStatus, CallSuccess, Caller, ChargeRequest, DailyUsage, KeyId, KeyStore, Ledger,
    Reservation, ReserveError, StoreError, Sums,
};
use crate::credits::{Balance, Bucket, Credits};
use crate::keys::KeyHash;
use crate::protocol::Protocol;

mod accounts;
mod batch;
mod batches;
mod entity;
mod escrow;
mod flush;
mod group_commit;
// Reservations held in memory need the SQLite committer; elsewhere only their types are used.
#[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
mod holds;
mod idempotent;
mod jobs;
mod key_cache;
mod leases;
mod ledger_ops;
mod migration;
#[cfg(feature = "sqlite")]
mod sqlite_direct;

use batch::{OwnedCharge, Write, unknown_account};
use entity::{account, api_key, call, credit_grant, subscription_lapse};
pub use escrow::DEFAULT_ESCROW_IDLE;
use group_commit::Committer;
pub use group_commit::DEFAULT_MAX_BATCH;
pub use jobs::GroupCommitStats;
#[cfg(feature = "sqlite")]
use jobs::SQLITE_BUSY_TIMEOUT;
use jobs::{Reply, begin_write};
use key_cache::KeyCache;
pub use migration::Migrator;

/// How long a readiness check waits for the database.
const READY_WITHIN: std::time::Duration = std::time::Duration::from_secs(2);

/// A [`Store`](super::Store) on a relational database through sea-orm.
///
/// Reservations, settles and refunds go through one committer task per store, which applies up
/// to [`DEFAULT_MAX_BATCH`] queued ones in a single transaction (group commit) and answers each
/// only after that transaction committed. Key lookups are answered from a cache of active keys
/// after the first; reservations check the key in their transaction, so a revoked key is
/// refused on its next charged call on every store sharing the database. The store must be
/// created inside the Tokio runtime that will use it.
#[derive(Debug, Clone)]
pub struct SeaOrmStore {
    db: DatabaseConnection,
    committer: Committer,
    keys: Arc<KeyCache>,
    /// The database file, when it is a `SQLite` file: its ledger writes bypass sqlx.
    sqlite_file: Option<Arc<Path>>,
    /// On `PostgreSQL`, whether the ledger's batches may commit asynchronously and be made
    /// durable by the flusher (see [`flush::postgres_flush_allowed`]).
    postgres_flusher: bool,
    /// The instance lease this store's reservations record, shared by its clones.
    lease: Arc<leases::HeldLease>,
    /// How long an idempotency key holds after its call.
    idempotency_window: std::time::Duration,
    /// When this store owns its `SQLite` file ([`SeaOrmStore::own_file`]): the reservations held
    /// in memory, and the owner's lock.
    owned: Option<Owned>,
    /// When this store charges against escrow ([`SeaOrmStore::with_escrow`]).
    escrow: Option<Arc<escrow::Escrow>>,
}

/// What a store that owns its `SQLite` file keeps (see [`SeaOrmStore::own_file`]).
#[derive(Debug, Clone)]
struct Owned {
    holds: Arc<holds::SharedHolds>,
    /// Locked for as long as any clone of the store lives; the kernel lets it go if the
    /// process dies.
    _lock: Arc<std::fs::File>,
}

impl From<DbErr> for StoreError {
    fn from(error: DbErr) -> StoreError {
        StoreError(Box::new(error))
    }
}

impl From<DbErr> for ReserveError {
    fn from(error: DbErr) -> ReserveError {
        ReserveError::Store(error.into())
    }
}

impl SeaOrmStore {
    /// Connects to `url` (`sqlite://gateway.db?mode=rwc`, `postgres://...`) and applies the
    /// migrations.
    pub async fn connect(url: &str) -> Result<SeaOrmStore, StoreError> {
        SeaOrmStore::connect_with(ConnectOptions::new(url)).await
    }

    /// Connects with explicit options (pool size, `PostgreSQL` schema search path, ...) and applies
    /// the migrations. On `SQLite` this also sets WAL mode, `synchronous = FULL` on the pool's
    /// connections and a busy time-out, so concurrent writers queue instead of failing with
    /// "database is locked". Ledger writes are answered only once durable (an acknowledged charge
    /// survives a power loss), though their commits do not wait for the disk themselves: see
    /// [`GroupCommitStats::flushes`].
    ///
    /// Unless `options` say otherwise ([`ConnectOptions::test_before_acquire`] set to `false`,
    /// or [`ConnectOptions::test_before_acquire_if_idle_for`]), a pooled connection to a
    /// database server is tested with a ping before it is handed out only once it has been idle
    /// for 30 s, and a `SQLite` file's never: sqlx's default, a ping on every checkout, costs a
    /// round trip before each statement. A connection the server cut while in use fails its
    /// statement; the pool replaces it, and settles and refunds are retried.
    pub async fn connect_with(mut options: ConnectOptions) -> Result<SeaOrmStore, StoreError> {
        options.sqlx_logging(false);
        // Test only connections idle long enough to have been dropped (unless the caller chose);
        // a SQLite file's connections are not dropped at all.
        if options.get_test_before_acquire()
            && options.get_test_before_acquire_if_idle_for().is_none()
        {
            if options.get_url().starts_with("sqlite:") {
                options.test_before_acquire(false);
            } else {
                options.test_before_acquire_if_idle_for(PING_IF_IDLE_FOR);
            }
        }
        #[cfg(feature = "sqlite")]
        if options.get_url().starts_with("sqlite:") {
            use sea_orm::sqlx::sqlite::{SqliteJournalMode, SqliteSynchronous};
            options.map_sqlx_sqlite_opts(|sqlite| {
                sqlite
                    .journal_mode(SqliteJournalMode::Wal)
                    .synchronous(SqliteSynchronous::Full)
                    .busy_timeout(SQLITE_BUSY_TIMEOUT)
                    .foreign_keys(true)
            });
        }
        let sqlite_file = sqlite_file(options.get_url()).map(Arc::from);
        let db = Database::connect(options).await?;
        migrate(&db).await?;
        let postgres_flusher = db.get_database_backend() == sea_orm::DbBackend::Postgres
            && flush::postgres_flush_allowed(&db).await?;
        let committer = committer(
            &db,
            sqlite_file.as_deref(),
            DEFAULT_MAX_BATCH,
            postgres_flusher,
            None,
        )?;
        Ok(SeaOrmStore {
            committer,
            db,
            keys: Arc::default(),
            sqlite_file,
            postgres_flusher,
            lease: Arc::default(),
            idempotency_window: super::DEFAULT_IDEMPOTENCY_WINDOW,
            owned: None,
            escrow: None,
        })
    }

    /// The same store owning its `SQLite` file: a reservation is then held in memory (credits
    /// held against the balance its batch read) and a call is written once, when it ends: an
    /// `ok` entry with its debit, or a `refunded` entry with nothing moved. That halves the
    /// ledger's writes per call; a crash loses only holds, which moved no money.
    ///
    /// A lock file beside the database (`<file>-owner.lock`) refuses a second owner, in this
    /// process or another, for as long as this store or a clone of it lives. Stores that do not
    /// own the file (the CLI, an admin tool, another process) may still grant, revoke, lapse and
    /// audit: each batch reads the account rows under the file's write lock, so the next
    /// reservation sees a grant or a revocation. If one of them takes credits that a held call
    /// counted on (a lapse at the end of a period, a call reserved by a store that does not own
    /// the file), that call ends `refunded`, unbilled, and its client is told the upstream
    /// failed: the account never goes below zero.
    ///
    /// A call with an idempotency key is still reserved in the database (see
    /// [`Ledger::reserve`]), and so are calls while their store does not own the file. While
    /// held, a call has no call-log entry; [`Ledger::balance`] counts it as spent.
    ///
    /// # Errors
    ///
    /// Not a `SQLite` file (always, in a build without the `sqlite` feature), the lock file
    /// cannot be made, or another store owns the file.
    pub fn own_file(self) -> Result<SeaOrmStore, StoreError> {
        let Some(file) = self.sqlite_file.clone() else {
            return Err(StoreError::msg("only a SQLite file can be owned"));
        };
        let lock_path = format!("{}-owner.lock", file.display());
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|error| StoreError::msg(format!("opening {lock_path}: {error}")))?;
        if let Err(error) = lock.try_lock() {
            return Err(StoreError::msg(format!(
                "another gateway owns {} (its lock {lock_path} is held: {error}); \
                 stop it first, or serve the file shared",
                file.display()
            )));
        }
        let owned = Owned {
            holds: Arc::default(),
            _lock: Arc::new(lock),
        };
        Ok(SeaOrmStore {
            committer: committer(
                &self.db,
                Some(&file),
                DEFAULT_MAX_BATCH,
                self.postgres_flusher,
                Some(owned.holds.clone()),
            )?,
            owned: Some(owned),
            ..self
        })
    }

    /// The same store charging against credit escrow, on `PostgreSQL`: while it holds an
    /// instance lease ([`Leases::take_lease`](super::Leases::take_lease)), it moves a slice of
    /// each account's credits it charges (64 calls' worth, doubling up to 1024 while its escrow
    /// for the account is refilled again within 250 ms, and at most an eighth of what the
    /// account has to spend; only from an account with at least 256 calls' worth, so that one
    /// running low is charged in the database) into an escrow row of its own, holds reservations
    /// in memory against it, and writes each call once, when it ends: an `ok` entry with the
    /// escrow's debit, or a `refunded` entry with nothing moved. No call's write touches the
    /// account's row, which other instances charging the same account would wait on.
    ///
    /// What stays as without escrow: a reservation waits for a read that its caller's key is
    /// still active, so a revocation refuses the next call on every instance; subscription
    /// credits are spent first (top-up credits in escrow are swapped for subscription credits
    /// granted meanwhile) and never after their period; the balance, the account listings and
    /// the audit count escrowed credits as the account's; a lapse takes a subscription's
    /// escrowed credits too, except what the lapsing store's own calls hold (a call another
    /// instance holds on them then ends `refunded`, unbilled, and its client is told the
    /// upstream failed). Escrow comes back on
    /// [`Leases::release_lease`](super::Leases::release_lease), and, after a crash or a lost
    /// lease, when recovery ([`Leases::orphaned_reservations`](super::Leases::orphaned_reservations))
    /// finds its lease ended. Calls with an idempotency key, and all calls while no lease is
    /// held, are reserved in the database as without escrow; for a keyed call, the account's
    /// free escrow on this instance goes back first when it holds subscription credits.
    ///
    /// The price: credits in one instance's escrow are not spendable by another until they come
    /// back. An account that falls below 256 calls' worth gets no new escrow: each instance
    /// spends what it still has in escrow for it, then reserves in the database. A call that
    /// the database refuses for credits while other instances hold escrow for the account
    /// recalls it, keyed or not: escrow under a lease that has ended (a crashed instance's) goes
    /// back at once, and the instances whose leases hold are asked (`NOTIFY` on the channel
    /// `mg_escrow_recall`, each instance listening on one connection of its pool, which
    /// reconnects if the connection is lost) to give back what they have free; the call waits up
    /// to a second for their escrow to fall, and is tried once more. So an account is refused
    /// (402) only when the credits left are held by calls still running elsewhere, or a recall
    /// was missed (an instance reconnecting): what an instance's escrow for an account has free
    /// goes back anyway once no call has been held against it for 5 to 10 seconds
    /// ([`DEFAULT_ESCROW_IDLE`](super::DEFAULT_ESCROW_IDLE); see [`with_escrow_idle_after`](Self::with_escrow_idle_after)).
    /// And subscription credits come first within each instance's escrow and the account row,
    /// not across instances: one may spend top-up credits from its escrow while another still
    /// holds subscription credits of the same account in its own.
    ///
    /// # Errors
    ///
    /// Not a `PostgreSQL` database.
    pub fn with_escrow(self) -> Result<SeaOrmStore, StoreError> {
        self.with_escrow_idle_after(DEFAULT_ESCROW_IDLE)
    }

    /// [`with_escrow`](Self::with_escrow), giving back what an account's escrow has free once
    /// no call has been held against it for `idle` to twice `idle` (at least 10 ms): the
    /// instance looks every `idle`. Shorter lets other instances spend an idle account's last
    /// credits sooner; each give-back is one short transaction on the account's row, and the
    /// next call on that account takes a new slice in another.
    ///
    /// # Errors
    ///
    /// Not a `PostgreSQL` database.
    pub fn with_escrow_idle_after(
        self,
        idle: std::time::Duration,
    ) -> Result<SeaOrmStore, StoreError> {
        if self.db.get_database_backend() != sea_orm::DbBackend::Postgres {
            return Err(StoreError::msg("escrow needs PostgreSQL"));
        }
        let idle = idle.max(std::time::Duration::from_millis(10));
        Ok(SeaOrmStore {
            escrow: Some(escrow::Escrow::start(self.db.clone(), idle)),
            ..self
        })
    }

    /// The database file, when the store is on a `SQLite` file.
    pub fn sqlite_file(&self) -> Option<&Path> {
        self.sqlite_file.as_deref()
    }

    /// How many reservations are held in memory now (always 0 unless the store owns its
    /// `SQLite` file, see [`own_file`](Self::own_file), or charges against escrow, see
    /// [`with_escrow`](Self::with_escrow)).
    pub async fn held_reservations(&self) -> usize {
        let escrowed = self.escrow.as_ref().map_or(0, |escrow| escrow.held_calls());
        escrowed
            + match &self.owned {
                Some(owned) => owned.holds.lock().holds.len(),
                None => 0,
            }
    }

    /// The calls this store holds in memory (owned file, escrow) reserved before `cutoff`.
    async fn held_before(&self, cutoff: chrono::DateTime<Utc>) -> Vec<super::Overdue> {
        let mut held = Vec::new();
        if let Some(escrow) = &self.escrow {
            held.push(escrow.held_before(cutoff));
        }
        if let Some(owned) = &self.owned {
            held.push(owned.holds.lock().holds.older_than(cutoff));
        }
        held
    }

    /// What `account` has to spend when its row holds `row`: that with its escrowed credits,
    /// which are the account's whichever instance holds them, less what this store holds
    /// against its escrow.
    async fn with_escrow_of<C: ConnectionTrait>(
        &self,
        conn: &C,
        account: AccountId,
        row: Balance,
    ) -> Result<Balance, StoreError> {
        let escrowed = escrow::escrowed(conn, Some(&[account.0])).await?;
        let whole = with_escrowed(row, escrowed.get(&account.0).copied().unwrap_or_default());
        Ok(match &self.escrow {
            Some(escrow) => whole.free_of(escrow.held_on(account.0)),
            None => whole,
        })
    }

    /// The holds of a store that owns its file, frozen: no batch is written and no
    /// reservation held until the guard is dropped. Take it before a write transaction, never
    /// inside one.
    async fn freeze_holds(&self) -> Option<holds::Frozen<'_>> {
        match &self.owned {
            Some(owned) => Some(owned.holds.freeze().await),
            None => None,
        }
    }

    /// A reservation without an idempotency key: on a file this store owns, decided at once
    /// where the rows the committer last read still hold (see `sqlite_direct::reserve_now`)
    /// and no reservation or refund waits for the committer (which would decide it first);
    /// otherwise queued (`holds::State::queue`): by the committer in its next batch, or,
    /// if it arrived while a batch took or gave up the write lock, at once as soon as the
    /// committer can tell the file's version again.
    async fn reserve_unkeyed(&self, charge: OwnedCharge) -> Result<Reservation, ReserveError> {
        if let (Some(escrow), Some(lease)) = (&self.escrow, charge.instance) {
            if let Some(reservation) = escrow.reserve(&charge, lease).await? {
                return Ok(reservation);
            }
            // Reserved in the database; refused for credits, tried once more after other
            // instances gave back what their escrow holds free for the account.
            let account = charge.caller.account.0;
            return match self.committer.reserve(charge.clone()).await {
                Err(ReserveError::InsufficientCredits) if escrow.recall(account, lease).await? => {
                    self.committer.reserve(charge).await
                }
                reserved => reserved,
            };
        }
        #[cfg(feature = "sqlite")]
        if let Some(owned) = &self.owned {
            let shared = &owned.holds;
            if let Some(reserved) = sqlite_direct::reserve_now(&mut shared.lock(), &charge) {
                return reserved;
            }
            let slot = self.committer.slot().await?;
            // Queued under the lock, so that reservations and refunds are decided in the
            // order they took it.
            let answer = {
                let mut state = shared.lock();
                if let Some(reserved) = sqlite_direct::reserve_now(&mut state, &charge) {
                    return reserved;
                }
                slot.queue(&mut state, Write::Reserve(charge), Reply::Reserve)
            };
            return answer.wait().await;
        }
        self.committer.reserve(charge).await
    }

    /// How the ledger's writes have been grouped into transactions so far.
    pub fn group_commit_stats(&self) -> GroupCommitStats {
        self.committer.stats()
    }

    /// The same store with at most `max_batch` ledger writes per transaction (1: none shared).
    /// Fails only if a `SQLite` file cannot be opened again for the new committer.
    pub fn with_max_batch(self, max_batch: usize) -> Result<SeaOrmStore, StoreError> {
        let holds = self.owned.as_ref().map(|owned| owned.holds.clone());
        Ok(SeaOrmStore {
            committer: committer(
                &self.db,
                self.sqlite_file.as_deref(),
                max_batch.max(1),
                self.postgres_flusher,
                holds,
            )?,
            ..self
        })
    }

    /// The underlying connection, for embedders that keep their own tables beside ours.
    pub fn connection(&self) -> &DatabaseConnection {
        &self.db
    }

    async fn begin_write(&self) -> Result<DatabaseTransaction, DbErr> {
        begin_write(&self.db).await
    }

    /// The same store holding idempotency keys for `window` after their call (default
    /// [`DEFAULT_IDEMPOTENCY_WINDOW`](super::DEFAULT_IDEMPOTENCY_WINDOW)). Gateways sharing a
    /// database should agree on it.
    pub fn with_idempotency_window(mut self, window: std::time::Duration) -> SeaOrmStore {
        self.idempotency_window = window;
        self
    }

    /// The same store trusting remembered keys' rules for `ttl` (default five seconds): how
    /// soon rules changed on another gateway sharing the database apply here.
    pub fn with_key_rules_ttl(mut self, ttl: std::time::Duration) -> SeaOrmStore {
        self.keys = Arc::new(KeyCache::with_ttl(ttl));
        self
    }

    async fn audit_accounts(&self) -> Result<Vec<AccountAudit>, StoreError> {
        let mut audits: Vec<AccountAudit> = account::Entity::find()
            .order_by_asc(account::Column::Id)
            .all(&self.db)
            .await?
            .into_iter()
            .map(|row| AccountAudit {
                account: AccountId(row.id),
                balance: balance_of(&row),
                granted: Sums::default(),
                charged: Sums::default(),
                lapsed: 0,
            })
            .collect();
        let index = |audits: &[AccountAudit], id: i64| {
            audits.binary_search_by_key(&AccountId(id), |audit| audit.account)
        };
        // Escrowed credits are the account's (see `with_escrow`).
        for (account, escrowed) in escrow::escrowed(&self.db, None).await? {
            let Ok(at) = index(&audits, account) else {
                return Err(StoreError::msg(format!(
                    "escrow for missing account {account}"
                )));
            };
            audits[at].balance = with_escrowed(audits[at].balance, escrowed);
        }

        // Sums of many 64-bit amounts may pass 64 bits (SQLite then fails, PostgreSQL cannot
        // cast back): each is summed as its high and low 32 bits, which fit for up to 2^31
        // rows, and put together here exactly. SUM widens to a decimal on some databases;
        // bring each half back to a 64-bit integer.
        let integer = match self.db.get_database_backend() {
            sea_orm::DbBackend::MySql => "SIGNED",
            _ => "BIGINT",
        };
        let sum = |column: &str, half: &str| {
            let part = match half {
                "high" => format!("({column} >> 32)"),
                _ => format!("({column} & 4294967295)"),
            };
            Expr::cust(format!("CAST(COALESCE(SUM({part}), 0) AS {integer})"))
        };
        let exact = |high: i64, low: i64| (i128::from(high) << 32) + i128::from(low);
        let grants: Vec<(i64, String, i64, i64)> = credit_grant::Entity::find()
            .select_only()
            .column(credit_grant::Column::AccountId)
            .column(credit_grant::Column::Bucket)
            .column_as(sum("amount", "high"), "high")
            .column_as(sum("amount", "low"), "low")
            .group_by(credit_grant::Column::AccountId)
            .group_by(credit_grant::Column::Bucket)
            .into_tuple()
            .all(&self.db)
            .await?;
        for (account, bucket, high, low) in grants {
            let Ok(at) = index(&audits, account) else {
                return Err(StoreError::msg(format!(
                    "grant for missing account {account}"
                )));
            };
            match Bucket::parse(&bucket) {
                Some(Bucket::Subscription) => audits[at].granted.subscription = exact(high, low),
                Some(Bucket::Topup) => audits[at].granted.topup = exact(high, low),
                None => return Err(StoreError::msg(format!("unknown bucket {bucket}"))),
            }
        }

        let charges: Vec<(i64, i64, i64, i64, i64)> = call::Entity::find()
            .select_only()
            .column(call::Column::AccountId)
            .column_as(sum("charged_subscription", "high"), "subscription_high")
            .column_as(sum("charged_subscription", "low"), "subscription_low")
            .column_as(sum("charged_topup", "high"), "topup_high")
            .column_as(sum("charged_topup", "low"), "topup_low")
            .filter(
                call::Column::Status.is_in([CallStatus::Ok.as_str(), CallStatus::Pending.as_str()]),
            )
            .group_by(call::Column::AccountId)
            .into_tuple()
            .all(&self.db)
            .await?;
        for (account, subscription_high, subscription_low, topup_high, topup_low) in charges {
            let Ok(at) = index(&audits, account) else {
                return Err(StoreError::msg(format!(
                    "call for missing account {account}"
                )));
            };
            audits[at].charged = Sums {
                subscription: exact(subscription_high, subscription_low),
                topup: exact(topup_high, topup_low),
            };
        }
        let lapses: Vec<(i64, i64, i64)> = subscription_lapse::Entity::find()
            .select_only()
            .column(subscription_lapse::Column::AccountId)
            .column_as(sum("amount", "high"), "high")
            .column_as(sum("amount", "low"), "low")
            .group_by(subscription_lapse::Column::AccountId)
            .into_tuple()
            .all(&self.db)
            .await?;
        for (account, high, low) in lapses {
            let Ok(at) = index(&audits, account) else {
                return Err(StoreError::msg(format!(
                    "lapse for missing account {account}"
                )));
            };
            audits[at].lapsed = exact(high, low);
        }
        Ok(audits)
    }
}

/// The file behind a `sqlite:` URL; `None` for other databases and in-memory `SQLite` (which a
/// second connection could not see).
fn sqlite_file(url: &str) -> Option<PathBuf> {
    #[cfg(feature = "sqlite")]
    if url.starts_with("sqlite:") && !url.contains(":memory:") && !url.contains("mode=memory") {
        use std::str::FromStr;
        let options = sea_orm::sqlx::sqlite::SqliteConnectOptions::from_str(url).ok()?;
        return Some(options.get_filename().to_path_buf());
    }
    let _ = url;
    None
}

/// The committer for a store: on a `SQLite` file, a thread calling `SQLite` directly; otherwise a
/// task on the sea-orm pool, with `PostgreSQL`'s flusher where it may run.
fn committer(
    db: &DatabaseConnection,
    sqlite_file: Option<&Path>,
    max_batch: usize,
    postgres_flusher: bool,
    holds: Option<Arc<holds::SharedHolds>>,
) -> Result<Committer, StoreError> {
    #[cfg(feature = "sqlite")]
    if let Some(file) = sqlite_file {
        let (connection, wal) = sqlite_direct::open(file)?;
        return Committer::start_direct(connection, wal, max_batch, holds);
    }
    let _ = (sqlite_file, holds);
    Ok(Committer::start(db.clone(), max_batch, postgres_flusher))
}

/// Applies the migrations one store at a time. Several gateway instances starting together on
/// an empty `PostgreSQL` or `MySQL` database would otherwise all try to create the same tables, and
/// all but one would fail to start. `PostgreSQL`: the whole migration runs in one transaction
/// (its DDL is transactional) that first takes an advisory lock for the schema, so the others
/// wait and then find nothing to do. `MySQL` commits each DDL statement as it goes, so the
/// migration runs on one session holding a named lock for the database.
async fn migrate(db: &DatabaseConnection) -> Result<(), DbErr> {
    let backend = db.get_database_backend();
    let mysql = backend == sea_orm::DbBackend::MySql;
    let lock = match backend {
        sea_orm::DbBackend::Postgres => {
            "SELECT pg_advisory_xact_lock(\
             hashtextextended('model-gateway migrations ' || current_schema(), 0))"
        }
        sea_orm::DbBackend::MySql => {
            "SELECT CAST(GET_LOCK(CONCAT('model-gateway migrations ', DATABASE()), 60) AS SIGNED) \
             AS locked"
        }
        _ => return Migrator::up(db, None).await,
    };
    let session = db.begin().await?;
    let locked = session
        .query_one_raw(sea_orm::Statement::from_string(backend, lock))
        .await?;
    if mysql {
        // 1: taken; 0: another instance held it for a minute; NULL: an error.
        let taken = locked.and_then(|row| row.try_get::<Option<i64>>("", "locked").ok().flatten());
        if taken != Some(1) {
            return Err(DbErr::Custom(
                "another gateway instance has held the migration lock for a minute".into(),
            ));
        }
    }
    let migrated = Migrator::up(&session, None).await;
    if mysql {
        // A named lock belongs to the session, which goes back to the pool: release it whether
        // or not the migration succeeded.
        session
            .execute_unprepared("DO RELEASE_LOCK(CONCAT('model-gateway migrations ', DATABASE()))")
            .await?;
    }
    migrated?;
    session.commit().await
}

/// A moment as a statement value that every backend keeps whole. On `MySQL` it is a plain
/// `DATETIME` in UTC: sqlx sends a `DateTime<Utc>` as a `TIMESTAMP`, which `MariaDB` stores as
/// `NULL` past 2038-01-19 (a key's expiry or a subscription's end set that far would vanish).
fn moment_value(backend: sea_orm::DbBackend, at: Option<chrono::DateTime<Utc>>) -> sea_orm::Value {
    match backend {
        sea_orm::DbBackend::MySql => at.map(|at| at.naive_utc()).into(),
        _ => at.into(),
    }
}

/// How long a pooled connection may sit idle before it is tested on checkout (see
/// [`SeaOrmStore::connect_with`]).
const PING_IF_IDLE_FOR: std::time::Duration = std::time::Duration::from_secs(30);

/// An account row's balance with its escrowed credits (see [`SeaOrmStore::with_escrow`]).
/// Saturates: a total past the largest balance is reported by the audit, not wrapped.
fn with_escrowed(row: Balance, escrowed: Balance) -> Balance {
    Balance {
        subscription: Credits(row.subscription.0.saturating_add(escrowed.subscription.0)),
        topup: Credits(row.topup.0.saturating_add(escrowed.topup.0)),
    }
}

fn balance_of(row: &account::Model) -> Balance {
    Balance {
        subscription: Credits(row.subscription_credits),
        topup: Credits(row.topup_credits),
    }
}

async fn locked_account<C: ConnectionTrait>(
    txn: &C,
    account: AccountId,
) -> Result<account::Model, StoreError> {
    account::Entity::find_by_id(account.0)
        .lock_exclusive()
        .one(txn)
        .await?
        .ok_or_else(|| unknown_account(account))
}

#[async_trait]
impl KeyStore for SeaOrmStore {
    /// Answers from the store's cache of active keys when it can (see [`Ledger::reserve`] for
    /// how a key revoked since is refused).
    async fn active_key(&self, key: &KeyHash) -> Result<Option<ActiveKey>, StoreError> {
        if let Some(active) = self.keys.get(key) {
            return Ok(Some(active));
        }
        let found = api_key::Entity::find()
            .filter(api_key::Column::KeyHash.eq(key.as_str()))
            .filter(api_key::Column::RevokedAt.is_null())
            .one(&self.db)
            .await?;
        let Some(row) = found else {
            return Ok(None);
        };
        let active = ActiveKey {
            caller: Caller {
                account: AccountId(row.account_id),
                key: KeyId(row.id),
            },
            rules: accounts::key_rules(&row)?,
        };
        self.keys.remember(key, active.clone());
        Ok(Some(active))
    }
}

#[async_trait]
impl Ledger for SeaOrmStore {
    async fn reserve(&self, request: ChargeRequest<'_>) -> Result<Reservation, ReserveError> {
        let mut charge = OwnedCharge::from(request);
        charge.instance = self.lease.for_reservation()?;
        let reserved = match request.idempotency {
            Some(key) => {
                // Held reservations count as spent: none may change while this one is decided.
                let holds = self.freeze_holds().await;
                let window = self.idempotency_window;
                let account = charge.caller.account.0;
                // A keyed call is reserved in the database: subscription credits in this
                // instance's escrow go back first, to be spent before the row's top-up credits.
                if let (Some(escrow), Some(lease)) = (&self.escrow, charge.instance)
                    && escrow.has_free_subscription(lease, account)
                {
                    escrow.give_back(lease, Some(account)).await?;
                }
                let reserve =
                    || idempotent::reserve(&self.db, charge.clone(), key, window, holds.as_deref());
                let mut reserved = reserve().await;
                if let (Err(ReserveError::InsufficientCredits), Some(escrow), Some(lease)) =
                    (&reserved, &self.escrow, charge.instance)
                {
                    // The account's credits may be in this instance's escrow: give back what is
                    // free there and try once more; then in other instances' (an escrow instance
                    // owns no file, so nothing is frozen while they are recalled).
                    escrow.give_back(lease, Some(account)).await?;
                    reserved = reserve().await;
                    if let Err(ReserveError::InsufficientCredits) = reserved
                        && escrow.recall(account, lease).await?
                    {
                        reserved = reserve().await;
                    }
                }
                reserved
            }
            None => self.reserve_unkeyed(charge).await,
        };
        if let Err(ReserveError::KeyRevoked) = reserved {
            self.keys.forget_id(request.caller.key);
        }
        reserved
    }

    async fn settle(&self, call: CallId, success: CallSuccess) -> Result<bool, StoreError> {
        if let Some(escrow) = self.escrow.as_ref().filter(|escrow| escrow.holds(call)) {
            return escrow.settle(call, success).await;
        }
        let Some(owned) = &self.owned else {
            if success.reply.is_some() {
                return idempotent::settle(&self.db, call, success).await;
            }
            return self.committer.settle(call, success).await;
        };
        // Queued under the holds' lock, in order with reservations and refunds (see
        // `reserve_unkeyed`).
        let slot = self.committer.slot().await?;
        let answer = {
            let mut state = owned.holds.lock();
            // A keyed call, reserved in the database: a held one has no key, and so no record
            // to keep its reply in, and the committer settles it.
            if success.reply.is_some() && state.holds.call(call.0).is_none() {
                Err(success)
            } else {
                Ok(slot.queue(&mut state, Write::Settle(call, success), Reply::Finish))
            }
        };
        match answer {
            Ok(answer) => answer.wait().await,
            Err(success) => idempotent::settle(&self.db, call, success).await,
        }
    }

    async fn forget_idempotent_calls(&self, now: chrono::DateTime<Utc>) -> Result<u64, StoreError> {
        idempotent::forget(&self.db, now, self.idempotency_window).await
    }

    async fn refund(&self, call: CallId, failure: &CallFailure) -> Result<bool, StoreError> {
        if let Some(escrow) = self.escrow.as_ref().filter(|escrow| escrow.holds(call)) {
            return escrow.refund(call, failure).await;
        }
        if let Some(owned) = &self.owned {
            // Queued under the holds' lock: see `reserve_unkeyed`.
            let slot = self.committer.slot().await?;
            let answer = {
                let mut state = owned.holds.lock();
                let refund = Write::Refund(call, failure.clone());
                slot.queue(&mut state, refund, Reply::Finish)
            };
            return answer.wait().await;
        }
        self.committer.refund(call, failure.clone()).await
    }

    async fn pending_for_request(
        &self,
        account: AccountId,
        request_id: &str,
    ) -> Result<Vec<CallId>, StoreError> {
        let ids: Vec<i64> = call::Entity::find()
            .select_only()
            .column(call::Column::Id)
            .filter(call::Column::AccountId.eq(account.0))
            .filter(call::Column::Status.eq(CallStatus::Pending.as_str()))
            .filter(call::Column::RequestId.eq(request_id))
            .into_tuple()
            .all(&self.db)
            .await?;
        Ok(ids.into_iter().map(CallId).collect())
    }

    async fn call_status(&self, call: CallId) -> Result<Option<CallStatus>, StoreError> {
        let status: Option<String> = call::Entity::find_by_id(call.0)
            .select_only()
            .column(call::Column::Status)
            .into_tuple()
            .one(&self.db)
            .await?;
        status
            .map(|status| {
                CallStatus::parse(&status)
                    .ok_or_else(|| StoreError::msg(format!("unknown status {status}")))
            })
            .transpose()
    }

    async fn stale_reservations(
        &self,
        cutoff: chrono::DateTime<Utc>,
        limit: u64,
    ) -> Result<Vec<CallId>, StoreError> {
        let ids: Vec<i64> = call::Entity::find()
            .select_only()
            .column(call::Column::Id)
            .filter(call::Column::Status.eq(CallStatus::Pending.as_str()))
            .filter(call::Column::CreatedAt.lt(cutoff))
            .filter(leases::unprotected(Utc::now()))
            .order_by_asc(call::Column::CreatedAt)
            .limit(limit)
            .into_tuple()
            .all(&self.db)
            .await?;
        Ok(ids.into_iter().map(CallId).collect())
    }

    async fn balance(&self, account: AccountId) -> Result<Balance, StoreError> {
        let row = async || {
            account::Entity::find_by_id(account.0)
                .one(&self.db)
                .await?
                .map(|row| balance_of(&row))
                .ok_or_else(|| unknown_account(account))
        };
        if let Some(holds) = self.freeze_holds().await {
            return Ok(holds.net(account.0, row().await?));
        }
        self.with_escrow_of(&self.db, account, row().await?).await
    }
}

fn call_record(row: call::Model) -> Result<CallRecord, StoreError> {
    let protocol = Protocol::parse(&row.protocol)
        .ok_or_else(|| StoreError::msg(format!("unknown protocol {}", row.protocol)))?;
    let status = CallStatus::parse(&row.status)
        .ok_or_else(|| StoreError::msg(format!("unknown status {}", row.status)))?;
    Ok(CallRecord {
        id: CallId(row.id),
        account: AccountId(row.account_id),
        key: KeyId(row.key_id),
        protocol,
        model: row.model,
        price: Credits(row.price),
        charged_subscription: Credits(row.charged_subscription),
        charged_topup: Credits(row.charged_topup),
        status,
        upstream_status: row.upstream_status.and_then(|s| u16::try_from(s).ok()),
        channel: row.upstream_channel,
        upstream_error: row.upstream_error,
        input_tokens: row.input_tokens,
        output_tokens: row.output_tokens,
        created_at: row.created_at,
        finished_at: row.finished_at,
        request_id: row.request_id,
    })
}

#[async_trait]
impl super::Leases for SeaOrmStore {
    async fn take_lease(
        &self,
        now: chrono::DateTime<Utc>,
        ttl: std::time::Duration,
    ) -> Result<Option<super::LeaseId>, StoreError> {
        leases::take(&self.db, self.sqlite_file.as_deref(), &self.lease, now, ttl)
            .await
            .map(Some)
    }

    async fn renew_lease(
        &self,
        now: chrono::DateTime<Utc>,
        ttl: std::time::Duration,
    ) -> Result<bool, StoreError> {
        leases::renew(&self.db, &self.lease, now, ttl).await
    }

    async fn release_lease(&self) -> Result<(), StoreError> {
        if let (Some(escrow), Some(lease)) = (&self.escrow, self.lease.current()) {
            escrow.give_back(lease, None).await?;
        }
        leases::release(&self.db, &self.lease).await
    }

    async fn orphaned_reservations(
        &self,
        now: chrono::DateTime<Utc>,
        limit: u64,
    ) -> Result<Vec<CallId>, StoreError> {
        leases::orphaned(
            &self.db,
            self.sqlite_file.as_deref(),
            &self.lease,
            now,
            limit,
        )
        .await
    }

    async fn forget_ended_leases(&self, now: chrono::DateTime<Utc>) -> Result<u64, StoreError> {
        leases::forget_ended(&self.db, now).await
    }
}

#[async_trait]
impl CallLog for SeaOrmStore {
    async fn usage(
        &self,
        account: AccountId,
        since: chrono::DateTime<Utc>,
    ) -> Result<Vec<DailyUsage>, StoreError> {
        // The UTC day of a call, as each database writes it.
        let (day, integer) = match self.db.get_database_backend() {
            sea_orm::DbBackend::Postgres => (
                "to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD')",
                "BIGINT",
            ),
            sea_orm::DbBackend::MySql => ("DATE_FORMAT(created_at, '%Y-%m-%d')", "SIGNED"),
            _ => ("substr(created_at, 1, 10)", "BIGINT"),
        };
        let rows: Vec<(String, String, i64, i64)> = call::Entity::find()
            .select_only()
            .column_as(Expr::cust(day), "day")
            .column(call::Column::Model)
            .column_as(Expr::cust(format!("CAST(COUNT(*) AS {integer})")), "calls")
            .column_as(
                Expr::cust(format!("CAST(COALESCE(SUM(price), 0) AS {integer})")),
                "credits",
            )
            .filter(call::Column::AccountId.eq(account.0))
            .filter(call::Column::Status.eq(CallStatus::Ok.as_str()))
            .filter(call::Column::CreatedAt.gte(since))
            .group_by(Expr::cust(day))
            .group_by(call::Column::Model)
            .order_by_asc(Expr::cust(day))
            .order_by_asc(call::Column::Model)
            .into_tuple()
            .all(&self.db)
            .await?;
        Ok(rows
            .into_iter()
            .map(|(day, model, calls, credits)| DailyUsage {
                day,
                model,
                calls,
                credits,
            })
            .collect())
    }

    async fn calls(
        &self,
        account: AccountId,
        query: CallQuery<'_>,
    ) -> Result<Vec<CallRecord>, StoreError> {
        let mut select = call::Entity::find().filter(call::Column::AccountId.eq(account.0));
        if let Some(before) = query.before {
            select = select.filter(call::Column::Id.lt(before.0));
        }
        if let Some(status) = query.status {
            select = select.filter(call::Column::Status.eq(status.as_str()));
        }
        if let Some(model) = query.model {
            select = select.filter(call::Column::Model.eq(model));
        }
        select
            .order_by_desc(call::Column::Id)
            .limit(query.limit)
            .all(&self.db)
            .await?
            .into_iter()
            .map(call_record)
            .collect()
    }
}
