//! The catalogue as the operator sees it: what serves now (`GET /admin/catalogue`), and a
//! reload (`POST /admin/catalogue/reload`), refused whole with the message a start would give.

use serde_json::{Value, json};

use super::{Admin, AdminError};
use crate::catalogue::{Catalogue, ResponsesRoute};
use crate::error::{ErrorBody, GatewayError};
use crate::store::Store;

/// The catalogue served: its models (name, protocol, prices, aliases, channels), its upstreams
/// (never their keys) and the settings of the whole gateway.
pub fn catalogue_view(catalogue: &Catalogue) -> Value {
    let mut models: Vec<_> = catalogue.models().collect();
    models.sort_by(|a, b| a.name.cmp(&b.name));
    let models: Vec<Value> = models
        .into_iter()
        .map(|model| {
            let channels: Vec<Value> = model
                .channels
                .iter()
                .map(|channel| {
                    json!({
                        "upstream": channel.upstream.name,
                        "upstream_model": channel.upstream_model,
                        "priority": channel.priority,
                        "weight": channel.weight,
                    })
                })
                .collect();
            let mut item = json!({
                "name": model.name,
                "protocol": model.protocol,
                "price": model.pricing.per_call,
                "aliases": model.aliases,
                "endpoints": model.endpoints,
                "channels": channels,
            });
            if let Some(tokens) = model.pricing.tokens {
                item["token_prices"] = json!(tokens);
                item["max_output_tokens"] = json!(model.max_output_tokens);
            }
            item
        })
        .collect();
    let upstreams: Vec<Value> = catalogue
        .upstreams()
        .iter()
        .map(|upstream| {
            json!({
                "name": upstream.name,
                "kind": upstream.kind_name(),
                "base_url": upstream.base_url,
                "api_key_env": upstream.api_key_env,
                "responses": match upstream.responses {
                    ResponsesRoute::Translate => "translate",
                    ResponsesRoute::Native => "native",
                },
            })
        })
        .collect();
    json!({
        "models": models,
        "upstreams": upstreams,
        "streaming": catalogue.streaming(),
        "error_body": match catalogue.error_body() {
            ErrorBody::Detail => "detail",
            _ => "compatible",
        },
        "call_deadline_secs": catalogue.call_deadline().as_secs_f64(),
    })
}

impl<S: Store> Admin<S> {
    /// The catalogue served now ([`catalogue_view`]); `404` on an admin without one.
    pub fn catalogue(&self) -> Result<Value, AdminError> {
        let catalogue = self.catalogue.as_ref().ok_or(GatewayError::UnknownPath)?;
        Ok(catalogue_view(&catalogue.current()))
    }

    /// Reads the catalogue again and serves it, or refuses it (`400` with the message a start
    /// would give) and keeps serving the one before; answers what serves now.
    pub async fn reload_catalogue(&self) -> Result<Value, AdminError> {
        let reloader = self
            .reloader
            .as_ref()
            .ok_or(GatewayError::InvalidCatalogue(
                "this gateway has no catalogue source to reload from".into(),
            ))?;
        match reloader.reload().await {
            Ok(catalogue) => Ok(catalogue_view(&catalogue)),
            Err(refused) => {
                tracing::warn!(error = %refused, "catalogue reload refused; the old one serves on");
                Err(GatewayError::InvalidCatalogue(refused.to_string()).into())
            }
        }
    }
}
