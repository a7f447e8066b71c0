//! Runs the storage conformance suite (`model_gateway::store::conformance`) against a store:
//! here this crate's own two, in memory and on a `SQLite` file. Put your implementation of the
//! storage traits in their place: the suite tells you which rule it breaks, if any, with the
//! steps that show it.
//!
//! ```sh
//! cargo run --example conformance --features sqlite,testing
//! ```

use model_gateway::store::conformance::{self, Conformance};
use model_gateway::{MemoryStore, SeaOrmStore};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The one-call form: 64 sequences, a fresh store each; panics naming the rule broken.
    let report = conformance::ledger(|| async { MemoryStore::new() }).await;
    println!("MemoryStore: {report}");

    // With settings, and the violation as a value. Every sequence may share one database: it
    // makes accounts of its own.
    let dir = tempfile::tempdir()?;
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("ledger.db").display()
    );
    let store = SeaOrmStore::connect(&url).await?.with_webhook_events();
    let report = Conformance::new()
        .cases(32)
        .with_events()
        .check(|| {
            let store = store.clone();
            async move { store }
        })
        .await?;
    println!("SeaOrmStore on SQLite: {report}");
    Ok(())
}
