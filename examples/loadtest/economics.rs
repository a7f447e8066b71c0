//! Cost prices and tiers beside plain token prices (`LOADTEST_ONLY=economics`): the same
//! question to `gpt-4o-mini-metered` (credits per million tokens) and to `gpt-4o-mini-costed`
//! (the same sale prices with a long-context tier, priority and flex tables and a minimum, and
//! cost prices with tiers of their own in the catalogue's currency: each settle works out the
//! operator's cost and the entry keeps it, the provider's usage object and the tier), through
//! a provider in this process, on the in-memory gateway and on an owned `SQLite` file;
//! alternated, `LOADTEST_ROUNDS` times, at concurrency 16 and 64; medians printed.

use crate::drive::{Load, compare_loads};
use crate::responses::provider;
use crate::targets::{memory_gateway_over_http, owned_gateway_over_http, owned_store};
use model_gateway::Catalogue;

/// Both models on one provider.
fn catalogue(provider: &str) -> Catalogue {
    Catalogue::from_toml(&format!(
        r#"
        currency = "USD"
        credit_value = 0.01
        service_tier_header = "x-service-tier"

        [[upstreams]]
        name = "load-provider"
        kind = "openai"
        base_url = "{provider}/v1"
        api_key_env = "K"

        [[models]]
        name = "gpt-4o-mini-metered"
        protocol = "chat_completions"
        upstream = "load-provider"
        max_output_tokens = 1000
        [models.tokens]
        input = 15
        output = 60
        cache_read = 7.5

        [[models]]
        name = "gpt-4o-mini-costed"
        protocol = "chat_completions"
        upstream = "load-provider"
        max_output_tokens = 1000
        [models.tokens]
        input = 15
        output = 60
        cache_read = 7.5
        minimum = 1
        long_context = {{ above = 128000, input = 30, output = 120 }}
        priority = {{ input = 25, output = 100 }}
        flex = {{ input = 7.5, output = 30 }}
        [models.cost]
        input = 0.15
        output = 0.6
        cache_read = 0.075
        minimum = 0.000001
        long_context = {{ above = 128000, input = 0.3, output = 1.2 }}
        priority = {{ input = 0.25, output = 1.0 }}
        "#
    ))
    .unwrap()
}

pub async fn run(requests: u64, rounds: usize) {
    let provider = provider().await;
    let memory = memory_gateway_over_http("in-memory", catalogue(&provider)).await;
    let dir = tempfile::tempdir().unwrap();
    let owned = owned_gateway_over_http(
        "owned file",
        owned_store(dir.path()).await,
        catalogue(&provider),
    )
    .await;
    println!("{requests} requests per run, {rounds} rounds, alternated");
    println!(
        "{:<11} {:<10} {:>4} {:>10} {:>9} {:>9} {:>12}",
        "gateway", "priced", "c", "req/s", "p50 ms", "p99 ms", "cpu us/call"
    );
    for concurrency in [16, 64] {
        for target in [&memory, &owned] {
            let loads = [(Load::Metered, "by tokens"), (Load::Costed, "+ costs")];
            compare_loads(target, concurrency, requests, rounds, &loads).await;
        }
    }
}
