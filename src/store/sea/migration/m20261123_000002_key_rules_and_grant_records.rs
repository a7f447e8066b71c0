//! Per-key rules (the models a key may call, when it expires, its requests per minute) and what
//! each grant was for: its reason, and the `Idempotency-Key` that makes a retried grant apply
//! once per account.

use sea_orm_migration::prelude::*;
use sea_orm_migration::schema::*;

use super::m20261122_000001_create_ledger::moment;

#[derive(DeriveMigrationName)]
pub(super) struct Migration;

#[derive(DeriveIden, Clone, Copy)]
enum MgApiKeys {
    Table,
    Models,
    ExpiresAt,
    Rpm,
}

#[derive(DeriveIden, Clone, Copy)]
enum MgCreditGrants {
    Table,
    AccountId,
    Reason,
    IdempotencyKey,
}

const GRANT_ONCE_INDEX: &str = "mg_credit_grants_idempotency";

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        // One column per statement: SQLite adds one at a time.
        let columns = [
            (MgApiKeys::Table.into_iden(), text_null(MgApiKeys::Models)),
            (
                MgApiKeys::Table.into_iden(),
                moment(manager, MgApiKeys::ExpiresAt, true),
            ),
            (MgApiKeys::Table.into_iden(), integer_null(MgApiKeys::Rpm)),
            (
                MgCreditGrants::Table.into_iden(),
                string_len_null(MgCreditGrants::Reason, 500),
            ),
            (
                MgCreditGrants::Table.into_iden(),
                string_len_null(MgCreditGrants::IdempotencyKey, 255),
            ),
        ];
        for (table, mut column) in columns {
            manager
                .alter_table(Table::alter().table(table).add_column(&mut column).take())
                .await?;
        }
        // Several NULLs are allowed in a unique index on every backend: grants without a key
        // are not limited.
        manager
            .create_index(
                Index::create()
                    .name(GRANT_ONCE_INDEX)
                    .table(MgCreditGrants::Table)
                    .col(MgCreditGrants::AccountId)
                    .col(MgCreditGrants::IdempotencyKey)
                    .unique()
                    .take(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_index(
                Index::drop()
                    .name(GRANT_ONCE_INDEX)
                    .table(MgCreditGrants::Table)
                    .to_owned(),
            )
            .await?;
        let columns = [
            (MgApiKeys::Table.into_iden(), MgApiKeys::Models.into_iden()),
            (
                MgApiKeys::Table.into_iden(),
                MgApiKeys::ExpiresAt.into_iden(),
            ),
            (MgApiKeys::Table.into_iden(), MgApiKeys::Rpm.into_iden()),
            (
                MgCreditGrants::Table.into_iden(),
                MgCreditGrants::Reason.into_iden(),
            ),
            (
                MgCreditGrants::Table.into_iden(),
                MgCreditGrants::IdempotencyKey.into_iden(),
            ),
        ];
        for (table, column) in columns {
            manager
                .alter_table(Table::alter().table(table).drop_column(column).take())
                .await?;
        }
        Ok(())
    }
}
