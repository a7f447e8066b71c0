//! `mg_webhook_events`: the outbox of webhook events and their delivery, written in the
//! transaction of what caused them where that is a ledger write.

use sea_orm_migration::prelude::*;
use sea_orm_migration::schema::*;

use super::m20261122_000001_create_ledger::moment;

#[derive(DeriveMigrationName)]
pub(super) struct Migration;

#[derive(DeriveIden, Clone, Copy)]
enum MgWebhookEvents {
    Table,
    Id,
    EventId,
    EventType,
    Body,
    Status,
    Attempts,
    NextAttemptAt,
    LastStatus,
    LastError,
    CreatedAt,
    DeliveredAt,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(MgWebhookEvents::Table)
                    .col(big_pk_auto(MgWebhookEvents::Id))
                    .col(string_len_uniq(MgWebhookEvents::EventId, 40))
                    .col(string_len(MgWebhookEvents::EventType, 40))
                    .col(text(MgWebhookEvents::Body))
                    .col(string_len(MgWebhookEvents::Status, 16))
                    .col(integer(MgWebhookEvents::Attempts).default(0))
                    .col(moment(manager, MgWebhookEvents::NextAttemptAt, false))
                    .col(integer_null(MgWebhookEvents::LastStatus))
                    .col(text_null(MgWebhookEvents::LastError))
                    .col(moment(manager, MgWebhookEvents::CreatedAt, false))
                    .col(moment(manager, MgWebhookEvents::DeliveredAt, true))
                    .take(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("idx_mg_webhook_events_due")
                    .table(MgWebhookEvents::Table)
                    .col(MgWebhookEvents::Status)
                    .col(MgWebhookEvents::NextAttemptAt)
                    .take(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(MgWebhookEvents::Table).to_owned())
            .await
    }
}
