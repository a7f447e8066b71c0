//! Idempotency keys on calls: one record per account and key, naming the call that holds the
//! key and, once that call is billed, the reply kept for the client's retries.

use sea_orm_migration::prelude::*;
use sea_orm_migration::schema::*;

use super::m20261122_000001_create_ledger::moment;

#[derive(DeriveMigrationName)]
pub(super) struct Migration;

#[derive(DeriveIden, Clone, Copy)]
enum MgIdempotentCalls {
    Table,
    Id,
    AccountId,
    IdemKey,
    Fingerprint,
    CallId,
    CreatedAt,
    ReplyStatus,
    ReplyContentType,
    ReplyBody,
}

const BY_KEY: &str = "mg_idempotent_calls_key";
const BY_CALL: &str = "mg_idempotent_calls_call";
const BY_AGE: &str = "mg_idempotent_calls_age";

/// A reply of up to [`MAX_KEPT_REPLY_BYTES`](crate::store::MAX_KEPT_REPLY_BYTES): `MySQL`'s `BLOB`
/// holds only 64 KiB, so it gets `LONGBLOB`.
fn reply_body(manager: &SchemaManager) -> ColumnDef {
    let mut definition = ColumnDef::new(MgIdempotentCalls::ReplyBody);
    if manager.get_database_backend() == sea_orm::DbBackend::MySql {
        definition.custom("LONGBLOB".into_iden());
    } else {
        definition.blob();
    }
    definition.null().take()
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        use MgIdempotentCalls as T;
        manager
            .create_table(
                Table::create()
                    .table(T::Table)
                    .col(big_pk_auto(T::Id))
                    .col(big_integer(T::AccountId))
                    .col(string_len(T::IdemKey, 255))
                    .col(string_len(T::Fingerprint, 64))
                    .col(big_integer(T::CallId))
                    .col(moment(manager, T::CreatedAt, false))
                    .col(integer_null(T::ReplyStatus))
                    .col(string_len_null(T::ReplyContentType, 255))
                    .col(reply_body(manager))
                    .take(),
            )
            .await?;
        let indexes = [
            (BY_KEY, vec![T::AccountId, T::IdemKey], true),
            (BY_CALL, vec![T::CallId], false),
            (BY_AGE, vec![T::CreatedAt], false),
        ];
        for (name, columns, unique) in indexes {
            let mut index = Index::create();
            index.name(name).table(T::Table);
            for column in columns {
                index.col(column);
            }
            if unique {
                index.unique();
            }
            manager.create_index(index.take()).await?;
        }
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(MgIdempotentCalls::Table).to_owned())
            .await
    }
}
