//! The catalogue changes without a restart: `POST /admin/catalogue/reload` reads the file again,
//! serves new prices, models and upstreams, refuses a bad file (or a change of a setting read
//! at start) with the message a start would give while the old catalogue serves on; a call in
//! flight finishes on the catalogue it began with, at the price it reserved; calls made while
//! the catalogue is reloaded again and again never fail, each charged the price it reserved.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::fake_provider::{FakeProvider, Fault};
use common::*;
use model_gateway::admin::AdminToken;
use model_gateway::catalogue::LiveCatalogue;
use model_gateway::reload::CatalogueReloader;
use model_gateway::upstream::{HttpUpstream, MockUpstream};
use model_gateway::{Catalogue, Gateway, Upstream};
use serde_json::Value;

const TOKEN: &str = "admin-token-for-tests-0123456789";

const CHAT_REPLY: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"Hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}"#;

/// A catalogue with one upstream at `base` and `models` (name, price) on it.
fn catalogue_toml(base: &str, models: &[(&str, i64)]) -> String {
    let mut toml = format!(
        "[[upstreams]]\nname = \"fake\"\nkind = \"openai\"\nbase_url = \"{base}/v1\"\napi_key_env = \"FAKE_KEY\"\n"
    );
    for (name, price) in models {
        toml.push_str(&format!(
            "[[models]]\nname = \"{name}\"\nprotocol = \"chat_completions\"\nprice = {price}\nupstream = \"fake\"\n"
        ));
    }
    toml
}

struct Reloading {
    gateway: common::Gateway,
    file: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Reloading {
    fn write(&self, toml: &str) {
        std::fs::write(&self.file, toml).unwrap();
    }

    async fn reload(&self) -> Answer {
        let request = self
            .gateway
            .client
            .post(format!("{}/admin/catalogue/reload", self.gateway.base))
            .bearer_auth(TOKEN);
        self.gateway.send(request).await
    }

    async fn shown(&self) -> Answer {
        let request = self
            .gateway
            .client
            .get(format!("{}/admin/catalogue", self.gateway.base))
            .bearer_auth(TOKEN);
        self.gateway.send(request).await
    }
}

/// The example gateway's wiring: a catalogue read from a file, reloaded from it.
async fn reloading_gateway(db: &TestDb, toml: &str) -> Reloading {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("models.toml");
    std::fs::write(&file, toml).unwrap();
    let catalogue = Catalogue::from_path(&file).unwrap();
    let upstream = Upstream::Http(
        HttpUpstream::with_keys(&catalogue, |_| Some("sk-provider".into())).unwrap(),
    );
    let live = LiveCatalogue::new(catalogue);
    let source = file.clone();
    let reloader = CatalogueReloader::new(live.clone(), upstream.clone(), move || {
        Catalogue::from_path(&source)
    });
    let router = Gateway::new(db.store.clone(), live, upstream)
        .catalogue_reloader(reloader)
        .admin_token(Some(AdminToken::new(TOKEN).unwrap()))
        .router();
    Reloading {
        gateway: serve_router(router).await,
        file,
        _dir: dir,
    }
}

fn model_prices(shown: &Value) -> Vec<(String, i64)> {
    shown["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|model| {
            (
                model["name"].as_str().unwrap().to_owned(),
                model["price"].as_i64().unwrap(),
            )
        })
        .collect()
}

fn credits_header(answer: &Answer) -> Option<i64> {
    answer
        .headers
        .get("x-gateway-credits")?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

#[tokio::test]
async fn a_reload_serves_new_prices_and_models_and_a_bad_catalogue_changes_nothing() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    provider.always(Fault::json(200, CHAT_REPLY));
    let reloading = reloading_gateway(&db, &catalogue_toml(&provider.base, &[("alpha", 2)])).await;
    let gateway = &reloading.gateway;
    let key = db.funded_key(100, 0).await;

    let shown = reloading.shown().await;
    assert_eq!(shown.status, 200, "{:?}", shown.body);
    assert_eq!(model_prices(&shown.body), [("alpha".to_owned(), 2)]);
    assert_eq!(shown.body["upstreams"][0]["name"], "fake");
    let before = gateway.chat(&key, "alpha").await;
    assert_eq!((before.status, credits_header(&before)), (200, Some(2)));

    reloading.write(&catalogue_toml(
        &provider.base,
        &[("alpha", 5), ("beta", 1)],
    ));
    let reloaded = reloading.reload().await;
    assert_eq!(reloaded.status, 200, "{:?}", reloaded.body);
    assert_eq!(
        model_prices(&reloaded.body),
        [("alpha".to_owned(), 5), ("beta".to_owned(), 1)]
    );
    let after = gateway.chat(&key, "alpha").await;
    assert_eq!((after.status, credits_header(&after)), (200, Some(5)));
    assert_eq!(gateway.chat(&key, "beta").await.status, 200);
    let listed = gateway
        .send(
            gateway
                .client
                .get(format!("{}/v1/models", gateway.base))
                .bearer_auth(&key),
        )
        .await;
    let ids: Vec<_> = listed.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|model| model["id"].as_str().unwrap().to_owned())
        .collect();
    assert!(ids.contains(&"beta".to_owned()), "{ids:?}");

    // A catalogue naming an upstream it does not have: refused as a start would refuse it.
    let broken = catalogue_toml(&provider.base, &[("gamma", 1)])
        .replace("upstream = \"fake\"\n", "upstream = \"nowhere\"\n");
    reloading.write(&broken);
    let at_start = Catalogue::from_path(&reloading.file)
        .unwrap_err()
        .to_string();
    let refused = reloading.reload().await;
    assert_eq!((refused.status, refused.detail()), (400, at_start.as_str()));
    assert_eq!(
        gateway.chat(&key, "beta").await.status,
        200,
        "the old one serves on"
    );
    assert_eq!(gateway.chat(&key, "gamma").await.status, 404);

    // A setting read at start is not changed by a reload.
    reloading.write(&format!(
        "streaming = true\n{}",
        catalogue_toml(&provider.base, &[("alpha", 9)])
    ));
    let refused = reloading.reload().await;
    assert_eq!(refused.status, 400);
    assert!(
        refused.detail().contains("streaming"),
        "{}",
        refused.detail()
    );
    let still = gateway.chat(&key, "alpha").await;
    assert_eq!(credits_header(&still), Some(5));
    assert_eq!(
        model_prices(&reloading.shown().await.body),
        [("alpha".to_owned(), 5), ("beta".to_owned(), 1)]
    );
    assert_eq!(db.balance(&key).await, balance(100 - 2 - 5 - 1 - 1 - 5, 0));
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn a_call_in_flight_finishes_at_the_price_it_reserved_on_the_upstream_it_began_with() {
    let db = local_db().await;
    let old_provider = FakeProvider::start().await;
    let new_provider = FakeProvider::start().await;
    old_provider.always(Fault::json(200, CHAT_REPLY).after(Duration::from_millis(400)));
    new_provider.always(Fault::json(200, CHAT_REPLY));
    let reloading =
        reloading_gateway(&db, &catalogue_toml(&old_provider.base, &[("alpha", 2)])).await;
    let key = db.funded_key(100, 0).await;
    let slow = {
        let gateway_base = reloading.gateway.base.clone();
        let client = reloading.gateway.client.clone();
        let key = key.clone();
        tokio::spawn(async move {
            let reply = client
                .post(format!("{gateway_base}/v1/chat/completions"))
                .bearer_auth(&key)
                .header("content-type", "application/json")
                .body(chat_body("alpha"))
                .send()
                .await
                .unwrap();
            let credits = reply.headers()["x-gateway-credits"]
                .to_str()
                .unwrap()
                .to_owned();
            (reply.status().as_u16(), credits)
        })
    };
    wait_for("the slow call to reach the old provider", async || {
        old_provider.requests() == 1
    })
    .await;
    // Another price, and another provider at the same upstream name.
    reloading.write(&catalogue_toml(&new_provider.base, &[("alpha", 7)]));
    assert_eq!(reloading.reload().await.status, 200);
    let (status, credits) = slow.await.unwrap();
    assert_eq!((status, credits.as_str()), (200, "2"));
    let now = reloading.gateway.chat(&key, "alpha").await;
    assert_eq!((now.status, credits_header(&now)), (200, Some(7)));
    assert_eq!(
        (old_provider.requests(), new_provider.requests()),
        (1, 1),
        "each call went to the provider of its catalogue"
    );
    let prices: Vec<i64> = db
        .calls(&key)
        .await
        .iter()
        .map(|call| call.price.get())
        .collect();
    assert_eq!(prices, [7, 2]);
    db.assert_audit_holds().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn calls_go_on_through_ten_reloads_each_charged_the_price_it_reserved() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    provider.always(Fault::json(200, CHAT_REPLY));
    let toml = |price| catalogue_toml(&provider.base, &[("alpha", price)]);
    let reloading = reloading_gateway(&db, &toml(2)).await;
    let key = db.funded_key(1_000_000, 0).await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let workers: Vec<_> = (0..8)
        .map(|_| {
            let base = reloading.gateway.base.clone();
            let client = reloading.gateway.client.clone();
            let key = key.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut answers = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let reply = client
                        .post(format!("{base}/v1/chat/completions"))
                        .bearer_auth(&key)
                        .header("content-type", "application/json")
                        .body(chat_body("alpha"))
                        .send()
                        .await
                        .unwrap();
                    let credits: Option<i64> = reply
                        .headers()
                        .get("x-gateway-credits")
                        .and_then(|value| value.to_str().ok()?.parse().ok());
                    answers.push((reply.status().as_u16(), credits));
                }
                answers
            })
        })
        .collect();
    for round in 1..=10 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        reloading.write(&toml(if round % 2 == 1 { 3 } else { 2 }));
        let reloaded = reloading.reload().await;
        assert_eq!(reloaded.status, 200, "reload {round}: {:?}", reloaded.body);
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut answers = Vec::new();
    for worker in workers {
        answers.extend(worker.await.unwrap());
    }
    assert!(answers.len() > 50, "only {} calls were made", answers.len());
    assert!(
        answers.iter().all(|(status, _)| *status == 200),
        "a call failed during the reloads"
    );
    let charged: i64 = answers.iter().map(|(_, credits)| credits.unwrap()).sum();
    assert!(
        answers.iter().any(|(_, credits)| *credits == Some(3))
            && answers.iter().any(|(_, credits)| *credits == Some(2)),
        "both prices were charged"
    );
    // What each client was told it paid is what its entry says and what left the account.
    let calls = db.calls(&key).await;
    assert_eq!(calls.len(), answers.len());
    assert!(calls.iter().all(|call| [2, 3].contains(&call.price.get())));
    assert_eq!(
        calls.iter().map(|call| call.price.get()).sum::<i64>(),
        charged
    );
    assert_eq!(db.balance(&key).await.total().get(), 1_000_000 - charged);
    db.assert_audit_holds().await;
    eprintln!(
        "{} calls across 10 reloads: {} at 2 credits, {} at 3",
        answers.len(),
        answers.iter().filter(|(_, c)| *c == Some(2)).count(),
        answers.iter().filter(|(_, c)| *c == Some(3)).count()
    );
}

#[tokio::test]
async fn the_catalogue_is_shown_but_not_reloaded_without_a_source() {
    let db = local_db().await;
    let router = Gateway::new(
        db.store.clone(),
        Arc::new(Catalogue::demo()),
        Upstream::Mock(MockUpstream::new()),
    )
    .admin_token(Some(AdminToken::new(TOKEN).unwrap()))
    .router();
    let gateway = serve_router(router).await;
    let shown = gateway
        .send(
            gateway
                .client
                .get(format!("{}/admin/catalogue", gateway.base))
                .bearer_auth(TOKEN),
        )
        .await;
    assert_eq!(shown.status, 200);
    assert!(model_prices(&shown.body).contains(&("gpt-4o-mini".to_owned(), 2)));
    let refused = gateway
        .send(
            gateway
                .client
                .post(format!("{}/admin/catalogue/reload", gateway.base))
                .bearer_auth(TOKEN),
        )
        .await;
    assert_eq!(refused.status, 400);
    let unauthorised = gateway
        .send(
            gateway
                .client
                .get(format!("{}/admin/catalogue", gateway.base)),
        )
        .await;
    assert_eq!(unauthorised.status, 401);
}
