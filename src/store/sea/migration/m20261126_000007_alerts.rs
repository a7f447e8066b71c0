//! What the balance and limit alerts keep: an account's own low-balance threshold
//! (`low_balance_credits`, `NULL`: the store's default) and the window in which a key's
//! `key.limit_reached` event was last written (`limit_alerted_window`), so that each window
//! tells it once.

use sea_orm_migration::prelude::*;
use sea_orm_migration::schema::*;

#[derive(DeriveMigrationName)]
pub(super) struct Migration;

#[derive(DeriveIden, Clone, Copy)]
enum MgAccounts {
    Table,
    LowBalanceCredits,
}

#[derive(DeriveIden, Clone, Copy)]
enum MgApiKeys {
    Table,
    LimitAlertedWindow,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(MgAccounts::Table)
                    .add_column(big_integer_null(MgAccounts::LowBalanceCredits))
                    .take(),
            )
            .await?;
        manager
            .alter_table(
                Table::alter()
                    .table(MgApiKeys::Table)
                    .add_column(big_integer_null(MgApiKeys::LimitAlertedWindow))
                    .take(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(MgApiKeys::Table)
                    .drop_column(MgApiKeys::LimitAlertedWindow)
                    .take(),
            )
            .await?;
        manager
            .alter_table(
                Table::alter()
                    .table(MgAccounts::Table)
                    .drop_column(MgAccounts::LowBalanceCredits)
                    .take(),
            )
            .await
    }
}
