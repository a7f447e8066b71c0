//! Records each call's request id (`x-request-id`), so an operator can find a client's call from
//! the id its answer carried.

use sea_orm_migration::prelude::*;
use sea_orm_migration::schema::*;

#[derive(DeriveMigrationName)]
pub(super) struct Migration;

#[derive(DeriveIden, Clone, Copy)]
enum MgCalls {
    Table,
    RequestId,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(MgCalls::Table)
                    .add_column(string_len_null(MgCalls::RequestId, 128))
                    .take(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(MgCalls::Table)
                    .drop_column(MgCalls::RequestId)
                    .take(),
            )
            .await
    }
}
