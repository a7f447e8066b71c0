//! On `SQLite`, the call log's status CHECK written without an `IN` list.
//!
//! `SQLite` evaluates `"status" IN ('pending', 'ok', 'refunded')` (a list of three or more
//! constants) by building a temporary b-tree of the list each time the statement runs: every
//! insert of a call (the owned file's one write per call) and every status update opened a
//! temporary database, created a table in it and inserted three rows: two fifths of what `SQLite`
//! spent on the call (callgrind). The same rule written as three comparisons is checked in place.
//!
//! The rule is unchanged (the column is `NOT NULL`, and `IN` and `=` compare it alike), so the
//! rows already stored satisfy it, and only the text of the table's definition changes: as
//! `SQLite` documents for changing a CHECK constraint ("Making Other Kinds Of Table Schema
//! Changes"), that is an edit of `sqlite_master` with `writable_schema` on and the schema version
//! moved on, in a transaction. `PostgreSQL` and `MySQL` check an `IN` list in
//! place: nothing changes there.

use sea_orm::{ConnectionTrait, DbBackend, DbErr, Statement};
use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub(super) struct Migration;

/// The rule as the first migration wrote it (sea-query's text).
const WITH_LIST: &str = r#"CHECK ("status" IN ('pending', 'ok', 'refunded'))"#;

/// The same rule, checked without a temporary b-tree.
const WITH_COMPARISONS: &str =
    r#"CHECK ("status" = 'pending' OR "status" = 'ok' OR "status" = 'refunded')"#;

/// Rewrites `from` as `to` in `mg_calls`'s definition, in a transaction of its own: on one
/// connection (`writable_schema` belongs to it), the rewrite and the new schema version standing
/// or falling together. Run again, it finds nothing to rewrite.
async fn rewrite(manager: &SchemaManager<'_>, from: &str, to: &str) -> Result<(), DbErr> {
    if manager.get_database_backend() != DbBackend::Sqlite {
        return Ok(());
    }
    let transaction = manager.begin().await?;
    let connection = transaction.get_connection();
    connection
        .execute_unprepared("PRAGMA writable_schema = ON")
        .await?;
    // The first statement writes, so the transaction takes the file's write lock (waiting for
    // it as any writer does) before it reads anything: the version read below is the latest.
    let rewritten = connection
        .execute_raw(Statement::from_sql_and_values(
            DbBackend::Sqlite,
            "UPDATE sqlite_master SET sql = replace(sql, ?1, ?2) \
             WHERE type = 'table' AND name = 'mg_calls' AND instr(sql, ?1) > 0",
            [from.into(), to.into()],
        ))
        .await;
    // Off again whatever happened; a failed rewrite fails the migration, which rolls it back.
    connection
        .execute_unprepared("PRAGMA writable_schema = OFF")
        .await?;
    if rewritten?.rows_affected() > 0 {
        let version: i64 = connection
            .query_one_raw(Statement::from_string(
                DbBackend::Sqlite,
                "PRAGMA schema_version",
            ))
            .await?
            .ok_or_else(|| DbErr::Custom("SQLite gave no schema version".into()))?
            .try_get_by_index(0)?;
        // Every connection reads the definition anew before its next statement.
        connection
            .execute_unprepared(&format!("PRAGMA schema_version = {}", version + 1))
            .await?;
    }
    transaction.commit().await
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        rewrite(manager, WITH_LIST, WITH_COMPARISONS).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        rewrite(manager, WITH_COMPARISONS, WITH_LIST).await
    }
}
