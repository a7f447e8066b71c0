//! The tests that need a process of their own: the example gateway started as real processes
//! (killed with SIGKILL mid-call and restarted; two sharing one `PostgreSQL`; its command
//! line and logs), and the metrics, whose recorder is global to the process, so no other test
//! may record into it.
//!
//! Run with every feature, as CI does: `cargo test --all-features`.

// Tests unwrap (a panic is how they fail) and share helpers through `pub` items.
#![allow(clippy::unwrap_used, unreachable_pub)]

#[path = "../common/mod.rs"]
mod common;

#[cfg(feature = "sqlite")]
mod docs;
mod metrics;
#[cfg(feature = "sqlite")]
mod processes;
