//! Models priced by tokens, end to end over HTTP: the reservation holds a ceiling, the settle
//! charges what the provider's usage costs and returns the rest in the same write, and each
//! kind of token is priced once. Each test names the bug of another gateway it rules out.

use crate::common;

use crate::streaming::{finished_call, leave_after, stream};
use common::fake_provider::{FakeProvider, Fault};
use common::*;
use model_gateway::{Catalogue, store::CallStatus};
use serde_json::json;

/// An OpenAI-style and an Anthropic-style provider behind token-priced models: credits per
/// million tokens, `max_output_tokens` the output a call reserves for when the client sets none.
/// With gateway-wide `settings` above it.
fn catalogue_with(openai: &FakeProvider, anthropic: &FakeProvider, settings: &str) -> Catalogue {
    Catalogue::from_toml(&format!(
        r#"
        {settings}
        streaming = true

        [[upstreams]]
        name = "openai"
        kind = "openai"
        base_url = "{}/v1"
        api_key_env = "OPENAI_KEY"

        [[upstreams]]
        name = "anthropic"
        kind = "anthropic"
        base_url = "{}"
        api_key_env = "ANTHROPIC_KEY"

        [[models]]
        name = "metered-chat"
        protocol = "chat_completions"
        upstream = "openai"
        max_output_tokens = 1000
        context_window = 100000
        [models.tokens]
        input = 100000
        output = 400000
        cache_read = 50000

        [[models]]
        name = "metered-claude"
        protocol = "messages"
        upstream = "anthropic"
        max_output_tokens = 1000
        [models.tokens]
        input = 100000
        output = 500000
        cache_read = 10000
        cache_write = 125000
        cache_write_1h = 200000

        [[models]]
        name = "flat-chat"
        protocol = "chat_completions"
        upstream = "openai"
        price = 2
        "#,
        openai.base, anthropic.base
    ))
    .unwrap()
}

struct Rig<'a> {
    db: &'a TestDb,
    gateway: Gateway,
    openai: FakeProvider,
    anthropic: FakeProvider,
}

async fn rig(db: &TestDb) -> Rig<'_> {
    rig_with(db, "").await
}

async fn rig_with<'a>(db: &'a TestDb, settings: &str) -> Rig<'a> {
    let (openai, anthropic) = (FakeProvider::start().await, FakeProvider::start().await);
    let gateway = http_gateway(db, catalogue_with(&openai, &anthropic, settings)).await;
    Rig {
        db,
        gateway,
        openai,
        anthropic,
    }
}

fn chat_reply(usage: serde_json::Value) -> Fault {
    let reply = json!({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": usage,
    });
    Fault::json(200, &reply.to_string())
}

fn chat(model: &str, max_tokens: Option<u64>) -> String {
    let mut body = json!({"model": model, "messages": [{"role": "user", "content": "Hello"}]});
    if let Some(max) = max_tokens {
        body["max_tokens"] = json!(max);
    }
    body.to_string()
}

/// Credits for `tokens` at `per_million` credits per million tokens.
fn at(tokens: i64, per_million: i64) -> i64 {
    tokens * per_million
}

/// A whole charge from a sum in credits per million tokens, rounded up once.
fn whole(per_million_sum: i64) -> i64 {
    (per_million_sum + 999_999) / 1_000_000
}

/// The charge is the provider's usage at the model's prices, cached input priced once at its
/// own rate (not also as input), and the rest of the ceiling goes back; the reply says what it
/// cost in `x-gateway-credits`, and the entry records each kind of token.
#[tokio::test]
async fn a_call_is_charged_what_its_usage_costs_and_the_rest_of_its_ceiling_goes_back() {
    each_database(async |db| {
        let rig = rig(db).await;
        let key = rig.db.funded_key(1_000, 500).await;
        rig.openai.then(chat_reply(json!({
            "prompt_tokens": 30, "completion_tokens": 12, "total_tokens": 42,
            "prompt_tokens_details": {"cached_tokens": 20},
            "completion_tokens_details": {"reasoning_tokens": 8}
        })));
        let response = rig
            .gateway
            .client
            .post(format!("{}{CHAT}", rig.gateway.base))
            .bearer_auth(&key)
            .header("content-type", "application/json")
            .body(chat("metered-chat", Some(100)))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        // 10 uncached input + 20 cached + 12 output (reasoning inside it, not added again).
        let cost = whole(at(10, 100_000) + at(20, 50_000) + at(12, 400_000));
        assert_eq!(cost, 7);
        let header = response.headers()["x-gateway-credits"]
            .to_str()
            .unwrap()
            .to_owned();
        assert_eq!(header, cost.to_string());
        assert_eq!(rig.db.balance(&key).await, balance(1_000 - cost, 500));
        let call = rig.db.calls(&key).await.remove(0);
        assert_eq!(call.status, CallStatus::Ok);
        assert_eq!(call.price.get(), cost);
        assert_eq!(
            (call.charged_subscription.get(), call.charged_topup.get()),
            (cost, 0)
        );
        assert_eq!(call.shortfall.get(), 0);
        assert_eq!(
            (
                call.input_tokens,
                call.cache_read_tokens,
                call.output_tokens,
                call.reasoning_tokens
            ),
            (Some(10), Some(20), Some(12), Some(8))
        );
        // The usage summary sums the kinds, and the credits charged.
        let usage = rig
            .gateway
            .send(
                rig.gateway
                    .client
                    .get(format!("{}/v1/usage", rig.gateway.base))
                    .bearer_auth(&key),
            )
            .await;
        let day = &usage.body["data"][0];
        assert_eq!(day["credits"], cost);
        assert_eq!(
            (
                &day["input_tokens"],
                &day["cache_read_tokens"],
                &day["output_tokens"]
            ),
            (&json!(10), &json!(20), &json!(12))
        );
        rig.db.assert_audit_holds().await;
    })
    .await;
}

/// Cache writes are priced once, at their own rate by duration: not as input as well, and an
/// hour's write not at the five-minute rate.
#[tokio::test]
async fn anthropic_cache_writes_are_priced_once_at_the_rate_of_their_duration() {
    let db = local_db().await;
    let rig = rig(&db).await;
    let key = rig.db.funded_key(10_000, 0).await;
    let reply = json!({
        "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
        "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn",
        "usage": {
            "input_tokens": 10, "output_tokens": 20,
            "cache_read_input_tokens": 100, "cache_creation_input_tokens": 300,
            "cache_creation": {"ephemeral_5m_input_tokens": 100, "ephemeral_1h_input_tokens": 200}
        }
    });
    rig.anthropic.then(Fault::json(200, &reply.to_string()));
    let body = json!({"model": "metered-claude", "max_tokens": 50,
        "messages": [{"role": "user", "content": "Hello"}]});
    let answer = rig
        .gateway
        .post_x_api_key(MESSAGES, &key, body.to_string())
        .await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    let cost = whole(
        at(10, 100_000) + at(20, 500_000) + at(100, 10_000) + at(100, 125_000) + at(200, 200_000),
    );
    assert_eq!(cost, 65);
    assert_eq!(rig.db.balance(&key).await.total().get(), 10_000 - cost);
    let call = rig.db.calls(&key).await.remove(0);
    assert_eq!(
        (
            call.input_tokens,
            call.cache_read_tokens,
            call.cache_write_tokens,
            call.cache_write_1h_tokens
        ),
        (Some(10), Some(100), Some(100), Some(200))
    );
}

/// An account that cannot cover a call's ceiling is refused `402` before the provider is
/// called, and nothing is charged; a smaller output limit lowers the ceiling.
#[tokio::test]
async fn a_call_whose_ceiling_the_account_cannot_cover_is_refused_402_uncharged() {
    let db = local_db().await;
    let rig = rig(&db).await;
    // Output alone: 1,000 tokens at 400,000 per million is 400 credits.
    let key = rig.db.funded_key(200, 0).await;
    let refused = rig
        .gateway
        .post_bearer(CHAT, &key, chat("metered-chat", None))
        .await;
    assert_eq!((refused.status, refused.detail()), (402, "积分不足"));
    assert_eq!(rig.openai.requests(), 0);
    rig.openai.then(chat_reply(
        json!({"prompt_tokens": 5, "completion_tokens": 5}),
    ));
    // 100 output tokens: 40 credits, beside the input's ceiling (about 110).
    let allowed = rig
        .gateway
        .post_bearer(CHAT, &key, chat("metered-chat", Some(100)))
        .await;
    assert_eq!(allowed.status, 200);
    assert_eq!(rig.db.balance(&key).await.total().get(), 200 - 3);
    rig.db.assert_audit_holds().await;
}

/// Limits `key` to `credits` a day; its caller.
async fn limit_key(db: &TestDb, key: &str, credits: i64) -> model_gateway::store::Caller {
    let caller = db.caller(key).await;
    let limit = model_gateway::admin::KeyPatch {
        limit: Some(Some(model_gateway::call::KeyLimit {
            credits: model_gateway::Credits::new(credits),
            period: model_gateway::call::LimitPeriod::Day,
        })),
        ..Default::default()
    };
    db.admin().update_key(caller.key, &limit).await.unwrap();
    caller
}

/// What a call of `metered-chat` with `body` reserves: its input ceiling at the input price and
/// `output` tokens at the output price.
fn chat_ceiling(body: &str, output: i64) -> i64 {
    let input = model_gateway::pricing::input_ceiling_tokens(body.as_bytes()) as i64;
    whole(at(input, 100_000) + at(output, 400_000))
}

/// A provider reporting more than the call's ceiling (here within the model's context window,
/// so the report is trusted): by default the ceiling is the most a call is charged. The entry
/// records the rest as the operator's shortfall, and the reply says what was charged (the
/// adversarial run: an entry charged 50 answered `x-gateway-credits: 2000`).
#[tokio::test]
async fn a_cost_above_the_ceiling_is_charged_the_ceiling_and_the_rest_is_the_shortfall() {
    each_database(async |db| {
        let rig = rig(db).await;
        let key = rig.db.funded_key(1_000, 0).await;
        let body = chat("metered-chat", Some(100));
        let ceiling = chat_ceiling(&body, 100);
        // 5,000 input tokens and 100 output: 540 credits, above the ceiling.
        rig.openai.then(chat_reply(
            json!({"prompt_tokens": 5000, "completion_tokens": 100}),
        ));
        let answer = rig.gateway.post_bearer(CHAT, &key, body).await;
        assert_eq!(answer.status, 200);
        assert!(ceiling < 540, "{ceiling}");
        assert_eq!(
            answer.headers["x-gateway-credits"],
            ceiling.to_string().as_str()
        );
        assert_eq!(rig.db.balance(&key).await.total().get(), 1_000 - ceiling);
        let call = rig.db.calls(&key).await.remove(0);
        assert_eq!(call.price.get(), ceiling);
        assert_eq!(call.shortfall.get(), 540 - ceiling);
        assert!(!call.usage_rejected);
        rig.db.assert_audit_holds().await;
    })
    .await;
}

/// With `charge_beyond_ceiling = true` a call may be charged beyond its ceiling, but never past
/// its key's limit (the adversarial run: a key limited to 100 a day spent 2,000); the reply and
/// the entry say what the ledger charged.
#[tokio::test]
async fn beyond_the_ceiling_a_call_is_charged_no_more_than_its_keys_limit_allows() {
    each_database(async |db| {
        let rig = rig_with(db, "charge_beyond_ceiling = true").await;
        let key = rig.db.funded_key(10_000, 0).await;
        let caller = limit_key(rig.db, &key, 200).await;
        // 50,000 input tokens and 100 output: 5,040 credits.
        rig.openai.then(chat_reply(
            json!({"prompt_tokens": 50_000, "completion_tokens": 100}),
        ));
        let answer = rig
            .gateway
            .post_bearer(CHAT, &key, chat("metered-chat", Some(100)))
            .await;
        assert_eq!(answer.status, 200);
        assert_eq!(answer.headers["x-gateway-credits"], "200");
        let call = rig.db.calls(&key).await.remove(0);
        assert_eq!((call.price.get(), call.shortfall.get()), (200, 5_040 - 200));
        let info = model_gateway::Accounts::key_info(&*rig.db.store, caller.key)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(info.spent.get(), 200);
        assert_eq!(rig.db.balance(&key).await.total().get(), 10_000 - 200);
        rig.db.assert_audit_holds().await;
    })
    .await;
}

/// The ceiling covers the output limit a provider may follow, not the one the client picked
/// to look small: the largest of `max_tokens`, `max_completion_tokens`, and each reply asked for
/// with `n` (the adversarial run: `max_tokens: 1, max_completion_tokens: 100000` reserved 32 and
/// cost 100,010; `n: 50, max_tokens: 10` delivered 500 tokens for a ceiling of 35).
#[tokio::test]
async fn the_ceiling_covers_the_largest_output_limit_and_every_reply_asked_for() {
    let db = local_db().await;
    let rig = rig(&db).await;
    let key = rig.db.funded_key(1_000, 0).await;
    let body = json!({"model": "metered-chat", "max_tokens": 1, "max_completion_tokens": 100_000,
        "messages": [{"role": "user", "content": "Hello"}]});
    let refused = rig.gateway.post_bearer(CHAT, &key, body.to_string()).await;
    assert_eq!((refused.status, refused.detail()), (402, "积分不足"));
    assert_eq!(rig.openai.requests(), 0);

    let body = json!({"model": "metered-chat", "max_tokens": 10, "n": 50,
        "messages": [{"role": "user", "content": "Hello"}]})
    .to_string();
    let ceiling = chat_ceiling(&body, 500);
    assert!(ceiling > chat_ceiling(&body, 10));
    rig.openai.then(chat_reply(
        json!({"prompt_tokens": 10, "completion_tokens": 500}),
    ));
    let answer = rig.gateway.post_bearer(CHAT, &key, body).await;
    assert_eq!(answer.status, 200);
    let call = rig.db.calls(&key).await.remove(0);
    let cost = whole(at(10, 100_000) + at(500, 400_000));
    assert_eq!((call.price.get(), call.shortfall.get()), (cost, 0));
    assert!(!call.usage_rejected, "500 tokens fit 50 replies of 10");

    for n in [json!(0), json!(129), json!(2.5), json!("2")] {
        let body = json!({"model": "metered-chat", "max_tokens": 10, "n": n,
            "messages": [{"role": "user", "content": "Hello"}]});
        let refused = rig.gateway.post_bearer(CHAT, &key, body.to_string()).await;
        assert_eq!(refused.status, 400, "n = {n}");
    }
    assert_eq!(rig.openai.requests(), 1);
    assert_eq!(
        rig.db.calls(&key).await.len(),
        1,
        "refusals are never charged"
    );
    rig.db.assert_audit_holds().await;
}

/// A provider's usage that no call could have used is not trusted: the call is charged its
/// ceiling, the entry is marked `usage_rejected` and keeps no count that is not one, and a
/// provider that answered is never refunded for it (the adversarial run: a million cache reads
/// on a 10-token prompt emptied an account; 2^63-1 tokens charged 9.2e18; -1000 was stored;
/// a float or a string count answered 502, refunded).
#[tokio::test]
async fn an_implausible_usage_report_is_charged_the_ceiling_and_flagged() {
    each_database(async |db| {
        let rig = rig(db).await;
        let key = rig.db.funded_key(100_000, 0).await;
        let reports = [
            json!({"prompt_tokens": 10, "completion_tokens": 5,
                "prompt_tokens_details": {"cached_tokens": 1_000_000}}),
            json!({"prompt_tokens": i64::MAX, "completion_tokens": 5}),
            json!({"prompt_tokens": 10, "completion_tokens": -1000}),
            json!({"prompt_tokens": 10.5, "completion_tokens": 5}),
            json!({"prompt_tokens": "10", "completion_tokens": 5}),
            json!({"prompt_tokens": 10, "completion_tokens": 1_000_000}),
            json!({"prompt_tokens": 200_000, "completion_tokens": 5}),
        ];
        let body = chat("metered-chat", Some(100));
        let ceiling = chat_ceiling(&body, 100);
        for (n, report) in reports.iter().enumerate() {
            rig.openai.then(chat_reply(report.clone()));
            let answer = rig.gateway.post_bearer(CHAT, &key, body.clone()).await;
            assert_eq!(answer.status, 200, "{report}");
            assert_eq!(
                answer.headers["x-gateway-credits"],
                ceiling.to_string().as_str()
            );
            let call = rig.db.calls(&key).await.remove(0);
            assert_eq!(call.status, CallStatus::Ok, "{report}");
            assert_eq!(
                (call.price.get(), call.usage_rejected),
                (ceiling, true),
                "{report}"
            );
            for count in [
                call.input_tokens,
                call.output_tokens,
                call.cache_read_tokens,
            ] {
                assert!(count.is_none_or(|count| count >= 0), "{report}: {call:?}");
            }
            let spent = ceiling * (n as i64 + 1);
            assert_eq!(rig.db.balance(&key).await.total().get(), 100_000 - spent);
        }
        rig.db.assert_audit_holds().await;
    })
    .await;
}

/// Many concurrent calls on one account never pass a check and then overdraw it (new-api #6609):
/// each reserves its ceiling in the write that checks it.
#[tokio::test]
async fn concurrent_calls_never_overdraw_an_account() {
    each_database(async |db| {
        let rig = rig(db).await;
        // Each call's ceiling is about 151 credits (its input's ceiling, about 111, and 100
        // output tokens, 40); 700 pay for four of them at once.
        let key = rig.db.funded_key(700, 0).await;
        rig.openai.always(chat_reply(
            json!({"prompt_tokens": 10, "completion_tokens": 100}),
        ));
        let calls = (0..24).map(|_| {
            let (gateway, key) = (&rig.gateway, &key);
            async move {
                gateway
                    .post_bearer(CHAT, key, chat("metered-chat", Some(100)))
                    .await
            }
        });
        let answers = futures::future::join_all(calls).await;
        let ok = answers.iter().filter(|answer| answer.status == 200).count() as i64;
        assert!(
            answers
                .iter()
                .all(|answer| [200, 402].contains(&answer.status))
        );
        // Each costs 41 credits (10 × 0.1 + 100 × 0.4 = 41).
        let left = rig.db.balance(&key).await.total().get();
        assert!(left >= 0, "{left}");
        assert_eq!(left, 700 - 41 * ok);
        assert!(ok >= 4, "{ok} calls got through");
        rig.db.assert_audit_holds().await;
    })
    .await;
}

/// A reply without usage is charged the gateway's estimate: never refunded whole (new-api
/// #5235) and never free; a per-call model next to it is charged its price as always.
#[tokio::test]
async fn a_reply_without_usage_is_charged_the_estimate_not_refunded_or_free() {
    let db = local_db().await;
    let rig = rig(&db).await;
    let key = rig.db.funded_key(1_000, 0).await;
    rig.openai.then(chat_reply(serde_json::Value::Null));
    let answer = rig
        .gateway
        .post_bearer(CHAT, &key, chat("metered-chat", Some(100)))
        .await;
    assert_eq!(answer.status, 200);
    let call = rig.db.calls(&key).await.remove(0);
    assert_eq!(call.status, CallStatus::Ok);
    assert!(call.price.get() > 0);
    // Never more than what the call reserved: input estimated, output counted from the reply.
    assert!(call.price.get() <= 41, "{call:?}");
    rig.openai.then(chat_reply(
        json!({"prompt_tokens": 10_000, "completion_tokens": 10_000}),
    ));
    let flat = rig
        .gateway
        .post_bearer(CHAT, &key, chat("flat-chat", None))
        .await;
    assert_eq!(flat.status, 200);
    assert_eq!(rig.db.calls(&key).await[0].price.get(), 2);
    rig.db.assert_audit_holds().await;
}

/// A provider failure refunds the whole ceiling, as for a price per call.
#[tokio::test]
async fn a_failed_call_gets_its_whole_ceiling_back() {
    let db = local_db().await;
    let rig = rig(&db).await;
    let key = rig.db.funded_key(1_000, 0).await;
    rig.openai
        .always(Fault::json(500, r#"{"error":{"message":"down"}}"#));
    let answer = rig
        .gateway
        .post_bearer(CHAT, &key, chat("metered-chat", Some(100)))
        .await;
    assert_eq!(answer.status, 502);
    assert_eq!(rig.db.balance(&key).await.total().get(), 1_000);
    assert_eq!(rig.db.calls(&key).await[0].status, CallStatus::Refunded);
    rig.db.assert_audit_holds().await;
}

/// The models list shows a token-priced model's prices and output ceiling, and only a price for
/// the others.
#[tokio::test]
async fn the_models_list_shows_token_prices() {
    let db = local_db().await;
    let rig = rig(&db).await;
    let key = rig.db.funded_key(1, 0).await;
    let listed = rig
        .gateway
        .send(
            rig.gateway
                .client
                .get(format!("{}/v1/models", rig.gateway.base))
                .bearer_auth(&key),
        )
        .await;
    let item = |id: &str| {
        listed.body["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|item| item["id"] == id)
            .unwrap()
            .clone()
    };
    let metered = item("metered-claude");
    assert_eq!(metered["token_prices"]["cache_write_1h"], 200000.0);
    assert_eq!(metered["token_prices"]["cache_read"], 10000.0);
    assert_eq!(metered["max_output_tokens"], 1000);
    let flat = item("flat-chat");
    assert_eq!(flat["price"], 2);
    assert!(flat.get("token_prices").is_none());
}

/// In mock mode a token-priced model is charged for the usage the mock reports, computed from
/// the request, so prices can be tried without a provider.
#[tokio::test]
async fn the_mock_reports_usage_from_the_request_and_it_is_charged() {
    let db = local_db().await;
    let catalogue = Catalogue::from_toml(
        r#"
        [[upstreams]]
        name = "openai"
        kind = "openai"
        base_url = "http://127.0.0.1:9/v1"
        api_key_env = "UNUSED"
        [[models]]
        name = "metered-chat"
        protocol = "chat_completions"
        upstream = "openai"
        max_output_tokens = 100
        tokens = { input = 100000, output = 400000 }
        "#,
    )
    .unwrap();
    let gateway = start_gateway(
        &db,
        catalogue,
        model_gateway::Upstream::Mock(model_gateway::upstream::MockUpstream::new()),
        model_gateway::router::DEFAULT_MAX_BODY_BYTES,
    )
    .await;
    let key = db.funded_key(1_000, 0).await;
    let body = chat("metered-chat", None);
    let answer = gateway.post_bearer(CHAT, &key, body.clone()).await;
    assert_eq!(answer.status, 200);
    let input = model_gateway::pricing::estimated_input_tokens(body.len()) as i64;
    assert_eq!(answer.body["usage"]["prompt_tokens"], input);
    let call = db.calls(&key).await.remove(0);
    assert_eq!(call.input_tokens, Some(input));
    assert_eq!(
        call.price.get(),
        whole(at(input, 100_000) + at(16, 400_000))
    );
}

fn chat_stream(model: &str, max_tokens: u64) -> serde_json::Value {
    json!({"model": model, "stream": true, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Hello"}]})
}

fn chunk(delta: &str) -> String {
    let chunk = json!({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": {"content": delta}, "finish_reason": null}]});
    format!("data: {chunk}\n\n")
}

/// A chat stream of a token-priced model is settled on the usage the provider reports at its
/// end, which the gateway asks for when the client did not (so that no streamed call is
/// billed as zero, `LiteLLM` #37923), without passing that chunk to a client that did not ask.
#[tokio::test]
async fn a_chat_stream_settles_on_the_usage_the_gateway_asked_for_without_showing_it() {
    let db = local_db().await;
    let rig = rig(&db).await;
    let key = db.funded_key(1_000, 0).await;
    let usage = json!({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 20, "total_tokens": 60}});
    rig.openai.then(Fault::sse([
        chunk("Hel"),
        chunk("lo"),
        format!("data: {usage}\n\n"),
        "data: [DONE]\n\n".to_owned(),
    ]));
    let received = stream(&rig.gateway, CHAT, &key, chat_stream("metered-chat", 100)).await;
    assert_eq!(received.status, 200);
    assert_eq!(received.joined_text(), "Hello");
    assert!(
        !received.text().contains("\"usage\""),
        "{}",
        received.text()
    );
    assert!(received.text().ends_with("data: [DONE]\n\n"));
    let sent: serde_json::Value = serde_json::from_slice(&rig.openai.last().body).unwrap();
    assert_eq!(sent["stream_options"]["include_usage"], true);
    let cost = whole(at(40, 100_000) + at(20, 400_000));
    let call = finished_call(&db, &key).await;
    assert_eq!((call.status, call.price.get()), (CallStatus::Ok, cost));
    assert_eq!(
        (call.input_tokens, call.output_tokens),
        (Some(40), Some(20))
    );
    assert_eq!(db.balance(&key).await.total().get(), 1_000 - cost);

    // A client that asked for the usage gets it, as the provider sent it.
    rig.openai.then(Fault::sse([
        chunk("Hi"),
        format!("data: {usage}\n\n"),
        "data: [DONE]\n\n".to_owned(),
    ]));
    let mut asked = chat_stream("metered-chat", 100);
    asked["stream_options"] = json!({"include_usage": true});
    let received = stream(&rig.gateway, CHAT, &key, asked).await;
    assert!(received.text().contains("\"usage\""));
    db.assert_audit_holds().await;
}

/// A client that turned the stream's usage off (`include_usage: false`, or options without it)
/// is still billed on the provider's usage: the gateway asks for it whatever the client set, and
/// keeps the usage chunk from it (the adversarial run: reasoning never billed, 42 credits for a
/// reply the provider counted at 5,010).
#[tokio::test]
async fn a_stream_whose_client_turned_usage_off_is_billed_on_the_providers_usage() {
    let db = local_db().await;
    let rig = rig(&db).await;
    let key = db.funded_key(10_000, 0).await;
    let usage = json!({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5000,
        "completion_tokens_details": {"reasoning_tokens": 4990}}});
    let mut spent = 0;
    for options in [json!({"include_usage": false}), json!({}), json!(null)] {
        rig.openai.then(Fault::sse([
            chunk("Hi"),
            format!("data: {usage}\n\n"),
            "data: [DONE]\n\n".to_owned(),
        ]));
        let mut body = chat_stream("metered-chat", 5000);
        body["stream_options"] = options.clone();
        let received = stream(&rig.gateway, CHAT, &key, body).await;
        assert_eq!(received.status, 200);
        assert_eq!(received.joined_text(), "Hi");
        assert!(
            !received.text().contains("\"usage\""),
            "{options}: {}",
            received.text()
        );
        let sent: serde_json::Value = serde_json::from_slice(&rig.openai.last().body).unwrap();
        assert_eq!(sent["stream_options"]["include_usage"], true, "{options}");
        assert_eq!(sent["model"], "metered-chat");
        let cost = whole(at(10, 100_000) + at(5000, 400_000));
        spent += cost;
        let call = db.calls(&key).await.remove(0);
        let call = if call.status == CallStatus::Pending {
            finished_call(&db, &key).await
        } else {
            call
        };
        assert_eq!(
            (call.status, call.price.get()),
            (CallStatus::Ok, cost),
            "{options}"
        );
        assert_eq!(call.reasoning_tokens, Some(4990));
    }
    assert_eq!(db.balance(&key).await.total().get(), 10_000 - spent);
    db.assert_audit_holds().await;
}

/// A client that leaves mid-stream is charged its input and the output it was passed, counted
/// from the deltas: not an estimate of output never generated (new-api #4168), never zero for
/// content it got, never more than the reservation.
#[tokio::test]
async fn a_client_leaving_mid_stream_pays_its_input_and_the_output_it_was_passed() {
    let db = local_db().await;
    let rig = rig(&db).await;
    let key = db.funded_key(1_000, 0).await;
    let body = chat_stream("metered-chat", 100);
    let deltas = [
        chunk("The quick brown fox"),
        chunk(" jumps over the lazy dog"),
    ];
    leave_after(&rig.gateway, &rig.openai, CHAT, &key, body.clone(), &deltas).await;
    let call = finished_call(&db, &key).await;
    assert_eq!(call.status, CallStatus::Ok);
    let forwarded = model_gateway::pricing::counted_text_tokens("The quick brown fox")
        + model_gateway::pricing::counted_text_tokens(" jumps over the lazy dog");
    assert_eq!(call.output_tokens, Some(forwarded as i64));
    let input = model_gateway::pricing::estimated_input_tokens(body.to_string().len()) as i64;
    let cost = whole(at(input, 100_000) + at(forwarded as i64, 400_000));
    assert_eq!(call.price.get(), cost);
    assert!(cost > 0 && cost < 41, "{cost}");
    assert_eq!(db.balance(&key).await.total().get(), 1_000 - cost);
    db.assert_audit_holds().await;
}

/// A stream that ends normally without usage (its client turned usage off) is charged the
/// estimate: the input estimated and the output counted; never refunded whole (new-api #5235).
#[tokio::test]
async fn a_stream_ending_without_usage_is_charged_the_estimate() {
    let db = local_db().await;
    let rig = rig(&db).await;
    let key = db.funded_key(1_000, 0).await;
    rig.openai.then(Fault::sse([
        chunk("Hello there"),
        "data: [DONE]\n\n".to_owned(),
    ]));
    let mut body = chat_stream("metered-chat", 100);
    body["stream_options"] = json!({"include_usage": false});
    let received = stream(&rig.gateway, CHAT, &key, body.clone()).await;
    assert_eq!(received.joined_text(), "Hello there");
    let call = finished_call(&db, &key).await;
    assert_eq!(call.status, CallStatus::Ok);
    let output = model_gateway::pricing::counted_text_tokens("Hello there") as i64;
    let input = model_gateway::pricing::estimated_input_tokens(body.to_string().len()) as i64;
    assert_eq!(call.output_tokens, Some(output));
    assert_eq!(
        call.price.get(),
        whole(at(input, 100_000) + at(output, 400_000))
    );
    db.assert_audit_holds().await;
}

/// An Anthropic stream left mid-way: the input its start reported, and the output passed on
/// counted, rather than the one token its start reports.
#[tokio::test]
async fn a_messages_stream_left_mid_way_pays_the_reported_input_and_the_output_passed() {
    let db = local_db().await;
    let rig = rig(&db).await;
    let key = db.funded_key(10_000, 0).await;
    let start = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"m\",\"usage\":{\"input_tokens\":50,\"output_tokens\":1}}}\n\n";
    let delta = "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello there, how can I help you today?\"}}\n\n";
    let body = json!({"model": "metered-claude", "stream": true, "max_tokens": 100,
        "messages": [{"role": "user", "content": "Hello"}]});
    leave_after(
        &rig.gateway,
        &rig.anthropic,
        MESSAGES,
        &key,
        body,
        &[start, delta],
    )
    .await;
    let call = finished_call(&db, &key).await;
    let output =
        model_gateway::pricing::counted_text_tokens("Hello there, how can I help you today?")
            as i64;
    assert!(output > 1);
    assert_eq!(
        (call.input_tokens, call.output_tokens),
        (Some(50), Some(output))
    );
    assert_eq!(
        call.price.get(),
        whole(at(50, 100_000) + at(output, 500_000))
    );
    db.assert_audit_holds().await;
}

/// A key whose spending limit is below a call's ceiling cannot make the call, though its cost
/// would fit: the ceiling is the most a call may cost, and a key's limit is never passed. The
/// client that asks for less output makes it (decided in issue 67; docs/api.md says so).
#[tokio::test]
async fn a_key_whose_limit_is_below_the_ceiling_asks_for_less_output() {
    let db = local_db().await;
    let rig = rig(&db).await;
    let key = rig.db.funded_key(10_000, 0).await;
    limit_key(rig.db, &key, 200).await;
    // The model's 1,000 output tokens: 400 credits of ceiling, past the key's 200.
    let refused = rig
        .gateway
        .post_bearer(CHAT, &key, chat("metered-chat", None))
        .await;
    assert_eq!(
        (refused.status, refused.detail()),
        (402, "API Key 额度已用尽")
    );
    assert_eq!(rig.openai.requests(), 0);
    rig.openai.then(chat_reply(
        json!({"prompt_tokens": 5, "completion_tokens": 5}),
    ));
    let allowed = rig
        .gateway
        .post_bearer(CHAT, &key, chat("metered-chat", Some(100)))
        .await;
    assert_eq!(allowed.status, 200);
    assert_eq!(rig.db.balance(&key).await.total().get(), 10_000 - 3);
}
