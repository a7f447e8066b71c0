//! Ledger semantics on every backend: the in-memory model, `SQLite`, and `PostgreSQL` when
//! `TEST_POSTGRES_URL` is set. The database backends must agree with the model step by step,
//! and concurrency must never spend a credit twice.

use crate::common;

use std::sync::Arc;

use common::*;
use model_gateway::{
    AccountId, CallId, Credits, Ledger, MemoryStore, Protocol, Store, credits::Bucket,
    keys::NewApiKey, store::CallFailure, store::CallStatus, store::CallSuccess, store::Caller,
    store::ChargeRequest, store::ReserveError, store::TokenUsage,
};
use sea_orm::ConnectionTrait;

fn failure() -> CallFailure {
    CallFailure {
        upstream_status: Some(503),
        error: "upstream answered 503".into(),
    }
}

fn success() -> CallSuccess {
    CallSuccess {
        upstream_status: 200,
        usage: TokenUsage {
            input_tokens: Some(3),
            output_tokens: Some(4),
            ..Default::default()
        },
        channel: Some("primary".into()),
        cost: None,
        reply: None,
        ..Default::default()
    }
}

async fn caller_with<S: Store>(store: &S, subscription: i64, topup: i64) -> Caller {
    let account = store.create_account("scenario").await.unwrap();
    let key = store
        .add_key(account, &NewApiKey::generate())
        .await
        .unwrap();
    for (bucket, amount) in [(Bucket::Subscription, subscription), (Bucket::Topup, topup)] {
        if amount > 0 {
            store
                .grant(account, bucket, Credits::new(amount))
                .await
                .unwrap();
        }
    }
    Caller { account, key }
}

fn charge(caller: Caller, price: i64) -> ChargeRequest<'static> {
    ChargeRequest::new(
        caller,
        Protocol::ChatCompletions,
        "gpt-4o-mini",
        Credits::new(price),
    )
    .with_request_id(Some("req_ledger-scenario"))
}

/// A scripted life of one account. Asserts the rules on the way and returns a trace of every
/// observable outcome, so that backends can be compared with the model.
async fn scenario<S: Store>(store: &S) -> Vec<String> {
    let mut trace = Vec::new();
    let caller = caller_with(store, 5, 4).await;
    let account = caller.account;

    // Subscription first, then a split, then top-up only.
    let first = store.reserve(charge(caller, 3)).await.unwrap();
    let split = store.reserve(charge(caller, 3)).await.unwrap();
    assert_eq!(
        (split.taken.subscription, split.taken.topup),
        (Credits::new(2), Credits::new(1))
    );
    trace.push(format!(
        "after two reserves {:?}",
        store.balance(account).await.unwrap()
    ));

    // Settle once; a second settle and a refund of a settled call change nothing.
    assert!(store.settle(first.call, success()).await.unwrap());
    assert!(!store.settle(first.call, success()).await.unwrap());
    assert!(!store.refund(first.call, &failure()).await.unwrap());
    trace.push(format!(
        "after settle {:?}",
        store.balance(account).await.unwrap()
    ));

    // Refund returns each credit to its bucket, once.
    assert!(store.refund(split.call, &failure()).await.unwrap());
    assert_eq!(store.balance(account).await.unwrap(), common::balance(2, 4));
    assert!(!store.refund(split.call, &failure()).await.unwrap());
    assert!(!store.settle(split.call, success()).await.unwrap());
    assert_eq!(store.balance(account).await.unwrap(), common::balance(2, 4));
    trace.push(format!(
        "after refunds {:?}",
        store.balance(account).await.unwrap()
    ));

    // Spending to exactly zero, then a refusal that writes nothing.
    let rest = store.reserve(charge(caller, 6)).await.unwrap();
    assert_eq!(store.balance(account).await.unwrap(), common::balance(0, 0));
    let refused = store.reserve(charge(caller, 1)).await;
    assert!(matches!(refused, Err(ReserveError::InsufficientCredits)));
    trace.push(format!(
        "after refusal {:?}",
        store.balance(account).await.unwrap()
    ));

    // A grant tops up; the pending call still counts as charged until settled.
    store
        .grant(account, Bucket::Topup, Credits::new(10))
        .await
        .unwrap();
    assert!(store.settle(rest.call, success()).await.unwrap());
    trace.push(format!("final {:?}", store.balance(account).await.unwrap()));

    let calls = store.recent_calls(account, 100).await.unwrap();
    for call in &calls {
        trace.push(format!(
            "{:?} price {} sub {} top {} upstream {:?} via {:?} tokens {:?}/{:?} request {:?}",
            call.status,
            call.price,
            call.charged_subscription,
            call.charged_topup,
            call.upstream_status,
            call.channel,
            call.input_tokens,
            call.output_tokens,
            call.request_id,
        ));
        assert_eq!(call.request_id.as_deref(), Some("req_ledger-scenario"));
        assert_eq!(
            call.charged_subscription.get() + call.charged_topup.get(),
            call.price.get()
        );
    }
    let statuses: Vec<_> = calls.iter().map(|c| c.status).collect();
    assert_eq!(
        statuses,
        [CallStatus::Ok, CallStatus::Refunded, CallStatus::Ok]
    );

    // Each entry's status read alone, as a settle that finds its entry finished reads it.
    let pending = store.reserve(charge(caller, 1)).await.unwrap();
    let mut read = Vec::new();
    for call in [
        first.call,
        split.call,
        pending.call,
        CallId(pending.call.0 + 1000),
    ] {
        read.push(store.call_status(call).await.unwrap());
    }
    assert_eq!(
        read,
        [
            Some(CallStatus::Ok),
            Some(CallStatus::Refunded),
            Some(CallStatus::Pending),
            None
        ]
    );
    assert!(store.refund(pending.call, &failure()).await.unwrap());
    trace.push(format!("statuses read alone {read:?}"));
    trace
}

backends!(
    async fn agrees_with_the_memory_model_and_the_audit_holds(db) {
        let model = scenario(&MemoryStore::new()).await;
        assert_eq!(scenario(db.store.as_ref()).await, model);
        db.assert_audit_holds().await;
    }
);

/// A call made by an alias keeps that name beside the catalogue name it is billed under; a call
/// by the catalogue name keeps none. Settled and refunded entries alike.
async fn assert_alias_is_kept_beside_the_model<S: Store>(store: &S) {
    let caller = caller_with(store, 10, 0).await;
    let by_alias = charge(caller, 2).with_requested_model(Some("gpt-4o-mini-2024-07-18"));
    let settled = store.reserve(by_alias).await.unwrap();
    assert!(store.settle(settled.call, success()).await.unwrap());
    let refunded = store.reserve(by_alias).await.unwrap();
    assert!(store.refund(refunded.call, &failure()).await.unwrap());
    let plain = store.reserve(charge(caller, 2)).await.unwrap();
    assert!(store.settle(plain.call, success()).await.unwrap());
    let calls = store.recent_calls(caller.account, 10).await.unwrap();
    let entry = |id: CallId| calls.iter().find(|call| call.id == id).unwrap();
    for id in [settled.call, refunded.call] {
        assert_eq!(entry(id).model, "gpt-4o-mini");
        assert_eq!(
            entry(id).requested_model.as_deref(),
            Some("gpt-4o-mini-2024-07-18")
        );
    }
    assert_eq!(entry(plain.call).requested_model, None);
    assert_eq!(
        store.balance(caller.account).await.unwrap(),
        common::balance(6, 0)
    );
}

#[tokio::test]
async fn an_alias_is_kept_beside_the_model_in_the_memory_model() {
    assert_alias_is_kept_beside_the_model(&MemoryStore::new()).await;
}

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn an_alias_is_kept_beside_the_model_on_an_owned_file() {
    let db = owned_sqlite_db().await;
    assert_alias_is_kept_beside_the_model(db.store.as_ref()).await;
    db.assert_audit_holds().await;
}

backends!(
    async fn an_alias_is_kept_beside_the_model(db) {
        assert_alias_is_kept_beside_the_model(db.store.as_ref()).await;
        db.assert_audit_holds().await;
    }
);

/// The CHECK constraints stand behind the code: no statement can make a bucket negative.
async fn assert_database_refuses_negative_buckets(db: &TestDb) {
    let caller = caller_with(db.store.as_ref(), 1, 0).await;
    for column in ["subscription_credits", "topup_credits"] {
        let sql = format!(
            "UPDATE mg_accounts SET {column} = {column} - 5 WHERE id = {}",
            caller.account.0
        );
        let result = db.store.connection().execute_unprepared(&sql).await;
        assert!(result.is_err(), "{column} went negative");
    }
    assert_eq!(
        db.store.balance(caller.account).await.unwrap(),
        balance(1, 0)
    );
}

backends!(
    async fn refuses_a_negative_bucket(db) {
        assert_database_refuses_negative_buckets(&db).await;
    }
);

/// Many simultaneous refunds of one call return its credits once.
async fn assert_concurrent_refunds_pay_back_once<S: Store + 'static>(store: Arc<S>) {
    let caller = caller_with(store.as_ref(), 10, 0).await;
    let reservation = store.reserve(charge(caller, 4)).await.unwrap();
    let refunds: Vec<_> = (0..20)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.refund(reservation.call, &failure()).await.unwrap() })
        })
        .collect();
    let mut applied = 0;
    for refund in refunds {
        applied += usize::from(refund.await.unwrap());
    }
    assert_eq!(applied, 1);
    assert_eq!(store.balance(caller.account).await.unwrap(), balance(10, 0));
}

backends!(
    async fn concurrent_refunds_of_one_call_pay_back_once(db) {
        assert_concurrent_refunds_pay_back_once(db.store.clone()).await;
    }
);

/// The audit reads one moment of the books: calls reserved, settled and refunded all along,
/// each of which moves a balance and a call's charge in one transaction, never make it see a
/// ledger that holds as broken (it read the balances, then the charges, in statements of their
/// own; a call committed between them failed it).
async fn assert_audit_holds_while_calls_are_charged(db: &TestDb) {
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    let store = db.store.clone();
    let caller = caller_with(store.as_ref(), 1_000_000, 1_000_000).await;
    let (stop, made) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU32::new(0)),
    );
    let charging: Vec<_> = (0..4)
        .map(|_| {
            let (store, stop, made) = (store.clone(), stop.clone(), made.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let reservation = store.reserve(charge(caller, 3)).await.unwrap();
                    if made.fetch_add(1, Ordering::Relaxed) % 3 == 0 {
                        assert!(store.refund(reservation.call, &failure()).await.unwrap());
                    } else {
                        assert!(store.settle(reservation.call, success()).await.unwrap());
                    }
                }
            })
        })
        .collect();
    // Audits while calls are made, until there have been enough of both.
    let mut audits = 0;
    while audits < 30 || made.load(Ordering::Relaxed) < 90 {
        db.assert_audit_holds().await;
        audits += 1;
    }
    stop.store(true, Ordering::Relaxed);
    for task in charging {
        task.await.unwrap();
    }
    db.assert_audit_holds().await;
}

backends!(
    #[multi_thread]
    async fn the_audit_holds_while_calls_are_charged(db) {
        assert_audit_holds_while_calls_are_charged(&db).await;
    }
);

/// 200 simultaneous calls on an account that can afford 50, spread over the given gateways
/// (one per process that shares the database): exactly 50 succeed, 150 get 402, nothing else.
async fn assert_200_calls_on_50_credits(db: &TestDb, gateways: &[Gateway]) {
    // 50 calls at price 2, split across buckets so the boundary crossing is raced too.
    let key = db.funded_key(61, 39).await;
    let mut calls = Vec::new();
    for i in 0..200 {
        let gateway_base = gateways[i % gateways.len()].base.clone();
        let client = gateways[i % gateways.len()].client.clone();
        let key = key.clone();
        calls.push(tokio::spawn(async move {
            chat_status(&client, &format!("{gateway_base}{CHAT}"), &key).await
        }));
    }
    let mut statuses = std::collections::BTreeMap::new();
    for call in calls {
        *statuses.entry(call.await.unwrap()).or_insert(0) += 1;
    }
    assert_eq!(statuses, [(200, 50), (402, 150)].into_iter().collect());
    assert_eq!(db.balance(&key).await, balance(0, 0));
    let entries = db.calls(&key).await;
    assert_eq!(entries.len(), 50);
    assert!(entries.iter().all(|c| c.status == CallStatus::Ok));
    db.assert_audit_holds().await;
}

backends!(
    #[multi_thread]
    async fn two_hundred_concurrent_calls_on_credits_for_50_give_exactly_50(db) {
        let gateway = start_mock_gateway(&db).await;
        assert_200_calls_on_50_credits(&db, &[gateway]).await;
    }
);

/// Two gateways, each with its own store on the same database, share one pool of credits.
async fn assert_two_gateways_never_spend_the_same_credit(db: &TestDb) {
    let second = db.second_instance().await;
    let gateways = [
        start_mock_gateway(db).await,
        start_mock_gateway(&second).await,
    ];
    assert_200_calls_on_50_credits(db, &gateways).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_gateways_on_one_mysql_never_spend_the_same_credit() {
    let Some(db) = mysql_db().await else { return };
    assert_two_gateways_never_spend_the_same_credit(&db).await;
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_gateways_on_one_postgres_never_spend_the_same_credit() {
    let Some(db) = postgres_db().await else {
        return;
    };
    assert_two_gateways_never_spend_the_same_credit(&db).await;
    db.drop_schema().await;
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_sqlite_connections_pools_on_one_file_never_spend_the_same_credit() {
    assert_two_gateways_never_spend_the_same_credit(&sqlite_db().await).await;
}

#[tokio::test]
async fn a_grant_must_be_positive_on_every_backend() {
    let memory = MemoryStore::new();
    let db = local_db().await;
    let stores: [&dyn Store; 2] = [&memory, db.store.as_ref()];
    for store in stores {
        let account: AccountId = store.create_account("x").await.unwrap();
        assert!(
            store
                .grant(account, Bucket::Topup, Credits::new(0))
                .await
                .is_err()
        );
        assert!(
            store
                .grant(account, Bucket::Topup, Credits::new(-5))
                .await
                .is_err()
        );
        assert_eq!(store.balance(account).await.unwrap(), balance(0, 0));
    }
}

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn migrations_use_their_own_table_and_keys_are_stored_only_as_hashes() {
    use sea_orm::{DbBackend, Statement};

    let db = sqlite_db().await;
    let key = db.funded_key(1, 0).await;
    let connection = db.store.connection();
    let tables: Vec<String> = connection
        .query_all_raw(Statement::from_string(
            DbBackend::Sqlite,
            "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name",
        ))
        .await
        .unwrap()
        .iter()
        .map(|row| row.try_get::<String>("", "name").unwrap())
        .collect();
    assert!(tables.contains(&"mg_migrations".to_owned()), "{tables:?}");
    assert!(
        !tables.contains(&"seaql_migrations".to_owned()),
        "{tables:?}"
    );
    assert!(
        tables
            .iter()
            .filter(|t| *t != "sqlite_sequence")
            .all(|t| t.starts_with("mg_"))
    );

    // A reconnect (a restart) finds the schema applied and changes nothing.
    drop(model_gateway::SeaOrmStore::connect(&db.url).await.unwrap());

    let row = connection
        .query_one_raw(Statement::from_string(
            DbBackend::Sqlite,
            "SELECT key_hash, display_prefix FROM mg_api_keys",
        ))
        .await
        .unwrap()
        .unwrap();
    let stored_hash: String = row.try_get("", "key_hash").unwrap();
    let prefix: String = row.try_get("", "display_prefix").unwrap();
    assert_eq!(stored_hash, model_gateway::keys::KeyHash::of(&key).as_str());
    assert!(key.starts_with(&prefix) && prefix.len() < 16);
    let file = std::fs::read(
        db.url
            .trim_start_matches("sqlite://")
            .trim_end_matches("?mode=rwc"),
    )
    .unwrap();
    let wal = std::fs::read(format!(
        "{}-wal",
        db.url
            .trim_start_matches("sqlite://")
            .trim_end_matches("?mode=rwc")
    ))
    .unwrap_or_default();
    for bytes in [file, wal] {
        assert!(
            !bytes
                .windows(key.len())
                .any(|window| window == key.as_bytes()),
            "the clear key is on disk"
        );
    }
}

/// Many simultaneous reservations on one store share transactions (group commit), and each is
/// still answered by exactly its own outcome.
async fn assert_group_commit_keeps_each_outcome(db: &TestDb) {
    let before = db.store.group_commit_stats();
    let caller = caller_with(db.store.as_ref(), 40, 0).await;
    let stranger = Caller {
        account: AccountId(i64::MAX),
        key: caller.key,
    };
    let reservations: Vec<_> = (0..64)
        .map(|i| {
            let store = db.store.clone();
            let who = if i == 17 { stranger } else { caller };
            tokio::spawn(async move { store.reserve(charge(who, 1)).await })
        })
        .collect();
    let (mut reserved, mut refused, mut failed) = (0, 0, 0);
    for reservation in reservations {
        match reservation.await.unwrap() {
            Ok(_) => reserved += 1,
            Err(ReserveError::InsufficientCredits) => refused += 1,
            Err(ReserveError::Store(_)) => failed += 1,
            Err(other) => panic!("unexpected refusal: {other}"),
        }
    }
    // The unknown account fails alone; its batch-mates keep their outcomes.
    assert_eq!((reserved, refused, failed), (40, 23, 1));
    assert_eq!(
        db.store.balance(caller.account).await.unwrap(),
        balance(0, 0)
    );
    let after = db.store.group_commit_stats();
    let (transactions, writes) = (
        after.transactions - before.transactions,
        after.writes - before.writes,
    );
    assert!(
        writes >= 64 && transactions < writes,
        "{transactions} transactions for {writes} writes"
    );
    db.assert_audit_holds().await;
}

backends!(
    #[multi_thread]
    async fn group_commit_keeps_each_outcome(db) {
        assert_group_commit_keeps_each_outcome(&db).await;
    }
);

/// A text answer to one SQL query on `PostgreSQL`.
async fn pg_text(sql: &impl ConnectionTrait, query: &str) -> String {
    use sea_orm::{DbBackend, Statement};
    let row = sql
        .query_one_raw(Statement::from_string(DbBackend::Postgres, query))
        .await
        .unwrap()
        .unwrap();
    row.try_get_by_index::<String>(0).unwrap()
}

/// Whether the WAL between `from` and `to` (both flushed positions) holds the commit record of
/// the transaction that last wrote call-log entry `call`.
async fn commit_of_entry_flushed(
    sql: &impl ConnectionTrait,
    call: model_gateway::CallId,
    from: &str,
    to: &str,
) -> bool {
    if pg_text(
        sql,
        &format!("SELECT ('{to}'::pg_lsn > '{from}'::pg_lsn)::text"),
    )
    .await
        != "true"
    {
        return false; // nothing was flushed at all
    }
    let found = pg_text(
        sql,
        &format!(
            "SELECT EXISTS (SELECT 1 FROM public.pg_get_wal_records_info('{from}', '{to}') r \
             WHERE r.resource_manager = 'Transaction' AND r.record_type = 'COMMIT' \
             AND r.xid = (SELECT xmin FROM mg_calls WHERE id = {}))::text",
            call.0
        ),
    )
    .await;
    found == "true"
}

/// Runs `write`, which answers the call-log entry it wrote, and tells whether the commit of
/// that write was already flushed when the answer came (read through `sql`, which may use
/// `pg_walinspect`).
async fn flushed_when_answered(
    sql: &impl ConnectionTrait,
    write: impl std::future::Future<Output = model_gateway::CallId>,
) -> (model_gateway::CallId, bool) {
    let flushed = "SELECT pg_current_wal_flush_lsn()::text";
    let before = pg_text(sql, flushed).await;
    let call = write.await;
    let after = pg_text(sql, flushed).await;
    (
        call,
        commit_of_entry_flushed(sql, call, &before, &after).await,
    )
}

/// On `PostgreSQL` a batch commits without waiting for the disk (the hot account's lock is not
/// held through an fsync), and the flusher makes it durable: no reservation, settle or refund
/// is answered before the WAL holding its commit is flushed. Checked in the WAL itself: the
/// commit record of the transaction that wrote the entry lies in WAL that was already flushed
/// when the answer came back. (Other tests' commits can only flush more, never less.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_answers_each_write_only_once_its_commit_is_flushed() {
    let Some(db) = postgres_db().await else {
        return;
    };
    assert_each_write_is_answered_once_flushed(&db).await;
    db.drop_schema().await;
}

/// The same where the server's own default is `synchronous_commit = off` (set here for the
/// store's sessions): the flush must still flush.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_flushes_even_where_the_server_commits_asynchronously() {
    let Some(db) = postgres_db().await else {
        return;
    };
    let mut options = sea_orm::ConnectOptions::new(&db.url);
    options
        .set_schema_search_path(db.pg_schema().unwrap())
        .map_sqlx_postgres_opts(|pg| pg.options([("synchronous_commit", "off")]));
    let store = model_gateway::SeaOrmStore::connect_with(options)
        .await
        .unwrap();
    let asynchronous = TestDb::sharing(&db, Arc::new(store));
    assert_eq!(
        pg_text(asynchronous.store.connection(), "SHOW synchronous_commit").await,
        "off"
    );
    assert_each_write_is_answered_once_flushed(&asynchronous).await;
    db.drop_schema().await;
}

/// Where the store's role may not write the flush's WAL message (`EXECUTE` on
/// `pg_logical_emit_message` revoked, as a provider might), the store still charges: it finds
/// out when it connects and commits each batch synchronously, so every write is durable when it
/// is answered (checked in the WAL, as above), and nothing goes through the flusher.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_without_the_flush_message_commits_each_batch_synchronously() {
    let Some(url) = postgres_url() else {
        return;
    };
    // A database and a role of this test's own: function privileges are per database, and a
    // superuser would pass every privilege check.
    let name = unique_name();
    let admin = sea_orm::Database::connect(&url).await.unwrap();
    for sql in [
        format!("CREATE ROLE {name} LOGIN"),
        format!("CREATE DATABASE {name} OWNER {name}"),
    ] {
        admin.execute_unprepared(&sql).await.unwrap();
    }
    let on_database = |user: Option<&str>| {
        let mut url = reqwest::Url::parse(&url).unwrap();
        if let Some(user) = user {
            url.set_username(user).unwrap();
        }
        url.set_path(&name);
        url.to_string()
    };
    let superuser = sea_orm::Database::connect(&on_database(None))
        .await
        .unwrap();
    superuser
        .execute_unprepared(
            "DO $$ DECLARE f regprocedure; BEGIN \
             FOR f IN SELECT oid::regprocedure FROM pg_proc \
             WHERE proname = 'pg_logical_emit_message' LOOP \
             EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f); \
             END LOOP; END $$; \
             CREATE EXTENSION pg_walinspect SCHEMA public",
        )
        .await
        .unwrap();

    let store = model_gateway::SeaOrmStore::connect(&on_database(Some(&name)))
        .await
        .unwrap();
    let refused = store
        .connection()
        .execute_unprepared("SELECT pg_logical_emit_message(true, 'test', 'refused')")
        .await;
    assert!(refused.is_err(), "the role may still write the message");
    let caller = caller_with(&store, 10, 0).await;
    for round in 0..4 {
        let reserve = async { store.reserve(charge(caller, 1)).await.unwrap().call };
        let (call, flushed) = flushed_when_answered(&superuser, reserve).await;
        assert!(
            flushed,
            "round {round}: reservation answered before its commit was flushed"
        );
        let settle = async {
            assert!(store.settle(call, success()).await.unwrap());
            call
        };
        let (_, flushed) = flushed_when_answered(&superuser, settle).await;
        assert!(
            flushed,
            "round {round}: settle answered before its commit was flushed"
        );
    }
    assert_eq!(store.group_commit_stats().flushes, 0);
    assert_eq!(
        store.balance(caller.account).await.unwrap().total(),
        Credits::new(6)
    );

    store.connection().clone().close().await.unwrap();
    superuser.close().await.unwrap();
    for sql in [
        format!("DROP DATABASE {name} WITH (FORCE)"),
        format!("DROP ROLE {name}"),
    ] {
        admin.execute_unprepared(&sql).await.unwrap();
    }
}

/// Connects a store per set of options, all at once, as gateway instances starting together.
async fn start_together(
    options: Vec<sea_orm::ConnectOptions>,
) -> Vec<Result<model_gateway::SeaOrmStore, model_gateway::store::StoreError>> {
    let starting = options
        .into_iter()
        .map(|options| tokio::spawn(model_gateway::SeaOrmStore::connect_with(options)));
    futures::future::join_all(starting)
        .await
        .into_iter()
        .map(|started| started.unwrap())
        .collect()
}

/// Every instance started and the schema's migrations were each recorded once.
async fn assert_all_started_and_migrated_once(
    started: Vec<Result<model_gateway::SeaOrmStore, model_gateway::store::StoreError>>,
) {
    use sea_orm_migration::MigratorTrait;
    let mut stores = Vec::new();
    for store in started {
        stores.push(store.expect("an instance failed to start"));
    }
    let sql = stores[0].connection();
    let row = sql
        .query_one_raw(sea_orm::Statement::from_string(
            sql.get_database_backend(),
            "SELECT COUNT(*) AS n FROM mg_migrations",
        ))
        .await
        .unwrap()
        .unwrap();
    let applied: i64 = row.try_get("", "n").unwrap();
    assert_eq!(
        applied as usize,
        model_gateway::store::Migrator::migrations().len()
    );
    for store in stores {
        store.connection().clone().close().await.unwrap();
    }
}

/// Four gateway instances starting together on an empty `PostgreSQL` schema all start (five
/// times over): the migrations run one instance at a time instead of racing to create the same
/// tables.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_instances_starting_together_on_an_empty_schema_all_start() {
    let Some(url) = postgres_url() else {
        return;
    };
    let admin = sea_orm::Database::connect(&url).await.unwrap();
    for _ in 0..5 {
        let schema = unique_name();
        admin
            .execute_unprepared(&format!("CREATE SCHEMA {schema}"))
            .await
            .unwrap();
        let options = (0..4)
            .map(|_| {
                let mut options = sea_orm::ConnectOptions::new(&url);
                options.set_schema_search_path(&schema).max_connections(2);
                options
            })
            .collect();
        assert_all_started_and_migrated_once(start_together(options).await).await;
        admin
            .execute_unprepared(&format!("DROP SCHEMA {schema} CASCADE"))
            .await
            .unwrap();
    }
}

/// The same on an empty MySQL/MariaDB database.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_instances_starting_together_on_an_empty_database_all_start() {
    for _ in 0..5 {
        let Some((server, database, url)) = empty_mysql_database().await else {
            return;
        };
        let options = (0..4)
            .map(|_| {
                let mut options = sea_orm::ConnectOptions::new(&url);
                options.max_connections(2);
                options
            })
            .collect();
        assert_all_started_and_migrated_once(start_together(options).await).await;
        let admin = sea_orm::Database::connect(&server).await.unwrap();
        admin
            .execute_unprepared(&format!("DROP DATABASE {database}"))
            .await
            .unwrap();
    }
}

async fn assert_each_write_is_answered_once_flushed(db: &TestDb) {
    let sql = db.store.connection();
    sql.execute_unprepared("CREATE EXTENSION IF NOT EXISTS pg_walinspect SCHEMA public")
        .await
        .unwrap();
    let store = &db.store;
    let caller = caller_with(store.as_ref(), 100, 0).await;
    for round in 0..10 {
        let reserve = async { store.reserve(charge(caller, 1)).await.unwrap().call };
        let (call, flushed) = flushed_when_answered(sql, reserve).await;
        assert!(
            flushed,
            "round {round}: reservation answered before its commit was flushed"
        );

        let finish = async {
            if round % 2 == 0 {
                assert!(store.settle(call, success()).await.unwrap());
            } else {
                assert!(store.refund(call, &failure()).await.unwrap());
            }
            call
        };
        let (_, flushed) = flushed_when_answered(sql, finish).await;
        assert!(
            flushed,
            "round {round}: settle or refund answered before its commit was flushed"
        );
    }
    assert!(db.store.group_commit_stats().flushes >= 20);
    db.assert_audit_holds().await;
}

/// Every backend answers a settle only after its batch is durable: a `SQLite` file and
/// `PostgreSQL` through their flusher (which counts its flushes), `MySQL` at its synchronous commit.
async fn assert_settles_are_flushed_where_commits_do_not_wait(db: &TestDb, flushed_later: bool) {
    let caller = caller_with(db.store.as_ref(), 10, 0).await;
    for _ in 0..5 {
        let reservation = db.store.reserve(charge(caller, 1)).await.unwrap();
        assert!(db.store.settle(reservation.call, success()).await.unwrap());
    }
    let flushes = db.store.group_commit_stats().flushes;
    if flushed_later {
        assert!(
            (1..=10).contains(&flushes),
            "{flushes} flushes for 10 writes"
        );
    } else {
        assert_eq!(flushes, 0);
    }
    db.assert_audit_holds().await;
}

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn sqlite_settles_are_answered_after_a_flush() {
    assert_settles_are_flushed_where_commits_do_not_wait(&sqlite_db().await, true).await;
}

#[tokio::test]
async fn postgres_settles_are_answered_after_a_flush() {
    let Some(db) = postgres_db().await else {
        return;
    };
    assert_settles_are_flushed_where_commits_do_not_wait(&db, true).await;
    db.drop_schema().await;
}

#[tokio::test]
async fn mysql_commits_are_durable_when_they_return() {
    let Some(db) = mysql_db().await else { return };
    assert_settles_are_flushed_where_commits_do_not_wait(&db, false).await;
    db.drop_schema().await;
}

// ---------------------------------------------------------------------------------------------
// Sums past 64 bits

/// Runs `statement` on the store's connection, in its database's dialect.
async fn execute(db: &TestDb, statement: sea_orm::sea_query::UpdateStatement) {
    let connection = db.store.connection();
    let built = connection.get_database_backend().build(&statement);
    connection.execute_raw(built).await.unwrap();
}

/// A grant that would take a bucket or the total past the largest balance is refused with a
/// clear, typed error and writes nothing; the audit still sums exactly where grants pass 64
/// bits, and reports an account whose two buckets together cannot be represented.
async fn assert_grants_past_the_largest_balance_are_refused(db: TestDb) {
    use model_gateway::{Accounts, Balance, store::StoreError};
    use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
    let store = db.store.clone();
    let account = store.create_account("large").await.unwrap();
    store
        .grant(account, Bucket::Topup, Credits::MAX)
        .await
        .unwrap();
    for (bucket, amount) in [
        (Bucket::Topup, 1),
        (Bucket::Subscription, 1),
        (Bucket::Subscription, i64::MAX),
    ] {
        let error = store
            .grant(account, bucket, Credits::new(amount))
            .await
            .unwrap_err();
        let StoreError::BalanceOverflow(overflow) = &error else {
            panic!("not a BalanceOverflow: {error}");
        };
        assert_eq!((overflow.account, overflow.bucket), (account, bucket));
        assert!(error.to_string().contains("largest value"), "{error}");
    }
    let full = Balance {
        subscription: Credits::new(0),
        topup: Credits::MAX,
    };
    assert_eq!(store.balance(account).await.unwrap(), full);
    let audits = store.audit().await.unwrap();
    assert!(audits.iter().all(|audit| audit.holds()), "{audits:?}");
    assert_eq!(
        audits[0].granted.topup,
        i128::from(i64::MAX),
        "one grant written"
    );

    // A second grant of the largest amount, as if the first had been spent: the sum passes
    // 64 bits, and the audit sums it exactly instead of failing.
    let copy = format!(
        "INSERT INTO mg_credit_grants (account_id, bucket, amount, created_at) \
         SELECT account_id, bucket, amount, created_at FROM mg_credit_grants WHERE account_id = {}",
        account.0
    );
    db.store
        .connection()
        .execute_unprepared(&copy)
        .await
        .unwrap();
    let audit = store.audit().await.unwrap().remove(0);
    assert_eq!(audit.granted.topup, 2 * i128::from(i64::MAX));
    assert_eq!(
        audit.problem(),
        Some("the balance differs from grants minus ok and pending charges (and lapses)")
    );

    // Both buckets full (a database edited by hand): the total cannot be represented.
    execute(
        &db,
        Query::update()
            .table(Alias::new("mg_accounts"))
            .value(Alias::new("subscription_credits"), i64::MAX)
            .and_where(Expr::col(Alias::new("id")).eq(account.0))
            .to_owned(),
    )
    .await;
    let audit = store.audit().await.unwrap().remove(0);
    assert!(
        audit.problem().unwrap().contains("cannot be represented"),
        "{audit:?}"
    );
    assert_eq!(store.balance(account).await.unwrap().total(), Credits::MAX);
    db.drop_schema().await;
}

backends!(
    async fn grants_past_the_largest_balance_are_refused(db) {
        assert_grants_past_the_largest_balance_are_refused(db).await;
    }
);

#[tokio::test]
async fn the_memory_store_refuses_grants_past_the_largest_balance_too() {
    use model_gateway::{Accounts, store::StoreError};
    let store = MemoryStore::new();
    let account = store.create_account("large").await.unwrap();
    store
        .grant(account, Bucket::Subscription, Credits::MAX)
        .await
        .unwrap();
    let error = store
        .grant(account, Bucket::Topup, Credits::new(1))
        .await
        .unwrap_err();
    assert!(matches!(error, StoreError::BalanceOverflow(_)), "{error}");
    assert_eq!(store.balance(account).await.unwrap().total(), Credits::MAX);
}

/// On `SQLite` the call log's status rule is checked in place: an insert or a status update
/// builds no temporary b-tree of the allowed statuses (an `IN` list of three did, on every
/// call). It still refuses any other status, and a file migrated before the change gets it
/// without losing or changing a row.
#[cfg(feature = "sqlite")]
#[tokio::test]
async fn the_call_status_rule_is_checked_without_a_temporary_btree() {
    use sea_orm::{DbBackend, Statement};
    use sea_orm_migration::MigratorTrait;

    let db = sqlite_db().await;
    let store = db.store.as_ref();
    let connection = db.store.connection();
    let rows = |sql: &'static str| async move {
        connection
            .query_all_raw(Statement::from_string(DbBackend::Sqlite, sql))
            .await
            .unwrap()
    };
    // Whether writing a call's status opens a temporary b-tree, and the rule as the table says it.
    let schema = || async {
        let plan = rows(
            "EXPLAIN INSERT INTO mg_calls (account_id, key_id, protocol, model, price, \
             charged_subscription, charged_topup, status, created_at) \
             VALUES (1, 1, 'chat_completions', 'm', 1, 1, 0, 'ok', '2026-11-28T00:00:00Z')",
        )
        .await;
        let ephemeral = plan
            .iter()
            .any(|row| row.try_get::<String>("", "opcode").unwrap() == "OpenEphemeral");
        let table: String = rows("SELECT sql FROM sqlite_master WHERE name = 'mg_calls'").await[0]
            .try_get("", "sql")
            .unwrap();
        (ephemeral, table)
    };
    let calls = || async {
        rows("SELECT id, status, charged_subscription, charged_topup FROM mg_calls ORDER BY id")
            .await
            .iter()
            .map(|row| {
                (
                    row.try_get::<i64>("", "id").unwrap(),
                    row.try_get::<String>("", "status").unwrap(),
                    row.try_get::<i64>("", "charged_subscription").unwrap(),
                    row.try_get::<i64>("", "charged_topup").unwrap(),
                )
            })
            .collect::<Vec<_>>()
    };
    let comparisons = r#"CHECK ("status" = 'pending' OR "status" = 'ok' OR "status" = 'refunded')"#;
    let list = r#"CHECK ("status" IN ('pending', 'ok', 'refunded'))"#;

    let (ephemeral, table) = schema().await;
    assert!(
        !ephemeral && table.contains(comparisons) && !table.contains(list),
        "{table}"
    );

    // Back to the definition before, which builds the b-tree: what the test is there to catch.
    // The migrations after it (`usage_rejected`, a translated call's record, then the
    // operator's economics) go down too, and their columns are put back by hand so that the
    // store writes as it does today.
    model_gateway::store::Migrator::down(connection, Some(4))
        .await
        .unwrap();
    for later_column in [
        "ALTER TABLE mg_calls ADD COLUMN usage_rejected boolean NOT NULL DEFAULT false",
        "ALTER TABLE mg_calls ADD COLUMN dropped_tools text NULL",
        "ALTER TABLE mg_calls ADD COLUMN upstream_protocol varchar(32) NULL",
        "ALTER TABLE mg_calls ADD COLUMN cost bigint NULL",
        "ALTER TABLE mg_calls ADD COLUMN credit_value bigint NULL",
        "ALTER TABLE mg_calls ADD COLUMN raw_usage text NULL",
        "ALTER TABLE mg_calls ADD COLUMN usage_estimated boolean NOT NULL DEFAULT false",
        "ALTER TABLE mg_calls ADD COLUMN service_tier varchar(16) NULL",
    ] {
        connection.execute_unprepared(later_column).await.unwrap();
    }
    let (ephemeral, table) = schema().await;
    assert!(ephemeral && table.contains(list), "{table}");
    // Calls of every status written under the old definition.
    let caller = caller_with(store, 100, 0).await;
    let settled = store.reserve(charge(caller, 4)).await.unwrap();
    assert!(store.settle(settled.call, success()).await.unwrap());
    let refunded = store.reserve(charge(caller, 5)).await.unwrap();
    assert!(store.refund(refunded.call, &failure()).await.unwrap());
    store.reserve(charge(caller, 6)).await.unwrap();
    let before = calls().await;
    assert_eq!(
        before
            .iter()
            .map(|call| call.1.as_str())
            .collect::<Vec<_>>(),
        ["ok", "refunded", "pending"]
    );

    for later_column in [
        "usage_rejected",
        "dropped_tools",
        "upstream_protocol",
        "cost",
        "credit_value",
        "raw_usage",
        "usage_estimated",
        "service_tier",
    ] {
        connection
            .execute_unprepared(&format!("ALTER TABLE mg_calls DROP COLUMN {later_column}"))
            .await
            .unwrap();
    }
    model_gateway::store::Migrator::up(connection, None)
        .await
        .unwrap();
    let (ephemeral, table) = schema().await;
    assert!(!ephemeral && table.contains(comparisons), "{table}");
    assert_eq!(calls().await, before);
    let integrity: String = rows("PRAGMA integrity_check").await[0]
        .try_get_by_index(0)
        .unwrap();
    assert_eq!(integrity, "ok");

    // Every status is still written under the new definition, and no other.
    let settled = store.reserve(charge(caller, 7)).await.unwrap();
    assert!(store.settle(settled.call, success()).await.unwrap());
    let refunded = store.reserve(charge(caller, 8)).await.unwrap();
    assert!(store.refund(refunded.call, &failure()).await.unwrap());
    let pending = store.reserve(charge(caller, 9)).await.unwrap();
    let bogus = format!(
        "UPDATE mg_calls SET status = 'bogus' WHERE id = {}",
        pending.call.0
    );
    assert!(connection.execute_unprepared(&bogus).await.is_err());
    assert_eq!(
        calls().await[3..]
            .iter()
            .map(|call| call.1.as_str())
            .collect::<Vec<_>>(),
        ["ok", "refunded", "pending"]
    );
    assert_eq!(
        store.balance(caller.account).await.unwrap(),
        balance(100 - 4 - 6 - 7 - 9, 0)
    );
    db.assert_audit_holds().await;
}
