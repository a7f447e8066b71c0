//! `mg_code_batches` and `mg_codes`: redemption codes an operator sells, stored as hashes, each
//! redeemed once (a guarded update of its row, in the transaction of its grant).

use sea_orm_migration::prelude::*;
use sea_orm_migration::schema::*;

use super::m20261122_000001_create_ledger::moment;

#[derive(DeriveMigrationName)]
pub(super) struct Migration;

#[derive(DeriveIden, Clone, Copy)]
enum MgCodeBatches {
    Table,
    Id,
    Label,
    Credits,
    Bucket,
    PeriodDays,
    ExpiresAt,
    CreatedAt,
}

#[derive(DeriveIden, Clone, Copy)]
enum MgCodes {
    Table,
    CodeHash,
    BatchId,
    RedeemedAt,
    AccountId,
    RevokedAt,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(MgCodeBatches::Table)
                    .col(big_pk_auto(MgCodeBatches::Id))
                    .col(string_len_null(MgCodeBatches::Label, 200))
                    .col(
                        big_integer(MgCodeBatches::Credits)
                            .check(Expr::col(MgCodeBatches::Credits).gt(0)),
                    )
                    .col(string_len(MgCodeBatches::Bucket, 16))
                    .col(integer_null(MgCodeBatches::PeriodDays))
                    .col(moment(manager, MgCodeBatches::ExpiresAt, true))
                    .col(moment(manager, MgCodeBatches::CreatedAt, false))
                    .take(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table(MgCodes::Table)
                    .col(string_len(MgCodes::CodeHash, 64).primary_key())
                    .col(big_integer(MgCodes::BatchId))
                    .col(moment(manager, MgCodes::RedeemedAt, true))
                    .col(big_integer_null(MgCodes::AccountId))
                    .col(moment(manager, MgCodes::RevokedAt, true))
                    .foreign_key(
                        ForeignKey::create()
                            .name("fk_mg_codes_batch")
                            .from(MgCodes::Table, MgCodes::BatchId)
                            .to(MgCodeBatches::Table, MgCodeBatches::Id),
                    )
                    .take(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("idx_mg_codes_batch")
                    .table(MgCodes::Table)
                    .col(MgCodes::BatchId)
                    .take(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(MgCodes::Table).to_owned())
            .await?;
        manager
            .drop_table(Table::drop().table(MgCodeBatches::Table).to_owned())
            .await
    }
}
