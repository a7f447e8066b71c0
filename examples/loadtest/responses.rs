//! `POST /v1/responses` (and, through the translating upstreams, `POST /v1/messages` to a chat
//! provider and `POST /v1/chat/completions` to an Anthropic one) beside
//! `POST /v1/chat/completions`, the same question through the same
//! gateway (the four layers on the in-memory store, so that the two differ only in the
//! protocol): in mock mode; through a translating upstream (a chat-completions provider in
//! this process answering a fixed reply), where the request and reply are translated on every
//! call; and through a native upstream (the same provider answering the Responses API too),
//! where both endpoints pass the request and the reply through and a Responses call records
//! who made the response. Alternated, `LOADTEST_ROUNDS` times, at concurrency 16 and 64;
//! medians printed. Chat runs twice each round: the spread of its second run against its first
//! is the noise the Responses row's ratio is read against.
//!
//! A Responses reply is longer than a chat one (the API repeats the request's settings and
//! gives each output item an id and a status): the `bare` rows are a server with no layers that
//! answers each endpoint with exactly the bytes the mock gateway answered it with, so what the
//! longer reply costs by itself shows beside what the gateway adds.

use crate::drive::{Load, compare_loads};
use crate::targets::{
    BODY, RESPONSES_BODY, Target, memory_gateway, memory_gateway_over_http, serve,
};
use model_gateway::Catalogue;

/// What the provider answers every chat call with.
const CHAT_REPLY: &str = r#"{"id":"chatcmpl-load","object":"chat.completion","created":1741476542,"model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"This is a fixed reply from the load test's provider."},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":11,"total_tokens":23}}"#;

/// What the provider answers every Responses call with, as `OpenAI` answers one.
const RESPONSES_REPLY: &str = r#"{"id":"resp_load","object":"response","created_at":1741476542,"status":"completed","error":null,"incomplete_details":null,"instructions":null,"max_output_tokens":null,"model":"gpt-4o-mini","output":[{"id":"msg_load","type":"message","status":"completed","role":"assistant","content":[{"type":"output_text","text":"This is a fixed reply from the load test's provider.","annotations":[]}]}],"parallel_tool_calls":true,"previous_response_id":null,"reasoning":{"effort":null,"summary":null},"store":true,"temperature":1.0,"text":{"format":{"type":"text"}},"tool_choice":"auto","tools":[],"top_p":1.0,"truncation":"disabled","usage":{"input_tokens":12,"input_tokens_details":{"cached_tokens":0},"output_tokens":11,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":23},"user":null,"metadata":{}}"#;

/// What the provider answers every messages call with, as Anthropic answers one.
const MESSAGE_REPLY: &str = r#"{"id":"msg_load","type":"message","role":"assistant","model":"claude-load","content":[{"type":"text","text":"This is a fixed reply from the load test's provider."}],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":12,"output_tokens":11}}"#;

/// A provider that answers [`CHAT_REPLY`] to chat completions, [`RESPONSES_REPLY`] to the
/// Responses API and [`MESSAGE_REPLY`] to Anthropic's messages, at once.
pub async fn provider() -> String {
    let fixed = |reply: &'static str| {
        move || async move { ([(http::header::CONTENT_TYPE, "application/json")], reply) }
    };
    let router = axum::Router::new()
        .route(
            "/v1/chat/completions",
            axum::routing::post(fixed(CHAT_REPLY)),
        )
        .route("/v1/responses", axum::routing::post(fixed(RESPONSES_REPLY)))
        .route("/v1/messages", axum::routing::post(fixed(MESSAGE_REPLY)));
    serve(router).await
}

/// A gateway whose one model is served by `provider`, reached the `responses` way (`translate`
/// or `native`).
async fn gateway_over(name: &'static str, provider: &str, responses: &str) -> Target {
    let catalogue = Catalogue::from_toml(&format!(
        "[[upstreams]]\nname = \"load-provider\"\nkind = \"openai\"\nbase_url = \"{provider}/v1\"\n\
         api_key_env = \"K\"\nresponses = \"{responses}\"\n\
         [[models]]\nname = \"gpt-4o-mini\"\nprotocol = \"chat_completions\"\nprice = 1\nupstream = \"load-provider\"\n\
         endpoints = [\"chat_completions\", \"responses\", \"messages\"]\n\
         [[upstreams]]\nname = \"load-anthropic\"\nkind = \"anthropic\"\nbase_url = \"{provider}\"\napi_key_env = \"K\"\n\
         [[models]]\nname = \"claude-load\"\nprotocol = \"messages\"\nprice = 1\nupstream = \"load-anthropic\"\n\
         max_output_tokens = 1024\nendpoints = [\"messages\", \"chat_completions\"]\n"
    ))
    .unwrap();
    memory_gateway_over_http(name, catalogue).await
}

/// The reply `target` gives to `body` on `path`, as bytes.
async fn reply_of(target: &Target, path: &str, body: &'static str) -> axum::body::Bytes {
    let mut request = reqwest::Client::new()
        .post(format!("{}{path}", target.base))
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(body);
    if let Some(key) = &target.key {
        request = request.bearer_auth(key);
    }
    let answer = request.send().await.unwrap();
    assert_eq!(answer.status(), 200);
    answer.bytes().await.unwrap()
}

/// A server with no layers answering each endpoint with what `mock` answered it with.
async fn bare(mock: &Target) -> Target {
    let chat = reply_of(mock, "/v1/chat/completions", BODY).await;
    let responses = reply_of(mock, "/v1/responses", RESPONSES_BODY).await;
    println!(
        "reply bytes: chat {}, responses {}",
        chat.len(),
        responses.len()
    );
    let fixed = |reply: axum::body::Bytes| {
        move || {
            let reply = reply.clone();
            async move { ([(http::header::CONTENT_TYPE, "application/json")], reply) }
        }
    };
    let router = axum::Router::new()
        .route("/v1/chat/completions", axum::routing::post(fixed(chat)))
        .route("/v1/responses", axum::routing::post(fixed(responses)));
    Target {
        name: "bare",
        base: serve(router).await,
        key: None,
        store: None,
    }
}

pub async fn run(requests: u64, rounds: usize) {
    let provider = provider().await;
    let mut mock = memory_gateway().await;
    mock.name = "mock";
    let translated = gateway_over("translated", &provider, "translate").await;
    let native = gateway_over("native", &provider, "native").await;
    let bare = bare(&mock).await;
    println!("{requests} requests per run, {rounds} rounds, alternated");
    println!(
        "{:<11} {:<10} {:>4} {:>10} {:>9} {:>9} {:>12}",
        "upstream", "endpoint", "c", "req/s", "p50 ms", "p99 ms", "cpu us/call"
    );
    // `LOADTEST_TARGETS=translated` keeps the rows whose names contain one of those words (to
    // profile one of them, say); `LOADTEST_ENDPOINTS=responses` drives only that endpoint.
    let kept = |name: &str| {
        std::env::var("LOADTEST_TARGETS").map_or(true, |only| {
            only.split(',').any(|word| name.contains(word.trim()))
        })
    };
    // Chat a second time beside itself: how far two runs of the same load differ, round by
    // round, is the noise the Responses row is judged against.
    let loads: Vec<(Load, &str)> = [
        (Load::Calls, "chat"),
        (Load::Responses, "responses"),
        (Load::Messages, "messages"),
        (Load::ChatToMessages, "chat>msgs"),
        (Load::Calls, "chat again"),
    ]
    .into_iter()
    .filter(|(_, label)| {
        std::env::var("LOADTEST_ENDPOINTS").map_or(true, |only| only.contains(label))
    })
    .collect();
    for concurrency in [16, 64] {
        for target in [&bare, &mock, &translated, &native] {
            // Messages calls of a chat model are the translating upstream's alone (the mock's
            // demo model and the bare server answer chat completions and Responses only).
            let loads: Vec<_> = loads
                .iter()
                .copied()
                .filter(|(load, _)| {
                    !matches!(load, Load::Messages | Load::ChatToMessages)
                        || target.name == "translated"
                })
                .collect();
            if kept(target.name) {
                compare_loads(target, concurrency, requests, rounds, &loads).await;
            }
        }
    }
}
