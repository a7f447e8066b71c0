//! Unit tests of the router.

use super::*;

fn route_chat(body: &str) -> Result<RoutedCall, GatewayError> {
    route(
        &Catalogue::demo(),
        Protocol::ChatCompletions,
        body.as_bytes(),
        false,
    )
}

fn route_messages(body: &str) -> Result<RoutedCall, GatewayError> {
    route(
        &Catalogue::demo(),
        Protocol::Messages,
        body.as_bytes(),
        false,
    )
}

#[test]
fn with_streaming_on_stream_true_is_routed_and_marked() {
    let body = br#"{"model":"gpt-4o-mini","messages":[],"stream":true}"#;
    let catalogue = Catalogue::demo();
    let routed = route(&catalogue, Protocol::ChatCompletions, body, true).unwrap();
    assert!(routed.stream);
    let plain = br#"{"model":"gpt-4o-mini","messages":[],"stream":false}"#;
    assert!(
        !route(&catalogue, Protocol::ChatCompletions, plain, true)
            .unwrap()
            .stream
    );
    let wrong = br#"{"model":"gpt-4o-mini","messages":[],"stream":1}"#;
    assert_eq!(
        route(&catalogue, Protocol::ChatCompletions, wrong, true).unwrap_err(),
        GatewayError::InvalidStreamField
    );
}

#[test]
fn a_chat_request_resolves_its_model_and_price() {
    let routed =
        route_chat(r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}"#)
            .unwrap();
    assert_eq!(routed.model.name, "gpt-4o-mini");
    assert_eq!(routed.model.pricing.per_call.get(), 2);
}

#[test]
fn malformed_requests_get_a_precise_400() {
    let cases = [
        ("not json", GatewayError::InvalidJson),
        (r#"[{"model":"gpt-4o-mini"}]"#, GatewayError::InvalidJson),
        (
            r#"{"model":"gpt-4o-mini","messages":[]"#,
            GatewayError::InvalidJson,
        ),
        (r#"{"messages":[]}"#, GatewayError::InvalidModelField),
        (
            r#"{"model":7,"messages":[]}"#,
            GatewayError::InvalidModelField,
        ),
        (
            r#"{"model":"gpt-4o-mini"}"#,
            GatewayError::InvalidMessagesField,
        ),
        (
            r#"{"model":"gpt-4o-mini","messages":"hi"}"#,
            GatewayError::InvalidMessagesField,
        ),
        (
            r#"{"model":"gpt-4o-mini","messages":[],"stream":true}"#,
            GatewayError::StreamingUnsupported,
        ),
        (
            r#"{"model":"gpt-4o-mini","messages":[],"stream":"yes"}"#,
            GatewayError::InvalidStreamField,
        ),
    ];
    for (body, expected) in cases {
        assert_eq!(route_chat(body).unwrap_err(), expected, "{body}");
    }
}

#[test]
fn messages_requires_a_positive_max_tokens() {
    let model = "claude-haiku-4-5";
    for max_tokens in ["", r#","max_tokens":0"#, r#","max_tokens":"10""#] {
        let body = format!(r#"{{"model":"{model}","messages":[]{max_tokens}}}"#);
        assert_eq!(
            route_messages(&body).unwrap_err(),
            GatewayError::InvalidMaxTokens
        );
    }
    let body = format!(r#"{{"model":"{model}","messages":[],"max_tokens":5}}"#);
    assert!(route_messages(&body).is_ok());
}

#[test]
fn a_model_of_the_other_protocol_is_not_found_on_either_endpoint() {
    let messages_model = r#"{"model":"claude-haiku-4-5","max_tokens":5,"messages":[]}"#;
    assert_eq!(
        route_chat(messages_model).unwrap_err(),
        GatewayError::ModelNotFound
    );
    let chat_model = r#"{"model":"gpt-4o-mini","max_tokens":5,"messages":[]}"#;
    assert_eq!(
        route_messages(chat_model).unwrap_err(),
        GatewayError::ModelNotFound
    );
    let unknown = r#"{"model":"no-such-model","messages":[]}"#;
    assert_eq!(
        route_chat(unknown).unwrap_err(),
        GatewayError::ModelNotFound
    );
}

#[test]
fn a_model_is_not_found_on_an_endpoint_it_does_not_list() {
    let catalogue = Catalogue::from_toml(
        r#"
        [[upstreams]]
        name = "openai"
        kind = "openai"
        base_url = "http://127.0.0.1:9/v1"
        api_key_env = "OPENAI_API_KEY"

        [[models]]
        name = "chat-only"
        protocol = "chat_completions"
        endpoints = ["chat_completions"]
        price = 1
        upstream = "openai"
        "#,
    )
    .unwrap();
    let chat = br#"{"model":"chat-only","messages":[]}"#;
    assert!(route(&catalogue, Protocol::ChatCompletions, chat, false).is_ok());
    let responses = br#"{"model":"chat-only","input":"hi"}"#;
    assert_eq!(
        route(&catalogue, Protocol::Responses, responses, false).unwrap_err(),
        GatewayError::ModelNotFound
    );
}

#[test]
fn malformed_is_reported_before_an_unknown_model() {
    let body = r#"{"model":"no-such-model","messages":[],"stream":true}"#;
    assert_eq!(
        route_chat(body).unwrap_err(),
        GatewayError::StreamingUnsupported
    );
}

#[test]
fn an_escaped_model_name_still_resolves() {
    let routed = route_chat(r#"{"model":"gpt\u002d4o-mini","messages":[]}"#).unwrap();
    assert_eq!(routed.model.name, "gpt-4o-mini");
}

#[test]
fn upstream_model_renames_only_the_model_value() {
    let body = Bytes::from_static(
        br#"{ "temperature" : 0.70, "model" : "house-chat", "messages":[{"x":1e3}] }"#,
    );
    let routed = route_chat(std::str::from_utf8(&body).unwrap()).unwrap();
    let upstream_model = routed.model.channels[0].upstream_model.as_deref();
    assert_eq!(
        routed.upstream_body(&body, upstream_model),
        Bytes::from_static(
            br#"{ "temperature" : 0.70, "model" : "qwen2.5-7b-instruct", "messages":[{"x":1e3}] }"#
        )
    );
}

#[test]
fn without_upstream_model_the_body_is_forwarded_as_is() {
    let body = Bytes::from_static(br#"{"model":"gpt-4o-mini","messages":[],"n":1.0}"#);
    let routed = route_chat(std::str::from_utf8(&body).unwrap()).unwrap();
    assert_eq!(routed.model.channels[0].upstream_model, None);
    assert_eq!(routed.upstream_body(&body, None), body);
}

/// A Responses body the envelope reads but that is not JSON when read whole (a number out of
/// range, which the envelope skips) is refused as not JSON, as a chat body is; a field that does
/// not translate is refused by name.
#[test]
fn a_responses_body_found_not_json_by_its_translation_is_invalid_json() {
    let responses = |body: &str| {
        route(
            &Catalogue::demo(),
            Protocol::Responses,
            body.as_bytes(),
            false,
        )
    };
    let out_of_range = [
        r#"{"model":"gpt-4o-mini","input":"Hi","temperature":1e400,"temperature":1}"#,
        r#"{"model":"gpt-4o-mini","input":"Hi","instructions":5,"top_p":-1e999}"#,
    ];
    for body in out_of_range {
        assert!(
            matches!(responses(body), Err(GatewayError::InvalidJson)),
            "{body}: {:?}",
            responses(body)
        );
    }
    let refused = responses(r#"{"model":"gpt-4o-mini","input":"Hi","background":true}"#);
    assert!(
        matches!(&refused, Err(GatewayError::UnsupportedField { field, .. }) if field == "background"),
        "{refused:?}"
    );
    assert!(responses(r#"{"model":"gpt-4o-mini","input":"Hi","temperature":0.5}"#).is_ok());
}

/// A body that is not UTF-8 is refused `400` invalid JSON on every endpoint, before its model
/// is looked up, and the same body with the character whole is routed.
#[test]
fn a_body_that_is_not_utf8_is_invalid_json() {
    let cases = [
        (
            Protocol::ChatCompletions,
            r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"café"}]}"#,
        ),
        (
            Protocol::Responses,
            r#"{"model":"gpt-4o-mini","input":[{"role":"user","content":"café"}]}"#,
        ),
        (
            Protocol::Responses,
            r#"{"model":"gpt-4o-mini","input":"café"}"#,
        ),
    ];
    for (protocol, body) in cases {
        assert!(
            route(&Catalogue::demo(), protocol, body.as_bytes(), false).is_ok(),
            "{body}"
        );
        // `é` cut to its first byte.
        let mut broken = body.as_bytes().to_vec();
        broken.remove(body.find('é').unwrap() + 1);
        assert!(std::str::from_utf8(&broken).is_err());
        assert_eq!(
            route(&Catalogue::demo(), protocol, &broken, false).err(),
            Some(GatewayError::InvalidJson),
            "{body}"
        );
    }
}

/// The router reads a Responses request's `store` as the upstream would read it from the body
/// (whether a native upstream's response is recorded), so the upstream need not read the body
/// again; a request the router's reading does not take is left to the upstream's.
#[test]
fn a_responses_requests_store_is_read_as_the_upstream_reads_it() {
    let catalogue = Catalogue::from_toml(
        "[[upstreams]]\nname = \"openai\"\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:9/v1\"\n\
         api_key_env = \"K\"\nresponses = \"native\"\n\
         [[models]]\nname = \"m\"\nprotocol = \"chat_completions\"\nprice = 1\nupstream = \"openai\"\n",
    )
    .unwrap();
    let read_by_the_router = [
        r#"{"model":"m","input":"Hi"}"#,
        r#"{"model":"m","input":"Hi","store":true}"#,
        r#"{"model":"m","input":"Hi","store":false}"#,
        r#"{"model":"m","store": false ,"input":[{"role":"user","content":"Hi"}]}"#,
        r#"{"model":"m","input":"Hi","store":null}"#,
        r#"{"model":"m","input":"Hi","store":"false"}"#,
        r#"{"model":"m","input":"Hi","store":0}"#,
    ];
    let mut kept = 0;
    for body in read_by_the_router {
        let routed = route(&catalogue, Protocol::Responses, body.as_bytes(), false).unwrap();
        let expected = crate::protocol::responses::kept_by_provider(body.as_bytes());
        // A body that reads the other way: the answer must be the router's.
        let decoy: &[u8] = if expected {
            br#"{"store":false}"#
        } else {
            b"{}"
        };
        assert_eq!(routed.kept_by_provider(decoy), expected, "{body}");
        kept += usize::from(expected);
    }
    assert_eq!(kept, 5);
    // A field the translation's reading does not know: a native model takes it, and the
    // upstream reads `store` from the body.
    let odd = br#"{"model":"m","input":"Hi","store":false,"future_field":1}"#;
    let routed = route(&catalogue, Protocol::Responses, odd, false).unwrap();
    assert!(!routed.kept_by_provider(odd));
    assert!(routed.kept_by_provider(b"{}"));
}
