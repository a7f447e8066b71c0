//! Credit escrow (`mg_escrows`): credits a gateway instance moved out of an account's row to
//! charge calls against without locking that row (see `SeaOrmStore::with_escrow`). One row per
//! account and instance lease; both buckets non-negative. Recovery returns a row to its account
//! once its lease has ended, so a lease row is kept while it has escrow.

use sea_orm_migration::prelude::*;
use sea_orm_migration::schema::*;

#[derive(DeriveMigrationName)]
pub(super) struct Migration;

#[derive(DeriveIden, Clone, Copy)]
enum MgEscrows {
    Table,
    AccountId,
    InstanceId,
    SubscriptionCredits,
    TopupCredits,
}

#[derive(DeriveIden, Clone, Copy)]
enum MgAccounts {
    Table,
    Id,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let non_negative =
            |column: MgEscrows| big_integer(column).check(Expr::col(column).gte(0)).take();
        manager
            .create_table(
                Table::create()
                    .table(MgEscrows::Table)
                    .col(big_integer(MgEscrows::AccountId))
                    .col(big_integer(MgEscrows::InstanceId))
                    .col(non_negative(MgEscrows::SubscriptionCredits))
                    .col(non_negative(MgEscrows::TopupCredits))
                    .primary_key(
                        Index::create()
                            .col(MgEscrows::AccountId)
                            .col(MgEscrows::InstanceId),
                    )
                    .foreign_key(
                        ForeignKey::create()
                            .from(MgEscrows::Table, MgEscrows::AccountId)
                            .to(MgAccounts::Table, MgAccounts::Id)
                            .on_delete(ForeignKeyAction::Restrict),
                    )
                    .take(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(MgEscrows::Table).to_owned())
            .await
    }
}
