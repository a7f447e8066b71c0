//! Upstreams on a cloud platform that hosts a provider's models under its own paths and
//! credentials ([`Hosting`](crate::catalogue::Hosting)): where a call goes, how it is
//! authorised (Bedrock's AWS Signature Version 4 or API key, Vertex AI's service-account
//! access tokens), and, for Bedrock, its event-stream replies decoded into the server-sent
//! events the provider's own API sends. What the body looks like on each platform is the
//! protocol's to say ([`UpstreamDialect::hosted_body`](crate::protocol::dialect::UpstreamDialect)).

#[cfg(feature = "bedrock")]
mod bedrock;
#[cfg(feature = "bedrock")]
mod event_stream;
#[cfg(feature = "vertex")]
mod vertex;

use crate::catalogue::{Hosting, UpstreamConfig};
use crate::protocol::HostedOn;
use crate::reply::EventStream;

/// The credentials and paths of a hosted upstream, made with its channel.
pub(super) enum Hosted {
    #[cfg(feature = "bedrock")]
    Bedrock(bedrock::Bedrock),
    #[cfg(feature = "vertex")]
    Vertex(vertex::Vertex),
}

impl std::fmt::Debug for Hosted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the credentials.
        f.write_str("Hosted")
    }
}

impl Hosted {
    /// The platform of `config` with its credentials read (from `key_for`'s variables, or the
    /// service account's file); `None` for an upstream on its provider's own API (or a
    /// platform this build leaves out, which the catalogue refused).
    pub(super) fn new(
        config: &UpstreamConfig,
        key_for: &(dyn Fn(&str) -> Option<String> + Send + Sync),
        client: &reqwest::Client,
    ) -> Option<Hosted> {
        let _ = (key_for, client);
        match &config.hosting {
            Hosting::Direct => None,
            #[cfg(feature = "bedrock")]
            Hosting::Bedrock(settings) => Some(Hosted::Bedrock(bedrock::Bedrock::new(
                &config.name,
                settings,
                &config.api_key_env,
                key_for,
            ))),
            #[cfg(feature = "vertex")]
            Hosting::Vertex(settings) => Some(Hosted::Vertex(vertex::Vertex::new(
                &config.name,
                settings,
                key_for,
                client.clone(),
            ))),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// Whether `other` holds the same credentials (a reload that kept them keeps this one,
    /// and with it a token already fetched).
    pub(super) fn same_credentials(&self, other: &Hosted) -> bool {
        match (self, other) {
            #[cfg(feature = "bedrock")]
            (Hosted::Bedrock(one), Hosted::Bedrock(other)) => one.same_credentials(other),
            #[cfg(feature = "vertex")]
            (Hosted::Vertex(one), Hosted::Vertex(other)) => one.same_credentials(other),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The platform, for the body and headers its protocol sends there.
    pub(super) fn on(&self) -> HostedOn {
        match *self {
            #[cfg(feature = "bedrock")]
            Hosted::Bedrock(_) => HostedOn::Bedrock,
            #[cfg(feature = "vertex")]
            Hosted::Vertex(_) => HostedOn::Vertex,
        }
    }

    /// Where a call on `model` goes, after the upstream's base URL.
    pub(super) fn call_path(&self, model: &str, stream: bool) -> String {
        let _ = (model, stream);
        match *self {
            #[cfg(feature = "bedrock")]
            Hosted::Bedrock(_) => bedrock::call_path(model, stream),
            #[cfg(feature = "vertex")]
            Hosted::Vertex(ref vertex) => vertex.call_path(model, stream),
        }
    }

    /// Adds the credentials to `request`, whole but for them: a signature over it, or a
    /// token. A failure says why, without a secret in it.
    pub(super) async fn authorize(&self, request: &mut reqwest::Request) -> Result<(), String> {
        let _ = &request;
        match *self {
            #[cfg(feature = "bedrock")]
            Hosted::Bedrock(ref bedrock) => bedrock.authorize(request),
            #[cfg(feature = "vertex")]
            Hosted::Vertex(ref vertex) => vertex.authorize(request).await,
        }
    }

    /// The platform refused the credentials a call carried: a token it no longer takes is
    /// fetched again for the next call.
    pub(super) fn refused(&self, request_token: Option<&http::HeaderValue>) {
        let _ = request_token;
        match *self {
            #[cfg(feature = "bedrock")]
            Hosted::Bedrock(_) => {}
            #[cfg(feature = "vertex")]
            Hosted::Vertex(ref vertex) => vertex.forget(request_token),
        }
    }

    /// The secrets held (keys, tokens), to remove from anything the platform echoes back.
    pub(super) fn secrets(&self) -> Vec<String> {
        match *self {
            #[cfg(feature = "bedrock")]
            Hosted::Bedrock(ref bedrock) => bedrock.secrets(),
            #[cfg(feature = "vertex")]
            Hosted::Vertex(ref vertex) => vertex.secrets(),
        }
    }

    /// The content type of the platform's streamed replies.
    pub(super) fn stream_content_type(&self) -> &'static str {
        match *self {
            #[cfg(feature = "bedrock")]
            Hosted::Bedrock(_) => bedrock::STREAM_CONTENT_TYPE,
            #[cfg(feature = "vertex")]
            Hosted::Vertex(_) => "text/event-stream",
        }
    }

    /// A streamed reply's body as the server-sent events of the provider's own API: Bedrock's
    /// event-stream frames decoded, each frame's CRCs checked.
    pub(super) fn events(&self, body: EventStream, max_event: usize) -> EventStream {
        let _ = (&body, max_event);
        match *self {
            #[cfg(feature = "bedrock")]
            Hosted::Bedrock(_) => {
                http_body_util::BodyExt::boxed_unsync(event_stream::Decoded::new(body, max_event))
            }
            #[cfg(feature = "vertex")]
            Hosted::Vertex(_) => body,
        }
    }
}

#[cfg(any(feature = "bedrock", feature = "vertex"))]
/// `text` as one path segment: RFC 3986's unreserved characters and `kept` as they are, the
/// rest percent-encoded (`:` in a Bedrock model id's version, `/` in an ARN).
fn path_segment(text: &str, kept: &[u8]) -> String {
    let mut encoded = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) || kept.contains(&byte) {
            encoded.push(char::from(byte));
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    encoded
}
