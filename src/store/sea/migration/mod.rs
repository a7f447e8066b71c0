//! Schema migrations, run at start under the crate's own migration table (`mg_migrations`) so
//! they never mix with the host application's.

// The migrations implement `MigrationTrait` through `async_trait`, whose expansion cannot take
// the `SchemaManager<'_>` that `rust_2018_idioms` asks for.
#![allow(elided_lifetimes_in_paths)]

use sea_orm_migration::prelude::*;

mod m20261122_000001_create_ledger;
mod m20261122_000002_add_call_channel;
mod m20261123_000001_add_call_request_id;
mod m20261123_000002_key_rules_and_grant_records;
mod m20261123_000003_subscription_periods;
mod m20261123_000004_instance_leases;
mod m20261123_000005_idempotent_calls;
mod m20261124_000001_escrows;
mod m20261126_000001_add_call_requested_model;
mod m20261126_000002_responses;
mod m20261126_000003_call_token_kinds;
mod m20261126_000004_redemption_codes;
mod m20261126_000005_key_limits;
mod m20261126_000006_webhook_events;
mod m20261126_000007_alerts;
mod m20261128_000001_call_status_check;
mod m20261206_000001_call_usage_rejected;
mod m20261207_000001_call_translation;
mod m20261207_000002_call_economics;

/// Applies the gateway's schema: `Migrator::up(&db, None)`. [`SeaOrmStore::connect`] runs it
/// under a database lock, so that gateway instances starting together on an empty database do
/// not race to create the same tables; an embedder running it directly on a database that
/// several processes share should do likewise.
///
/// [`SeaOrmStore::connect`]: crate::SeaOrmStore::connect
#[derive(Debug)]
pub struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![
            Box::new(m20261122_000001_create_ledger::Migration),
            Box::new(m20261122_000002_add_call_channel::Migration),
            Box::new(m20261123_000001_add_call_request_id::Migration),
            Box::new(m20261123_000002_key_rules_and_grant_records::Migration),
            Box::new(m20261123_000003_subscription_periods::Migration),
            Box::new(m20261123_000004_instance_leases::Migration),
            Box::new(m20261123_000005_idempotent_calls::Migration),
            Box::new(m20261124_000001_escrows::Migration),
            Box::new(m20261126_000001_add_call_requested_model::Migration),
            Box::new(m20261126_000002_responses::Migration),
            Box::new(m20261126_000003_call_token_kinds::Migration),
            Box::new(m20261126_000004_redemption_codes::Migration),
            Box::new(m20261126_000005_key_limits::Migration),
            Box::new(m20261126_000006_webhook_events::Migration),
            Box::new(m20261126_000007_alerts::Migration),
            Box::new(m20261128_000001_call_status_check::Migration),
            Box::new(m20261206_000001_call_usage_rejected::Migration),
            Box::new(m20261207_000001_call_translation::Migration),
            Box::new(m20261207_000002_call_economics::Migration),
        ]
    }

    fn migration_table_name() -> DynIden {
        "mg_migrations".into_iden()
    }
}
