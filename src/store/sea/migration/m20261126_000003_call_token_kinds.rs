//! Records a call's tokens by kind (cache reads, 5-minute and 1-hour cache writes, reasoning)
//! beside input and output, and what a call priced by tokens cost beyond what its account
//! could pay (`shortfall`).

use sea_orm_migration::prelude::*;
use sea_orm_migration::schema::*;

#[derive(DeriveMigrationName)]
pub(super) struct Migration;

#[derive(DeriveIden, Clone, Copy)]
enum MgCalls {
    Table,
    CacheReadTokens,
    CacheWriteTokens,
    #[sea_orm(iden = "cache_write_1h_tokens")]
    CacheWrite1hTokens,
    ReasoningTokens,
    Shortfall,
}

const TOKEN_KINDS: [MgCalls; 4] = [
    MgCalls::CacheReadTokens,
    MgCalls::CacheWriteTokens,
    MgCalls::CacheWrite1hTokens,
    MgCalls::ReasoningTokens,
];

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        // One column per statement: SQLite alters a table one change at a time.
        for kind in TOKEN_KINDS {
            manager
                .alter_table(
                    Table::alter()
                        .table(MgCalls::Table)
                        .add_column(big_integer_null(kind))
                        .take(),
                )
                .await?;
        }
        manager
            .alter_table(
                Table::alter()
                    .table(MgCalls::Table)
                    .add_column(big_integer(MgCalls::Shortfall).default(0))
                    .take(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for column in TOKEN_KINDS.into_iter().chain([MgCalls::Shortfall]) {
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
