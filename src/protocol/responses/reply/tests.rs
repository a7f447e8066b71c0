use super::*;
use crate::protocol::responses::write::keys_of_every_object;
use serde_json::json;

/// A chat reply's bytes give a `response` whatever the reply holds (odd types are skipped),
/// and the usage the billing layer's own reading gives, so that a translated call is charged
/// as a chat call with the same reply is.
#[test]
fn a_reply_gives_a_response_and_the_billing_layers_usage_whatever_it_holds() {
    let request = Translated::new(json!({ "model": "m", "input": "Hi" })).unwrap();
    let replies = [
        r#"{"created":1,"choices":[{"message":{"content":"Hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11,"prompt_tokens_details":{"cached_tokens":4},"completion_tokens_details":{"reasoning_tokens":1}}}"#,
        r#"{"created":1,"choices":[{"message":{"content":"Hi"}}],"usage":null}"#,
        r#"{"created":1,"choices":[{"message":{"content":"Hi"}}]}"#,
        r#"{"created":1,"choices":[{"message":{"content":["odd"]}}],"usage":{"prompt_tokens":3}}"#,
        r#"{"created":1,"choices":[{"message":{"content":"Hi"}}],"usage":{"prompt_tokens":"3"}}"#,
        r#"{"created":1,"choices":[{"message":{"content":"Hi"}}],"usage":[1,2]}"#,
        r#"  {"created":1,"usage":{"completion_tokens":5}}"#,
        // `usage` objects of other shapes: read twice (the billing layer's reading knows
        // other providers' keys), or once with `OpenAI`'s keys alone.
        r#"{"created":1,"choices":[{"message":{"content":"Hi"}}],"usage":{}}"#,
        r#"{"created":1,"choices":[{"message":{"content":"Hi"}}],"usage":{"prompt_tokens":9,"completion_tokens":2,"prompt_tokens_details":null,"completion_tokens_details":{"reasoning_tokens":null,"accepted_prediction_tokens":0}}}"#,
        r#"{"created":1,"choices":[{"message":{"content":"Hi"}}],"usage":{"prompt_tokens":9,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0}}}"#,
        r#"{"created":1,"choices":[{"message":{"content":"Hi"}}],"usage":{"prompt_tokens":3,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":7}}}"#,
        r#"{"created":1,"choices":[{"message":{"content":"Hi"}}],"usage":{"prompt_tokens":-3,"completion_tokens":2,"total_tokens":0}}"#,
        r#"{"created":1,"choices":[{"message":{"content":"Hi"}}],"usage":{"prompt_tokens":9,"completion_tokens":2,"prompt_cache_hit_tokens":4,"prompt_cache_miss_tokens":5}}"#,
        r#"{"created":1,"choices":[{"message":{"content":"Hi"}}],"usage":{"input_tokens":9,"output_tokens":2}}"#,
        r#"{"created":1,"choices":[{"message":{"content":"Hi"}}],"usage":{"prompt_tokens":9,"input_tokens":8,"completion_tokens":2}}"#,
        r#"{"created":1,"choices":[{"message":{"content":"Hi"}}],"usage":{"prompt_tokens":9,"completion_tokens":2,"cache_read_input_tokens":3,"cache_creation_input_tokens":1}}"#,
        r#"{"created":1,"choices":[{"message":{"content":"Hi"}}],"usage":{"prompt_tokens":9,"completion_tokens":2,"reasoning_tokens":1}}"#,
        r#"{"created":1,"choices":[{"message":{"content":"Hi"}}],"usage":{"prompt_tokens":9,"prompt_tokens":8}}"#,
        r#"{"created":1,"choices":[{"message":{"content":"Hi"}}],"usage":{"prompt_tokens":9,"prompt_tokens_details":{"reasoning_tokens":"x"}}}"#,
        r#"{"created":1,"choices":[{"message":{"content":"Hi"}}],"usage":{"prompt_tokens":9,"cache_creation":{"ephemeral_5m_input_tokens":"x"}}}"#,
    ];
    for reply in replies {
        let (response, usage) =
            response_json_from_chat_bytes(&request, reply.as_bytes(), &mut Ids::counting())
                .unwrap();
        assert_eq!(
            usage,
            crate::protocol::reply_usage(reply.as_bytes()),
            "{reply}"
        );
        let response: Value = serde_json::from_slice(&response).unwrap();
        assert_eq!(response["object"], "response", "{reply}");
        assert!(response["output"].is_array(), "{reply}");
    }
    // Texts with escapes and without (copied between quotes), in every place a text is.
    for escaped in [
        &br#"{"created":1,"choices":[{"message":{"content":"caf\u00e9 \"q\"\n\/","reasoning_content":"\u2603","tool_calls":[{"id":"c\u0031","function":{"name":"f","arguments":"{\"a\":\"\\n\"}"}}]}}]}"#[..],
        "{\"created\":1,\"choices\":[{\"message\":{\"content\":\"café ☃ / \u{7f}\",\"reasoning\":\"r\",\"refusal\":\"no\",\"tool_calls\":[{\"id\":\"c1\",\"function\":{\"name\":\"f\",\"arguments\":\"[]\"}}]}}]}".as_bytes(),
    ] {
        let (response, _) =
            response_json_from_chat_bytes(&request, escaped, &mut Ids::counting()).unwrap();
        let response: Value = serde_json::from_slice(&response).unwrap();
        let reply: Value = serde_json::from_slice(escaped).unwrap();
        let message = &reply["choices"][0]["message"];
        let output = response["output"].as_array().unwrap();
        let item = |kind: &str| output.iter().find(|item| item["type"] == kind).unwrap();
        let parts = item("message")["content"].as_array().unwrap();
        // A refusal is the message's one part; else its text is.
        let (kind, field, key) = match message.get("refusal") {
            Some(_) => ("refusal", "refusal", "refusal"),
            None => ("output_text", "text", "content"),
        };
        let part = parts.iter().find(|part| part["type"] == kind).unwrap();
        assert_eq!(part[field], message[key]);
        assert_eq!(
            item("function_call")["arguments"],
            message["tool_calls"][0]["function"]["arguments"]
        );
    }
    // A text that is not valid JSON (a lone surrogate) is no reply, as `Value` finds it.
    let broken = br#"{"created":1,"choices":[{"message":{"content":"\ud800"}}]}"#;
    assert!(serde_json::from_slice::<Value>(broken).is_err());
    assert!(response_json_from_chat_bytes(&request, broken, &mut Ids::counting()).is_err());
    // Not an object: a failure, as the billing layer would judge it.
    let array = br#"[1,"m",[]]"#;
    let read = response_json_from_chat_bytes(&request, array, &mut Ids::counting());
    assert!(read.is_ok_and(|(_, usage)| usage.is_none()));
    assert!(response_json_from_chat_bytes(&request, b"not json", &mut Ids::counting()).is_err());
}

/// The response is written field by field, so nothing but this test would see a key
/// written twice: every object of a response with every kind of item, every setting given
/// and every one left to its default, holds each key once.
#[test]
fn a_written_response_holds_each_key_once_in_every_object() {
    let given = json!({
        "model": "m", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 9,
        "metadata": { "a": "b" }, "parallel_tool_calls": false,
        "reasoning": { "effort": "low" }, "service_tier": "flex", "temperature": 0.2,
        "text": { "format": { "type": "json_object" } }, "tool_choice": "none",
        "tools": [{ "type": "function", "name": "f" }], "top_p": 0.5, "user": "u",
    });
    let reply = br#"{"created":1,"model":"m","choices":[{"message":{"content":"Hi","reasoning_content":"Hm.","tool_calls":[{"id":"c1","function":{"name":"f","arguments":"{}"}}]},"finish_reason":"length"}],"usage":{"prompt_tokens":3,"completion_tokens":2}}"#;
    // Each request as both readings take it: parsed, and read from its bytes.
    let requests = [given, json!({ "model": "m", "input": "Hi" })].map(|request| {
        let bytes = serde_json::to_vec(&request).unwrap();
        [
            Translated::new(request).unwrap(),
            Translated::from_slice(&bytes).unwrap(),
        ]
    });
    for request in requests.iter().flatten() {
        let (response, _) =
            response_json_from_chat_bytes(request, reply, &mut Ids::counting()).unwrap();
        let objects = keys_of_every_object(&response);
        assert_eq!(objects[0].len(), 25, "{:?}", objects[0]);
        for keys in &objects {
            let mut unique = keys.clone();
            unique.sort();
            unique.dedup();
            assert_eq!(unique.len(), keys.len(), "{keys:?}");
        }
        let value: Value = serde_json::from_slice(&response).unwrap();
        let kinds: Vec<_> = value["output"]
            .as_array()
            .unwrap()
            .iter()
            .map(|item| item["type"].as_str().unwrap())
            .collect();
        assert_eq!(kinds, ["reasoning", "message", "function_call"]);
        assert_eq!(value["incomplete_details"]["reason"], "max_output_tokens");
    }
}

/// A namespaced tool (Codex's multi-agent tools) reaches chat completions as a function tool
/// under its flat name; its call comes back, complete and streamed, under its own name in its
/// namespace (`{"name": "spawn_agent", "namespace": "multi_agent_v1"}`, which is how Codex
/// takes one: a flat name is an "unsupported call" to it), and goes out again flat.
#[test]
fn a_namespaced_tools_call_comes_back_in_its_namespace() {
    let request = json!({
        "model": "m",
        "input": [
            { "role": "user", "content": "Spawn one." },
            { "type": "function_call", "call_id": "call_0", "name": "spawn_agent",
              "namespace": "multi_agent_v1", "arguments": "{}" },
            { "type": "function_call_output", "call_id": "call_0", "output": "spawned" },
        ],
        "tools": [{ "type": "namespace", "name": "multi_agent_v1", "description": "Agents.",
                    "tools": [{ "type": "function", "name": "spawn_agent", "parameters": { "type": "object" } }] }],
    });
    for translated in [
        Translated::new(request.clone()).unwrap(),
        Translated::from_slice(&serde_json::to_vec(&request).unwrap()).unwrap(),
    ] {
        let chat: Value = serde_json::from_slice(&translated.chat_body("m")).unwrap();
        assert_eq!(
            chat["tools"][0]["function"]["name"],
            "multi_agent_v1__spawn_agent"
        );
        assert_eq!(
            chat["messages"][1]["tool_calls"][0]["function"]["name"], "multi_agent_v1__spawn_agent",
            "an earlier call goes out flat"
        );
        let reply = json!({
            "choices": [{ "index": 0, "finish_reason": "tool_calls", "message": { "role": "assistant",
                "tool_calls": [{ "id": "call_1", "type": "function",
                    "function": { "name": "multi_agent_v1__spawn_agent", "arguments": "{\"task\":\"x\"}" } }] } }],
        });
        let response = response_from_chat(&translated, &reply, &mut Ids::counting());
        let call = &response["output"][0];
        assert_eq!(
            (call["name"].as_str(), call["namespace"].as_str()),
            (Some("spawn_agent"), Some("multi_agent_v1"))
        );
        let stream = [
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"multi_agent_v1__spawn_agent","arguments":""}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{}"}}]},"finish_reason":"tool_calls"}]}"#,
        ]
        .iter()
        .map(|data| format!("data: {data}\n\n"))
        .chain(["data: [DONE]\n\n".to_owned()])
        .collect::<String>();
        let events =
            crate::protocol::responses::StreamTranslator::new(&translated, Ids::counting())
                .push(stream.as_bytes());
        let items: Vec<Value> = events
            .split_terminator("\n\n")
            .filter_map(|event| serde_json::from_str::<Value>(event.split_once("data: ")?.1).ok())
            .filter(|event| event["item"]["type"] == "function_call")
            .map(|event| event["item"].clone())
            .collect();
        assert_eq!(items.len(), 2, "added and done: {events}");
        for item in items {
            assert_eq!(
                (item["name"].as_str(), item["namespace"].as_str()),
                (Some("spawn_agent"), Some("multi_agent_v1"))
            );
        }
    }
}
