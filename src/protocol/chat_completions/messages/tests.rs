//! The chat-as-messages translation against its corpus (`tests/corpus/chat_as_messages`, the
//! expected outputs written by hand from the providers' documented formats), its refusals, and
//! the usage it writes, read back as the gateway read the provider's.

use proptest::prelude::*;
use serde_json::{Value, json};

use super::reply::chat_usage;
use super::*;

fn corpus() -> Vec<(String, Value)> {
    crate::protocol::translate::corpus("chat_as_messages")
}

fn translated(case: &Value) -> ChatAsMessages {
    let max = case["max_output_tokens"].as_u64();
    ChatAsMessages::from_slice_with(
        &serde_json::to_vec(&case["request"]).unwrap(),
        BuiltinTools::Refuse,
        max,
    )
    .unwrap()
}

/// Chat chunks in server-sent event text: the JSON ones, and `[DONE]` as a string.
fn chunks(text: &str) -> Vec<Value> {
    text.split_terminator("\n\n")
        .filter(|event| !event.starts_with(':'))
        .map(|event| {
            let data = event.strip_prefix("data: ").unwrap();
            serde_json::from_str(data).unwrap_or_else(|_| Value::from(data))
        })
        .collect()
}

#[test]
fn the_corpus_requests_translate_to_the_messages_requests_written_for_them() {
    let mut checked = 0;
    for (name, case) in corpus() {
        let Some(expected) = case.get("messages_request") else {
            continue;
        };
        let body = translated(&case).messages_body(case["model"].as_str().unwrap());
        let body: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(&body, expected, "{name}");
        checked += 1;
    }
    assert_eq!(checked, 4);
}

#[test]
fn the_corpus_messages_translate_to_the_chat_completions_written_for_them() {
    let mut checked = 0;
    for (name, case) in corpus() {
        let (Some(reply), Some(expected)) = (case.get("message"), case.get("completion")) else {
            continue;
        };
        let bytes = serde_json::to_vec(reply).unwrap();
        let (completion, usage) = translated(&case)
            .reply(&bytes, "chatcmpl-1".to_owned(), 1741476800)
            .unwrap();
        let completion: Value = serde_json::from_slice(&completion).unwrap();
        assert_eq!(&completion, expected, "{name}");
        // Billed as the message's usage, and the client's completion reads back as it.
        assert_eq!(Some(usage), crate::protocol::reply_usage(&bytes), "{name}");
        assert_eq!(
            Some(usage),
            crate::protocol::reply_usage(&serde_json::to_vec(&completion).unwrap()),
            "{name}"
        );
        checked += 1;
    }
    assert_eq!(checked, 3);
}

#[test]
fn the_corpus_message_streams_translate_to_the_chunks_written_for_them_cut_anywhere() {
    let mut checked = 0;
    for (name, case) in corpus() {
        let (Some(stream), Some(expected)) = (case.get("message_stream"), case.get("chunks"))
        else {
            continue;
        };
        let stream: String = stream
            .as_array()
            .unwrap()
            .iter()
            .map(|event| format!("{}\n\n", event.as_str().unwrap()))
            .collect();
        let request = translated(&case);
        let text = request
            .stream("chatcmpl-1".to_owned(), 1741476800)
            .push(stream.as_bytes());
        assert_eq!(&Value::Array(chunks(&text)), expected, "{name}");
        for cut in 0..=stream.len() {
            let mut translator = request.stream("chatcmpl-1".to_owned(), 1741476800);
            let mut pieces = translator.push(&stream.as_bytes()[..cut]);
            pieces.push_str(&translator.push(&stream.as_bytes()[cut..]));
            assert_eq!(pieces, text, "{name} cut at {cut}");
        }
        checked += 1;
    }
    assert_eq!(checked, 3);
}

#[test]
fn what_has_no_equivalent_is_refused_by_name() {
    let cases = [
        (json!({ "n": 2 }), "n"),
        (json!({ "seed": 7 }), "seed"),
        (json!({ "logprobs": true }), "logprobs"),
        (json!({ "presence_penalty": 0.5 }), "presence_penalty"),
        (json!({ "temperature": 1.5 }), "temperature"),
        (
            json!({ "response_format": { "type": "json_object" } }),
            "response_format.type",
        ),
        (json!({ "web_search_options": {} }), "web_search_options"),
        (
            json!({ "tools": [{ "type": "custom", "custom": { "name": "x" } }] }),
            "tools[0].type",
        ),
        (
            json!({ "messages": [{ "role": "user", "content": [{ "type": "input_audio" }] }] }),
            "messages[0].content[0].type",
        ),
        (
            json!({ "messages": [{ "role": "assistant", "tool_calls": [{ "id": "c", "type": "function", "function": { "name": "f", "arguments": "[1]" } }] }] }),
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            json!({ "messages": [{ "role": "function", "content": "x" }] }),
            "messages[0].role",
        ),
        (json!({ "functions": [] }), "functions"),
    ];
    for (extra, field) in cases {
        let mut request =
            json!({ "model": "m", "messages": [{ "role": "user", "content": "Hi" }] });
        for (key, value) in extra.as_object().unwrap() {
            request[key] = value.clone();
        }
        let refused = ChatAsMessages::new_with(&request, BuiltinTools::Refuse, None).unwrap_err();
        assert_eq!(refused.field, field, "{request}");
    }
    // The defaults of what has no equivalent go through; web search is dropped where the
    // upstream drops built-in tools.
    let defaults = json!({
        "model": "m", "messages": [{ "role": "user", "content": "Hi" }],
        "n": 1, "logprobs": false, "presence_penalty": 0, "frequency_penalty": 0.0,
        "web_search_options": {}, "store": false, "metadata": { "a": "b" },
    });
    let translated = ChatAsMessages::new_with(&defaults, BuiltinTools::Drop, None).unwrap();
    assert_eq!(translated.dropped_tools(), ["web_search"]);
    let body: Value = serde_json::from_slice(&translated.messages_body("m")).unwrap();
    assert_eq!(
        body,
        json!({ "model": "m", "max_tokens": 8192, "messages": [{ "role": "user", "content": [{ "type": "text", "text": "Hi" }] }] })
    );
}

#[test]
fn reasoning_effort_is_a_thinking_budget_below_the_output_limit() {
    let with = |effort: &str, max: u64| {
        let request = json!({
            "model": "m", "messages": [{ "role": "user", "content": "Hi" }],
            "reasoning_effort": effort, "max_completion_tokens": max,
        });
        let body = ChatAsMessages::new_with(&request, BuiltinTools::Refuse, None)
            .unwrap()
            .messages_body("m");
        serde_json::from_slice::<Value>(&body).unwrap()["thinking"].clone()
    };
    assert_eq!(
        with("low", 32000),
        json!({ "type": "enabled", "budget_tokens": 2048 })
    );
    assert_eq!(
        with("high", 32000),
        json!({ "type": "enabled", "budget_tokens": 16384 })
    );
    assert_eq!(
        with("high", 4000),
        json!({ "type": "enabled", "budget_tokens": 3999 })
    );
    assert_eq!(
        with("medium", 1000),
        Value::Null,
        "no budget fits below 1,024"
    );
    assert_eq!(with("minimal", 32000), Value::Null);
}

use crate::protocol::translate::usage_counts::{count, put};

proptest! {
    /// Whatever an Anthropic provider reports (input outside the cache, cache reads, writes of
    /// both durations or only their total, counts that are no counts), the chat usage the
    /// client reads is read back by the gateway as exactly what it read of the provider's.
    #[test]
    fn the_translated_usage_reads_back_as_the_providers(
        input in count(), output in count(), read in count(), created in count(),
        five in count(), hour in count(), split in any::<bool>(),
    ) {
        let mut usage = serde_json::Map::new();
        put(&mut usage, "input_tokens", input);
        put(&mut usage, "output_tokens", output);
        put(&mut usage, "cache_read_input_tokens", read);
        put(&mut usage, "cache_creation_input_tokens", created);
        if split {
            let mut detail = serde_json::Map::new();
            put(&mut detail, "ephemeral_5m_input_tokens", five);
            put(&mut detail, "ephemeral_1h_input_tokens", hour);
            usage.insert("cache_creation".into(), Value::Object(detail));
        }
        let usage = Value::Object(usage);
        let reply = json!({ "usage": usage }).to_string();
        let Some(provider) = crate::protocol::reply_usage(reply.as_bytes()) else {
            return Ok(());
        };
        let written = chat_usage(provider, || usage.clone());
        let client = json!({ "usage": written }).to_string();
        prop_assert_eq!(crate::protocol::reply_usage(client.as_bytes()), Some(provider));
    }
}
