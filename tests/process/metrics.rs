//! The metrics operators scrape: known traffic through the example gateway, then
//! `install_prometheus`'s text checked counter by counter. (Beside the process tests only: the
//! recorder is global to the process.)

use crate::common;

use std::collections::BTreeMap;

use common::fake_provider::{FakeProvider, Fault};
use common::*;
use model_gateway::Catalogue;

/// The rendered text as `name{label="value",...}` (labels sorted) -> value.
fn samples(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.is_empty())
        .map(|line| {
            let (series, value) = line.rsplit_once(' ').unwrap();
            let series = match series.split_once('{') {
                Some((name, labels)) => {
                    let mut labels: Vec<&str> = labels.trim_end_matches('}').split(',').collect();
                    labels.sort();
                    format!("{name}{{{}}}", labels.join(","))
                }
                None => series.to_owned(),
            };
            (series, value.parse().unwrap())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_count_known_traffic() {
    let metrics = model_gateway::telemetry::install_prometheus().unwrap();
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let ok = r#"{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}"#;
    // Beside the chat model, one that Google's clients call (translated to chat completions).
    let gemini_model = "[[models]]\nname = \"gemini-on-chat\"\nprotocol = \"chat_completions\"\n\
                        endpoints = [\"gemini\"]\nprice = 1\nupstream = \"prov\"\n";
    let toml = one_upstream_toml("prov", &provider.base, "K", "") + gemini_model;
    let catalogue = Catalogue::from_toml(&toml).unwrap();
    let gateway = http_gateway(&db, catalogue).await;
    let key = db.funded_key(4 * CHAT_PRICE, 0).await;

    provider
        .then(Fault::json(200, ok))
        .then(Fault::json(200, ok));
    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);
    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);
    // A Responses call, translated to the provider's chat completions, counted as its own.
    let chat_reply = r#"{"id":"c","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;
    provider.then(Fault::json(200, chat_reply));
    let responses = gateway
        .post_bearer(
            "/v1/responses",
            &key,
            format!(r#"{{"model":"{CHAT_MODEL}","input":"Hi"}}"#),
        )
        .await;
    assert_eq!(responses.status, 200, "{responses:?}");
    provider.then(Fault::json(503, r#"{"error":{"message":"down"}}"#));
    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 502);
    assert_eq!(gateway.chat(&key, "no-such-model").await.status, 404);
    let poor = db.funded_key(1, 0).await;
    assert_eq!(gateway.chat(&poor, CHAT_MODEL).await.status, 402);

    let seen = samples(&metrics.render());
    let value = |series: &str| {
        *seen
            .get(series)
            .unwrap_or_else(|| panic!("no {series} in {seen:#?}"))
    };
    let calls = |outcome: &str| {
        value(&format!(
            "mg_calls_total{{model=\"{CHAT_MODEL}\",outcome=\"{outcome}\",protocol=\"chat_completions\"}}"
        ))
    };
    assert_eq!(calls("ok"), 2.0);
    assert_eq!(calls("refunded"), 1.0);
    assert_eq!(
        value(&format!(
            "mg_calls_total{{model=\"{CHAT_MODEL}\",outcome=\"ok\",protocol=\"responses\"}}"
        )),
        1.0
    );
    assert_eq!(
        value(&format!(
            "mg_credits_charged_total{{model=\"{CHAT_MODEL}\"}}"
        )),
        6.0
    );
    assert_eq!(
        value(&format!(
            "mg_credits_refunded_total{{model=\"{CHAT_MODEL}\"}}"
        )),
        2.0
    );
    assert_eq!(
        value("mg_refusals_total{reason=\"insufficient_credits\",status=\"402\"}"),
        1.0
    );
    assert_eq!(
        value("mg_refusals_total{reason=\"model_not_found\",status=\"404\"}"),
        1.0
    );
    assert_eq!(
        value("mg_refusals_total{reason=\"upstream_unavailable\",status=\"502\"}"),
        1.0
    );
    assert_eq!(
        value("mg_upstream_attempts_total{outcome=\"ok\",upstream=\"prov\"}"),
        3.0
    );
    assert_eq!(
        value("mg_upstream_attempts_total{outcome=\"retryable\",upstream=\"prov\"}"),
        1.0
    );
    assert_eq!(value("mg_upstream_seconds_count{upstream=\"prov\"}"), 4.0);
    assert_eq!(value("mg_breaker_open{upstream=\"prov\"}"), 0.0);
    assert_eq!(value("mg_pending_reservations"), 0.0);
    // Four reservations, three settles and a refund went through the ledger's batches.
    assert!(value("mg_ledger_batch_writes_sum") >= 8.0, "{seen:#?}");
    assert!(value("mg_ledger_batch_seconds_count") >= 1.0);

    // A Gemini call is counted under its own protocol.
    provider.then(Fault::json(200, chat_reply));
    let gemini = gateway
        .post_bearer(
            "/v1beta/models/gemini-on-chat:generateContent",
            &key,
            r#"{"contents":[{"parts":[{"text":"Hi"}]}]}"#,
        )
        .await;
    assert_eq!(gemini.status, 200, "{gemini:?}");
    let seen = samples(&metrics.render());
    assert_eq!(
        seen.get("mg_calls_total{model=\"gemini-on-chat\",outcome=\"ok\",protocol=\"gemini\"}"),
        Some(&1.0),
        "{seen:#?}"
    );

    clients_leaving_at_any_moment_leave_the_metrics_equal_to_the_ledger(&metrics, &db).await;
    the_credits_counted_are_what_the_ledger_charged_and_the_shortfall_apart(&metrics, &db).await;
}

/// Finding 9 of the fault run: after a storm of clients that hang up at any moment (before the
/// provider answered, while the call settles, after), the call counters equal the ledger's
/// entries, the credits counter its charges, and the pending gauge is back to zero. Counted
/// as the change since before the storm (the recorder is the process's).
async fn clients_leaving_at_any_moment_leave_the_metrics_equal_to_the_ledger(
    metrics: &model_gateway::telemetry::PrometheusHandle,
    db: &TestDb,
) {
    let provider = FakeProvider::start().await;
    let ok = r#"{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}"#;
    provider.always(Fault::json(200, ok).after(std::time::Duration::from_millis(40)));
    let catalogue =
        Catalogue::from_toml(&one_upstream_toml("storm", &provider.base, "K", "")).unwrap();
    let gateway = http_gateway(db, catalogue).await;
    let key = db.funded_key(10_000, 0).await;
    let series = |outcome: &str| {
        format!(
            "mg_calls_total{{model=\"{CHAT_MODEL}\",outcome=\"{outcome}\",protocol=\"chat_completions\"}}"
        )
    };
    let charged = format!("mg_credits_charged_total{{model=\"{CHAT_MODEL}\"}}");
    let read = |name: &str| samples(&metrics.render()).get(name).copied().unwrap_or(0.0);
    let before = (
        read(&series("ok")),
        read(&series("refunded")),
        read(&charged),
    );

    // 12 rounds of 25 clients, each hanging up after 5 to 125 ms (the provider answers after
    // 40 ms, the settle a little later), or not at all.
    for round in 0..12_u64 {
        let calls = (0..25_u64).map(|i| {
            let client = reqwest::Client::builder()
                .timeout(std::time::Duration::from_millis(5 + (i * 5 + round) % 125))
                .build()
                .unwrap();
            let (url, key) = (format!("{}{CHAT}", gateway.base), key.clone());
            async move {
                let _ = client
                    .post(url)
                    .bearer_auth(key)
                    .body(chat_body(CHAT_MODEL))
                    .send()
                    .await;
            }
        });
        futures::future::join_all(calls).await;
    }

    let mut entries = Vec::new();
    let mut seen = (0.0, 0.0, 0.0);
    for _ in 0..100 {
        entries = db.calls(&key).await;
        seen = (
            read(&series("ok")) - before.0,
            read(&series("refunded")) - before.1,
            read(&charged) - before.2,
        );
        let count = |status| entries.iter().filter(|call| call.status == status).count() as f64;
        let ledger = (
            count(model_gateway::store::CallStatus::Ok),
            count(model_gateway::store::CallStatus::Refunded),
            count(model_gateway::store::CallStatus::Ok) * CHAT_PRICE as f64,
        );
        let finished = entries
            .iter()
            .all(|call| call.status != model_gateway::store::CallStatus::Pending);
        if finished && ledger == seen && read("mg_pending_reservations") == 0.0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let count = |status| entries.iter().filter(|call| call.status == status).count() as f64;
    // Clients that left before their call was charged wrote nothing.
    assert!(entries.len() > 200, "{}", entries.len());
    assert_eq!(count(model_gateway::store::CallStatus::Pending), 0.0);
    assert!(
        count(model_gateway::store::CallStatus::Ok) > 0.0
            && count(model_gateway::store::CallStatus::Refunded) > 0.0
    );
    assert_eq!(
        seen.0,
        count(model_gateway::store::CallStatus::Ok),
        "ok calls counted as in the ledger"
    );
    assert_eq!(
        seen.1,
        count(model_gateway::store::CallStatus::Refunded),
        "refunded calls likewise"
    );
    assert_eq!(
        seen.2,
        count(model_gateway::store::CallStatus::Ok) * CHAT_PRICE as f64
    );
    assert_eq!(read("mg_pending_reservations"), 0.0, "nothing pending");
}

/// Finding 6 of the adversarial run: `mg_credits_charged_total` counted a call's cost, not what
/// it was charged (9.22e18 against a ledger of 53,630). A token-priced model's calls: one
/// within its ceiling, one whose provider reports more input than the ceiling allowed (charged
/// the ceiling, the rest its shortfall), one with a usage report the gateway does not trust
/// (charged the ceiling, flagged). The charged counter equals the ledger's charges, the
/// shortfall counter the entries' shortfalls, `x-gateway-credits` each entry's charge.
/// (Part of the test above: the recorder is the process's.)
async fn the_credits_counted_are_what_the_ledger_charged_and_the_shortfall_apart(
    metrics: &model_gateway::telemetry::PrometheusHandle,
    db: &TestDb,
) {
    const MODEL: &str = "metered-for-metrics";
    let provider = FakeProvider::start().await;
    let catalogue = Catalogue::from_toml(&format!(
        "[[upstreams]]\nname = \"metered\"\nkind = \"openai\"\nbase_url = \"{}/v1\"\n\
         api_key_env = \"K\"\n\n[[models]]\nname = \"{MODEL}\"\nprotocol = \"chat_completions\"\n\
         upstream = \"metered\"\nmax_output_tokens = 100\ncontext_window = 1000000\n\
         [models.tokens]\ninput = 1000000\noutput = 1000000\n",
        provider.base
    ))
    .unwrap();
    let gateway = http_gateway(db, catalogue).await;
    let key = db.funded_key(1_000_000, 0).await;
    let usage = |input: i64, output: i64| {
        format!(
            r#"{{"choices":[],"usage":{{"prompt_tokens":{input},"completion_tokens":{output}}}}}"#
        )
    };
    let read = |name: &str| samples(&metrics.render()).get(name).copied().unwrap_or(0.0);
    let charged = format!("mg_credits_charged_total{{model=\"{MODEL}\"}}");
    let short = format!("mg_credits_shortfall_total{{model=\"{MODEL}\"}}");
    let rejected = format!("mg_usage_rejected_total{{model=\"{MODEL}\"}}");

    provider
        .then(Fault::json(200, &usage(5, 5)))
        .then(Fault::json(200, &usage(500_000, 5)))
        .then(Fault::json(200, &usage(-1_000, 5)));
    let mut told = Vec::new();
    for _ in 0..3 {
        let answer = gateway.chat(&key, MODEL).await;
        assert_eq!(answer.status, 200, "{answer:?}");
        let credits = answer.headers["x-gateway-credits"].to_str().unwrap();
        told.push(credits.parse::<i64>().unwrap());
    }

    let mut calls = db.calls(&key).await;
    calls.sort_by_key(|call| call.id.0);
    let entries: Vec<(i64, i64, bool)> = calls
        .iter()
        .map(|call| (call.price.get(), call.shortfall.get(), call.usage_rejected))
        .collect();
    assert_eq!(entries.len(), 3, "{calls:?}");
    assert_eq!(entries[0], (10, 0, false), "within the ceiling: its cost");
    let ceiling = entries[1].0;
    assert!(ceiling < 500_005, "charged the ceiling: {entries:?}");
    assert_eq!(entries[1], (ceiling, 500_005 - ceiling, false));
    assert_eq!(entries[2].0, ceiling, "an untrusted report: the ceiling");
    assert!(entries[2].2, "flagged");
    assert_eq!(
        told,
        entries.iter().map(|entry| entry.0).collect::<Vec<_>>(),
        "x-gateway-credits is each entry's charge"
    );
    let ledger: i64 = entries.iter().map(|entry| entry.0).sum();
    let shortfall: i64 = entries.iter().map(|entry| entry.1).sum();
    assert_eq!(read(&charged), ledger as f64);
    assert_eq!(read(&short), shortfall as f64);
    assert_eq!(read(&rejected), 1.0);
    assert_eq!(
        db.balance(&key).await.total().get(),
        1_000_000 - ledger,
        "the account paid what the ledger says"
    );
}
