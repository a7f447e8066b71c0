//! Records the name a client called a model by when it was one of the model's aliases, beside
//! the catalogue name the call is billed under.

use sea_orm_migration::prelude::*;
use sea_orm_migration::schema::*;

#[derive(DeriveMigrationName)]
pub(super) struct Migration;

#[derive(DeriveIden, Clone, Copy)]
enum MgCalls {
    Table,
    RequestedModel,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(MgCalls::Table)
                    .add_column(string_null(MgCalls::RequestedModel))
                    .take(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(MgCalls::Table)
                    .drop_column(MgCalls::RequestedModel)
                    .take(),
            )
            .await
    }
}
