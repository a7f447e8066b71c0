//! Records how a translated call went: the tools its translation left out (`dropped_tools`,
//! as the reply's `x-gateway-dropped-tools` header names them), and the protocol the channel
//! that served it spoke (`upstream_protocol`), beside the endpoint the client called
//! (`protocol`).

use sea_orm_migration::prelude::*;
use sea_orm_migration::schema::*;

#[derive(DeriveMigrationName)]
pub(super) struct Migration;

#[derive(DeriveIden)]
enum MgCalls {
    Table,
    DroppedTools,
    UpstreamProtocol,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        // One column per statement: SQLite adds one at a time.
        manager
            .alter_table(
                Table::alter()
                    .table(MgCalls::Table)
                    .add_column(text_null(MgCalls::DroppedTools))
                    .take(),
            )
            .await?;
        manager
            .alter_table(
                Table::alter()
                    .table(MgCalls::Table)
                    .add_column(string_len_null(MgCalls::UpstreamProtocol, 32))
                    .take(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for column in [MgCalls::UpstreamProtocol, MgCalls::DroppedTools] {
            manager
                .alter_table(
                    Table::alter()
                        .table(MgCalls::Table)
                        .drop_column(column)
                        .take(),
                )
                .await?;
        }
        Ok(())
    }
}
