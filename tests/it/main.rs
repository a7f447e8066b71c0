//! The integration tests, in one binary (one link of sea-orm and sqlx instead of one per
//! file): the gateway served over real HTTP on a temporary `SQLite` file, a private
//! `PostgreSQL` schema or a private `MariaDB` database (`common`), against local fake
//! providers. A test about one backend is compiled with that backend's feature only.
//!
//! Run with every feature, as CI does: `cargo test --all-features`. The tests about the gateway
//! rather than one backend run on a `SQLite` file; `TEST_LOCAL_DB=postgres` (or `mysql`) runs
//! them on that database instead, as CI does after the first run. A test about every backend
//! is written once with `backends!`.

// Tests unwrap (a panic is how they fail) and share helpers through `pub` items.
#![allow(clippy::unwrap_used, unreachable_pub)]

#[path = "../common/mod.rs"]
#[macro_use]
mod common;

mod admin;
mod alerts;
mod bad_input;
mod clients;
mod codes;
#[cfg(feature = "testing")]
mod conformance;
mod contract;
mod economics;
mod embeddings;
mod escrow;
#[cfg(feature = "sqlite")]
mod front_door;
mod gemini;
#[cfg(all(feature = "bedrock", feature = "vertex"))]
mod hosted;
mod idempotency;
mod integrity;
mod key_holder;
mod key_limits;
mod key_rules;
mod late_settle;
mod leases;
mod ledger;
#[cfg(feature = "testing")]
mod ledger_properties;
mod owned_file;
mod reload;
mod reports;
mod responses;
mod streaming;
mod subscriptions;
mod token_pricing;
mod translation;
mod upstream;
mod usage;
mod webhooks;
