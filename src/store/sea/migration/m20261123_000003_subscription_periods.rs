//! Subscription periods: when an account's subscription credits end, and the ledger of what
//! lapsed when they did, so that `grants - charges - lapses = balance` still holds.

use sea_orm_migration::prelude::*;
use sea_orm_migration::schema::*;

use super::m20261122_000001_create_ledger::moment;

#[derive(DeriveMigrationName)]
pub(super) struct Migration;

#[derive(DeriveIden, Clone, Copy)]
enum MgAccounts {
    Table,
    Id,
    SubscriptionEndsAt,
}

#[derive(DeriveIden, Clone, Copy)]
enum MgSubscriptionLapses {
    Table,
    Id,
    AccountId,
    Amount,
    PeriodEnd,
    CreatedAt,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(MgAccounts::Table)
                    .add_column(moment(manager, MgAccounts::SubscriptionEndsAt, true))
                    .take(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table(MgSubscriptionLapses::Table)
                    .col(big_pk_auto(MgSubscriptionLapses::Id))
                    .col(big_integer(MgSubscriptionLapses::AccountId))
                    .col(
                        big_integer(MgSubscriptionLapses::Amount)
                            .check(Expr::col(MgSubscriptionLapses::Amount).gt(0)),
                    )
                    .col(moment(manager, MgSubscriptionLapses::PeriodEnd, false))
                    .col(moment(manager, MgSubscriptionLapses::CreatedAt, false))
                    .foreign_key(
                        ForeignKey::create()
                            .from(MgSubscriptionLapses::Table, MgSubscriptionLapses::AccountId)
                            .to(MgAccounts::Table, MgAccounts::Id)
                            .on_delete(ForeignKeyAction::Restrict),
                    )
                    .take(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("mg_subscription_lapses_account")
                    .table(MgSubscriptionLapses::Table)
                    .col(MgSubscriptionLapses::AccountId)
                    .take(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(MgSubscriptionLapses::Table).to_owned())
            .await?;
        manager
            .alter_table(
                Table::alter()
                    .table(MgAccounts::Table)
                    .drop_column(MgAccounts::SubscriptionEndsAt)
                    .take(),
            )
            .await
    }
}
