//! An in-memory store: for embedding without a database, and the reference model the database
//! backends are tested against. Nothing survives a restart.

mod accounts;
mod call_log;
mod codes;
mod ledger;
mod state;

pub use state::MemoryStore;
