//! The committer: how the ledger's writes reach the database, in batches, one transaction
//! each (group commit), answered once durable. Every charging mode writes through it; the
//! shared mode is the committer alone (see `super::mode`).
//!
//! From the bottom up: `jobs` (the committer's vocabulary and counters), `row_cache` (the rows
//! a `SQLite` file's committer keeps between batches), `batch` (a batch's
//! decisions, against the rules), `ledger_ops` (a batch written through sea-orm) and
//! `sqlite_direct` (a batch written to a `SQLite` file directly), `batches` and `flush` (answering
//! once durable), `group_commit` (the committer itself).

pub(in crate::store::sea) mod batch;
mod batch_rows;
pub(in crate::store::sea) mod batches;
pub(in crate::store::sea) mod flush;
pub(in crate::store::sea) mod group_commit;
pub(in crate::store::sea) mod jobs;
pub(in crate::store::sea) mod ledger_ops;
#[cfg(feature = "sqlite")]
pub(in crate::store::sea) mod row_cache;
#[cfg(feature = "sqlite")]
pub(in crate::store::sea) mod sqlite_direct;
#[cfg(feature = "sqlite")]
mod sqlite_writes;
