//! Instance leases (`mg_instances`): a serving gateway's row, renewed while it lives, whose id
//! each of its reservations records.
//!
//! A lease holds until its `expires_at`. Renewal only extends a lease that still holds, so one
//! that ended (expired, or ended by recovery) is never revived: its holder takes a new one.
//! Judged by the clock of whoever reads the row, so hosts sharing a database keep their clocks
//! in step (NTP): a host running ahead by more than a lease's margin would see its peers'
//! leases end early, and refund calls they are still serving (those calls then answer 502).
//!
//! On a `SQLite` file every holder is on the same host, and the operating system says at once
//! whether it is alive: each lease has a lock file beside the database, held locked by its
//! holder for as long as the process runs. A lock that can be taken belongs to a dead process,
//! so a gateway restarted after a crash ends its predecessor's lease at start rather than
//! waiting for it to expire.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Instant;

use chrono::{DateTime, Utc};
use sea_orm::sea_query::Expr;
use sea_orm::{
    ColumnTrait, Condition, DatabaseConnection, EntityTrait, NotSet, QueryFilter, QuerySelect, Set,
};

use super::entity::{call, escrow, instance};
use super::rows::pending_ids;
use crate::store::{CallId, CallStatus, LeaseId, StoreError};

/// No lease: reservations record none.
const NONE: i64 = 0;

/// The lease a store holds now, shared by its clones, and on a `SQLite` file its lock.
#[derive(Debug, Default)]
pub(super) struct HeldLease {
    id: AtomicI64,
    lock: Mutex<Option<LockFile>>,
    /// Until when, on this process's monotonic clock, the lease surely holds for every reader:
    /// from just before the statement that last set its expiry, its time to live less a margin
    /// (see [`safe_until`]). Past it, no call is reserved under the lease.
    safe_until: Mutex<Option<Instant>>,
    /// The leases this process held that ended while it lived, by expiry (the database was out
    /// of reach longer than their time to live): its calls under way under them are its own to
    /// finish, never its own recovery's to refund (another instance's recovery may).
    lost: Mutex<Vec<i64>>,
}

impl HeldLease {
    /// The leases this process held that ended by expiry while it lived.
    pub(super) fn lost(&self) -> Vec<i64> {
        self.lost
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// The lease that reservations record now.
    pub(super) fn current(&self) -> Option<i64> {
        Some(self.id.load(Ordering::Acquire)).filter(|id| *id != NONE)
    }

    /// The lease a reservation made now records: `None` if there is none; an error if it is
    /// held but could not be renewed in time, so that another instance may judge it ended and
    /// refund what is reserved under it. The call is then answered `503` rather than reserved
    /// and later withheld.
    pub(super) fn for_reservation(&self) -> Result<Option<i64>, StoreError> {
        let Some(id) = self.current() else {
            return Ok(None);
        };
        let safe_until = *self
            .safe_until
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match safe_until {
            Some(until) if Instant::now() >= until => Err(StoreError::msg(
                "this gateway's instance lease could not be renewed in time; no call is \
                 reserved under it until it is",
            )),
            _ => Ok(Some(id)),
        }
    }

    /// The lease's expiry was set by a statement sent at `sent` with `ttl`.
    fn extended(&self, sent: Instant, ttl: std::time::Duration) {
        *self
            .safe_until
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(safe_until(sent, ttl));
    }

    fn hold(&self, id: i64, lock: Option<LockFile>) {
        let mut held = self
            .lock
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        *held = lock;
        self.id.store(id, Ordering::Release);
    }

    /// Stops recording `id`, and removes its lock file, if it is still the one held.
    fn drop_lease(&self, id: i64) {
        let mut held = self
            .lock
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if self
            .id
            .compare_exchange(id, NONE, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
            && let Some(lock) = held.take()
        {
            let _ = std::fs::remove_file(&lock.path);
        }
    }
}

/// A lease's lock file, locked for as long as this value lives. Dropped without its lease
/// being ended (the store was dropped, or its process died), it stays behind unlocked, which is
/// how other instances learn that its holder is gone.
#[derive(Debug)]
struct LockFile {
    path: PathBuf,
    _file: File,
}

/// Where the lock files of a `SQLite` file's leases live.
fn lock_dir(database: &Path) -> PathBuf {
    let mut name = database.as_os_str().to_owned();
    name.push("-leases");
    PathBuf::from(name)
}

fn lock_path(database: &Path, lease: i64) -> PathBuf {
    lock_dir(database).join(format!("{lease}.lock"))
}

fn io_error(what: &str, path: &Path, error: &std::io::Error) -> StoreError {
    StoreError::msg(format!("{what} {}: {error}", path.display()))
}

/// Creates the lease's lock file, already locked: it is locked under a temporary name and then
/// renamed, so that nobody can find it unlocked while its holder lives.
fn create_lock(database: &Path, lease: i64) -> Result<LockFile, StoreError> {
    let dir = lock_dir(database);
    std::fs::create_dir_all(&dir).map_err(|error| io_error("creating", &dir, &error))?;
    let temporary = dir.join(format!(".{lease}.{}.tmp", std::process::id()));
    let file =
        File::create(&temporary).map_err(|error| io_error("creating", &temporary, &error))?;
    file.try_lock()
        .map_err(|error| StoreError::msg(format!("locking {}: {error}", temporary.display())))?;
    let path = lock_path(database, lease);
    std::fs::rename(&temporary, &path).map_err(|error| io_error("renaming", &temporary, &error))?;
    Ok(LockFile { path, _file: file })
}

/// Whether the holder of `lease` is known to be dead: its lock file exists and can be locked.
/// A missing file says nothing (its holder may be between taking the row and the lock), and
/// the expiry decides.
fn holder_is_dead(database: &Path, lease: i64) -> bool {
    let path = lock_path(database, lease);
    let Ok(file) = File::open(&path) else {
        return false;
    };
    if file.try_lock().is_ok() {
        // Nobody will take this lock again; the lock is ours until `file` closes.
        let _ = std::fs::remove_file(&path);
        return true;
    }
    false
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|name| name.trim().chars().take(255).collect())
        .filter(|name: &String| !name.is_empty())
        .unwrap_or_else(|| "unknown".to_owned())
}

/// How long a lease whose expiry a statement sent at `sent` set to its `ttl` surely holds, on
/// the sender's monotonic clock: the expiry is `now + ttl` on the sender's wall clock, taken
/// before `sent`, and readers judge it by theirs. A margin of one heartbeat (a fifth of the
/// lease) covers the readers' clocks running ahead (hosts keep them in step with NTP) and the
/// statement's own time.
fn safe_until(sent: Instant, ttl: std::time::Duration) -> Instant {
    sent + ttl - ttl / 5
}

fn expiry(now: DateTime<Utc>, ttl: std::time::Duration) -> Result<DateTime<Utc>, StoreError> {
    chrono::Duration::from_std(ttl)
        .ok()
        .and_then(|ttl| now.checked_add_signed(ttl))
        .ok_or_else(|| StoreError::Invalid("lease time to live out of range".into()))
}

/// Takes a new lease until `now + ttl` and makes it the one `held` records, ending the one it
/// held before.
pub(super) async fn take(
    db: &DatabaseConnection,
    sqlite_file: Option<&Path>,
    held: &HeldLease,
    now: DateTime<Utc>,
    ttl: std::time::Duration,
) -> Result<LeaseId, StoreError> {
    if let Some(previous) = held.current() {
        end(db, held, previous).await?;
    }
    let sent = Instant::now();
    let row = instance::ActiveModel {
        id: NotSet,
        host: Set(host_name()),
        pid: Set(i64::from(std::process::id())),
        started_at: Set(now),
        expires_at: Set(expiry(now, ttl)?),
    };
    let id = instance::Entity::insert(row).exec(db).await?.last_insert_id;
    let lock = match sqlite_file {
        Some(database) => Some(create_lock(database, id)?),
        None => None,
    };
    held.extended(sent, ttl);
    held.hold(id, lock);
    Ok(LeaseId(id))
}

/// Extends the held lease to `now + ttl` if it still holds; `false` if it had ended (and is
/// no longer recorded) or there is none.
pub(super) async fn renew(
    db: &DatabaseConnection,
    held: &HeldLease,
    now: DateTime<Utc>,
    ttl: std::time::Duration,
) -> Result<bool, StoreError> {
    let Some(id) = held.current() else {
        return Ok(false);
    };
    let sent = Instant::now();
    let renewed = instance::Entity::update_many()
        .col_expr(instance::Column::ExpiresAt, Expr::value(expiry(now, ttl)?))
        .filter(instance::Column::Id.eq(id))
        .filter(instance::Column::ExpiresAt.gt(now))
        .exec(db)
        .await?;
    if renewed.rows_affected == 1 {
        held.extended(sent, ttl);
        return Ok(true);
    }
    held.drop_lease(id);
    held.lost
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .push(id);
    Ok(false)
}

/// Ends lease `id` now (its holder stops, or is dead) and, if `held` holds it, stops recording it.
pub(super) async fn end(
    db: &DatabaseConnection,
    held: &HeldLease,
    id: i64,
) -> Result<(), StoreError> {
    instance::Entity::update_many()
        .col_expr(
            instance::Column::ExpiresAt,
            Expr::value(DateTime::UNIX_EPOCH),
        )
        .filter(instance::Column::Id.eq(id))
        .exec(db)
        .await?;
    held.drop_lease(id);
    Ok(())
}

/// On a `SQLite` file, ends the leases that hold at `now` but whose holder is dead.
pub(super) async fn end_dead_holders(
    db: &DatabaseConnection,
    sqlite_file: Option<&Path>,
    held: &HeldLease,
    now: DateTime<Utc>,
) -> Result<(), StoreError> {
    let Some(database) = sqlite_file else {
        return Ok(());
    };
    let live: Vec<i64> = instance::Entity::find()
        .select_only()
        .column(instance::Column::Id)
        .filter(instance::Column::ExpiresAt.gt(now))
        .into_tuple()
        .all(db)
        .await?;
    for lease in live {
        if Some(lease) != held.current() && holder_is_dead(database, lease) {
            tracing::info!(lease, "the gateway holding this lease is gone; ending it");
            end(db, held, lease).await?;
        }
    }
    Ok(())
}

/// `pending` entries made under a lease that does not hold at `now`, oldest first (call
/// [`end_dead_holders`] first, and give back the escrow of ended leases), but for those under
/// `own`: leases this process held and lost while it lived, whose calls it is still serving.
pub(super) async fn orphaned(
    db: &DatabaseConnection,
    now: DateTime<Utc>,
    limit: u64,
    own: &[i64],
) -> Result<Vec<CallId>, StoreError> {
    let mut which = Condition::all()
        .add(call::Column::InstanceId.is_not_null())
        .add(outside_live_leases(now));
    if !own.is_empty() {
        which = which.add(call::Column::InstanceId.is_not_in(own.iter().copied()));
    }
    pending_ids(db, which, call::Column::Id, Some(limit)).await
}

/// Entries whose lease does not hold at `now`. A subquery, not a list read beforehand: in one
/// statement, an entry is seen only with its lease (taken before any entry records it), so a
/// gateway starting meanwhile cannot have its fresh calls taken for orphans.
fn outside_live_leases(now: DateTime<Utc>) -> sea_orm::sea_query::SimpleExpr {
    call::Column::InstanceId.not_in_subquery(live(now))
}

/// The leases that hold at `now`, as a subquery.
pub(super) fn live(now: DateTime<Utc>) -> sea_orm::sea_query::SelectStatement {
    sea_orm::sea_query::Query::select()
        .column(instance::Column::Id)
        .from(instance::Entity)
        .and_where(instance::Column::ExpiresAt.gt(now))
        .to_owned()
}

/// Entries that no live lease protects at `now`: made under no lease, or under one that ended.
pub(super) fn unprotected(now: DateTime<Utc>) -> Condition {
    Condition::any()
        .add(call::Column::InstanceId.is_null())
        .add(outside_live_leases(now))
}

/// Deletes the leases that ended before `now` with nothing pending and no escrow.
pub(super) async fn forget_ended(
    db: &DatabaseConnection,
    now: DateTime<Utc>,
) -> Result<u64, StoreError> {
    let busy: Vec<Option<i64>> = call::Entity::find()
        .select_only()
        .column(call::Column::InstanceId)
        .distinct()
        .filter(call::Column::Status.eq(CallStatus::Pending.as_str()))
        .filter(call::Column::InstanceId.is_not_null())
        .into_tuple()
        .all(db)
        .await?;
    let escrowing: Vec<i64> = escrow::Entity::find()
        .select_only()
        .column(escrow::Column::InstanceId)
        .distinct()
        .into_tuple()
        .all(db)
        .await?;
    let mut ended = instance::Entity::delete_many().filter(instance::Column::ExpiresAt.lte(now));
    let busy: Vec<i64> = busy.into_iter().flatten().chain(escrowing).collect();
    if !busy.is_empty() {
        ended = ended.filter(instance::Column::Id.is_not_in(busy));
    }
    Ok(ended.exec(db).await?.rows_affected)
}

/// Ends the held lease on a clean stop.
pub(super) async fn release(db: &DatabaseConnection, held: &HeldLease) -> Result<(), StoreError> {
    match held.current() {
        Some(id) => end(db, held, id).await,
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_file_is_found_dead_only_once_its_holder_lets_it_go() {
        let dir = tempfile::tempdir().unwrap();
        let database = dir.path().join("gateway.db");
        let lock = create_lock(&database, 7).unwrap();
        assert!(!holder_is_dead(&database, 7), "a held lock is alive");
        assert!(!holder_is_dead(&database, 8), "a missing lock says nothing");
        // Closing the file, as the death of its process does, lets the lock go.
        drop(lock);
        assert!(holder_is_dead(&database, 7));
        assert!(
            !lock_path(&database, 7).exists(),
            "a dead lease's file is removed"
        );
    }
}
