//! Amazon Bedrock: Anthropic's models at `/model/{model id}/invoke` and
//! `/invoke-with-response-stream`, each request signed with AWS Signature Version 4 (by the AWS
//! SDK's own signer, `aws-sigv4`) from the credentials in the environment, or carrying a
//! Bedrock API key (`Authorization: Bearer`) when its variable is set.

use std::time::SystemTime;

use aws_credential_types::Credentials;
use aws_sigv4::http_request::{SignableBody, SignableRequest, SigningSettings, sign};
use aws_sigv4::sign::v4;
use aws_smithy_runtime_api::client::identity::Identity;
use http::HeaderValue;

use crate::catalogue::BedrockSettings;

/// The content type of Bedrock's streamed replies: AWS's binary event-stream framing.
pub(super) const STREAM_CONTENT_TYPE: &str = "application/vnd.amazon.eventstream";

/// The signing name of Bedrock's runtime API.
const SERVICE: &str = "bedrock";

pub(in crate::upstream) struct Bedrock {
    region: String,
    access: Access,
}

/// How the calls are authorised.
enum Access {
    /// A Bedrock API key, as the `Authorization` header.
    ApiKey { header: HeaderValue, key: String },
    /// AWS credentials every request is signed with.
    Signed(Identity, Credentials),
    /// Neither is set: the channel fails without being contacted, saying which variables.
    Missing(String),
}

impl Bedrock {
    /// Reads the API key variable, else the credential variables `settings` names.
    pub(super) fn new(
        upstream: &str,
        settings: &BedrockSettings,
        api_key_env: &str,
        key_for: &(dyn Fn(&str) -> Option<String> + Send + Sync),
    ) -> Bedrock {
        let read = |variable: &str| key_for(variable).filter(|value| !value.is_empty());
        let api_key = read(api_key_env).and_then(|key| {
            let mut header = HeaderValue::try_from(format!("Bearer {key}")).ok()?;
            header.set_sensitive(true);
            Some(Access::ApiKey { header, key })
        });
        let keys = || {
            let id = read(&settings.access_key_id_env)?;
            let secret = read(&settings.secret_access_key_env)?;
            let token = read(&settings.session_token_env);
            let credentials = Credentials::new(id, secret, token, None, "environment");
            Some(Access::Signed(credentials.clone().into(), credentials))
        };
        let access = api_key.or_else(keys).unwrap_or_else(|| {
            let why = format!(
                "no Bedrock credentials: set {api_key_env} (an API key), or {} and {}",
                settings.access_key_id_env, settings.secret_access_key_env
            );
            tracing::warn!(
                upstream,
                "{why}; this upstream will fail without being contacted"
            );
            Access::Missing(why)
        });
        Bedrock {
            region: settings.region.clone(),
            access,
        }
    }

    pub(super) fn same_credentials(&self, other: &Bedrock) -> bool {
        self.region == other.region && self.secrets() == other.secrets()
    }

    pub(super) fn secrets(&self) -> Vec<String> {
        match &self.access {
            Access::ApiKey { key, .. } => vec![key.clone()],
            Access::Signed(_, credentials) => {
                let mut secrets = vec![
                    credentials.access_key_id().to_owned(),
                    credentials.secret_access_key().to_owned(),
                ];
                secrets.extend(credentials.session_token().map(str::to_owned));
                secrets
            }
            Access::Missing(_) => Vec::new(),
        }
    }

    /// Signs `request` (its method, URL, headers and body, as sent), or adds the API key.
    pub(super) fn authorize(&self, request: &mut reqwest::Request) -> Result<(), String> {
        let identity = match &self.access {
            Access::ApiKey { header, .. } => {
                request
                    .headers_mut()
                    .insert(http::header::AUTHORIZATION, header.clone());
                return Ok(());
            }
            Access::Missing(why) => return Err(why.clone()),
            Access::Signed(identity, _) => identity,
        };
        let params = v4::SigningParams::builder()
            .identity(identity)
            .region(&self.region)
            .name(SERVICE)
            .time(SystemTime::now())
            .settings(SigningSettings::default())
            .build()
            .map_err(|error| format!("could not sign the request: {error}"))?
            .into();
        let body = request
            .body()
            .and_then(reqwest::Body::as_bytes)
            .unwrap_or_default();
        let headers = request
            .headers()
            .iter()
            .filter_map(|(name, value)| Some((name.as_str(), value.to_str().ok()?)));
        let signable = SignableRequest::new(
            request.method().as_str(),
            request.url().as_str(),
            headers,
            SignableBody::Bytes(body),
        )
        .map_err(|error| format!("could not sign the request: {error}"))?;
        let (instructions, _) = sign(signable, &params)
            .map_err(|error| format!("could not sign the request: {error}"))?
            .into_parts();
        let (headers, _) = instructions.into_parts();
        for header in headers {
            let mut value = HeaderValue::try_from(header.value())
                .map_err(|_| "the signature is not a header value".to_owned())?;
            value.set_sensitive(header.sensitive());
            request.headers_mut().insert(header.name(), value);
        }
        Ok(())
    }
}

/// The path of a call on `model` (a model id, an inference profile's id or ARN), encoded as a
/// path segment.
pub(super) fn call_path(model: &str, stream: bool) -> String {
    let verb = if stream {
        "invoke-with-response-stream"
    } else {
        "invoke"
    };
    format!("/model/{}/{verb}", super::path_segment(model, b""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_id_is_one_encoded_path_segment() {
        assert_eq!(
            call_path("anthropic.claude-sonnet-4-5-20250929-v1:0", false),
            "/model/anthropic.claude-sonnet-4-5-20250929-v1%3A0/invoke"
        );
        assert_eq!(
            call_path("arn:aws:bedrock:us-east-1:1:inference-profile/us.x", true),
            "/model/arn%3Aaws%3Abedrock%3Aus-east-1%3A1%3Ainference-profile%2Fus.x/invoke-with-response-stream"
        );
    }
}
