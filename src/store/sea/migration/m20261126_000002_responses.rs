//! `mg_responses`: who made each response that a provider keeps (the Responses API), so that
//! `previous_response_id` and `/v1/responses/{id}` reach it only for that account, at the
//! upstream that keeps it.

use sea_orm_migration::prelude::*;
use sea_orm_migration::schema::*;

use super::m20261122_000001_create_ledger::moment;

#[derive(DeriveMigrationName)]
pub(super) struct Migration;

#[derive(DeriveIden, Clone, Copy)]
enum MgResponses {
    Table,
    ResponseId,
    AccountId,
    Upstream,
    CreatedAt,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(MgResponses::Table)
                    .col(string_len(MgResponses::ResponseId, 255).primary_key())
                    .col(big_integer(MgResponses::AccountId))
                    .col(string_len(MgResponses::Upstream, 255))
                    .col(moment(manager, MgResponses::CreatedAt, false))
                    .take(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(MgResponses::Table).to_owned())
            .await
    }
}
