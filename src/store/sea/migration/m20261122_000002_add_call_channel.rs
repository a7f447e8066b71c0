//! Records which upstream (channel) served each call, now that a model can have several.

use sea_orm_migration::prelude::*;
use sea_orm_migration::schema::*;

#[derive(DeriveMigrationName)]
pub(super) struct Migration;

#[derive(DeriveIden, Clone, Copy)]
enum MgCalls {
    Table,
    UpstreamChannel,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(MgCalls::Table)
                    .add_column(string_null(MgCalls::UpstreamChannel))
                    .take(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(MgCalls::Table)
                    .drop_column(MgCalls::UpstreamChannel)
                    .take(),
            )
            .await
    }
}
