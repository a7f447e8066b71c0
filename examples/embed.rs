//! Embedding the gateway layers in an existing axum application.
//!
//! The host app keeps its own routes (`/health` here) and mounts the two gateway endpoints,
//! built from the four layers over its own database.
//!
//! ```text
//! cargo run --example embed   # listens on 127.0.0.1:8090, mock upstream, embedded.db
//! ```

use std::sync::Arc;

use axum::{Router, routing::get};
use model_gateway::recovery::Upkeep;
use model_gateway::{
    ApiKeyAuthLayer, Catalogue, CreditChargeLayer, ProtocolRouterLayer, RefundOnUpstreamErrorLayer,
    SeaOrmStore, recovery::recovery_age, upstream::MockUpstream,
};
use tower::ServiceBuilder;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Shared mode: the host app writes the same file through its own connections.
    let store = Arc::new(SeaOrmStore::connect("sqlite://embedded.db?mode=rwc").await?);
    let catalogue = Arc::new(Catalogue::demo());
    // Holds this instance's lease, so that a crash's reservations are refunded at the next
    // start (which this does first) rather than never; keep the handle for as long as you serve.
    let _upkeep = Upkeep::new(store.clone(), recovery_age(&catalogue))
        .start()
        .await?;

    // Outermost first: who is calling, which model, charge, refund on upstream failure.
    let gateway = ServiceBuilder::new()
        .layer(ApiKeyAuthLayer::new(store.clone()))
        .layer(ProtocolRouterLayer::new(catalogue).max_body_bytes(8 * 1024 * 1024))
        .layer(CreditChargeLayer::new(store.clone()))
        .layer(RefundOnUpstreamErrorLayer::new(store.clone()))
        .service(MockUpstream::new());

    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route_service("/v1/chat/completions", gateway.clone())
        .route_service("/v1/messages", gateway);

    let listener = tokio::net::TcpListener::bind("127.0.0.1:8090").await?;
    println!("host app with an embedded gateway on http://127.0.0.1:8090");
    axum::serve(listener, app).await?;
    Ok(())
}
