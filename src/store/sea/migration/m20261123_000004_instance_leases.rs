//! Instance leases: each serving gateway holds a row that it renews every few seconds, and each
//! reservation records the lease it was made under, so that recovery can tell a dead gateway's
//! reservations from a live one's without guessing from their age.

use sea_orm_migration::prelude::*;
use sea_orm_migration::schema::*;

use super::m20261122_000001_create_ledger::moment;

#[derive(DeriveMigrationName)]
pub(super) struct Migration;

#[derive(DeriveIden, Clone, Copy)]
enum MgInstances {
    Table,
    Id,
    Host,
    Pid,
    StartedAt,
    ExpiresAt,
}

#[derive(DeriveIden, Clone, Copy)]
enum MgCalls {
    Table,
    InstanceId,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(MgInstances::Table)
                    .col(big_pk_auto(MgInstances::Id))
                    .col(string_len(MgInstances::Host, 255))
                    .col(big_integer(MgInstances::Pid))
                    .col(moment(manager, MgInstances::StartedAt, false))
                    .col(moment(manager, MgInstances::ExpiresAt, false))
                    .take(),
            )
            .await?;
        // No foreign key: a lease row is deleted once its reservations are all finished, and
        // the entries keep the number as history.
        manager
            .alter_table(
                Table::alter()
                    .table(MgCalls::Table)
                    .add_column(big_integer_null(MgCalls::InstanceId))
                    .take(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(MgCalls::Table)
                    .drop_column(MgCalls::InstanceId)
                    .take(),
            )
            .await?;
        manager
            .drop_table(Table::drop().table(MgInstances::Table).to_owned())
            .await
    }
}
