//! Escrow given back when it sits idle, and when another instance recalls it.

use sea_orm::{ConnectionTrait, DbBackend, Statement};
use tokio::sync::oneshot;

use super::state::{Escrow, RECALL_CHANNEL};
use crate::store::{AccountId, StoreError};

/// Looks for idle escrow every `every` while the escrow is in use (see
/// [`Escrow::give_back_idle`]).
pub(super) async fn give_back_idle(escrow: std::sync::Weak<Escrow>, every: std::time::Duration) {
    loop {
        tokio::time::sleep(every).await;
        let Some(escrow) = escrow.upgrade() else {
            return;
        };
        match escrow.give_back_idle().await {
            Ok(0) => {}
            Ok(rows) => tracing::debug!(rows, "gave back idle escrow"),
            Err(error) => tracing::warn!(%error, "giving back idle escrow failed; will retry"),
        }
    }
}

/// Listens for recalls (see [`Escrow::recall`]) on a connection of the escrow's pool, and
/// gives back what this instance's escrow has free for each account recalled in its schema;
/// ends when the escrow is dropped. A recall missed (while reconnecting) only waits for the
/// idle look.
pub(super) async fn answer_recalls(
    escrow: std::sync::Weak<Escrow>,
    mut stop: oneshot::Receiver<()>,
) {
    const RETRY: std::time::Duration = std::time::Duration::from_secs(1);
    let (schema, mut listener) = loop {
        let Some(live) = escrow.upgrade() else {
            return;
        };
        match listen_for_recalls(&live).await {
            Ok(listening) => break listening,
            Err(error) => tracing::warn!(%error, "listening for escrow recalls failed; will retry"),
        }
        drop(live);
        tokio::select! {
            _ = &mut stop => return,
            () = tokio::time::sleep(RETRY) => {}
        }
    };
    loop {
        let notification = tokio::select! {
            _ = &mut stop => return,
            notification = listener.recv() => notification,
        };
        let account = match &notification {
            Ok(notification) => notification
                .payload()
                .strip_prefix(schema.as_str())
                .and_then(|rest| rest.strip_prefix(':'))
                .and_then(|account| account.parse::<i64>().ok()),
            // The pool was closed: nothing more to listen for.
            Err(sea_orm::sqlx::Error::PoolClosed) => return,
            Err(error) => {
                // The next `recv` reconnects.
                tracing::warn!(%error, "listening for escrow recalls failed; will retry");
                tokio::select! {
                    _ = &mut stop => return,
                    () = tokio::time::sleep(RETRY) => {}
                }
                None
            }
        };
        let (Some(account), Some(escrow)) = (account, escrow.upgrade()) else {
            continue;
        };
        match escrow.give_back_account(AccountId(account)).await {
            Ok(0) => {}
            Ok(rows) => tracing::debug!(account, rows, "gave back recalled escrow"),
            Err(error) => tracing::warn!(%error, account, "giving back recalled escrow failed"),
        }
    }
}

/// This store's schema, and a listener on [`RECALL_CHANNEL`].
pub(super) async fn listen_for_recalls(
    escrow: &Escrow,
) -> Result<(String, sea_orm::sqlx::postgres::PgListener), StoreError> {
    let schema = escrow
        .db
        .query_one_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT current_schema()",
        ))
        .await?
        .ok_or_else(|| StoreError::msg("no current schema"))?
        .try_get_by_index::<String>(0)?;
    let pool = escrow.db.get_postgres_connection_pool();
    let mut listener = sea_orm::sqlx::postgres::PgListener::connect_with(pool)
        .await
        .map_err(sql_error)?;
    listener.listen(RECALL_CHANNEL).await.map_err(sql_error)?;
    Ok((schema, listener))
}
pub(super) fn sql_error(error: sea_orm::sqlx::Error) -> StoreError {
    StoreError::msg(format!("listening for escrow recalls: {error}"))
}
