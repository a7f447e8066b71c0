//! Anthropic's messages where a cloud platform hosts Claude: the model named in the path, not
//! the body; the API version in the body (`bedrock-2023-05-31`, `vertex-2023-10-16`), not a
//! header; on Bedrock the beta flags in the body too (`anthropic_beta`) and no `stream` field
//! (the path says it).

use bytes::Bytes;
use http::HeaderMap;
use serde_json::{Map, Value};

use crate::protocol::HostedOn;

/// The `anthropic_version` each platform takes.
fn version(on: HostedOn) -> &'static str {
    match on {
        HostedOn::Bedrock => "bedrock-2023-05-31",
        HostedOn::Vertex => "vertex-2023-10-16",
    }
}

/// The body a platform takes for a messages request `body` (the body Anthropic's own API
/// takes); `None` where `body` is not a JSON object (the provider then says what is wrong).
pub(super) fn body(body: &[u8], on: HostedOn, client_headers: &HeaderMap) -> Option<Bytes> {
    let mut object: Map<String, Value> = serde_json::from_slice(body).ok()?;
    object.remove("model");
    object.insert("anthropic_version".to_owned(), version(on).into());
    if on == HostedOn::Bedrock {
        object.remove("stream");
        let mut betas: Vec<Value> = match object.remove("anthropic_beta") {
            Some(Value::Array(betas)) => betas,
            _ => Vec::new(),
        };
        let flags = client_headers
            .get_all("anthropic-beta")
            .iter()
            .filter_map(|value| value.to_str().ok())
            .flat_map(|value| value.split(','))
            .map(str::trim)
            .filter(|flag| !flag.is_empty());
        for flag in flags {
            if !betas.iter().any(|beta| beta == flag) {
                betas.push(flag.into());
            }
        }
        if !betas.is_empty() {
            object.insert("anthropic_beta".to_owned(), Value::Array(betas));
        }
    }
    serde_json::to_vec(&object).ok().map(Bytes::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sent(on: HostedOn, headers: &HeaderMap) -> Value {
        let request = br#"{"model":"claude","max_tokens":5,"stream":true,"messages":[]}"#;
        let sent = body(request, on, headers).expect("an object");
        serde_json::from_slice(&sent).expect("JSON")
    }

    #[test]
    fn bedrock_takes_its_version_and_the_beta_flags_in_the_body_and_no_model_or_stream() {
        let mut headers = HeaderMap::new();
        headers.insert("anthropic-beta", "a-1, b-2".parse().expect("header"));
        let sent = sent(HostedOn::Bedrock, &headers);
        assert_eq!(sent["anthropic_version"], "bedrock-2023-05-31");
        assert_eq!(sent["anthropic_beta"], serde_json::json!(["a-1", "b-2"]));
        assert!(sent.get("model").is_none() && sent.get("stream").is_none());
        assert_eq!(sent["max_tokens"], 5);
    }

    #[test]
    fn vertex_takes_its_version_in_the_body_and_keeps_the_stream_flag() {
        let sent = sent(HostedOn::Vertex, &HeaderMap::new());
        assert_eq!(sent["anthropic_version"], "vertex-2023-10-16");
        assert_eq!(sent["stream"], true);
        assert!(sent.get("model").is_none() && sent.get("anthropic_beta").is_none());
    }

    #[test]
    fn a_body_that_is_no_object_is_left_to_the_provider() {
        assert!(body(b"[1]", HostedOn::Vertex, &HeaderMap::new()).is_none());
    }
}
