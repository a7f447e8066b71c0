//! The admin API: every resource, its auth, paging and errors, idempotent grants, and the
//! command line agreeing with it. Served over real HTTP on a `SQLite` file; idempotent grants
//! also on `PostgreSQL` and `MariaDB`.

use crate::common;

use std::sync::Arc;

use common::*;
use model_gateway::admin::{Admin, AdminToken};
use model_gateway::{
    Accounts, Credits, Gateway, KeyStore, Ledger, Protocol, Upstream, credits::Bucket,
    store::CallFailure, store::ChargeRequest, upstream::MockUpstream,
};
use sea_orm::ConnectionTrait;
use serde_json::{Value, json};

const TOKEN: &str = "admin-token-for-tests-0123456789";

/// The example gateway in mock mode with the admin API on.
async fn admin_gateway(db: &TestDb) -> common::Gateway {
    let router = Gateway::new(
        db.store.clone(),
        Arc::new(model_gateway::Catalogue::demo()),
        Upstream::Mock(MockUpstream::new()),
    )
    .admin_token(Some(AdminToken::new(TOKEN).unwrap()))
    .metrics(|| "mg_test_metric 1\n".to_owned())
    .router();
    serve_router(router).await
}

impl common::Gateway {
    async fn admin(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Answer {
        let mut request = self
            .client
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(TOKEN);
        if let Some(body) = body {
            request = request.json(&body);
        }
        self.send(request).await
    }

    async fn admin_get(&self, path: &str) -> Answer {
        self.admin(reqwest::Method::GET, path, None).await
    }

    async fn admin_post(&self, path: &str, body: Value) -> Answer {
        self.admin(reqwest::Method::POST, path, Some(body)).await
    }

    async fn admin_patch(&self, path: &str, body: Value) -> Answer {
        self.admin(reqwest::Method::PATCH, path, Some(body)).await
    }

    /// Creates an account through the API: its id and key.
    async fn new_account(&self, name: &str, subscription: i64, topup: i64) -> (i64, String) {
        let created = self
            .admin_post(
                "/admin/accounts",
                json!({"name": name, "subscription": subscription, "topup": topup}),
            )
            .await;
        assert_eq!(created.status, 201, "{:?}", created.body);
        (
            created.body["id"].as_i64().unwrap(),
            created.body["key"].as_str().unwrap().to_owned(),
        )
    }
}

#[tokio::test]
async fn without_an_admin_token_every_admin_path_is_404() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    for path in ["/admin/accounts", "/admin/audit", "/admin/accounts/1"] {
        let answer = gateway.admin_get(path).await;
        assert_eq!(
            (answer.status, answer.detail()),
            (404, "接口不存在"),
            "{path}"
        );
    }
    let created = gateway
        .admin_post("/admin/accounts", json!({"name": "x"}))
        .await;
    assert_eq!(created.status, 404);
    assert_eq!(db.store.account_count().await.unwrap(), 0);
}

#[tokio::test]
async fn admin_paths_open_only_to_the_admin_token_and_it_opens_nothing_else() {
    let db = local_db().await;
    let gateway = admin_gateway(&db).await;
    let key = db.funded_key(10, 0).await;
    let url = format!("{}/admin/accounts", gateway.base);
    let refusals = [
        gateway.send(gateway.client.get(&url)).await,
        gateway
            .send(
                gateway
                    .client
                    .get(&url)
                    .bearer_auth("wrong-token-wrong-token"),
            )
            .await,
        gateway
            .send(
                gateway
                    .client
                    .get(&url)
                    .bearer_auth(&TOKEN[..TOKEN.len() - 1]),
            )
            .await,
        gateway
            .send(gateway.client.get(&url).bearer_auth(&key))
            .await,
        gateway
            .send(gateway.client.get(&url).header("x-api-key", TOKEN))
            .await,
    ];
    for refusal in refusals {
        assert_eq!(
            (refusal.status, refusal.detail()),
            (401, "无效的管理员令牌")
        );
    }
    assert_eq!(gateway.admin_get("/admin/accounts").await.status, 200);

    // The admin token is not a gateway key.
    let call = gateway.chat(TOKEN, CHAT_MODEL).await;
    assert_eq!((call.status, call.detail()), (401, "无效的 API Key"));
    let balance = gateway
        .send(
            gateway
                .client
                .get(format!("{}/v1/balance", gateway.base))
                .bearer_auth(TOKEN),
        )
        .await;
    assert_eq!(balance.status, 401);
    assert_eq!(db.balance(&key).await, balance_of(10, 0));
}

fn balance_of(subscription: i64, topup: i64) -> model_gateway::Balance {
    common::balance(subscription, topup)
}

#[tokio::test]
async fn accounts_are_created_listed_a_page_at_a_time_and_shown_with_their_keys() {
    let db = local_db().await;
    let gateway = admin_gateway(&db).await;
    let created = gateway
        .admin_post(
            "/admin/accounts",
            json!({"name": "alice", "subscription": 5, "topup": 7}),
        )
        .await;
    assert_eq!(created.status, 201);
    assert_eq!(
        created.body["balance"],
        json!({"subscription": 5, "topup": 7, "total": 12, "subscription_ends_at": null})
    );
    let alice = created.body["id"].as_i64().unwrap();
    let key = created.body["key"].as_str().unwrap();
    assert_eq!(gateway.chat(key, CHAT_MODEL).await.status, 200);
    gateway.new_account("bob", 1, 0).await;
    gateway.new_account("carol", 0, 0).await;

    let first = gateway.admin_get("/admin/accounts?limit=2").await;
    assert_eq!(first.status, 200);
    let names = |page: &Answer| -> Vec<String> {
        page.body["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|account| account["name"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(names(&first), ["alice", "bob"]);
    assert_eq!(first.body["has_more"], true);
    assert_eq!(
        first.body["data"][0]["balance"],
        json!({"subscription": 5 - CHAT_PRICE, "topup": 7, "total": 12 - CHAT_PRICE, "subscription_ends_at": null})
    );
    let after = first.body["next_after"].as_i64().unwrap();
    let second = gateway
        .admin_get(&format!("/admin/accounts?limit=2&after={after}"))
        .await;
    assert_eq!(names(&second), ["carol"]);
    assert_eq!(second.body["has_more"], false);
    assert_eq!(second.body["next_after"], Value::Null);
    let found = gateway.admin_get("/admin/accounts?search=ARO").await;
    assert_eq!(names(&found), ["carol"], "search ignores case");
    let by_key = gateway
        .admin_get(&format!("/admin/accounts?search={}", &key[..12]))
        .await;
    assert_eq!(names(&by_key), ["alice"], "search by key prefix");

    let shown = gateway.admin_get(&format!("/admin/accounts/{alice}")).await;
    assert_eq!(shown.status, 200);
    assert_eq!(shown.body["name"], "alice");
    assert_eq!(shown.body["balance"]["total"], 12 - CHAT_PRICE);
    let keys = shown.body["keys"].as_array().unwrap();
    assert_eq!(keys.len(), 1);
    assert_eq!(keys[0]["prefix"], &key[..12]);
    assert_eq!(keys[0]["status"], "active");
    for rule in ["models", "expires_at", "rpm"] {
        assert_eq!(keys[0][rule], Value::Null, "{rule}");
    }
    assert!(
        !shown.bytes.windows(key.len()).any(|w| w == key.as_bytes()),
        "the key is shown once, at creation"
    );
}

#[tokio::test]
async fn keys_are_added_given_rules_and_revoked() {
    let db = local_db().await;
    let gateway = admin_gateway(&db).await;
    let (account, _) = gateway.new_account("alice", 100, 0).await;
    let added = gateway
        .admin_post(&format!("/admin/accounts/{account}/keys"), json!({}))
        .await;
    assert_eq!(added.status, 201);
    let key_id = added.body["id"].as_i64().unwrap();
    let key = added.body["key"].as_str().unwrap().to_owned();
    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);

    let patched = gateway
        .admin_patch(
            &format!("/admin/keys/{key_id}"),
            json!({"models": [CHAT_MODEL], "rpm": 30, "expires_at": "2999-01-01T00:00:00Z"}),
        )
        .await;
    assert_eq!(patched.status, 200, "{:?}", patched.body);
    assert_eq!(patched.body["models"], json!([CHAT_MODEL]));
    assert_eq!(patched.body["rpm"], 30);
    assert_eq!(patched.body["expires_at"], "2999-01-01T00:00:00Z");
    // Only the fields sent change; null lifts a rule.
    let lifted = gateway
        .admin_patch(&format!("/admin/keys/{key_id}"), json!({"rpm": null}))
        .await;
    assert_eq!(lifted.body["rpm"], Value::Null);
    assert_eq!(lifted.body["models"], json!([CHAT_MODEL]));

    let revoked = gateway
        .admin_post(&format!("/admin/keys/{key_id}/revoke"), json!({}))
        .await;
    assert_eq!(revoked.status, 200);
    assert_eq!(revoked.body["status"], "revoked");
    let refused = gateway.chat(&key, CHAT_MODEL).await;
    assert_eq!((refused.status, refused.detail()), (401, "无效的 API Key"));
    let again = gateway
        .admin_post(&format!("/admin/keys/{key_id}/revoke"), json!({}))
        .await;
    assert_eq!(
        (again.status, &again.body["status"]),
        (200, &json!("revoked"))
    );
}

#[tokio::test]
async fn unknown_accounts_and_keys_are_404_and_a_bad_body_is_400_naming_the_field() {
    let db = local_db().await;
    let gateway = admin_gateway(&db).await;
    let (account, _) = gateway.new_account("alice", 1, 0).await;
    for path in [
        "/admin/accounts/999",
        "/admin/accounts/abc",
        "/admin/accounts/999/calls",
    ] {
        let answer = gateway.admin_get(path).await;
        assert_eq!(
            (answer.status, answer.detail()),
            (404, "账户不存在"),
            "{path}"
        );
    }
    let grant = gateway
        .admin_post(
            "/admin/accounts/999/grants",
            json!({"bucket": "topup", "credits": 1}),
        )
        .await;
    assert_eq!(grant.status, 404);
    for answer in [
        gateway
            .admin_patch("/admin/keys/999", json!({"rpm": 1}))
            .await,
        gateway
            .admin_post("/admin/keys/999/revoke", json!({}))
            .await,
    ] {
        assert_eq!((answer.status, answer.detail()), (404, "API Key 不存在"));
    }

    let field_refusals = [
        ("/admin/accounts", json!({"subscription": 1}), "name"),
        (
            "/admin/accounts",
            json!({"name": "x", "topup": -1}),
            "topup",
        ),
        (
            "/admin/accounts",
            json!({"name": "x", "credit": 1}),
            "credit",
        ),
        (
            &format!("/admin/accounts/{account}/grants"),
            json!({"bucket": "gold", "credits": 1}),
            "bucket",
        ),
        (
            &format!("/admin/accounts/{account}/grants"),
            json!({"bucket": "topup", "credits": 0}),
            "credits",
        ),
    ];
    for (path, body, field) in field_refusals {
        let answer = gateway.admin_post(path, body).await;
        assert_eq!(answer.status, 400, "{path} {field}");
        assert!(answer.detail().contains(field), "{}", answer.detail());
    }
    let key_id = db
        .store
        .keys_of(model_gateway::AccountId(account))
        .await
        .unwrap()[0]
        .id
        .0;
    let unknown_model = gateway
        .admin_patch(
            &format!("/admin/keys/{key_id}"),
            json!({"models": ["no-such-model"]}),
        )
        .await;
    assert_eq!(unknown_model.status, 400);
    assert!(unknown_model.detail().contains("models"));
    let not_json = gateway
        .send(
            gateway
                .client
                .post(format!("{}/admin/accounts", gateway.base))
                .bearer_auth(TOKEN)
                .body("{not json"),
        )
        .await;
    assert_eq!(not_json.status, 400);
    let overflow = gateway
        .admin_post(
            &format!("/admin/accounts/{account}/grants"),
            json!({"bucket": "topup", "credits": i64::MAX}),
        )
        .await;
    assert_eq!(overflow.status, 400);
    let bad_query = gateway
        .admin_get(&format!("/admin/accounts/{account}/calls?status=won"))
        .await;
    assert_eq!(bad_query.status, 400);
    assert!(bad_query.detail().contains("status"));
    let wrong_method = gateway
        .admin(reqwest::Method::DELETE, "/admin/accounts", None)
        .await;
    assert_eq!(wrong_method.status, 405);
    let balance = db
        .store
        .balance(model_gateway::AccountId(account))
        .await
        .unwrap();
    assert_eq!(balance, balance_of(1, 0), "nothing refused moved credits");
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn a_grant_sent_again_with_its_idempotency_key_is_applied_once() {
    let db = local_db().await;
    let gateway = admin_gateway(&db).await;
    let (account, key) = gateway.new_account("alice", 0, 0).await;
    let path = format!("/admin/accounts/{account}/grants");
    let grant = |idempotency_key: &'static str, credits: i64| {
        gateway.send(
            gateway
                .client
                .post(format!("{}{path}", gateway.base))
                .bearer_auth(TOKEN)
                .header("idempotency-key", idempotency_key)
                .json(&json!({"bucket": "topup", "credits": credits, "reason": "pack 1"})),
        )
    };
    let first = grant("order-1", 50).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.body["applied"], true);
    assert_eq!(first.body["balance"]["topup"], 50);
    for _ in 0..3 {
        let again = grant("order-1", 50).await;
        assert_eq!(again.status, 200);
        assert_eq!(again.body["applied"], false);
        assert_eq!(again.body["balance"]["topup"], 50);
    }
    let reused = grant("order-1", 60).await;
    assert_eq!(reused.status, 422);
    assert_eq!(grant("order-2", 60).await.body["balance"]["topup"], 110);
    assert_eq!(db.balance(&key).await, balance_of(0, 110));
    db.assert_audit_holds().await;
}

/// Twenty grants with one key sent at once, on each database: one applies.
async fn concurrent_grants_apply_once(db: &TestDb) {
    let admin = Admin::new(db.store.clone());
    let created = admin
        .create_account(&model_gateway::admin::NewAccount {
            name: "alice".into(),
            subscription: 0,
            topup: 0,
        })
        .await
        .unwrap();
    let grants = (0..20).map(|_| {
        let admin = admin.clone();
        tokio::spawn(async move {
            let grant =
                model_gateway::admin::GrantRequest::new(Bucket::Subscription, Credits::new(7));
            admin
                .grant(created.id, &grant, Some("renewal-2026-11"))
                .await
        })
    });
    let results = futures::future::join_all(grants).await;
    let applied = results
        .into_iter()
        .map(|joined| joined.unwrap().unwrap())
        .filter(|granted| granted.applied)
        .count();
    assert_eq!(applied, 1);
    let balance = db.store.balance(created.id).await.unwrap();
    assert_eq!(balance, balance_of(7, 0));
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn concurrent_grants_with_one_idempotency_key_apply_once_on_every_database() {
    each_database(concurrent_grants_apply_once).await;
}

#[tokio::test]
async fn calls_are_paged_newest_first_and_filtered_by_status_and_model() {
    let db = local_db().await;
    let gateway = admin_gateway(&db).await;
    let (account, key) = gateway.new_account("alice", 100, 0).await;
    for _ in 0..3 {
        assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);
    }
    assert_eq!(gateway.messages(&key, MESSAGES_MODEL).await.status, 200);
    // A refunded call, as a failed upstream leaves it.
    let caller = db
        .store
        .caller_for_key(&model_gateway::keys::KeyHash::of(&key))
        .await
        .unwrap()
        .unwrap();
    let reservation = db
        .store
        .reserve(ChargeRequest::new(
            caller,
            Protocol::ChatCompletions,
            CHAT_MODEL,
            Credits::new(CHAT_PRICE),
        ))
        .await
        .unwrap();
    let failure = CallFailure {
        upstream_status: Some(503),
        error: "overloaded".into(),
    };
    assert!(db.store.refund(reservation.call, &failure).await.unwrap());

    let path = format!("/admin/accounts/{account}/calls");
    let first = gateway.admin_get(&format!("{path}?limit=2")).await;
    assert_eq!(first.status, 200);
    let ids = |page: &Answer| -> Vec<i64> {
        page.body["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|call| call["id"].as_i64().unwrap())
            .collect()
    };
    let page_one = ids(&first);
    assert_eq!(page_one.len(), 2);
    assert!(page_one[0] > page_one[1], "newest first");
    assert_eq!(first.body["data"][0]["status"], "refunded");
    assert_eq!(first.body["has_more"], true);
    let before = first.body["next_before"].as_i64().unwrap();
    let rest = gateway
        .admin_get(&format!("{path}?limit=10&before={before}"))
        .await;
    assert_eq!(ids(&rest).len(), 3);
    assert_eq!(rest.body["has_more"], false);

    let refunded = gateway.admin_get(&format!("{path}?status=refunded")).await;
    assert_eq!(ids(&refunded), [reservation.call.0]);
    assert_eq!(refunded.body["data"][0]["upstream_error"], "overloaded");
    let messages = gateway
        .admin_get(&format!("{path}?model={MESSAGES_MODEL}"))
        .await;
    assert_eq!(ids(&messages).len(), 1);
    let ok_chat = gateway
        .admin_get(&format!("{path}?model={CHAT_MODEL}&status=ok"))
        .await;
    assert_eq!(ids(&ok_chat).len(), 3);
}

#[tokio::test]
async fn the_audit_answers_200_and_says_whether_the_books_balance() {
    let db = local_db().await;
    let gateway = admin_gateway(&db).await;
    let (account, key) = gateway.new_account("alice", 10, 0).await;
    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);
    let honest = gateway.admin_get("/admin/audit").await;
    assert_eq!(honest.status, 200);
    assert_eq!(honest.body["ok"], true);
    assert_eq!(honest.body["accounts"][0]["ok"], true);

    let tamper = format!("UPDATE mg_accounts SET topup_credits = 5 WHERE id = {account}");
    db.store
        .connection()
        .execute_unprepared(&tamper)
        .await
        .unwrap();
    let tampered = gateway.admin_get("/admin/audit").await;
    assert_eq!(tampered.status, 200);
    assert_eq!(tampered.body["ok"], false);
    assert_eq!(tampered.body["accounts"][0]["account"], account);
    assert_eq!(tampered.body["accounts"][0]["ok"], false);
}

#[tokio::test]
async fn metrics_on_the_main_address_need_the_admin_token() {
    let db = local_db().await;
    let gateway = admin_gateway(&db).await;
    let url = format!("{}/metrics", gateway.base);
    let anonymous = gateway.send(gateway.client.get(&url)).await;
    assert_eq!(anonymous.status, 401);
    let scraped = gateway
        .client
        .get(&url)
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(scraped.status(), 200);
    assert_eq!(scraped.text().await.unwrap(), "mg_test_metric 1\n");
}

/// The example's command line, against the test's database: its standard output.
#[cfg(feature = "sqlite")]
pub fn cli(db: &TestDb, args: &[&str]) -> String {
    let output = std::process::Command::new(gateway_binary())
        .args(args)
        .env("DATABASE_URL", &db.url)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

#[cfg(feature = "sqlite")]
pub fn cli_json(db: &TestDb, args: &[&str]) -> Value {
    serde_json::from_str(&cli(db, args)).unwrap()
}

/// On the `SQLite` file the example's command line opens by its URL alone.
#[cfg(feature = "sqlite")]
#[tokio::test]
async fn the_command_line_and_the_api_agree() {
    let db = sqlite_db().await;
    let gateway = admin_gateway(&db).await;
    let created = cli_json(
        &db,
        &[
            "accounts",
            "create",
            "--name",
            "alice",
            "--subscription",
            "5",
        ],
    );
    let account = created["id"].as_i64().unwrap();
    let key = created["key"].as_str().unwrap().to_owned();
    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);

    let shown = gateway
        .admin_get(&format!("/admin/accounts/{account}"))
        .await;
    assert_eq!(
        cli_json(&db, &["accounts", "show", &account.to_string()]),
        shown.body
    );
    let listed = gateway.admin_get("/admin/accounts").await;
    assert_eq!(cli_json(&db, &["accounts", "list"]), listed.body);
    let calls = gateway
        .admin_get(&format!("/admin/accounts/{account}/calls"))
        .await;
    assert_eq!(
        cli_json(&db, &["calls", "--account", &account.to_string()]),
        calls.body
    );

    let key_id = shown.body["keys"][0]["id"].as_i64().unwrap().to_string();
    let updated = cli_json(
        &db,
        &[
            "keys",
            "update",
            "--id",
            &key_id,
            "--models",
            "gpt-4o-mini,claude-haiku-4-5",
            "--rpm",
            "9",
        ],
    );
    let after = gateway
        .admin_get(&format!("/admin/accounts/{account}"))
        .await;
    assert_eq!(updated, after.body["keys"][0]);
    assert_eq!(
        updated["models"],
        json!(["gpt-4o-mini", "claude-haiku-4-5"])
    );

    let granted = cli_json(
        &db,
        &[
            "grants",
            "add",
            "--account",
            &account.to_string(),
            "--bucket",
            "topup",
            "--credits",
            "4",
            "--idempotency-key",
            "k1",
        ],
    );
    let through_api = gateway
        .send(
            gateway
                .client
                .post(format!("{}/admin/accounts/{account}/grants", gateway.base))
                .bearer_auth(TOKEN)
                .header("idempotency-key", "k1")
                .json(&json!({"bucket": "topup", "credits": 4})),
        )
        .await;
    assert_eq!(granted["applied"], true);
    assert_eq!(
        through_api.body["applied"], false,
        "the CLI's grant counted once"
    );
    assert_eq!(granted["balance"], through_api.body["balance"]);

    let audit = gateway.admin_get("/admin/audit").await;
    assert!(cli(&db, &["audit"]).contains("audit passed"));
    assert_eq!(audit.body["ok"], true);
}

/// Finding 6 of the fault run: a body over the admin API's 2 MiB is a `{"detail"}` 413.
#[tokio::test]
async fn an_admin_body_over_its_limit_is_a_json_413() {
    let db = local_db().await;
    let gateway = admin_gateway(&db).await;
    let name = "x".repeat(3 << 20);
    let answer = gateway
        .admin(
            reqwest::Method::POST,
            "/admin/accounts",
            Some(json!({ "name": name })),
        )
        .await;
    assert_eq!(answer.status, 413);
    assert_eq!(answer.detail(), "请求体过大");
}

/// Finding 8 of the fault run: a search folds case beyond ASCII alike on every database
/// (`SQLite`'s `lower()` folds ASCII only), and a search with a NUL (`%00`) lists nothing it
/// should not: the API refuses control characters.
#[tokio::test]
async fn account_search_folds_unicode_case_on_every_database_and_refuses_control_characters() {
    each_database(async |db: &TestDb| {
        let admin = db.admin();
        for name in ["Ünïcödé ÄBC", "plain ascii", "ÜBER"] {
            let new = model_gateway::admin::NewAccount {
                name: name.into(),
                subscription: 0,
                topup: 0,
            };
            admin.create_account(&new).await.unwrap();
        }
        let names = async |search: &str| -> Vec<String> {
            let found = admin.accounts(None, Some(10), Some(search)).await.unwrap();
            found.data.into_iter().map(|account| account.name).collect()
        };
        assert_eq!(names("ünïcödé").await, ["Ünïcödé ÄBC"]);
        assert_eq!(names("äbc").await, ["Ünïcödé ÄBC"]);
        assert_eq!(names("ü").await, ["Ünïcödé ÄBC", "ÜBER"]);
        assert_eq!(names("ASCII").await, ["plain ascii"]);
        assert!(names("\0").await.is_empty(), "a NUL matches no name");
        // Paged: the second match comes after the first.
        let first = admin.accounts(None, Some(1), Some("ü")).await.unwrap();
        let after = first.data[0].id;
        let next = admin
            .accounts(Some(after), Some(1), Some("ü"))
            .await
            .unwrap();
        assert_eq!(next.data[0].name, "ÜBER");
    })
    .await;
    let db = local_db().await;
    let gateway = admin_gateway(&db).await;
    let refused = gateway.admin_get("/admin/accounts?search=%00").await;
    assert_eq!(refused.status, 400);
    assert!(refused.detail().contains("search"), "{refused:?}");
}

/// The operator sees a token-priced call's tokens by kind and what it was charged, as the key
/// holder does.
#[tokio::test]
async fn the_admin_api_shows_a_token_priced_calls_tokens_and_charge() {
    let db = local_db().await;
    let gateway = admin_gateway(&db).await;
    let (account, key) = gateway.new_account("metered", 100, 0).await;
    let body = chat_body("gpt-4.1-mini");
    assert_eq!(
        gateway.post_bearer(CHAT, &key, body.clone()).await.status,
        200
    );
    let calls = gateway
        .admin_get(&format!("/admin/accounts/{account}/calls"))
        .await;
    let entry = &calls.body["data"][0];
    let input = model_gateway::pricing::estimated_input_tokens(body.len());
    assert_eq!(entry["model"], "gpt-4.1-mini");
    assert_eq!(
        (&entry["input_tokens"], &entry["output_tokens"]),
        (&json!(input), &json!(16))
    );
    // 40 and 160 credits per million tokens: a few dozen tokens cost the least charge, 1.
    assert_eq!(
        (&entry["price"], &entry["shortfall"]),
        (&json!(1), &json!(0))
    );
    assert_eq!(db.balance(&key).await.total().get(), 99);
}

/// An admin request whose body stalls (a declared length, part of the body) is the client's
/// time-out, `408`, not the database's `503` with `x-should-retry` (the adversarial run: `503`
/// after 5 s); nothing is written.
#[tokio::test]
async fn an_admin_body_that_stalls_is_408_not_503() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let db = local_db().await;
    let gateway = admin_gateway(&db).await;
    let address = gateway.base.trim_start_matches("http://").to_owned();
    let mut stream = tokio::net::TcpStream::connect(&address).await.unwrap();
    let head = format!(
        "POST /admin/accounts HTTP/1.1\r\nhost: {address}\r\nauthorization: Bearer {TOKEN}\r\n\
         content-type: application/json\r\ncontent-length: 100\r\n\r\n{{\"name\":"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let started = std::time::Instant::now();
    let mut answer = vec![0; 4096];
    let read = tokio::time::timeout(std::time::Duration::from_secs(40), stream.read(&mut answer))
        .await
        .expect("an answer")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..read]);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(!answer.contains("x-should-retry"), "{answer}");
    assert!(
        started.elapsed() >= std::time::Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    let accounts = db.admin().accounts(None, Some(10), None).await.unwrap();
    assert!(accounts.data.is_empty(), "{accounts:?}");
}
