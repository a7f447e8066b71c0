//! The webhook outbox on the sea-orm backend (`mg_webhook_events`): an event is inserted in
//! the transaction of what caused it, and claimed for delivery by a guarded update of its
//! `next_attempt_at`, so that two dispatchers rarely send it twice (and a receiver tells a
//! repeat by its id when they do).

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sea_orm::sea_query::{Expr, ExprTrait};
use sea_orm::{ColumnTrait, EntityTrait, QueryFilter, QueryOrder, QuerySelect};

use super::entity::webhook_event;
use super::rows::{insert_event, moment_value};
use super::store::SeaOrmStore;
use crate::events::WebhookEvent;
use crate::store::records::{Attempted, Delivery, DeliveryStatus};
use crate::store::traits::EventOutbox;
use crate::store::types::StoreError;

fn delivery(row: webhook_event::Model) -> Result<Delivery, StoreError> {
    Ok(Delivery {
        id: row.id,
        status: DeliveryStatus::parse(&row.status)
            .ok_or_else(|| StoreError::msg(format!("event {}: unknown status", row.id)))?,
        event_id: row.event_id,
        kind: row.event_type,
        body: row.body,
        attempts: u32::try_from(row.attempts).unwrap_or_default(),
        next_attempt_at: row.next_attempt_at,
        last_status: row
            .last_status
            .and_then(|status| u16::try_from(status).ok()),
        last_error: row.last_error,
        created_at: row.created_at,
        delivered_at: row.delivered_at,
    })
}

#[async_trait]
impl EventOutbox for SeaOrmStore {
    async fn record_event(&self, event: &WebhookEvent) -> Result<(), StoreError> {
        if !self.events.writes(event.kind) {
            return Ok(());
        }
        insert_event(&self.db, event).await
    }

    async fn claim_deliveries(
        &self,
        now: DateTime<Utc>,
        hold: std::time::Duration,
        limit: u64,
    ) -> Result<Vec<Delivery>, StoreError> {
        let due = webhook_event::Entity::find()
            .filter(webhook_event::Column::Status.eq(DeliveryStatus::Pending.as_str()))
            .filter(webhook_event::Column::NextAttemptAt.lte(now))
            .order_by_asc(webhook_event::Column::Id)
            .limit(limit)
            .all(&self.db)
            .await?;
        let until = now + chrono::Duration::from_std(hold).unwrap_or(chrono::Duration::MAX);
        let backend = self.db.get_database_backend();
        let mut claimed = Vec::with_capacity(due.len());
        for row in due {
            // Only if it is still due: a dispatcher that claimed it since moved it on.
            let taken = webhook_event::Entity::update_many()
                .col_expr(
                    webhook_event::Column::NextAttemptAt,
                    Expr::value(moment_value(backend, Some(until))),
                )
                .filter(webhook_event::Column::Id.eq(row.id))
                .filter(webhook_event::Column::Status.eq(DeliveryStatus::Pending.as_str()))
                .filter(webhook_event::Column::NextAttemptAt.lte(now))
                .exec(&self.db)
                .await?;
            if taken.rows_affected == 1 {
                claimed.push(delivery(row)?);
            }
        }
        Ok(claimed)
    }

    async fn attempted(&self, id: i64, attempt: &Attempted) -> Result<(), StoreError> {
        let backend = self.db.get_database_backend();
        let update = webhook_event::Entity::update_many()
            .col_expr(
                webhook_event::Column::Attempts,
                Expr::col(webhook_event::Column::Attempts).add(1),
            )
            .filter(webhook_event::Column::Id.eq(id));
        let update = match attempt {
            Attempted::Delivered { status, at } => update
                .col_expr(
                    webhook_event::Column::Status,
                    Expr::value(DeliveryStatus::Delivered.as_str()),
                )
                .col_expr(
                    webhook_event::Column::LastStatus,
                    Expr::value(i32::from(*status)),
                )
                .col_expr(
                    webhook_event::Column::LastError,
                    Expr::value(None::<String>),
                )
                .col_expr(
                    webhook_event::Column::DeliveredAt,
                    Expr::value(moment_value(backend, Some(*at))),
                ),
            Attempted::Failed {
                status,
                error,
                retry_at,
            } => {
                let update = update
                    .col_expr(
                        webhook_event::Column::LastStatus,
                        Expr::value(status.map(i32::from)),
                    )
                    .col_expr(webhook_event::Column::LastError, Expr::value(error.clone()));
                match retry_at {
                    Some(at) => update.col_expr(
                        webhook_event::Column::NextAttemptAt,
                        Expr::value(moment_value(backend, Some(*at))),
                    ),
                    None => update.col_expr(
                        webhook_event::Column::Status,
                        Expr::value(DeliveryStatus::Failed.as_str()),
                    ),
                }
            }
        };
        update.exec(&self.db).await?;
        Ok(())
    }

    async fn deliveries(
        &self,
        status: Option<DeliveryStatus>,
        limit: u64,
    ) -> Result<Vec<Delivery>, StoreError> {
        let mut select = webhook_event::Entity::find()
            .order_by_desc(webhook_event::Column::Id)
            .limit(limit);
        if let Some(status) = status {
            select = select.filter(webhook_event::Column::Status.eq(status.as_str()));
        }
        select
            .all(&self.db)
            .await?
            .into_iter()
            .map(delivery)
            .collect()
    }

    async fn retry_delivery(
        &self,
        id: i64,
        now: DateTime<Utc>,
    ) -> Result<Option<Delivery>, StoreError> {
        let backend = self.db.get_database_backend();
        webhook_event::Entity::update_many()
            .col_expr(
                webhook_event::Column::Status,
                Expr::value(DeliveryStatus::Pending.as_str()),
            )
            .col_expr(
                webhook_event::Column::NextAttemptAt,
                Expr::value(moment_value(backend, Some(now))),
            )
            .filter(webhook_event::Column::Id.eq(id))
            .exec(&self.db)
            .await?;
        webhook_event::Entity::find_by_id(id)
            .one(&self.db)
            .await?
            .map(delivery)
            .transpose()
    }
}
