use serde_json::{Value, json};

use super::*;

fn translate(request: Value, stream: bool) -> Result<Value, Untranslatable> {
    let body = serde_json::to_vec(&request).expect("JSON");
    let translated = GeminiAsChat::from_slice_with(&body, "m", stream, BuiltinTools::Refuse)?;
    Ok(serde_json::from_slice(&translated.chat_body("upstream-m")).expect("a chat body"))
}

#[test]
fn a_conversation_with_function_calls_becomes_chat_messages() {
    let chat = translate(
        json!({
            "systemInstruction": { "parts": [{ "text": "Be brief." }, { "text": "Use tools." }] },
            "contents": [
                { "role": "user", "parts": [{ "text": "Weather in Paris and Rome?" }] },
                { "role": "model", "parts": [
                    { "text": "thinking...", "thought": true },
                    { "functionCall": { "name": "weather", "args": { "city": "Paris" } } },
                    { "functionCall": { "id": "given", "name": "weather", "args": { "city": "Rome" } } },
                ] },
                { "role": "user", "parts": [
                    { "functionResponse": { "id": "given", "name": "weather", "response": { "c": 20 } } },
                    { "functionResponse": { "name": "weather", "response": { "c": 18 } } },
                    { "text": "Thanks" },
                    { "inlineData": { "mimeType": "image/png", "data": "iVBO" } },
                ] },
            ],
            "generationConfig": { "maxOutputTokens": 100, "temperature": 0.2, "topP": 0.9,
                                  "stopSequences": ["END"], "topK": 40 },
        }),
        true,
    )
    .expect("translates");
    assert_eq!(chat["model"], "upstream-m");
    assert_eq!(
        chat["messages"],
        json!([
            { "role": "system", "content": "Be brief.\nUse tools." },
            { "role": "user", "content": "Weather in Paris and Rome?" },
            { "role": "assistant", "content": null, "tool_calls": [
                { "id": "call_1", "type": "function", "function": { "name": "weather", "arguments": "{\"city\":\"Paris\"}" } },
                { "id": "given", "type": "function", "function": { "name": "weather", "arguments": "{\"city\":\"Rome\"}" } },
            ] },
            { "role": "tool", "tool_call_id": "given", "content": "{\"c\":20}" },
            { "role": "tool", "tool_call_id": "call_1", "content": "{\"c\":18}" },
            { "role": "user", "content": [
                { "type": "text", "text": "Thanks" },
                { "type": "image_url", "image_url": { "url": "data:image/png;base64,iVBO" } },
            ] },
        ])
    );
    assert_eq!(
        (
            &chat["max_tokens"],
            &chat["temperature"],
            &chat["top_p"],
            &chat["stop"]
        ),
        (&json!(100), &json!(0.2), &json!(0.9), &json!(["END"]))
    );
    assert!(chat.get("top_k").is_none());
    assert_eq!(chat["stream"], true);
    assert_eq!(chat["stream_options"], json!({ "include_usage": true }));
}

#[test]
fn tools_and_their_schemas_become_json_schema_function_tools() {
    let chat = translate(
        json!({
            "contents": [{ "parts": [{ "text": "Hi" }] }],
            "tools": [{ "functionDeclarations": [
                { "name": "f", "description": "does f", "parameters": {
                    "type": "OBJECT", "propertyOrdering": ["a"],
                    "properties": { "a": { "type": "STRING", "nullable": true },
                                    "b": { "type": "ARRAY", "items": { "type": "INTEGER" } } },
                    "required": ["a"] } },
                { "name": "g", "parametersJsonSchema": { "type": "object", "additionalProperties": false } },
                { "name": "h" },
            ] }],
            "toolConfig": { "functionCallingConfig": { "mode": "ANY", "allowedFunctionNames": ["g"] } },
        }),
        false,
    )
    .expect("translates");
    assert_eq!(
        chat["tools"][0]["function"],
        json!({ "name": "f", "description": "does f", "parameters": {
            "type": "object",
            "properties": { "a": { "type": ["string", "null"] },
                            "b": { "type": "array", "items": { "type": "integer" } } },
            "required": ["a"] } })
    );
    assert_eq!(
        chat["tools"][1]["function"]["parameters"],
        json!({ "type": "object", "additionalProperties": false })
    );
    assert_eq!(
        chat["tools"][2]["function"]["parameters"],
        json!({ "type": "object", "properties": {} })
    );
    assert_eq!(
        chat["tool_choice"],
        json!({ "type": "function", "function": { "name": "g" } })
    );
    assert!(chat.get("stream").is_none());
}

#[test]
fn output_settings_translate_to_their_chat_names() {
    let chat = translate(
        json!({
            "contents": [{ "parts": [{ "text": "Hi" }] }],
            "generationConfig": {
                "responseMimeType": "application/json",
                "responseSchema": { "type": "OBJECT", "properties": { "x": { "type": "NUMBER" } } },
                "thinkingConfig": { "thinkingBudget": 8000, "includeThoughts": true },
                "candidateCount": 2, "seed": 7,
            },
        }),
        false,
    )
    .expect("translates");
    assert_eq!(
        chat["response_format"],
        json!({ "type": "json_schema", "json_schema": { "name": "response",
            "schema": { "type": "object", "properties": { "x": { "type": "number" } } } } })
    );
    assert_eq!(
        (&chat["reasoning_effort"], &chat["n"], &chat["seed"]),
        (&json!("medium"), &json!(2), &json!(7))
    );
    let plain_json = translate(
        json!({ "contents": [], "generationConfig": { "responseMimeType": "application/json",
                 "thinkingConfig": { "thinkingLevel": "LOW" } } }),
        false,
    )
    .expect("translates");
    assert_eq!(
        plain_json["response_format"],
        json!({ "type": "json_object" })
    );
    assert_eq!(plain_json["reasoning_effort"], "low");
}

#[test]
fn what_has_no_equivalent_is_refused_by_name() {
    let refused = |request: Value| translate(request, false).expect_err("refused").field;
    let text = json!([{ "parts": [{ "text": "Hi" }] }]);
    assert_eq!(
        refused(json!({ "contents": text, "cachedContent": "cachedContents/1" })),
        "cachedContent"
    );
    assert_eq!(
        refused(json!({ "contents": text, "tools": [{ "googleSearch": {} }] })),
        "tools[0].googleSearch"
    );
    assert_eq!(
        refused(
            json!({ "contents": text, "generationConfig": { "responseModalities": ["IMAGE"] } })
        ),
        "generationConfig.responseModalities"
    );
    assert_eq!(
        refused(
            json!({ "contents": text, "generationConfig": { "mediaResolution": "MEDIA_RESOLUTION_LOW" } })
        ),
        "generationConfig.mediaResolution"
    );
    assert_eq!(
        refused(
            json!({ "contents": [{ "parts": [{ "inlineData": { "mimeType": "audio/wav", "data": "UklG" } }] }] })
        ),
        "contents[0].parts[0].inlineData.mimeType"
    );
    assert_eq!(
        refused(
            json!({ "contents": [{ "parts": [{ "functionResponse": { "name": "f", "response": {} } }] }] })
        ),
        "contents[0].parts[0].functionResponse"
    );
    assert_eq!(
        refused(
            json!({ "contents": [{ "role": "model", "parts": [{ "executableCode": { "code": "1" } }] }] })
        ),
        "contents[0].parts[0]"
    );
    assert_eq!(
        refused(
            json!({ "contents": text, "toolConfig": { "functionCallingConfig":
            { "mode": "ANY", "allowedFunctionNames": ["a", "b"] } } })
        ),
        "toolConfig.functionCallingConfig.allowedFunctionNames"
    );
    // Dropped instead where the upstream says so, and named.
    let body = serde_json::to_vec(&json!({ "contents": text, "tools": [{ "googleSearch": {} },
        { "functionDeclarations": [{ "name": "f" }] }] }))
    .expect("JSON");
    let dropped =
        GeminiAsChat::from_slice_with(&body, "m", false, BuiltinTools::Drop).expect("translates");
    assert_eq!(dropped.dropped_tools(), ["googleSearch"]);
}

#[test]
fn a_chat_completion_is_a_gemini_response_with_the_same_usage() {
    let body = br#"{"contents":[{"parts":[{"text":"Hi"}]}],"generationConfig":{"thinkingConfig":{"includeThoughts":true}}}"#;
    let translated = GeminiAsChat::from_slice_with(body, "asked", false, BuiltinTools::Refuse)
        .expect("translates");
    let reply = br#"{"id":"chatcmpl-9","choices":[{"index":0,"finish_reason":"tool_calls","message":{
        "role":"assistant","content":"Let me look.","reasoning_content":"They want weather.",
        "tool_calls":[{"id":"call_a","type":"function","function":{"name":"weather","arguments":"{\"city\":\"Paris\"}"}}]}}],
        "usage":{"prompt_tokens":100,"completion_tokens":40,"prompt_tokens_details":{"cached_tokens":60},
                 "completion_tokens_details":{"reasoning_tokens":25}}}"#;
    let (response, usage) = translated.reply(reply).expect("a chat completion");
    let response: Value = serde_json::from_slice(&response).expect("JSON");
    assert_eq!(
        response["candidates"],
        json!([{ "content": { "role": "model", "parts": [
            { "text": "They want weather.", "thought": true },
            { "text": "Let me look." },
            { "functionCall": { "id": "call_a", "name": "weather", "args": { "city": "Paris" } } },
        ] }, "finishReason": "STOP", "index": 0 }])
    );
    assert_eq!(
        response["usageMetadata"],
        json!({ "promptTokenCount": 100, "cachedContentTokenCount": 60, "candidatesTokenCount": 15,
                "thoughtsTokenCount": 25, "totalTokenCount": 140 })
    );
    assert_eq!(
        (
            response["modelVersion"].as_str(),
            response["responseId"].as_str()
        ),
        (Some("asked"), Some("chatcmpl-9"))
    );
    // Read back as Google's, the usage is the chat usage the call is billed by.
    let written =
        crate::protocol::reply_usage(&serde_json::to_vec(&response).expect("JSON")).expect("usage");
    assert_eq!(written, usage);
    assert_eq!(
        (
            usage.input_tokens,
            usage.cache_read_tokens,
            usage.output_tokens
        ),
        (Some(40), Some(60), Some(40))
    );
    assert!(translated.reply(b"[]").is_none());
}

/// The events `stream` writes for the chat `events`, each cut at every byte.
fn streamed(translated: &GeminiAsChat, events: &str) -> Vec<Value> {
    let mut translator = translated.stream();
    let mut out = String::new();
    for byte in events.as_bytes() {
        out.push_str(&translator.push(std::slice::from_ref(byte)));
    }
    assert_eq!(translator.pending(), 0);
    out.split("\r\n\r\n")
        .filter(|event| !event.is_empty())
        .map(|event| {
            serde_json::from_str(event.strip_prefix("data: ").expect("data")).expect("JSON")
        })
        .collect()
}

#[test]
fn a_chat_stream_is_googles_responses_ending_with_the_calls_and_the_usage() {
    let body = br#"{"contents":[{"parts":[{"text":"Hi"}]}]}"#;
    let translated = GeminiAsChat::from_slice_with(body, "asked", true, BuiltinTools::Refuse)
        .expect("translates");
    let events = concat!(
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
        ": keep-alive\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"reasoning_content\":\"hidden\"}}]}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"}}]}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_z\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"\"}}]}}]}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{\\\"a\\\":\"}}]}}]}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"1}\"}}]}}]}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":4}}\n\n",
        "data: [DONE]\n\n",
    );
    let responses = streamed(&translated, events);
    let parts: Vec<&Value> = responses
        .iter()
        .map(|response| &response["candidates"][0]["content"]["parts"][0])
        .collect();
    // The reasoning is not shown: the client did not ask for thoughts.
    assert_eq!(
        parts,
        [
            &json!({ "text": "Hel" }),
            &json!({ "text": "lo" }),
            &json!({ "functionCall": { "id": "call_z", "name": "f", "args": { "a": 1 } } }),
        ]
    );
    let last = responses.last().expect("a last response");
    assert_eq!(last["candidates"][0]["finishReason"], "STOP");
    assert_eq!(
        last["usageMetadata"],
        json!({ "promptTokenCount": 9, "candidatesTokenCount": 4, "totalTokenCount": 13 })
    );
    assert!(
        responses[..2]
            .iter()
            .all(|r| r["candidates"][0].get("finishReason").is_none())
    );
    assert_eq!(last["responseId"], "c1");

    // Cut before `[DONE]`: the text, and no last response (the calls, sent whole, with it).
    // An error chunk: Google's error object.
    assert_eq!(streamed(&translated, &events[..events.len() - 14]).len(), 2);
    let failed = streamed(&translated, "data: {\"error\":{\"message\":\"boom\"}}\n\n");
    assert_eq!(
        failed,
        [json!({ "error": { "code": 500, "message": "boom", "status": "INTERNAL" } })]
    );
}

/// A Gemini stream translated from chat completions is read by the Gemini dialect as its own:
/// content, then the last response with the usage, after which its close is its end.
#[test]
fn the_translated_stream_reads_as_a_gemini_stream() {
    let body = br#"{"contents":[{"parts":[{"text":"Hi"}]}]}"#;
    let translated = GeminiAsChat::from_slice_with(body, "asked", true, BuiltinTools::Refuse)
        .expect("translates");
    let mut translator = translated.stream();
    let written = translator.push(concat!(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\n",
        "data: [DONE]\n\n",
    ).as_bytes());
    let mut reader = crate::protocol::reader::StreamReader::new(crate::protocol::Protocol::Gemini);
    let kinds: Vec<_> = written
        .split_inclusive("\r\n\r\n")
        .map(|event| reader.read(event.as_bytes()))
        .collect();
    use crate::protocol::sse::EventKind;
    assert_eq!(kinds, [EventKind::Content, EventKind::Other]);
    assert!(reader.closed(), "its last response finished it");
    assert_eq!(
        (
            reader.reported().input_tokens,
            reader.reported().output_tokens
        ),
        (Some(3), Some(1))
    );
}

// --- The corpus (`tests/corpus/gemini_as_chat`, expected outputs written by hand) -------------

fn corpus() -> Vec<(String, Value)> {
    crate::protocol::translate::corpus("gemini_as_chat")
}

fn of_case(case: &Value) -> GeminiAsChat {
    let request = serde_json::to_vec(&case["request"]).expect("JSON");
    let model = case["model"].as_str().expect("a model");
    let stream = case["stream"] == Value::Bool(true);
    GeminiAsChat::from_slice_with(&request, model, stream, BuiltinTools::Refuse)
        .expect("translates")
}

#[test]
fn the_corpus_requests_translate_to_the_chat_requests_written_for_them() {
    let mut checked = 0;
    for (name, case) in corpus() {
        let Some(expected) = case.get("chat_request") else {
            continue;
        };
        let upstream_model = expected["model"].as_str().expect("a model");
        let chat: Value =
            serde_json::from_slice(&of_case(&case).chat_body(upstream_model)).expect("JSON");
        assert_eq!(&chat, expected, "{name}");
        checked += 1;
    }
    assert_eq!(checked, 3);
}

#[test]
fn the_corpus_chat_replies_translate_to_the_responses_written_for_them() {
    let mut checked = 0;
    for (name, case) in corpus() {
        let (Some(reply), Some(expected)) = (case.get("chat_reply"), case.get("response")) else {
            continue;
        };
        let reply = serde_json::to_vec(reply).expect("JSON");
        let (response, usage) = of_case(&case).reply(&reply).expect("a chat completion");
        let response: Value = serde_json::from_slice(&response).expect("JSON");
        assert_eq!(&response, expected, "{name}");
        // Billed as the chat call, and the client's response reads back as it.
        assert_eq!(Some(usage), crate::protocol::reply_usage(&reply), "{name}");
        let written = serde_json::to_vec(&response).expect("JSON");
        assert_eq!(
            Some(usage),
            crate::protocol::reply_usage(&written),
            "{name}"
        );
        checked += 1;
    }
    assert_eq!(checked, 2);
}

#[test]
fn the_corpus_chat_streams_translate_to_the_events_written_for_them_cut_anywhere() {
    let mut checked = 0;
    for (name, case) in corpus() {
        let (Some(stream), Some(expected)) = (case.get("chat_stream"), case.get("events")) else {
            continue;
        };
        let stream: String = stream
            .as_array()
            .expect("a list")
            .iter()
            .map(|event| format!("{}\n\n", event.as_str().expect("an event")))
            .collect();
        let translated = of_case(&case);
        let text = translated.stream().push(stream.as_bytes());
        let events: Vec<Value> = text
            .split_terminator("\r\n\r\n")
            .map(|event| {
                serde_json::from_str(event.strip_prefix("data: ").expect("data")).expect("JSON")
            })
            .collect();
        assert_eq!(&Value::Array(events), expected, "{name}");
        for cut in 0..=stream.len() {
            let mut translator = translated.stream();
            let mut pieces = translator.push(&stream.as_bytes()[..cut]);
            pieces.push_str(&translator.push(&stream.as_bytes()[cut..]));
            assert_eq!(pieces, text, "{name} cut at {cut}");
        }
        checked += 1;
    }
    assert_eq!(checked, 2);
}

proptest::proptest! {
    /// Whatever a chat provider reports (cached input inside the prompt, reasoning inside the
    /// completion, counts that are no counts), the call is billed by it as a chat call is, and
    /// a report to trust reads back from the Gemini client's `usageMetadata` as the same kinds
    /// and counts. (Cache writes, which Google has no name for, are not generated: they would
    /// read back as input.)
    #[test]
    fn the_translated_usage_reads_back_as_the_providers(
        prompt in count(), completion in count(), cached in count(), reasoning in count(),
    ) {
        let mut usage = serde_json::Map::new();
        put(&mut usage, "prompt_tokens", prompt);
        put(&mut usage, "completion_tokens", completion);
        if let Some(cached) = cached {
            usage.insert("prompt_tokens_details".into(), json!({ "cached_tokens": cached }));
        }
        if let Some(reasoning) = reasoning {
            usage.insert("completion_tokens_details".into(), json!({ "reasoning_tokens": reasoning }));
        }
        let reply = json!({ "choices": [{ "index": 0, "message": { "content": "Hi" },
            "finish_reason": "stop" }], "usage": usage }).to_string();
        let Some(provider) = crate::protocol::reply_usage(reply.as_bytes()) else {
            return Ok(());
        };
        let translated = GeminiAsChat::from_slice_with(br#"{"contents":[]}"#, "m", false, BuiltinTools::Refuse)
            .expect("translates");
        let (response, billed) = translated.reply(reply.as_bytes()).expect("a chat completion");
        proptest::prop_assert_eq!(billed, provider);
        // Reasoning beyond the output it is part of cannot be said in Google's names, where
        // thoughts are added to the candidates: billed as reported, shown as it can be.
        let said = provider.reasoning_tokens.unwrap_or(0) <= provider.output_tokens.unwrap_or(i64::MAX);
        if !provider.malformed && said {
            // Reasoning without an output count is no count Google's names can carry (its
            // thoughts are output): left out.
            let expected = TokenUsage {
                reasoning_tokens: provider.reasoning_tokens.filter(|_| provider.output_tokens.is_some()),
                ..provider
            };
            proptest::prop_assert_eq!(crate::protocol::reply_usage(&response), Some(expected));
        }
    }
}

use crate::protocol::translate::usage_counts::{count, put};
