//! Records what a call cost the operator and how its usage was reported: `cost` and
//! `credit_value` (billionths of the operator's currency: what the provider bills him, and what
//! a credit was worth when it was settled; the entry's margin is `price * credit_value - cost`),
//! `raw_usage` (the provider's usage object as it reported it), `usage_estimated` (a count the
//! gateway made itself) and `service_tier` (the tier it was priced at).

use sea_orm_migration::prelude::*;
use sea_orm_migration::schema::*;

#[derive(DeriveMigrationName)]
pub(super) struct Migration;

#[derive(DeriveIden)]
enum MgCalls {
    Table,
    Cost,
    CreditValue,
    RawUsage,
    UsageEstimated,
    ServiceTier,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        // One column per statement: SQLite adds one at a time.
        let columns = [
            big_integer_null(MgCalls::Cost),
            big_integer_null(MgCalls::CreditValue),
            text_null(MgCalls::RawUsage),
            boolean(MgCalls::UsageEstimated).default(false).take(),
            string_len_null(MgCalls::ServiceTier, 16),
        ];
        for mut column in columns {
            manager
                .alter_table(
                    Table::alter()
                        .table(MgCalls::Table)
                        .add_column(&mut column)
                        .take(),
                )
                .await?;
        }
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for column in [
            MgCalls::ServiceTier,
            MgCalls::UsageEstimated,
            MgCalls::RawUsage,
            MgCalls::CreditValue,
            MgCalls::Cost,
        ] {
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
