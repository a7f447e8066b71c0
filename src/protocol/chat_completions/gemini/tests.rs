use serde_json::{Value, json};

use super::*;
use crate::protocol::reply_usage;

fn translate(request: Value) -> Result<Value, Untranslatable> {
    let body = serde_json::to_vec(&request).expect("JSON");
    let translated = ChatAsGemini::from_slice_with(&body, BuiltinTools::Refuse, Some(512))?;
    Ok(serde_json::from_slice(&translated.gemini_body()).expect("a Gemini body"))
}

#[test]
fn a_conversation_with_tool_calls_becomes_gemini_contents() {
    let gemini = translate(json!({
        "model": "g", "stream": true, "stream_options": { "include_usage": true },
        "messages": [
            { "role": "system", "content": "Be brief." },
            { "role": "developer", "content": [{ "type": "text", "text": "Use tools." }] },
            { "role": "user", "content": [
                { "type": "text", "text": "Weather here?" },
                { "type": "image_url", "image_url": { "url": "data:image/png;base64,iVBO" } },
            ] },
            { "role": "assistant", "content": null, "reasoning_content": "hidden", "tool_calls": [
                { "id": "a", "type": "function", "function": { "name": "weather", "arguments": "{\"city\":\"Paris\"}" } },
                { "id": "b", "type": "function", "function": { "name": "time", "arguments": "" } },
            ] },
            { "role": "tool", "tool_call_id": "b", "content": "noon" },
            { "role": "tool", "tool_call_id": "a", "content": "{\"c\":18}" },
            { "role": "user", "content": "Thanks" },
        ],
        "tools": [{ "type": "function", "function": { "name": "weather",
            "parameters": { "type": "object", "properties": { "city": { "type": "string" } } } } }],
        "tool_choice": { "type": "function", "function": { "name": "weather" } },
        "temperature": 0.3, "stop": "END", "user": "u1", "parallel_tool_calls": false,
        "reasoning_effort": "medium",
        "response_format": { "type": "json_schema", "json_schema": { "name": "r", "schema": { "type": "object" } } },
    }))
    .expect("translates");
    assert_eq!(
        gemini,
        json!({
            "systemInstruction": { "parts": [{ "text": "Be brief.\n\nUse tools." }] },
            "contents": [
                { "role": "user", "parts": [
                    { "text": "Weather here?" },
                    { "inlineData": { "mimeType": "image/png", "data": "iVBO" } },
                ] },
                { "role": "model", "parts": [
                    { "functionCall": { "name": "weather", "args": { "city": "Paris" } } },
                    { "functionCall": { "name": "time", "args": {} } },
                ] },
                { "role": "user", "parts": [
                    { "functionResponse": { "name": "time", "response": { "result": "noon" } } },
                    { "functionResponse": { "name": "weather", "response": { "c": 18 } } },
                    { "text": "Thanks" },
                ] },
            ],
            "tools": [{ "functionDeclarations": [{ "name": "weather",
                "parametersJsonSchema": { "type": "object", "properties": { "city": { "type": "string" } } } }] }],
            "toolConfig": { "functionCallingConfig": { "mode": "ANY", "allowedFunctionNames": ["weather"] } },
            "generationConfig": {
                "temperature": 0.3, "stopSequences": ["END"], "maxOutputTokens": 512,
                "thinkingConfig": { "thinkingBudget": 8192 },
                "responseMimeType": "application/json", "responseJsonSchema": { "type": "object" },
            },
        })
    );
}

#[test]
fn what_has_no_equivalent_is_refused_by_name() {
    let refused = |request: Value| translate(request).expect_err("refused").field;
    let hi = json!([{ "role": "user", "content": "Hi" }]);
    assert_eq!(
        refused(json!({ "messages": hi, "logit_bias": { "1": 2 } })),
        "logit_bias"
    );
    assert_eq!(
        refused(json!({ "messages": hi, "audio": { "voice": "x" } })),
        "audio"
    );
    assert_eq!(
        refused(json!({ "messages": [{ "role": "user", "content": [
            { "type": "image_url", "image_url": { "url": "https://x/a.png" } }] }] })),
        "messages[0].content[0].image_url.url"
    );
    assert_eq!(
        refused(
            json!({ "messages": hi, "tools": [{ "type": "custom", "custom": { "name": "c" } }] })
        ),
        "tools[0].type"
    );
    assert_eq!(
        refused(json!({ "messages": [{ "role": "tool", "tool_call_id": "x", "content": "r" }] })),
        "messages[0].tool_call_id"
    );
    assert_eq!(
        refused(
            json!({ "messages": [{ "role": "assistant", "tool_calls": [{ "id": "a", "type": "function",
            "function": { "name": "f", "arguments": "[1]" } }] }] })
        ),
        "messages[0].tool_calls[0].function.arguments"
    );
    let body =
        serde_json::to_vec(&json!({ "messages": hi, "web_search_options": {} })).expect("JSON");
    let dropped =
        ChatAsGemini::from_slice_with(&body, BuiltinTools::Drop, None).expect("translates");
    assert_eq!(dropped.dropped_tools(), ["web_search"]);
}

#[test]
fn a_gemini_response_is_a_chat_completion_with_the_same_usage() {
    let body = br#"{"model":"asked","messages":[{"role":"user","content":"Hi"}]}"#;
    let translated =
        ChatAsGemini::from_slice_with(body, BuiltinTools::Refuse, None).expect("translates");
    let reply = br#"{"candidates":[{"content":{"role":"model","parts":[
        {"text":"Considering.","thought":true},{"text":"Let me look."},
        {"functionCall":{"name":"weather","args":{"city":"Paris"}}}]},"finishReason":"STOP","index":0}],
        "usageMetadata":{"promptTokenCount":100,"cachedContentTokenCount":60,"toolUsePromptTokenCount":5,
        "candidatesTokenCount":15,"thoughtsTokenCount":25,"totalTokenCount":145},"responseId":"r1"}"#;
    let (completion, usage) = translated
        .reply(reply, "chatcmpl-1".into(), 7)
        .expect("a response");
    let completion: Value = serde_json::from_slice(&completion).expect("JSON");
    assert_eq!(
        completion["choices"],
        json!([{ "index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": "Let me look.", "reasoning_content": "Considering.",
            "tool_calls": [{ "id": "call_0", "type": "function",
                             "function": { "name": "weather", "arguments": "{\"city\":\"Paris\"}" } }] } }])
    );
    assert_eq!(
        (completion["model"].as_str(), completion["created"].as_u64()),
        (Some("asked"), Some(7))
    );
    // The chat usage reads back as the Gemini usage the call is billed by.
    let written = reply_usage(&serde_json::to_vec(&completion).expect("JSON")).expect("usage");
    assert_eq!(written, usage);
    assert_eq!(
        (
            usage.input_tokens,
            usage.cache_read_tokens,
            usage.output_tokens,
            usage.reasoning_tokens
        ),
        (Some(45), Some(60), Some(40), Some(25))
    );
    // A blocked prompt: no candidate, a content filter.
    let blocked =
        br#"{"promptFeedback":{"blockReason":"SAFETY"},"usageMetadata":{"promptTokenCount":4}}"#;
    let (completion, _) = translated
        .reply(blocked, "c".into(), 0)
        .expect("a response");
    let completion: Value = serde_json::from_slice(&completion).expect("JSON");
    assert_eq!(completion["choices"][0]["finish_reason"], "content_filter");
    assert!(translated.reply(b"[]", "c".into(), 0).is_err());
    assert!(
        translated
            .reply(br#"{"object":"chat.completion"}"#, "c".into(), 0)
            .is_err()
    );
}

#[test]
fn googles_stream_is_chat_chunks_ending_with_the_usage_and_done() {
    let body = br#"{"model":"asked","messages":[{"role":"user","content":"Hi"}]}"#;
    let translated =
        ChatAsGemini::from_slice_with(body, BuiltinTools::Refuse, None).expect("translates");
    let events = concat!(
        "data: {\"candidates\":[{\"content\":{\"role\":\"model\",\"parts\":[{\"text\":\"Hel\"}]},\"index\":0}],\"usageMetadata\":{\"promptTokenCount\":9}}\r\n\r\n",
        "data: {\"candidates\":[{\"content\":{\"role\":\"model\",\"parts\":[{\"text\":\"lo\"},{\"functionCall\":{\"name\":\"f\",\"args\":{\"a\":1}}}]},\"finishReason\":\"STOP\",\"index\":0}],\"usageMetadata\":{\"promptTokenCount\":9,\"candidatesTokenCount\":4}}\r\n\r\n",
    );
    let mut translator = translated.stream("chatcmpl-x".into(), 1);
    let mut out = String::new();
    for byte in events.as_bytes() {
        out.push_str(&translator.push(std::slice::from_ref(byte)));
    }
    let mut reader =
        crate::protocol::reader::StreamReader::new(crate::protocol::Protocol::ChatCompletions);
    let chunks: Vec<&str> = out.split_inclusive("\n\n").collect();
    let kinds: Vec<_> = chunks
        .iter()
        .map(|chunk| reader.read(chunk.as_bytes()))
        .collect();
    use crate::protocol::sse::EventKind;
    assert_eq!(
        kinds,
        [
            EventKind::Other,   // the role
            EventKind::Content, // "Hel"
            EventKind::Content, // "lo"
            EventKind::Content, // the call
            EventKind::Other,   // the finish reason
            EventKind::Other,   // the usage
            EventKind::End,
        ]
    );
    assert!(chunks[3].contains("\"tool_calls\":[{\"function\":{\"arguments\":\"{\\\"a\\\":1}\",\"name\":\"f\"},\"id\":\"call_0\",\"index\":0"), "{}", chunks[3]);
    assert!(chunks[4].contains("\"finish_reason\":\"tool_calls\""));
    assert_eq!(
        (
            reader.reported().input_tokens,
            reader.reported().output_tokens
        ),
        (Some(9), Some(4))
    );
    // Cut before a finish reason: no `[DONE]`. Google's error object: chat's error chunk.
    let mut cut = translated.stream("c".into(), 1);
    assert!(
        !cut.push(&events.as_bytes()[..events.find("\r\n\r\n").expect("an end") + 4])
            .contains("[DONE]")
    );
    let mut failed = translated.stream("c".into(), 1);
    let error = failed.push(b"data: {\"error\":{\"code\":503,\"message\":\"overloaded\",\"status\":\"UNAVAILABLE\"}}\r\n\r\n");
    assert_eq!(
        error,
        "data: {\"error\":{\"message\":\"overloaded\",\"type\":\"UNAVAILABLE\"}}\n\n"
    );
}

// --- The corpus (`tests/corpus/chat_as_gemini`, expected outputs written by hand) -------------

fn corpus() -> Vec<(String, Value)> {
    crate::protocol::translate::corpus("chat_as_gemini")
}

fn of_case(case: &Value) -> ChatAsGemini {
    let request = serde_json::to_vec(&case["request"]).expect("JSON");
    ChatAsGemini::from_slice_with(&request, BuiltinTools::Refuse, None).expect("translates")
}

const CREATED: u64 = 1_741_476_800;

#[test]
fn the_corpus_requests_translate_to_the_gemini_requests_written_for_them() {
    let mut checked = 0;
    for (name, case) in corpus() {
        let Some(expected) = case.get("gemini_request") else {
            continue;
        };
        let gemini: Value = serde_json::from_slice(&of_case(&case).gemini_body()).expect("JSON");
        assert_eq!(&gemini, expected, "{name}");
        checked += 1;
    }
    assert_eq!(checked, 2);
}

#[test]
fn the_corpus_gemini_replies_translate_to_the_completions_written_for_them() {
    let mut checked = 0;
    for (name, case) in corpus() {
        let (Some(reply), Some(expected)) = (case.get("gemini_reply"), case.get("completion"))
        else {
            continue;
        };
        let reply = serde_json::to_vec(reply).expect("JSON");
        let (completion, usage) = of_case(&case)
            .reply(&reply, "chatcmpl-1".into(), CREATED)
            .expect("a response");
        let completion: Value = serde_json::from_slice(&completion).expect("JSON");
        assert_eq!(&completion, expected, "{name}");
        assert_eq!(Some(usage), reply_usage(&reply), "{name}");
        let written = serde_json::to_vec(&completion).expect("JSON");
        assert_eq!(Some(usage), reply_usage(&written), "{name}");
        checked += 1;
    }
    assert_eq!(checked, 2);
}

#[test]
fn the_corpus_gemini_streams_translate_to_the_chunks_written_for_them_cut_anywhere() {
    let mut checked = 0;
    for (name, case) in corpus() {
        let (Some(stream), Some(expected)) = (case.get("gemini_stream"), case.get("chunks")) else {
            continue;
        };
        let stream: String = stream
            .as_array()
            .expect("a list")
            .iter()
            .map(|event| format!("{}\r\n\r\n", event.as_str().expect("an event")))
            .collect();
        let translated = of_case(&case);
        let text = translated
            .stream("chatcmpl-1".into(), CREATED)
            .push(stream.as_bytes());
        let chunks: Vec<Value> = text
            .split_terminator("\n\n")
            .map(|event| {
                let data = event.strip_prefix("data: ").expect("data");
                serde_json::from_str(data).unwrap_or_else(|_| Value::from(data))
            })
            .collect();
        assert_eq!(&Value::Array(chunks), expected, "{name}");
        for cut in 0..=stream.len() {
            let mut translator = translated.stream("chatcmpl-1".into(), CREATED);
            let mut pieces = translator.push(&stream.as_bytes()[..cut]);
            pieces.push_str(&translator.push(&stream.as_bytes()[cut..]));
            assert_eq!(pieces, text, "{name} cut at {cut}");
        }
        checked += 1;
    }
    assert_eq!(checked, 2);
}

proptest::proptest! {
    /// Whatever Google reports (cached input inside the prompt, tool-use prompt tokens beside
    /// it, thoughts beside the candidates, counts that are no counts), the call is billed by
    /// it as a Gemini call is, and the chat client's usage reads back as the same report (one
    /// not to be trusted passed on in Google's names, and not trusted again).
    #[test]
    fn the_translated_usage_reads_back_as_the_providers(
        prompt in count(), cached in count(), tool_use in count(), candidates in count(),
        thoughts in count(),
    ) {
        let mut usage = serde_json::Map::new();
        put(&mut usage, "promptTokenCount", prompt);
        put(&mut usage, "cachedContentTokenCount", cached);
        put(&mut usage, "toolUsePromptTokenCount", tool_use);
        put(&mut usage, "candidatesTokenCount", candidates);
        put(&mut usage, "thoughtsTokenCount", thoughts);
        let reply = json!({ "candidates": [{ "content": { "role": "model", "parts": [{ "text": "Hi" }] },
            "finishReason": "STOP" }], "usageMetadata": usage }).to_string();
        let Some(provider) = reply_usage(reply.as_bytes()) else {
            return Ok(());
        };
        let translated = ChatAsGemini::from_slice_with(br#"{"messages":[]}"#, BuiltinTools::Refuse, None)
            .expect("translates");
        let (completion, billed) = translated
            .reply(reply.as_bytes(), "c".into(), 0)
            .expect("a response");
        proptest::prop_assert_eq!(billed, provider);
        if !provider.malformed {
            proptest::prop_assert_eq!(reply_usage(&completion), Some(provider));
        }
    }
}

use crate::protocol::translate::usage_counts::{count, put};
