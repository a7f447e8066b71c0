use super::*;
use crate::protocol::reader::StreamReader;
use crate::protocol::reply_usage;

#[test]
fn the_path_names_the_model_and_the_verb_on_v1beta_and_v1() {
    assert_eq!(
        path_call("/v1beta/models/gemini-2.5-flash:generateContent"),
        Some(PathCall {
            model: "gemini-2.5-flash",
            stream: false
        })
    );
    assert_eq!(
        path_call("/v1/models/gpt-4o-mini:streamGenerateContent"),
        Some(PathCall {
            model: "gpt-4o-mini",
            stream: true
        })
    );
    for not_a_call in [
        "/v1beta/models/gemini-2.5-flash:countTokens",
        "/v1beta/models/gemini-2.5-flash",
        "/v1beta/models/:generateContent",
        "/v1beta/models/a/b:generateContent",
        "/v1beta/tunedModels/x:generateContent",
        "/v1/chat/completions",
    ] {
        assert_eq!(path_call(not_a_call), None, "{not_a_call}");
    }
    assert!(is_gemini_path("/v1beta/models"));
    assert!(is_gemini_path("/v1/models/x:countTokens"));
    assert!(!is_gemini_path("/v1/models/gpt-4o-mini"));
    assert!(!is_gemini_path("/v1/chat/completions"));
}

fn usage(metadata: &str) -> TokenUsage {
    reply_usage(format!(r#"{{"candidates":[],"usageMetadata":{metadata}}}"#).as_bytes())
        .expect("a reply")
}

/// Google counts cached tokens inside `promptTokenCount` and thinking tokens outside
/// `candidatesTokenCount`: each kind is priced once.
#[test]
fn usage_metadata_maps_to_disjoint_kinds() {
    let read = usage(
        r#"{"promptTokenCount":1000,"cachedContentTokenCount":600,"candidatesTokenCount":40,
            "thoughtsTokenCount":25,"toolUsePromptTokenCount":7,"totalTokenCount":1072}"#,
    );
    assert_eq!(
        read,
        TokenUsage {
            input_tokens: Some(407),
            output_tokens: Some(65),
            cache_read_tokens: Some(600),
            reasoning_tokens: Some(25),
            ..TokenUsage::default()
        }
    );
    assert_eq!(read.all_input_tokens(), Some(1007));
    // Without a cache or thinking: the counts as given.
    let plain = usage(r#"{"promptTokenCount":12,"candidatesTokenCount":3,"totalTokenCount":15}"#);
    assert_eq!(
        (
            plain.input_tokens,
            plain.output_tokens,
            plain.cache_read_tokens
        ),
        (Some(12), Some(3), None)
    );
    // A chunk before any output: the prompt alone.
    let early = usage(r#"{"promptTokenCount":12}"#);
    assert_eq!((early.input_tokens, early.output_tokens), (Some(12), None));
}

#[test]
fn a_cache_beyond_the_prompt_or_a_count_that_is_none_is_not_trusted() {
    let beyond = usage(r#"{"promptTokenCount":10,"cachedContentTokenCount":20}"#);
    assert!(beyond.malformed);
    assert_eq!(beyond.input_tokens, Some(0));
    let negative = usage(r#"{"promptTokenCount":10,"candidatesTokenCount":-1}"#);
    assert!(negative.malformed);
    let text = usage(r#"{"promptTokenCount":"10"}"#);
    assert!(text.malformed);
    assert_eq!(text.input_tokens, None);
    let huge = usage(r#"{"candidatesTokenCount":9223372036854775807,"thoughtsTokenCount":1}"#);
    assert!(huge.malformed);
    assert_eq!(huge.output_tokens, None);
}

fn read_all(events: &[&str]) -> (StreamReader, Vec<EventKind>) {
    let mut reader = StreamReader::new(Protocol::Gemini).counting_output();
    let kinds = events
        .iter()
        .map(|data| reader.read(format!("data: {data}\r\n\r\n").as_bytes()))
        .collect();
    (reader, kinds)
}

#[test]
fn a_stream_is_read_chunk_by_chunk_to_its_finish_reason() {
    let (mut reader, kinds) = read_all(&[
        r#"{"candidates":[{"content":{"role":"model","parts":[{"text":""}]},"index":0}],"usageMetadata":{"promptTokenCount":9}}"#,
        r#"{"candidates":[{"content":{"role":"model","parts":[{"text":"Hello"}]},"index":0}],"usageMetadata":{"promptTokenCount":9}}"#,
        r#"{"candidates":[{"content":{"role":"model","parts":[{"functionCall":{"name":"f","args":{"a":1}}}]},"index":0}]}"#,
        r#"{"candidates":[{"content":{"role":"model","parts":[{"text":" world"}]},"finishReason":"STOP","index":0}],"usageMetadata":{"promptTokenCount":9,"candidatesTokenCount":4,"thoughtsTokenCount":2}}"#,
    ]);
    assert_eq!(
        kinds,
        [
            EventKind::Other,
            EventKind::Content,
            EventKind::Content,
            EventKind::Content
        ]
    );
    // No chunk ends the stream: Google closing it, every candidate finished, does.
    assert!(!reader.ended());
    assert!(reader.closed());
    let reported = reader.reported();
    assert_eq!(
        (reported.input_tokens, reported.output_tokens),
        (Some(9), Some(6))
    );
    // The last chunk's text is counted too: "Hello", the call, " world".
    let counted = reader.counted_output().expect("counted");
    let expected = crate::protocol::tokens::counted_text_tokens("Hellof{\"a\":1} world");
    assert_eq!(counted, expected);
}

/// Two candidates finishing in different chunks: the stream ends at its close only once both
/// have; closed before, it was cut.
#[test]
fn a_stream_ends_at_its_close_once_every_candidate_seen_has_finished() {
    let one = r#"{"candidates":[{"content":{"parts":[{"text":"a"}]},"index":0},{"content":{"parts":[{"text":"b"}]},"index":1}]}"#;
    let first_done =
        r#"{"candidates":[{"content":{"parts":[{"text":"."}]},"finishReason":"STOP","index":0}]}"#;
    let second_done =
        r#"{"candidates":[{"content":{"parts":[{"text":"!"}]},"finishReason":"STOP","index":1}]}"#;
    let (mut cut, _) = read_all(&[one, first_done]);
    assert!(!cut.closed(), "candidate 1 never finished");
    let (mut whole, _) = read_all(&[one, first_done, second_done]);
    assert!(whole.closed());
    let (mut nothing, _) = read_all(&[one]);
    assert!(!nothing.closed());
}

#[test]
fn an_error_object_in_the_stream_is_a_failure_and_a_blocked_prompt_an_end() {
    let (_, kinds) =
        read_all(&[r#"{"error":{"code":500,"message":"Internal error","status":"INTERNAL"}}"#]);
    assert_eq!(
        kinds,
        [EventKind::Error("INTERNAL: Internal error".to_owned())]
    );
    let (mut reader, kinds) = read_all(&[
        r#"{"promptFeedback":{"blockReason":"SAFETY"},"usageMetadata":{"promptTokenCount":5}}"#,
    ]);
    assert_eq!(kinds, [EventKind::Other]);
    assert!(reader.closed(), "a blocked prompt is a whole reply");
    assert_eq!(reader.reported().input_tokens, Some(5));
}

#[test]
fn the_gateways_error_event_is_googles_error_object() {
    let event = Gemini.error_event(&GatewayError::UpstreamUnavailable, 0);
    let text = std::str::from_utf8(&event).expect("text");
    let data = text
        .strip_prefix("data: ")
        .and_then(|rest| rest.strip_suffix("\r\n\r\n"))
        .expect("one event");
    let error: serde_json::Value = serde_json::from_str(data).expect("JSON");
    assert_eq!(
        error,
        serde_json::json!({"error": {"code": 502, "message": "上游服务暂时不可用", "status": "UNAVAILABLE"}})
    );
}

#[test]
fn the_envelope_reads_the_path_and_checks_contents_then_streaming() {
    let path = "/v1beta/models/m:streamGenerateContent";
    let body = br#"{"contents":[{"parts":[{"text":"hi"}]}]}"#;
    let envelope = Gemini.envelope_at(path, body, true).expect("a call");
    assert_eq!((envelope.model.name.as_ref(), envelope.stream), ("m", true));
    assert!(envelope.model.raw.is_none());
    assert_eq!(
        Gemini.envelope_at(path, body, false).err(),
        Some(GatewayError::StreamingUnsupported)
    );
    assert_eq!(
        Gemini.envelope_at(path, b"[1]", true).err(),
        Some(GatewayError::InvalidJson)
    );
    let refused = Gemini.envelope_at(path, br#"{"contents":{}}"#, true).err();
    assert!(
        matches!(&refused, Some(GatewayError::InvalidField { field, .. }) if field == "contents"),
        "{refused:?}"
    );
    // Without its path, a body alone is no Gemini call.
    assert_eq!(
        Gemini.envelope(body, true).err(),
        Some(GatewayError::UnknownPath)
    );
}

#[test]
fn metering_reads_the_output_limit_for_each_candidate() {
    let path = "/v1beta/models/m:generateContent";
    let body = br#"{"contents":[],"generationConfig":{"maxOutputTokens":300,"candidateCount":2}}"#;
    let envelope = Gemini.envelope_at(path, body, false).expect("a call");
    let metering = Gemini.metering(&envelope, body).expect("metered");
    assert_eq!((metering.output_limit, metering.replies), (Some(300), 2));
    let nine = br#"{"contents":[],"generationConfig":{"candidateCount":9}}"#;
    assert!(Gemini.metering(&envelope, nine).is_err());
    let plain = br#"{"contents":[]}"#;
    let metering = Gemini.metering(&envelope, plain).expect("metered");
    assert_eq!((metering.output_limit, metering.replies), (None, 1));
}

#[test]
fn a_call_goes_to_the_upstreams_path_for_its_model_and_verb() {
    assert_eq!(
        Gemini.call_path(MODELS_PATH, "gemini-2.5-flash", false),
        Some("/v1beta/models/gemini-2.5-flash:generateContent".to_owned())
    );
    assert_eq!(
        Gemini.call_path(MODELS_PATH, "g", true),
        Some("/v1beta/models/g:streamGenerateContent?alt=sse".to_owned())
    );
    // Whatever the client speaks, a Gemini upstream takes its calls under the models' path.
    for protocol in Protocol::ALL {
        let route = protocol
            .dialect()
            .upstream(UpstreamKind::Gemini, ResponsesRoute::default());
        if protocol != Protocol::Embeddings {
            assert_eq!(
                route.map(|route| route.path),
                Some(MODELS_PATH),
                "{protocol:?}"
            );
        }
    }
    assert_eq!(
        Gemini.count_tokens_path(UpstreamKind::Gemini, "g"),
        Some("/v1beta/models/g:countTokens".to_owned())
    );
    assert_eq!(Gemini.count_tokens_path(UpstreamKind::Openai, "g"), None);
    let headers = Gemini.headers(&HeaderMap::new(), HeaderValue::from_static("sk-g"));
    assert_eq!(headers["x-goog-api-key"], "sk-g");
    assert!(!headers.contains_key(http::header::AUTHORIZATION));
}
