//! Records whether a billed call's usage report failed the gateway's checks (`usage_rejected`):
//! such a call is charged its ceiling, and the operator should know which provider answered
//! oddly.

use sea_orm_migration::prelude::*;
use sea_orm_migration::schema::*;

#[derive(DeriveMigrationName)]
pub(super) struct Migration;

#[derive(DeriveIden)]
enum MgCalls {
    Table,
    UsageRejected,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(MgCalls::Table)
                    .add_column(boolean(MgCalls::UsageRejected).default(false))
                    .take(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(MgCalls::Table)
                    .drop_column(MgCalls::UsageRejected)
                    .take(),
            )
            .await
    }
}
