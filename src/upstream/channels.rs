//! The channels of each catalogue served, by upstream name: built from the catalogue and the
//! provider keys, kept across a reload where an upstream is unchanged (its connections and its
//! breaker go on), and looked up for a call by the catalogue that routed it.

use std::collections::HashMap;
use std::sync::Arc;

use http::{HeaderMap, HeaderName, HeaderValue};

use super::breaker::CircuitBreaker;
use super::channel::{Channel, Endpoints, ReadLimits};
use super::hosted::Hosted;
use crate::catalogue::{Catalogue, ModelChannel, UpstreamConfig};

/// Where provider keys are read: the name of a variable to its value.
pub(super) type KeySource = Arc<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// The upstreams by name, as one catalogue names them.
pub(super) type Channels = HashMap<String, Arc<Channel>>;

/// How many catalogues' upstreams are kept after a reload, newest first: a call routed on an
/// older catalogue finds the upstreams it names there, as long as it lasts.
pub(super) const GENERATIONS: usize = 8;

/// The channel for `model_channel`'s upstream as the catalogue that routed the call named it
/// (newest first), or else by name in the newest catalogue (a model built outside one).
pub(super) fn channel_for<'a>(
    generations: &'a [Arc<Channels>],
    model_channel: &ModelChannel,
) -> Option<&'a Arc<Channel>> {
    let name = &model_channel.upstream.name;
    generations
        .iter()
        .filter_map(|channels| channels.get(name))
        .find(|channel| Arc::ptr_eq(&channel.config, &model_channel.upstream))
        .or_else(|| generations.first()?.get(name))
}

/// A channel for each of `catalogue`'s upstreams; one of `old` is kept where its settings and
/// key are the same.
pub(super) fn build_channels(
    catalogue: &Catalogue,
    key_for: &(dyn Fn(&str) -> Option<String> + Send + Sync),
    old: &Channels,
) -> Result<Channels, reqwest::Error> {
    let mut channels = HashMap::new();
    for config in catalogue.upstreams() {
        let secret = key_for(&config.api_key_env).filter(|key| !key.is_empty());
        let limits = ReadLimits {
            reply: catalogue.max_reply_bytes(),
            event: catalogue.max_event_bytes(),
        };
        let same_settings = old.get(&config.name).filter(|kept| {
            *kept.config == **config && kept.secret == secret && kept.limits == limits
        });
        // A client is made from the settings alone: the kept one serves equal settings.
        let client = match same_settings {
            Some(kept) => kept.client.clone(),
            None => build_client(config)?,
        };
        let hosted = Hosted::new(config, key_for, &client).map(Arc::new);
        let unchanged = same_settings.filter(|kept| match (&kept.hosted, &hosted) {
            (Some(kept), Some(new)) => kept.same_credentials(new),
            (kept, new) => kept.is_none() && new.is_none(),
        });
        if let Some(kept) = unchanged {
            // The same upstream: its connections and its breaker go on, under the new
            // catalogue's settings (equal to the old), so that its models find it.
            let channel = Channel {
                config: config.clone(),
                client: kept.client.clone(),
                api_key: kept.api_key.clone(),
                secret: kept.secret.clone(),
                breaker: kept.breaker.clone(),
                limits,
                endpoints: kept.endpoints.clone(),
                hosted: kept.hosted.clone(),
            };
            channels.insert(config.name.clone(), Arc::new(channel));
            continue;
        }
        let api_key = secret
            .as_deref()
            .filter(|_| hosted.is_none())
            .and_then(|key| {
                let value = config.kind.speaks().api_key_value(key);
                let mut value = HeaderValue::try_from(value).ok()?;
                value.set_sensitive(true);
                Some(value)
            });
        if api_key.is_none() && hosted.is_none() {
            tracing::warn!(
                upstream = %config.name,
                variable = %config.api_key_env,
                "provider key not set; this upstream will fail without being contacted"
            );
        }
        let channel = Channel {
            client,
            hosted,
            breaker: Arc::new(CircuitBreaker::new(
                config.breaker_failures,
                config.breaker_cooldown,
            )),
            config: config.clone(),
            api_key,
            secret,
            limits,
            endpoints: Endpoints::of(config),
        };
        channels.insert(config.name.clone(), Arc::new(channel));
    }
    Ok(channels)
}

fn build_client(config: &UpstreamConfig) -> Result<reqwest::Client, reqwest::Error> {
    let mut default_headers = HeaderMap::new();
    for (name, value) in &config.headers {
        // Validated when the catalogue was loaded.
        if let (Ok(name), Ok(value)) = (
            HeaderName::try_from(name.as_str()),
            HeaderValue::try_from(value.as_str()),
        ) {
            default_headers.append(name, value);
        }
    }
    // No client-wide time-out: each request sets its own, and a streamed one none (see
    // `Channel::attempt`).
    let mut builder = reqwest::Client::builder()
        .connect_timeout(config.connect_timeout)
        .default_headers(default_headers)
        // A redirected POST would be replayed as a GET elsewhere: treat it as a failure.
        .redirect(reqwest::redirect::Policy::none());
    if let Some(proxy) = &config.proxy {
        builder = builder.proxy(reqwest::Proxy::all(proxy)?);
    }
    builder.build()
}
