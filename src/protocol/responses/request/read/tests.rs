use proptest::prelude::*;
use serde_json::{Value, json};

use super::super::super::{ChatReply, Ids, write_response};
use super::super::{Translated, Untranslatable};
use super::{RawStr, translate};
use serde_json::value::RawValue;

/// What a translation gives: the chat request calling `m`, and a response that repeats the
/// request (written for a fixed reply), both parsed; or the refusal.
fn outcome(
    translated: Result<Translated, Untranslatable>,
) -> Result<(Value, Value), Untranslatable> {
    let translated = translated?;
    let chat = serde_json::from_slice(&translated.chat_body("m")).expect("JSON");
    let reply = ChatReply {
        created: Some(1),
        text: Some("Hi".into()),
        ..ChatReply::default()
    };
    let response = write_response(translated.echoed(), &reply, &mut Ids::counting());
    Ok((chat, serde_json::from_slice(&response).expect("JSON")))
}

/// `request` translated both ways: parsed, and from its bytes (as written by `to_bytes`).
fn both(request: &Value, to_bytes: fn(&Value) -> serde_json::Result<Vec<u8>>) {
    let bytes = to_bytes(request).unwrap();
    let parsed = outcome(Translated::new(request.clone()));
    let read = outcome(Translated::from_slice(&bytes));
    assert_eq!(read, parsed, "{request}");
}

/// `body`, kept as written, translates from its bytes as it does once parsed.
fn readings_agree(body: &[u8]) {
    let parsed: Value = serde_json::from_slice(body).unwrap();
    assert_eq!(
        outcome(Translated::from_slice(body)),
        outcome(Translated::new(parsed)),
        "{}",
        String::from_utf8_lossy(body)
    );
}

/// Requests as clients send them are read here, without a `Value`: the corpus's, and a
/// coding agent's turn with every kind of item, pretty-printed or not.
#[test]
fn ordinary_requests_are_read_from_their_bytes_and_translate_as_parsed() {
    let dir = format!("{}/tests/corpus/responses", env!("CARGO_MANIFEST_DIR"));
    let mut requests = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let case: Value =
            serde_json::from_slice(&std::fs::read(entry.unwrap().path()).unwrap()).unwrap();
        if case.get("chat_request").is_some() {
            requests.push(case["request"].clone());
        }
    }
    assert_eq!(requests.len(), 11);
    requests.push(json!({
        "model": "m", "instructions": "Be \"brief\".\n", "stream": true, "store": false,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k",
        "tools": [{ "type": "function", "name": "sh", "description": "Runs it.",
                    "parameters": { "type": "object", "properties": {} }, "strict": false }],
        "tool_choice": { "type": "function", "name": "sh" }, "parallel_tool_calls": false,
        "reasoning": { "effort": "high", "summary": "auto" }, "truncation": "disabled",
        "text": { "format": { "type": "json_schema", "name": "s", "schema": {} },
                  "verbosity": "low" },
        "temperature": 0.25, "top_p": 0.5, "max_output_tokens": 99, "top_logprobs": 2,
        "metadata": { "a": "b" }, "user": "u", "service_tier": "flex", "background": false,
        "input": [
            { "role": "developer", "content": [{ "type": "input_text", "text": "Rules." }] },
            { "type": "message", "role": "user", "content": [
                { "type": "input_text", "text": "caf\u{e9} \u{1f600}" },
                { "type": "input_image", "image_url": "data:image/png;base64,AA", "detail": "low" },
                { "type": "input_file", "file_id": "file-1", "filename": "a.pdf" },
                { "type": "input_audio", "input_audio": { "data": "AA", "format": "wav" } }] },
            { "type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "x" },
            { "type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{ "type": "output_text", "text": "Let me look.", "annotations": [] }] },
            { "type": "function_call", "call_id": "c1", "name": "sh", "arguments": "{\"a\":1}" },
            { "type": "function_call", "call_id": "c2", "name": "sh" },
            { "type": "function_call_output", "call_id": "c1", "output": "ok" },
            { "type": "function_call_output", "call_id": "c2",
              "output": [{ "type": "input_text", "text": "o" }, { "type": "output_text", "text": "k" }] },
            { "role": "assistant", "content": [{ "type": "refusal", "refusal": "No." }] },
            { "role": "assistant", "content": "Done." },
            { "type": "function_call", "call_id": "c3", "name": "sh", "arguments": "{}" },
        ],
    }));
    for request in &requests {
        for to_bytes in [
            serde_json::to_vec::<Value>,
            serde_json::to_vec_pretty::<Value>,
        ] {
            let bytes = to_bytes(request).unwrap();
            assert!(translate(&bytes).is_some(), "given way: {request}");
            both(request, to_bytes);
        }
    }
    // Pretty-printed, the echo holds no line break (it goes into `data:` lines).
    let pretty = serde_json::to_vec_pretty(requests.last().unwrap()).unwrap();
    let (_, echoed) = translate(&pretty).unwrap();
    let response = write_response(&echoed, &ChatReply::default(), &mut Ids::counting());
    assert!(!response.contains(&b'\n'));
}

/// Mostly one of `usual` or the field left out (`None`); now and then one of `odd`.
fn pick(usual: Vec<Value>, odd: Vec<Value>) -> impl Strategy<Value = Option<Value>> {
    match (usual.is_empty(), odd.is_empty()) {
        (true, _) => prop::option::weighted(0.08, prop::sample::select(odd)).boxed(),
        (false, true) => prop::option::weighted(0.6, prop::sample::select(usual)).boxed(),
        (false, false) => prop_oneof![
            40 => prop::option::weighted(0.6, prop::sample::select(usual)),
            1 => prop::sample::select(odd).prop_map(Some),
        ]
        .boxed(),
    }
}

/// One of `usual`; now and then one of `odd`, or nothing.
fn required(usual: Vec<Value>, odd: Vec<Value>) -> impl Strategy<Value = Option<Value>> {
    prop_oneof![
        40 => prop::sample::select(usual).prop_map(Some),
        1 => prop::option::weighted(0.5, prop::sample::select(odd)),
    ]
}

/// The parts a message of `role` holds (text alone for a system message, a refusal for an
/// assistant's, images, files and audio for a user's).
fn parts_of(role: Option<&str>) -> Vec<Value> {
    let mut parts = vec![
        json!({ "type": "input_text", "text": "t\u{e9}\"\n" }),
        json!({ "type": "output_text", "text": "o" }),
    ];
    match role {
        Some("assistant") => parts.push(json!({ "type": "refusal", "refusal": "no" })),
        Some("user") => parts.extend([
            json!({ "type": "input_image", "image_url": "https://x/a.png" }),
            json!({ "type": "input_image", "image_url": "https://x/a.png", "detail": "low" }),
            json!({ "type": "input_file", "file_data": "AA", "filename": "a.pdf" }),
            json!({ "type": "input_file", "file_id": "f", "file_data": null }),
            json!({ "type": "input_audio", "input_audio": { "data": "AA", "format": "wav" } }),
        ]),
        _ => {}
    }
    parts
}

/// One of `usual`; now and then a part out of place or malformed.
fn part(usual: Vec<Value>) -> impl Strategy<Value = Value> {
    let odd = prop::sample::select(vec![
        json!({ "type": "input_text" }),
        json!({ "type": "input_text", "text": 5 }),
        json!({ "type": "refusal" }),
        json!({ "type": "refusal", "refusal": "no" }),
        json!({ "type": "input_image", "image_url": "https://x/a.png" }),
        json!({ "type": "input_image", "image_url": "https://x/a.png", "detail": 3 }),
        json!({ "type": "input_image", "file_id": "f" }),
        json!({ "type": "input_file", "file_url": "https://x/a.pdf" }),
        json!({ "type": "input_audio" }),
        json!({ "type": "video" }),
        json!({ "text": "untyped" }),
        json!("a string"),
    ]);
    prop_oneof![40 => prop::sample::select(usual), 1 => odd]
}

fn content(parts: Vec<Value>) -> impl Strategy<Value = Option<Value>> {
    prop_oneof![
        3 => prop::collection::vec(part(parts), 0..4).prop_map(|parts| Some(Value::from(parts))),
        1 => required(vec![json!("text \u{1f600}")], vec![json!(null), json!(7), json!({ "a": 1 })]),
    ]
}

/// An object of the fields given.
fn object<const N: usize>(fields: [(&str, Option<Value>); N]) -> Value {
    let mut object = serde_json::Map::new();
    for (name, value) in fields {
        if let Some(value) = value {
            object.insert(name.into(), value);
        }
    }
    Value::Object(object)
}

fn item() -> impl Strategy<Value = Value> {
    let roles = vec![
        json!("user"),
        json!("assistant"),
        json!("system"),
        json!("developer"),
    ];
    let message = required(roles, vec![json!("tool"), json!(5)])
        .prop_flat_map(|role| {
            let parts = parts_of(role.as_ref().and_then(Value::as_str));
            let kind = pick(vec![json!("message")], vec![json!(3)]);
            (Just(role), kind, content(parts))
        })
        .prop_map(|(role, kind, content)| {
            object([("type", kind), ("role", role), ("content", content)])
        });
    let call_id = || pick(vec![json!("c1"), json!("c2")], vec![json!(4)]);
    let call = (
        call_id(),
        pick(vec![json!("f")], vec![json!(null), json!(2)]),
        pick(
            vec![json!("{}"), json!("{\"a\":1}")],
            vec![json!({ "a": 1 })],
        ),
    )
        .prop_map(|(call_id, name, arguments)| {
            object([
                ("type", Some(json!("function_call"))),
                ("call_id", call_id.or(Some(json!("c1")))),
                ("name", name.or(Some(json!("f")))),
                ("arguments", arguments),
            ])
        });
    let custom_call = (
        call_id(),
        pick(vec![json!("apply_patch")], vec![json!(null), json!(2)]),
        pick(
            vec![json!("*** Begin Patch\n\u{4e16}"), json!("")],
            vec![json!(["x"]), json!(null)],
        ),
    )
        .prop_map(|(call_id, name, input)| {
            object([
                ("type", Some(json!("custom_tool_call"))),
                ("call_id", call_id.or(Some(json!("c2")))),
                ("name", name.or(Some(json!("apply_patch")))),
                ("input", input),
            ])
        });
    let output = (
        call_id(),
        content(parts_of(None)),
        prop::sample::select(vec!["function_call_output", "custom_tool_call_output"]),
    )
        .prop_map(|(call_id, output, kind)| {
            object([
                ("type", Some(json!(kind))),
                ("call_id", call_id.or(Some(json!("c1")))),
                ("output", output),
            ])
        });
    let reasoning = Just(json!({ "type": "reasoning", "summary": [], "encrypted_content": "x" }));
    let odd = prop::sample::select(vec![
        json!({ "type": "item_reference", "id": "msg_1" }),
        json!({ "type": "web_search_call" }),
    ]);
    prop_oneof![
        12 => message,
        9 => call,
        4 => custom_call,
        6 => output,
        3 => reasoning,
        1 => odd,
    ]
}

fn request() -> impl Strategy<Value = Value> {
    let input = prop_oneof![
        8 => prop::collection::vec(item(), 0..8).prop_map(|items| Some(Value::from(items))),
        1 => required(vec![json!("Hi")], vec![json!(null), json!(1)]),
    ];
    let tool = json!({ "type": "function", "name": "f", "parameters": { "type": "object" } });
    let grammar = json!({ "type": "grammar", "syntax": "lark", "definition": "start: \"a\"\n" });
    let custom = json!({ "type": "custom", "name": "p", "description": "Patches.",
                         "format": grammar });
    let free = json!({ "type": "custom", "name": "n", "format": { "type": "text" },
                       "description": null, "defer_loading": false });
    let settings = (
        pick(vec![json!("Be brief."), json!(null)], vec![json!(5)]),
        pick(
            vec![json!(true), json!(false), json!(null)],
            vec![json!("yes")],
        ),
        pick(vec![json!(0.5), json!(null)], vec![json!("hot")]),
        pick(vec![json!(9), json!(null)], vec![]),
        pick(vec![json!(false), json!(null)], vec![]),
        pick(
            vec![
                json!([tool]),
                json!([tool, custom, free]),
                json!([{ "type": "custom", "name": "q" }]),
                json!([]),
                json!(null),
            ],
            vec![
                json!([{ "type": "web_search" }]),
                json!([{ "type": "function" }]),
                json!([{ "type": "custom", "name": "p", "format": { "type": "grammar" } }]),
                json!([{ "type": "custom", "name": "p", "format": { "type": "json" } }]),
                json!([{ "type": "custom", "name": "p", "format": null, "parameters": {} }]),
                json!([{ "type": "custom", "name": "p", "format": "text" }]),
                json!("x"),
            ],
        ),
        pick(
            vec![
                json!("auto"),
                json!("required"),
                json!({ "type": "function", "name": "f" }),
                json!({ "type": "custom", "name": "p" }),
                json!({ "type": "allowed_tools", "mode": "auto",
                        "tools": [{ "type": "function", "name": "f" },
                                  { "type": "custom", "name": "p" }] }),
                json!(null),
            ],
            vec![
                json!({ "type": "function" }),
                json!({ "type": "custom" }),
                json!({ "type": "allowed_tools", "mode": "none", "tools": [] }),
                json!({ "type": "allowed_tools", "mode": "required",
                        "tools": [{ "type": "image_generation" }] }),
                json!({ "type": "web_search" }),
                json!(5),
            ],
        ),
        pick(
            vec![
                json!({ "format": { "type": "json_schema", "name": "s", "schema": {} } }),
                json!({ "format": { "type": "text" } }),
                json!({ "format": { "type": "json_object" }, "verbosity": "low" }),
                json!({ "verbosity": "low" }),
                json!(null),
            ],
            vec![
                json!({ "format": { "type": "json_schema", "schema": {} } }),
                json!({ "format": { "type": "yaml" } }),
                json!("x"),
            ],
        ),
    );
    let more = (
        pick(
            vec![
                json!({ "effort": "low", "summary": "auto" }),
                json!({ "effort": null }),
                json!(null),
            ],
            vec![json!("high")],
        ),
        pick(vec![json!(2), json!(null)], vec![]),
        pick(vec![json!({ "a": "b" }), json!(null)], vec![]),
        pick(
            vec![json!("disabled"), json!(null)],
            vec![json!("auto"), json!(5)],
        ),
        pick(vec![json!(false), json!(null)], vec![json!(true)]),
        pick(vec![json!(null)], vec![json!("resp_1")]),
        pick(
            vec![json!(false), json!(["reasoning.encrypted_content"])],
            vec![],
        ),
        pick(vec![], vec![json!(1), json!(null)]),
    );
    (input, settings, more).prop_map(|(input, settings, more)| {
        let (instructions, stream, temperature, max, parallel, tools, choice, text) = settings;
        let (reasoning, logprobs, metadata, truncation, background, previous, hint, odd) = more;
        object([
            ("model", Some(json!("gpt"))),
            ("input", input),
            ("instructions", instructions),
            ("stream", stream),
            ("temperature", temperature),
            ("max_output_tokens", max),
            ("parallel_tool_calls", parallel),
            ("tools", tools),
            ("tool_choice", choice),
            ("text", text),
            ("reasoning", reasoning),
            ("top_logprobs", logprobs),
            ("metadata", metadata),
            ("truncation", truncation),
            ("background", background),
            ("previous_response_id", previous),
            ("store", hint),
            ("frobnicate", odd),
        ])
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Whatever a request holds, it translates from its bytes as it does parsed: the same
    /// chat request and echo, or the same refusal.
    #[test]
    fn a_request_translates_from_its_bytes_as_it_does_parsed(request in request()) {
        both(&request, serde_json::to_vec::<Value>);
        both(&request, serde_json::to_vec_pretty::<Value>);
    }
}

/// A key given twice: the last counts, as when parsed.
#[test]
fn a_duplicated_key_translates_as_parsed() {
    readings_agree(br#"{"model":"m","input":"a","temperature":1,"input":"b","temperature":0.5}"#);
}

/// Texts are copied as written, but not a lone escaped surrogate, which is not JSON: it is
/// refused as parsing refuses it (the router answers `400` invalid JSON), while a pair is
/// copied.
#[test]
fn a_lone_escaped_surrogate_is_refused_and_a_pair_copied() {
    for lone in [
        r#""\ud800""#,
        r#""a\uDC00b""#,
        r#"[{"role":"user","content":"\ud83d"}]"#,
    ] {
        let body = format!(r#"{{"model":"m","input":{lone}}}"#);
        assert!(serde_json::from_str::<Value>(&body).is_err(), "{body}");
        let refused = Translated::from_slice(body.as_bytes()).expect_err(&body);
        assert!(refused.field.is_empty(), "{body}: {refused:?}");
    }
    let body = br#"{"model":"m","instructions":"\ud83d\ude00 \\ud800","input":[{"role":"user","content":"\uD83D\uDE00"}]}"#;
    let translated = Translated::from_slice(body).unwrap();
    let chat = String::from_utf8(translated.chat_body("m")).unwrap();
    assert!(chat.contains(r#""\ud83d\ude00 \\ud800""#), "{chat}");
    assert!(chat.contains(r#""\uD83D\uDE00""#), "{chat}");
    readings_agree(body);
}

/// A string kept as written is refused where reading it refuses it (a lone escaped
/// surrogate), short or long (the two are searched differently), and otherwise kept.
#[test]
fn a_raw_string_is_refused_as_reading_it_is() {
    let long = "x\\n".repeat(100);
    for text in [
        "",
        "caf\\u00e9",
        "\\\\ud800",
        "\\ud83d\\ude00",
        "\\ud800",
        "a\\uDFFFb",
    ] {
        for text in [text.to_owned(), format!("{long}{text}{long}")] {
            let literal = format!("\"{text}\"");
            let raw: Box<RawValue> = serde_json::from_str(&literal).unwrap();
            let read = serde_json::from_str::<String>(&literal);
            let kept = RawStr::of_string(&raw);
            assert_eq!(kept.is_ok(), read.is_ok(), "{literal}");
            if let Ok(kept) = kept {
                assert_eq!(kept.escaped(), text);
            }
        }
    }
}

/// Codex's default request: a function tool, a namespace of function tools and web search.
/// Web search dropped, it is named, and the rest translates as without it, the namespace's
/// tools under flat names; refused (and by default, for an embedder's own
/// `Translated::from_slice`), it is named.
#[test]
fn built_in_tools_are_dropped_and_named_or_refused() {
    use crate::protocol::BuiltinTools;
    let with = json!({
        "model": "m",
        "input": "Hi",
        "tools": [
            { "type": "function", "name": "shell", "parameters": { "type": "object" } },
            { "type": "namespace", "name": "multi_agent_v1", "tools": [
                { "type": "function", "name": "spawn_agent", "parameters": { "type": "object" } }
            ] },
            { "type": "web_search", "external_web_access": false },
        ],
    });
    let body = serde_json::to_vec(&with).unwrap();
    let dropped = Translated::from_slice_with(&body, BuiltinTools::Drop).unwrap();
    assert_eq!(dropped.dropped_tools(), ["web_search"]);
    assert_eq!(
        dropped.unflatten("multi_agent_v1__spawn_agent"),
        Some(("multi_agent_v1", "spawn_agent"))
    );
    let without = json!({
        "model": "m",
        "input": "Hi",
        "tools": [
            { "type": "function", "name": "shell", "parameters": { "type": "object" } },
            { "type": "function", "name": "multi_agent_v1__spawn_agent", "parameters": { "type": "object" } },
        ],
    });
    assert_eq!(
        outcome(Ok(dropped)).unwrap().0,
        outcome(Translated::new(without)).unwrap().0
    );
    for refused in [
        Translated::from_slice_with(&body, BuiltinTools::Refuse),
        Translated::from_slice(&body),
        Translated::new(with),
    ] {
        assert_eq!(refused.unwrap_err().field, "tools[2].type");
    }
    let plain = Translated::from_slice_with(br#"{"model":"m","input":"Hi"}"#, BuiltinTools::Drop);
    assert!(plain.unwrap().dropped_tools().is_empty());
}
