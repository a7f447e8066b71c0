//! The messages-as-chat translation against its corpus (`tests/corpus/messages_as_chat`, the
//! expected outputs written by hand from the providers' documented formats), its refusals,
//! and the usage it writes, read back as the gateway read the provider's.

use proptest::prelude::*;
use serde_json::{Value, json};

use super::reply::anthropic_usage;
use super::*;

fn corpus() -> Vec<(String, Value)> {
    crate::protocol::translate::corpus("messages_as_chat")
}

fn translated(request: &Value) -> MessagesAsChat {
    MessagesAsChat::from_slice(&serde_json::to_vec(request).unwrap()).unwrap()
}

/// Server-sent event text as its events, each checked to name its `type` in its `event:` line.
fn events(text: &str) -> Vec<Value> {
    text.split_terminator("\n\n")
        .map(|event| {
            let (name, data) = event.split_once('\n').unwrap();
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(
                name.strip_prefix("event: "),
                data["type"].as_str(),
                "{event}"
            );
            data
        })
        .collect()
}

#[test]
fn the_corpus_requests_translate_to_the_chat_requests_written_for_them() {
    let mut checked = 0;
    for (name, case) in corpus() {
        let Some(expected) = case.get("chat_request") else {
            continue;
        };
        let chat = translated(&case["request"]).chat_body(case["model"].as_str().unwrap());
        let chat: Value = serde_json::from_slice(&chat).unwrap();
        assert_eq!(&chat, expected, "{name}");
        checked += 1;
    }
    assert_eq!(checked, 6);
}

#[test]
fn the_corpus_chat_replies_translate_to_the_messages_written_for_them() {
    let mut checked = 0;
    for (name, case) in corpus() {
        let (Some(reply), Some(expected)) = (case.get("chat_reply"), case.get("message")) else {
            continue;
        };
        let reply_bytes = serde_json::to_vec(reply).unwrap();
        let (message, usage) = translated(&case["request"])
            .reply(&reply_bytes, "msg_1")
            .unwrap();
        let message: Value = serde_json::from_slice(&message).unwrap();
        assert_eq!(&message, expected, "{name}");
        // The usage billed is the chat call's, and the client's message reads back as it.
        assert_eq!(
            Some(usage),
            crate::protocol::reply_usage(&reply_bytes),
            "{name}"
        );
        assert_eq!(
            Some(usage),
            crate::protocol::reply_usage(&serde_json::to_vec(&message).unwrap()),
            "{name}"
        );
        checked += 1;
    }
    assert_eq!(checked, 4);
}

/// Each corpus stream gives its events, whole and cut at every byte.
#[test]
fn the_corpus_chat_streams_translate_to_the_events_written_for_them_cut_anywhere() {
    let mut checked = 0;
    for (name, case) in corpus() {
        let (Some(stream), Some(expected)) = (case.get("chat_stream"), case.get("events")) else {
            continue;
        };
        let stream: String = stream
            .as_array()
            .unwrap()
            .iter()
            .map(|event| format!("{}\n\n", event.as_str().unwrap()))
            .collect();
        let request = translated(&case["request"]);
        let mut whole = request.stream("msg_1".to_owned());
        let text = whole.push(stream.as_bytes());
        assert_eq!(&Value::Array(events(&text)), expected, "{name}");
        for cut in 0..=stream.len() {
            let mut translator = request.stream("msg_1".to_owned());
            let mut pieces = translator.push(&stream.as_bytes()[..cut]);
            pieces.push_str(&translator.push(&stream.as_bytes()[cut..]));
            assert_eq!(pieces, text, "{name} cut at {cut}");
        }
        checked += 1;
    }
    assert_eq!(checked, 5);
}

#[test]
fn what_has_no_equivalent_is_refused_by_name() {
    let cases = [
        (json!({ "top_k": 5 }), "top_k"),
        (json!({ "container": "c" }), "container"),
        (
            json!({ "tools": [{ "type": "web_search_20250305", "name": "web_search" }] }),
            "tools[0].type",
        ),
        (
            json!({ "messages": [{ "role": "user", "content": [{ "type": "search_result" }] }] }),
            "messages[0].content[0].type",
        ),
        (
            json!({ "messages": [{ "role": "assistant", "content": [{ "type": "server_tool_use" }] }] }),
            "messages[0].content[0].type",
        ),
        (json!({ "system": [{ "type": "image" }] }), "system[0]"),
        (
            json!({ "tool_choice": { "type": "sometimes" } }),
            "tool_choice.type",
        ),
        (
            json!({ "thinking": { "type": "enabled" } }),
            "thinking.budget_tokens",
        ),
        (
            json!({ "messages": [{ "role": "tool", "content": "x" }] }),
            "messages[0].role",
        ),
        (
            json!({ "messages": [{ "role": "system", "content": [{ "type": "image" }] }] }),
            "messages[0].content[0]",
        ),
        (
            json!({ "output_config": { "task_budget": 3 } }),
            "output_config.task_budget",
        ),
    ];
    for (extra, field) in cases {
        let mut request = json!({
            "model": "m", "max_tokens": 10, "messages": [{ "role": "user", "content": "Hi" }],
        });
        for (key, value) in extra.as_object().unwrap() {
            request[key] = value.clone();
        }
        let refused = MessagesAsChat::new_with(&request, BuiltinTools::Refuse).unwrap_err();
        assert_eq!(refused.field, field, "{request}");
    }
}

#[test]
fn anthropics_own_tools_are_dropped_and_named_where_the_upstream_drops_them() {
    let request = json!({
        "model": "m", "max_tokens": 10, "messages": [{ "role": "user", "content": "Hi" }],
        "tools": [
            { "type": "web_search_20250305", "name": "web_search", "max_uses": 3 },
            { "name": "get_weather", "input_schema": { "type": "object" } },
            { "type": "custom", "name": "lookup", "input_schema": { "type": "object" } },
        ],
    });
    let translated = MessagesAsChat::new_with(&request, BuiltinTools::Drop).unwrap();
    assert_eq!(translated.dropped_tools(), ["web_search_20250305"]);
    let chat: Value = serde_json::from_slice(&translated.chat_body("m")).unwrap();
    let names: Vec<_> = chat["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|tool| tool["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["get_weather", "lookup"]);
}

#[test]
fn tool_choice_and_thinking_map_to_their_chat_settings() {
    let with = |extra: Value| {
        let mut request = json!({
            "model": "m", "max_tokens": 10, "messages": [{ "role": "user", "content": "Hi" }],
            "tools": [{ "name": "t", "input_schema": { "type": "object" } }],
        });
        for (key, value) in extra.as_object().unwrap() {
            request[key] = value.clone();
        }
        let chat = MessagesAsChat::new_with(&request, BuiltinTools::Refuse)
            .unwrap()
            .chat_body("m");
        serde_json::from_slice::<Value>(&chat).unwrap()
    };
    assert_eq!(
        with(json!({ "tool_choice": { "type": "auto" } }))["tool_choice"],
        "auto"
    );
    assert_eq!(
        with(json!({ "tool_choice": { "type": "none" } }))["tool_choice"],
        "none"
    );
    assert_eq!(
        with(json!({ "tool_choice": { "type": "tool", "name": "t" } }))["tool_choice"],
        json!({ "type": "function", "function": { "name": "t" } })
    );
    let budget = |tokens: u64| {
        with(json!({ "thinking": { "type": "enabled", "budget_tokens": tokens } }))
            ["reasoning_effort"]
            .clone()
    };
    assert_eq!(
        [budget(1024), budget(4096), budget(16384)],
        [json!("low"), json!("medium"), json!("high")]
    );
    let claude_code = with(json!({
        "thinking": { "type": "adaptive", "display": "omitted" },
        "output_config": { "effort": "max" },
        "context_management": { "edits": [{ "type": "clear_thinking_20251015", "keep": "all" }] },
    }));
    assert_eq!(claude_code["reasoning_effort"], "high");
    assert!(claude_code.get("context_management").is_none());
    let schema = json!({ "type": "object", "properties": { "a": { "type": "string" } } });
    let structured =
        with(json!({ "output_config": { "format": { "type": "json_schema", "schema": schema } } }));
    assert_eq!(
        structured["response_format"]["json_schema"]["schema"],
        schema
    );
    let disabled = with(json!({ "thinking": { "type": "disabled" } }));
    assert!(disabled.get("reasoning_effort").is_none());
    assert!(with(json!({})).get("stream_options").is_none());
}

use crate::protocol::translate::usage_counts::{count, put};

proptest! {
    /// Whatever a chat provider reports (cached input inside the prompt, cache writes,
    /// reasoning inside the completion, counts that are no counts), the usage the client reads
    /// is read back by the gateway as exactly what it read of the provider's: the same kinds,
    /// the same counts, the same trust, so the same credits by either endpoint.
    #[test]
    fn the_translated_usage_reads_back_as_the_providers(
        prompt in count(), completion in count(), cached in count(), reasoning in count(),
        writes in count(), writes_1h in count(), top_read in count(),
    ) {
        let mut chat = serde_json::Map::new();
        put(&mut chat, "prompt_tokens", prompt);
        put(&mut chat, "completion_tokens", completion);
        let mut details = serde_json::Map::new();
        put(&mut details, "cached_tokens", cached);
        if !details.is_empty() {
            chat.insert("prompt_tokens_details".into(), Value::Object(details));
        }
        let mut details = serde_json::Map::new();
        put(&mut details, "reasoning_tokens", reasoning);
        if !details.is_empty() {
            chat.insert("completion_tokens_details".into(), Value::Object(details));
        }
        put(&mut chat, "cache_write_tokens", writes);
        put(&mut chat, "cache_write_1h_tokens", writes_1h);
        put(&mut chat, "cache_read_input_tokens", top_read);
        let chat = Value::Object(chat);
        let reply = json!({ "usage": chat }).to_string();
        let Some(provider) = crate::protocol::reply_usage(reply.as_bytes()) else {
            return Ok(());
        };
        let (written, read) = anthropic_usage(&chat);
        prop_assert_eq!(read, provider);
        let client = json!({ "usage": written }).to_string();
        prop_assert_eq!(crate::protocol::reply_usage(client.as_bytes()), Some(provider));
    }
}
