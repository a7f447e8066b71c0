//! What each call cost the operator, what it was charged and what it earned, over real HTTP from
//! fake providers whose replies carry each provider's usage shape: cost, charge and margin
//! exact, a long-context tier crossed exactly at its threshold, service tiers and a minimum,
//! the reservation holding the dearest tier the call can reach; in every charging mode
//! (`SQLite` shared and owned, `PostgreSQL` shared and escrow, `MariaDB`).
//!
//! The catalogue's money: `credit_value = 0.01` USD, so a credit is a cent, and each model's
//! cost prices are in USD per million tokens.

use crate::common;

use std::sync::Arc;

use common::fake_provider::{FakeProvider, Fault};
use common::*;
use model_gateway::admin::AdminToken;
use model_gateway::money::Money;
use model_gateway::store::{CallRecord, CallStatus};
use model_gateway::{Catalogue, Gateway, Upstream};
use serde_json::{Value, json};

const ADMIN_TOKEN: &str = "admin-token-for-economics-0123456789";

/// Four providers (two OpenAI-style, one Anthropic, one Google) behind token-priced models
/// with cost prices; `azure` has a cost of its own for `gpt-azure`.
fn catalogue(
    settings: &str,
    openai: &FakeProvider,
    azure: &FakeProvider,
    anthropic: &FakeProvider,
    google: &FakeProvider,
) -> Catalogue {
    Catalogue::from_toml(&format!(
        r#"
        {settings}
        currency = "USD"
        credit_value = 0.01
        service_tier_header = "x-service-tier"

        [[upstreams]]
        name = "openai"
        kind = "openai"
        base_url = "{openai}/v1"
        api_key_env = "K"

        [[upstreams]]
        name = "azure"
        kind = "openai"
        base_url = "{azure}/v1"
        api_key_env = "K"

        [[upstreams]]
        name = "anthropic"
        kind = "anthropic"
        base_url = "{anthropic}"
        api_key_env = "K"

        [[upstreams]]
        name = "google"
        kind = "gemini"
        base_url = "{google}"
        api_key_env = "K"

        [[models]]
        name = "gpt-cost"
        protocol = "chat_completions"
        upstream = "openai"
        max_output_tokens = 10000
        context_window = 400000
        [models.tokens]
        input = 300
        output = 1200
        cache_read = 150
        [models.cost]
        input = 2.5
        output = 10.0
        cache_read = 1.25

        [[models]]
        name = "gpt-azure"
        protocol = "chat_completions"
        upstreams = [{{ name = "azure", cost = {{ input = 2.0, output = 8.0, cache_read = 0.5 }} }}]
        max_output_tokens = 10000
        context_window = 400000
        [models.tokens]
        input = 300
        output = 1200
        cache_read = 150
        [models.cost]
        input = 2.5
        output = 10.0
        cache_read = 1.25

        [[models]]
        name = "gpt-tiered"
        protocol = "chat_completions"
        upstream = "openai"
        max_output_tokens = 100
        context_window = 400000
        [models.tokens]
        input = 100
        output = 400
        minimum = 2
        priority = {{ input = 170, output = 680 }}
        flex = {{ input = 50, output = 200 }}
        [models.cost]
        input = 1.0
        output = 4.0
        minimum = 0.01
        priority = {{ input = 1.7, output = 6.8 }}
        flex = {{ input = 0.5, output = 2.0 }}

        [[models]]
        name = "claude-cost"
        protocol = "messages"
        upstream = "anthropic"
        endpoints = ["messages", "chat_completions"]
        max_output_tokens = 10000
        context_window = 400000
        [models.tokens]
        input = 300
        output = 1500
        cache_read = 30
        cache_write = 375
        cache_write_1h = 600
        [models.cost]
        input = 3.0
        output = 15.0
        cache_read = 0.3
        cache_write = 3.75
        cache_write_1h = 6.0

        [[models]]
        name = "claude-long"
        protocol = "messages"
        upstream = "anthropic"
        max_output_tokens = 1000
        context_window = 400000
        [models.tokens]
        input = 300
        output = 1500
        long_context = {{ above = 200000, input = 600, output = 2250 }}
        [models.cost]
        input = 3.0
        output = 15.0
        long_context = {{ above = 200000, input = 6.0, output = 22.5 }}

        [[models]]
        name = "gemini-cost"
        protocol = "gemini"
        upstream = "google"
        max_output_tokens = 20000
        context_window = 400000
        [models.tokens]
        input = 100
        output = 400
        cache_read = 10
        [models.cost]
        input = 1.0
        output = 4.0
        cache_read = 0.1
        "#,
        openai = openai.base,
        azure = azure.base,
        anthropic = anthropic.base,
        google = google.base,
    ))
    .unwrap()
}

struct Rig {
    db: TestDb,
    gateway: common::Gateway,
    openai: FakeProvider,
    azure: FakeProvider,
    anthropic: FakeProvider,
    google: FakeProvider,
}

impl Rig {
    async fn on(db: TestDb) -> Rig {
        Rig::with(db, "").await
    }

    /// With gateway-wide `settings` on top of the catalogue.
    async fn with(db: TestDb, settings: &str) -> Rig {
        let (openai, azure) = (FakeProvider::start().await, FakeProvider::start().await);
        let (anthropic, google) = (FakeProvider::start().await, FakeProvider::start().await);
        let catalogue = catalogue(settings, &openai, &azure, &anthropic, &google);
        let upstream = model_gateway::upstream::HttpUpstream::with_keys(&catalogue, |_| {
            Some("sk-provider".into())
        })
        .unwrap();
        let router = Gateway::new(
            db.store.clone(),
            Arc::new(catalogue),
            Upstream::Http(upstream),
        )
        .admin_token(Some(AdminToken::new(ADMIN_TOKEN).unwrap()))
        .router();
        let gateway = serve_router(router).await;
        Rig {
            db,
            gateway,
            openai,
            azure,
            anthropic,
            google,
        }
    }

    /// `body` posted to `path` with `key` (and `headers`): the status and the reply.
    async fn call(&self, key: &str, path: &str, body: &Value, headers: &[(&str, &str)]) -> Answer {
        let mut request = self
            .gateway
            .client
            .post(format!("{}{path}", self.gateway.base))
            .bearer_auth(key)
            .header("x-goog-api-key", key)
            .json(body);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        self.gateway.send(request).await
    }

    /// The key's only (or latest) call, as the store records it.
    async fn last_call(&self, key: &str) -> CallRecord {
        self.db.calls(key).await.remove(0)
    }

    /// The call log of `key`'s account through the admin API.
    async fn admin_calls(&self, key: &str) -> Value {
        let account = self.db.account(key).await;
        let answer = self
            .gateway
            .send(
                self.gateway
                    .client
                    .get(format!(
                        "{}/admin/accounts/{}/calls",
                        self.gateway.base, account.0
                    ))
                    .bearer_auth(ADMIN_TOKEN),
            )
            .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        answer.body
    }
}

/// Runs `test` in each charging mode this machine has: `SQLite` shared and owned, `PostgreSQL`
/// shared and with escrow, `MariaDB`.
async fn each_charging_mode(test: impl AsyncFn(Rig)) {
    #[cfg(feature = "sqlite")]
    {
        test(Rig::on(sqlite_db().await).await).await;
        test(Rig::on(owned_sqlite_db().await).await).await;
    }
    #[cfg(feature = "postgres")]
    if let Some(db) = postgres_db().await {
        let schema = db.pg_schema().unwrap().to_owned();
        let escrow = postgres_store(&db.url, &schema)
            .await
            .with_escrow()
            .unwrap();
        model_gateway::store::Leases::take_lease(
            &escrow,
            chrono::Utc::now(),
            std::time::Duration::from_secs(60),
        )
        .await
        .unwrap()
        .unwrap();
        let escrow: Arc<model_gateway::store::SeaOrmStore> = Arc::new(escrow);
        test(Rig::on(TestDb::sharing(&db, escrow)).await).await;
        test(Rig::on(db.second_instance().await).await).await;
        db.drop_schema().await;
    }
    if let Some(db) = mysql_db().await {
        test(Rig::on(db).await).await;
    }
}

fn chat(model: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 100})
}

/// A chat request whose text is `bytes` long and whose output may reach `max_tokens`: what
/// makes a provider's report of that much usage one the gateway trusts and reserves for (a
/// token is at least a byte).
fn chat_of(model: &str, bytes: usize, max_tokens: u64) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": "a".repeat(bytes)}],
        "max_tokens": max_tokens,
    })
}

fn chat_reply(usage: &Value, tier: Option<&str>) -> Fault {
    let mut reply = json!({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": usage,
    });
    if let Some(tier) = tier {
        reply["service_tier"] = json!(tier);
    }
    Fault::json(200, &reply.to_string())
}

fn message_reply(usage: &Value) -> Fault {
    let reply = json!({
        "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
        "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn",
        "usage": usage,
    });
    Fault::json(200, &reply.to_string())
}

fn money(text: &str) -> Money {
    text.parse().unwrap()
}

/// A settled call charged `credits`, costing `cost` and earning `margin`, at a cent a credit.
fn assert_billed(call: &CallRecord, credits: i64, cost: &str, margin: &str) {
    assert_eq!(call.status, CallStatus::Ok, "{call:?}");
    assert_eq!(call.price.get(), credits, "charged");
    assert_eq!(call.shortfall.get(), 0, "charged in full");
    assert_eq!(call.cost, Some(money(cost)), "cost");
    assert_eq!(call.credit_value, Some(money("0.01")));
    assert_eq!(call.margin, Some(money(margin)), "margin");
    // The margin is the charge at a credit's value less the cost, to the billionth.
    assert_eq!(
        money(margin).nanos(),
        credits * 10_000_000 - money(cost).nanos()
    );
}

/// `OpenAI`'s usage with cached and reasoning tokens: 10,000 uncached input, 20,000 cached,
/// 5,000 output (2,000 reasoning). Sale: 3 + 3 + 6 = 12 credits; cost: 0.025 + 0.025 + 0.05 =
/// 0.1 USD; margin 0.02. The entry keeps the channel and the provider's usage as it wrote it.
#[tokio::test]
async fn an_openai_call_records_its_cost_charge_and_margin_in_every_charging_mode() {
    each_charging_mode(async |rig| {
        let key = rig.db.funded_key(1_000, 0).await;
        let usage = json!({
            "prompt_tokens": 30000, "completion_tokens": 5000, "total_tokens": 35000,
            "prompt_tokens_details": {"cached_tokens": 20000, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 2000}
        });
        rig.openai.then(chat_reply(&usage, Some("default")));
        let answer = rig
            .call(&key, CHAT, &chat_of("gpt-cost", 30_000, 10_000), &[])
            .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        let call = rig.last_call(&key).await;
        assert_billed(&call, 12, "0.1", "0.02");
        assert_eq!(call.channel.as_deref(), Some("openai"));
        assert!(!call.usage_estimated);
        let raw: Value = serde_json::from_str(call.raw_usage.as_deref().unwrap()).unwrap();
        assert_eq!(raw, usage, "the provider's usage, as it wrote it");
        assert_eq!(rig.db.balance(&key).await, balance(1_000 - 12, 0));

        // A channel with a cost of its own: 10,000 × 2 + 20,000 × 0.5 + 5,000 × 8 = 0.07.
        rig.azure.then(chat_reply(&usage, None));
        let answer = rig
            .call(&key, CHAT, &chat_of("gpt-azure", 30_000, 10_000), &[])
            .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        let call = rig.last_call(&key).await;
        assert_billed(&call, 12, "0.07", "0.05");
        assert_eq!(call.channel.as_deref(), Some("azure"));
        rig.db.assert_audit_holds().await;
    })
    .await;
}

/// Anthropic's usage with cache reads and both cache writes: 1,000 input, 100,000 read,
/// 2,000 written for 5 minutes and 4,000 for an hour, 3,000 output. Sale: 0.3 + 3 + 0.75 + 2.4
/// + 4.5 = 10.95, 11 credits; cost: 0.003 + 0.03 + 0.0075 + 0.024 + 0.045 = 0.1095 USD.
#[tokio::test]
async fn an_anthropic_call_prices_cache_reads_and_both_cache_writes_for_sale_and_cost() {
    each_charging_mode(async |rig| {
        let key = rig.db.funded_key(1_000, 0).await;
        let usage = json!({
            "input_tokens": 1000, "output_tokens": 3000,
            "cache_read_input_tokens": 100000, "cache_creation_input_tokens": 6000,
            "cache_creation": {"ephemeral_5m_input_tokens": 2000, "ephemeral_1h_input_tokens": 4000},
            "service_tier": "standard"
        });
        rig.anthropic.then(message_reply(&usage));
        let body = json!({
            "model": "claude-cost", "max_tokens": 5000,
            "messages": [{"role": "user", "content": "a".repeat(107_000)}]
        });
        let answer = rig.call(&key, MESSAGES, &body, &[]).await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        let call = rig.last_call(&key).await;
        assert_billed(&call, 11, "0.1095", "0.0005");
        assert_eq!(
            (call.cache_write_tokens, call.cache_write_1h_tokens),
            (Some(2000), Some(4000))
        );
        assert_eq!(call.service_tier, Some(model_gateway::pricing::ServiceTier::Standard));
        let raw: Value = serde_json::from_str(call.raw_usage.as_deref().unwrap()).unwrap();
        assert_eq!(raw, usage);
    })
    .await;
}

/// Google's `usageMetadata`: 50,000 prompt tokens (20,000 cached), 10,000 candidate and 5,000
/// thinking tokens. Sale: 3 + 0.2 + 6 = 9.2, 10 credits; cost: 0.03 + 0.002 + 0.06 = 0.092.
#[tokio::test]
async fn a_gemini_call_prices_its_usage_metadata_for_sale_and_cost() {
    each_charging_mode(async |rig| {
        let key = rig.db.funded_key(1_000, 0).await;
        let metadata = json!({
            "promptTokenCount": 50000, "cachedContentTokenCount": 20000,
            "candidatesTokenCount": 10000, "thoughtsTokenCount": 5000, "totalTokenCount": 65000
        });
        let reply = json!({
            "candidates": [{"content": {"parts": [{"text": "Hi"}], "role": "model"}, "finishReason": "STOP", "index": 0}],
            "usageMetadata": metadata, "modelVersion": "gemini-2.5-flash"
        });
        rig.google.then(Fault::json(200, &reply.to_string()));
        let body = json!({
            "contents": [{"role": "user", "parts": [{"text": "a".repeat(50_000)}]}],
            "generationConfig": {"maxOutputTokens": 20000}
        });
        let answer = rig
            .call(&key, "/v1beta/models/gemini-cost:generateContent", &body, &[])
            .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        let call = rig.last_call(&key).await;
        assert_eq!(
            (call.input_tokens, call.cache_read_tokens, call.output_tokens),
            (Some(30000), Some(20000), Some(15000)),
            "thinking is output"
        );
        assert_billed(&call, 10, "0.092", "0.008");
        let raw: Value = serde_json::from_str(call.raw_usage.as_deref().unwrap()).unwrap();
        assert_eq!(raw, metadata);
    })
    .await;
}

/// The whole call at the long-context prices from one input token past the threshold (all of
/// the input counts), not at it; for sale and cost alike. A body large enough that its
/// reservation holds the call.
#[tokio::test]
async fn the_long_context_tier_applies_from_one_token_past_its_threshold() {
    each_charging_mode(async |rig| {
        let key = rig.db.funded_key(10_000, 0).await;
        let long = "a".repeat(210_000);
        let body = json!({"model": "claude-long", "max_tokens": 1000, "messages": [{"role": "user", "content": long}]});
        // (input, charged, cost, margin): 199,999 × 300 + 1,000 × 1,500 = 61.4997 → 62 and
        // 0.614997; 200,000: 61.5 → 62 and 0.615; 200,001 × 600 + 1,000 × 2,250 = 122.2506
        // → 123 and 1.222506.
        let cases = [
            (199_999, 62, "0.614997", "0.005003"),
            (200_000, 62, "0.615", "0.005"),
            (200_001, 123, "1.222506", "0.007494"),
        ];
        for (input, credits, cost, margin) in cases {
            // Cached input counts toward the threshold too.
            let usage = json!({"input_tokens": input - 50_000, "cache_read_input_tokens": 50_000, "output_tokens": 1000});
            rig.anthropic.then(message_reply(&usage));
            let answer = rig.call(&key, MESSAGES, &body, &[]).await;
            assert_eq!(answer.status, 200, "{}", answer.body);
            let call = rig.last_call(&key).await;
            // Cached input at the input price: the model gives no cache price.
            assert_billed(&call, credits, cost, margin);
        }
        rig.db.assert_audit_holds().await;
    })
    .await;
}

/// A call is priced at the tier its provider says it served (`service_tier` in `OpenAI`'s
/// reply), else the tier asked for (in the body, or the operator's header); never below the
/// model's minimum, for sale and cost alike.
#[tokio::test]
async fn service_tiers_and_the_minimum_charge_price_sale_and_cost() {
    each_charging_mode(async |rig| {
        let key = rig.db.funded_key(1_000, 0).await;
        let usage =
            json!({"prompt_tokens": 10000, "completion_tokens": 1000, "total_tokens": 11000});
        // Priority, as the reply says: 1.7 + 0.68 = 2.38 → 3 credits; 0.017 + 0.0068 = 0.0238.
        rig.openai.then(chat_reply(&usage, Some("priority")));
        let mut body = chat_of("gpt-tiered", 10_000, 1_000);
        body["service_tier"] = json!("priority");
        let answer = rig.call(&key, CHAT, &body, &[]).await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        let call = rig.last_call(&key).await;
        assert_billed(&call, 3, "0.0238", "0.0062");
        assert_eq!(
            call.service_tier,
            Some(model_gateway::pricing::ServiceTier::Priority)
        );

        // Asked in the operator's header, the reply silent: priced as asked.
        rig.openai.then(chat_reply(&usage, None));
        let answer = rig
            .call(
                &key,
                CHAT,
                &chat_of("gpt-tiered", 10_000, 1_000),
                &[("x-service-tier", "priority")],
            )
            .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert_billed(&rig.last_call(&key).await, 3, "0.0238", "0.0062");

        // Flex: 0.5 + 0.2 = 0.7 credits and 0.007 USD, both under their minimum (2 credits,
        // 0.01 USD).
        rig.openai.then(chat_reply(&usage, Some("flex")));
        let mut body = chat_of("gpt-tiered", 10_000, 1_000);
        body["service_tier"] = json!("flex");
        let answer = rig.call(&key, CHAT, &body, &[]).await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        let call = rig.last_call(&key).await;
        assert_billed(&call, 2, "0.01", "0.01");
        assert_eq!(
            call.service_tier,
            Some(model_gateway::pricing::ServiceTier::Flex)
        );
        rig.db.assert_audit_holds().await;
    })
    .await;
}

/// The reservation holds the dearest tier the call can reach: a call that asks for priority
/// (or names no tier, which the provider may answer at priority) needs the priority ceiling;
/// one that asks for the standard tier, only the standard one.
#[tokio::test]
async fn the_reservation_holds_the_dearest_tier_the_call_can_reach() {
    let rig = Rig::on(local_db().await).await;
    let body = |tier: &str| {
        let mut body = chat_of("gpt-tiered", 10_000, 1_000);
        body["service_tier"] = json!(tier);
        body
    };
    // The ceilings of this body: its input at a token a byte plus the 1,024 a provider may
    // add, and 1,000 tokens out; at the standard prices (100, 400 per million) and at
    // priority's (170, 680).
    let input = serde_json::to_vec(&body("default")).unwrap().len() as i64 + 1_024;
    let ceiling = |input_price: i64, output_price: i64| {
        (input * input_price + 1_000 * output_price + 999_999) / 1_000_000
    };
    let (standard, priority) = (ceiling(100, 400), ceiling(170, 680));
    assert_eq!((standard, priority), (2, 3), "input {input}");
    let key = rig.db.funded_key(standard, 0).await;
    for tier in ["priority", "auto"] {
        let answer = rig.call(&key, CHAT, &body(tier), &[]).await;
        assert_eq!(answer.status, 402, "{tier}: {}", answer.body);
    }
    let answer = rig
        .call(
            &key,
            CHAT,
            &body("default"),
            &[("x-service-tier", "priority")],
        )
        .await;
    assert_eq!(answer.status, 402, "asked in the header: {}", answer.body);
    assert_eq!(rig.openai.requests(), 0, "nothing reached the provider");
    let usage = json!({"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20});
    rig.openai.then(chat_reply(&usage, Some("default")));
    let answer = rig.call(&key, CHAT, &body("default"), &[]).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
}

/// A reply without usage is charged on the gateway's own count, and the entry says so.
#[tokio::test]
async fn a_call_charged_on_the_gateways_own_count_says_its_usage_was_estimated() {
    let rig = Rig::on(local_db().await).await;
    let key = rig.db.funded_key(1_000, 0).await;
    let reply = json!({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]
    });
    rig.openai.then(Fault::json(200, &reply.to_string()));
    let answer = rig.call(&key, CHAT, &chat("gpt-cost"), &[]).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let call = rig.last_call(&key).await;
    assert!(call.usage_estimated, "{call:?}");
    assert!(call.cost.is_some_and(|cost| cost > Money::ZERO), "{call:?}");
    assert_eq!(call.raw_usage, None, "the provider reported none");
}

/// A usage report the gateway does not trust (more output than the call allowed) is charged
/// the call's ceiling, and its cost is not guessed from it: the entry has none, nor a margin.
#[tokio::test]
async fn a_rejected_usage_report_records_no_cost() {
    let rig = Rig::on(local_db().await).await;
    let key = rig.db.funded_key(1_000, 0).await;
    let usage = json!({"prompt_tokens": 100, "completion_tokens": 999_999_999, "total_tokens": 1_000_000_099});
    rig.openai.then(chat_reply(&usage, None));
    let answer = rig.call(&key, CHAT, &chat("gpt-cost"), &[]).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let call = rig.last_call(&key).await;
    assert!(call.usage_rejected, "{call:?}");
    assert_eq!((call.cost, call.margin), (None, None), "{call:?}");
    assert!(call.price.get() > 0);
}

/// The admin API's call log shows the channel, the provider's usage as an object and the cost
/// and margin as exact decimal numbers; the key holder's own call log leaves the operator's
/// cost and margin out.
#[tokio::test]
async fn the_admin_call_log_shows_cost_and_margin_and_the_key_holder_does_not_see_them() {
    let rig = Rig::on(local_db().await).await;
    let key = rig.db.funded_key(1_000, 0).await;
    let usage = json!({
        "prompt_tokens": 30000, "completion_tokens": 5000, "total_tokens": 35000,
        "prompt_tokens_details": {"cached_tokens": 20000},
        "completion_tokens_details": {"reasoning_tokens": 2000}
    });
    rig.openai.then(chat_reply(&usage, None));
    let body = chat_of("gpt-cost", 30_000, 10_000);
    assert_eq!(rig.call(&key, CHAT, &body, &[]).await.status, 200);
    let log = rig.admin_calls(&key).await;
    let entry = &log["data"][0];
    assert_eq!(entry["channel"], "openai");
    assert_eq!(entry["raw_usage"], usage);
    assert_eq!(entry["price"], 12);
    let text = serde_json::to_string(&log).unwrap();
    assert!(text.contains(r#""cost":0.1,"#), "an exact decimal: {text}");
    assert!(text.contains(r#""margin":0.02,"#), "{text}");
    assert_eq!(entry["usage_estimated"], false);

    let own = rig
        .gateway
        .send(
            rig.gateway
                .client
                .get(format!("{}/v1/calls", rig.gateway.base))
                .bearer_auth(&key),
        )
        .await;
    assert_eq!(own.status, 200, "{}", own.body);
    let mine = &own.body["data"][0];
    assert_eq!(mine["price"], 12);
    for operators_own in ["cost", "credit_value", "margin"] {
        assert!(mine.get(operators_own).is_none(), "{operators_own}: {mine}");
    }
}

/// With `usage_cost` on, a complete reply's usage says what the call was charged (`cost`, the
/// credits of `x-gateway-credits`) and by what (`cost_details`), on each protocol; off (the
/// default), the reply is the provider's.
#[tokio::test]
async fn usage_cost_writes_the_charge_into_each_protocols_reply_when_the_operator_asks() {
    let rig = Rig::with(local_db().await, "usage_cost = true").await;
    let key = rig.db.funded_key(10_000, 0).await;
    let usage = json!({
        "prompt_tokens": 30000, "completion_tokens": 5000, "total_tokens": 35000,
        "prompt_tokens_details": {"cached_tokens": 20000},
        "completion_tokens_details": {"reasoning_tokens": 2000}
    });
    rig.openai.then(chat_reply(&usage, None));
    let answer = rig
        .call(&key, CHAT, &chat_of("gpt-cost", 30_000, 10_000), &[])
        .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.headers["x-gateway-credits"], "12");
    let written = &answer.body["usage"];
    assert_eq!(written["cost"], 12);
    assert_eq!(
        written["cost_details"],
        json!({"credits": 12, "input_tokens": 10000, "cache_read_tokens": 20000,
               "output_tokens": 5000, "reasoning_tokens": 2000, "estimated": false})
    );
    // The provider's own fields are all still there, as written.
    assert_eq!(written["prompt_tokens"], 30000);
    assert_eq!(answer.body["choices"][0]["message"]["content"], "hi");

    let anthropic = json!({"input_tokens": 1000, "output_tokens": 3000,
        "cache_read_input_tokens": 100000,
        "cache_creation": {"ephemeral_5m_input_tokens": 2000, "ephemeral_1h_input_tokens": 4000}});
    rig.anthropic.then(message_reply(&anthropic));
    let body = json!({"model": "claude-cost", "max_tokens": 5000,
        "messages": [{"role": "user", "content": "a".repeat(107_000)}]});
    let answer = rig.call(&key, MESSAGES, &body, &[]).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.body["usage"]["cost"], 11);
    assert_eq!(
        answer.body["usage"]["cost_details"]["cache_write_1h_tokens"],
        4000
    );

    let reply = json!({
        "candidates": [{"content": {"parts": [{"text": "Hi"}], "role": "model"}, "finishReason": "STOP", "index": 0}],
        "usageMetadata": {"promptTokenCount": 50000, "cachedContentTokenCount": 20000,
            "candidatesTokenCount": 10000, "thoughtsTokenCount": 5000, "totalTokenCount": 65000}
    });
    rig.google.then(Fault::json(200, &reply.to_string()));
    let body = json!({"contents": [{"role": "user", "parts": [{"text": "a".repeat(50_000)}]}],
        "generationConfig": {"maxOutputTokens": 20000}});
    let answer = rig
        .call(
            &key,
            "/v1beta/models/gemini-cost:generateContent",
            &body,
            &[],
        )
        .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.body["usageMetadata"]["cost"], 10);
    assert_eq!(answer.body["usageMetadata"]["promptTokenCount"], 50000);

    // Off by default: the provider's reply, byte for byte.
    let plain = Rig::on(local_db().await).await;
    let key = plain.db.funded_key(1_000, 0).await;
    let reply = chat_reply(&usage, None);
    plain.openai.then(reply);
    let answer = plain
        .call(&key, CHAT, &chat_of("gpt-cost", 30_000, 10_000), &[])
        .await;
    assert_eq!(answer.status, 200);
    assert!(
        answer.body["usage"].get("cost").is_none(),
        "{}",
        answer.body
    );
    assert_eq!(answer.body["usage"], usage);
}

/// A stream's entry keeps the provider's usage objects as it sent them (Anthropic's two, in
/// order), also when the stream was translated for a chat client (its provider's, not the
/// translation's), and its cost.
#[tokio::test]
async fn a_streams_entry_keeps_the_providers_usage_objects_as_it_sent_them() {
    let rig = Rig::with(local_db().await, "streaming = true\nusage_cost = true").await;
    let key = rig.db.funded_key(10_000, 0).await;
    let start = r#"{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","model":"m","content":[],"stop_reason":null,"usage":{"input_tokens":1000,"cache_read_input_tokens":100000,"output_tokens":1}}}"#;
    let delta = r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":3000}}"#;
    let events = [
        format!("event: message_start\ndata: {start}\n\n"),
        "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n".to_owned(),
        "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n".to_owned(),
        "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n".to_owned(),
        format!("event: message_delta\ndata: {delta}\n\n"),
        "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n".to_owned(),
    ];
    let expected = r#"[{"input_tokens":1000,"cache_read_input_tokens":100000,"output_tokens":1},{"output_tokens":3000}]"#;
    // 1,000 × 300 + 100,000 × 30 + 3,000 × 1,500 = 7.8 → 8 credits; cost 0.003 + 0.03 + 0.045.
    for (path, body) in [
        (
            MESSAGES,
            json!({"model": "claude-cost", "max_tokens": 5000, "stream": true,
                   "messages": [{"role": "user", "content": "a".repeat(101_000)}]}),
        ),
        (
            CHAT,
            json!({"model": "claude-cost", "max_tokens": 5000, "stream": true,
                   "stream_options": {"include_usage": true},
                   "messages": [{"role": "user", "content": "a".repeat(101_000)}]}),
        ),
    ] {
        rig.anthropic
            .then(Fault::sse(events.iter().map(String::as_bytes)));
        let response = rig
            .gateway
            .client
            .post(format!("{}{path}", rig.gateway.base))
            .bearer_auth(&key)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{path}");
        let text = response.text().await.unwrap();
        assert!(text.contains("Hi"), "{path}: {text}");
        // With `usage_cost`, the last usage object the client reads says what it was charged.
        let last_usage = text
            .lines()
            .filter_map(|line| line.strip_prefix("data: "))
            .filter_map(|data| serde_json::from_str::<Value>(data).ok())
            .filter_map(|event| {
                let usage = event.get("usage").or(event.pointer("/message/usage"))?;
                usage.get("cost").map(|_| usage.clone())
            })
            .next_back()
            .unwrap_or_else(|| panic!("{path}: no usage with its cost: {text}"));
        assert_eq!(last_usage["cost"], 8, "{path}: {last_usage}");
        assert_eq!(last_usage["cost_details"]["cache_read_tokens"], 100000);
        let call = crate::streaming::finished_call(&rig.db, &key).await;
        assert_eq!(call.raw_usage.as_deref(), Some(expected), "{path}");
        assert_billed(&call, 8, "0.078", "0.002");
        // The next call's entry is the newest.
        rig.db.assert_audit_holds().await;
    }
}
