//! A key's spending limit (`limit_credits` per `limit_period`) and what it has spent in its
//! current window (`limit_spent` in window `limit_window`), written in the transaction that
//! reserves each of its calls.

use sea_orm_migration::prelude::*;
use sea_orm_migration::schema::*;

#[derive(DeriveMigrationName)]
pub(super) struct Migration;

#[derive(DeriveIden, Clone, Copy)]
enum MgApiKeys {
    Table,
    LimitCredits,
    LimitPeriod,
    LimitSpent,
    LimitWindow,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        // One column per statement: SQLite alters a table one change at a time.
        let columns = [
            big_integer_null(MgApiKeys::LimitCredits),
            string_len_null(MgApiKeys::LimitPeriod, 8),
            big_integer(MgApiKeys::LimitSpent).default(0).take(),
            big_integer(MgApiKeys::LimitWindow).default(0).take(),
        ];
        for column in columns {
            manager
                .alter_table(
                    Table::alter()
                        .table(MgApiKeys::Table)
                        .add_column(column)
                        .take(),
                )
                .await?;
        }
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for column in [
            MgApiKeys::LimitCredits,
            MgApiKeys::LimitPeriod,
            MgApiKeys::LimitSpent,
            MgApiKeys::LimitWindow,
        ] {
            manager
                .alter_table(
                    Table::alter()
                        .table(MgApiKeys::Table)
                        .drop_column(column)
                        .take(),
                )
                .await?;
        }
        Ok(())
    }
}
