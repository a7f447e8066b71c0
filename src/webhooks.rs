//! Delivering webhook events: [`WebhookDispatcher`] takes the events due from the store's
//! outbox ([`EventOutbox`]), `POST`s each to the operator's endpoint, signed (see
//! [`events`](crate::events)), and records the answer: delivered on a 2xx, else tried again
//! after a backoff that doubles (5 s, 10 s, ... up to an hour), given up after
//! [`MAX_ATTEMPTS`] (an operator may retry it by hand). It runs beside the calls, never in
//! them: a receiver that is down slows no call. The outbox is in the database, so what was not
//! delivered is delivered after a restart, by whichever instance gets to it first; a delivery
//! under way when its instance died is taken again once its claim runs out. Each event is
//! claimed on its own, for as long as one attempt may take, so that in normal operation
//! (several instances, a slow receiver) every event is sent once; only an instance that dies
//! mid-attempt leaves one to be sent again. A receiver tells a repeat by the event's id.
//!
//! ```no_run
//! use std::sync::Arc;
//! use model_gateway::webhooks::WebhookDispatcher;
//! use model_gateway::SeaOrmStore;
//!
//! # async fn run() -> Result<(), tower::BoxError> {
//! let store = Arc::new(SeaOrmStore::connect("sqlite://gateway.db?mode=rwc").await?.with_webhook_events());
//! let dispatcher = WebhookDispatcher::new(store, "https://billing.example.com/hooks", "whsec_...")?;
//! let running = dispatcher.spawn();
//! # Ok(()) }
//! ```

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;

use crate::events::{SIGNATURE_HEADER, sign};
use crate::store::{Attempted, Delivery, EventOutbox, StoreError};

/// Attempts before a delivery is given up (the last about a day after the first).
pub const MAX_ATTEMPTS: u32 = 16;
/// The first retry's wait; each next one doubles, up to [`MAX_BACKOFF`].
pub const DEFAULT_BACKOFF: Duration = Duration::from_secs(5);
/// The longest wait between two attempts.
pub const MAX_BACKOFF: Duration = Duration::from_secs(3600);
/// How long an attempt may take.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// The shortest webhook secret taken.
pub const MIN_SECRET_CHARS: usize = 16;

/// Host names of cloud instances' metadata services, which hold credentials: never a webhook's.
const METADATA_HOSTS: [&str; 4] = [
    "metadata.google.internal",
    "metadata.goog",
    "metadata",
    "instance-data",
];

/// Why a webhook URL's host is refused: a link-local address (where cloud metadata services
/// answer, `169.254.169.254` and `fe80::/10`) or a metadata service's name.
fn refused_host(url: &reqwest::Url) -> Option<&'static str> {
    const LINK_LOCAL: &str =
        "the webhook URL must not point at a link-local address (a cloud metadata service)";
    let host = url.host_str()?;
    let address = host.trim_start_matches('[').trim_end_matches(']');
    match address.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V4(ip)) if ip.is_link_local() => Some(LINK_LOCAL),
        Ok(std::net::IpAddr::V6(ip))
            if (ip.segments()[0] & 0xffc0) == 0xfe80
                || ip.to_ipv4_mapped().is_some_and(|ip| ip.is_link_local()) =>
        {
            Some(LINK_LOCAL)
        }
        Ok(_) => None,
        Err(_) => {
            let name = host.trim_end_matches('.').to_ascii_lowercase();
            METADATA_HOSTS
                .contains(&name.as_str())
                .then_some("the webhook URL must not point at a cloud metadata service")
        }
    }
}

/// Deliveries attempted in one round, each claimed on its own.
pub const ROUND: u64 = 32;

/// What one round claimed and delivered.
#[derive(Debug, Default, Clone, Copy)]
struct Round {
    claimed: u64,
    delivered: usize,
}

/// Delivers the outbox's events to one endpoint; see the module docs.
#[derive(Clone)]
pub struct WebhookDispatcher {
    outbox: Arc<dyn EventOutbox>,
    url: Arc<str>,
    secret: Arc<str>,
    client: reqwest::Client,
    timeout: Duration,
    backoff: Duration,
    poll: Duration,
}

impl std::fmt::Debug for WebhookDispatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookDispatcher")
            .field("url", &self.url)
            .field("timeout", &self.timeout)
            .field("backoff", &self.backoff)
            .finish_non_exhaustive()
    }
}

impl WebhookDispatcher {
    /// Delivers `outbox`'s events to `url`, signed with `secret`. Fails on a URL that is not
    /// `http(s)://...` or an empty secret.
    pub fn new(
        outbox: Arc<dyn EventOutbox>,
        url: impl Into<String>,
        secret: impl Into<String>,
    ) -> Result<WebhookDispatcher, tower::BoxError> {
        let url = url.into();
        let parsed = reqwest::Url::parse(&url).map_err(|error| format!("webhook URL: {error}"))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err("the webhook URL must be http:// or https://".into());
        }
        if let Some(refused) = refused_host(&parsed) {
            return Err(refused.into());
        }
        let secret = secret.into();
        if secret.chars().count() < MIN_SECRET_CHARS {
            return Err(format!(
                "the webhook secret must be at least {MIN_SECRET_CHARS} characters (a signature \
                 is only as strong as its secret)"
            )
            .into());
        }
        Ok(WebhookDispatcher {
            outbox,
            url: url.into(),
            secret: secret.into(),
            client: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()?,
            timeout: DEFAULT_TIMEOUT,
            backoff: DEFAULT_BACKOFF,
            poll: Duration::from_secs(1),
        })
    }

    /// The longest one attempt may take (default [`DEFAULT_TIMEOUT`]).
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> WebhookDispatcher {
        self.timeout = timeout;
        self
    }

    /// The first retry's wait (default [`DEFAULT_BACKOFF`]).
    #[must_use]
    pub fn backoff(mut self, first: Duration) -> WebhookDispatcher {
        self.backoff = first;
        self
    }

    /// How often the outbox is looked at (default a second).
    #[must_use]
    pub fn poll_every(mut self, poll: Duration) -> WebhookDispatcher {
        self.poll = poll;
        self
    }

    /// Delivers what is due now, up to a round of [`ROUND`] events; how many were delivered.
    pub async fn deliver_due(&self) -> Result<usize, StoreError> {
        Ok(self.deliver_round().await?.delivered)
    }

    /// One round: events claimed and attempted one at a time, so that each claim's hold
    /// covers the one attempt it is for. A batch claimed under one hold and delivered one by one
    /// outlived its hold behind a slow receiver, and another instance sent the rest again.
    async fn deliver_round(&self) -> Result<Round, StoreError> {
        // Held past an attempt's time-out: another instance takes it only if this one died.
        let hold = self.timeout * 2 + Duration::from_secs(1);
        let mut round = Round::default();
        while round.claimed < ROUND {
            let Some(delivery) = self
                .outbox
                .claim_deliveries(Utc::now(), hold, 1)
                .await?
                .pop()
            else {
                break;
            };
            round.claimed += 1;
            let attempt = self.attempt(&delivery).await;
            if matches!(attempt, Attempted::Delivered { .. }) {
                round.delivered += 1;
            } else {
                tracing::warn!(event = %delivery.event_id, ?attempt, "webhook delivery failed");
            }
            self.outbox.attempted(delivery.id, &attempt).await?;
        }
        Ok(round)
    }

    /// Delivers what is due, every poll, until the task is aborted.
    pub fn spawn(self) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            loop {
                match self.deliver_round().await {
                    // More may be waiting: look again at once.
                    Ok(round) if round.claimed == ROUND => continue,
                    Ok(_) => {}
                    Err(error) => tracing::warn!(%error, "webhook outbox unavailable"),
                }
                tokio::time::sleep(self.poll).await;
            }
        })
    }

    async fn attempt(&self, delivery: &Delivery) -> Attempted {
        let timestamp = Utc::now().timestamp();
        let signature = sign(&self.secret, timestamp, delivery.body.as_bytes());
        let sent = self
            .client
            .post(&*self.url)
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(SIGNATURE_HEADER, signature)
            .header("x-gateway-event-id", &delivery.event_id)
            .timeout(self.timeout)
            .body(delivery.body.clone())
            .send()
            .await;
        let (status, error) = match sent {
            Ok(answer) if answer.status().is_success() => {
                return Attempted::Delivered {
                    status: answer.status().as_u16(),
                    at: Utc::now(),
                };
            }
            Ok(answer) => (
                Some(answer.status().as_u16()),
                format!("the endpoint answered {}", answer.status()),
            ),
            Err(error) => (None, format!("not delivered: {error}")),
        };
        let made = delivery.attempts + 1;
        let retry_at = (made < MAX_ATTEMPTS).then(|| {
            let wait = backoff(self.backoff, made);
            Utc::now() + chrono::Duration::from_std(wait).unwrap_or(chrono::Duration::MAX)
        });
        Attempted::Failed {
            status,
            error,
            retry_at,
        }
    }
}

/// The wait after the `made`th failed attempt: `first`, doubled each time, at most an hour.
fn backoff(first: Duration, made: u32) -> Duration {
    let factor = 1u32 << (made.saturating_sub(1)).min(20);
    first.saturating_mul(factor).min(MAX_BACKOFF)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dispatcher(url: &str, secret: &str) -> Result<WebhookDispatcher, tower::BoxError> {
        WebhookDispatcher::new(Arc::new(crate::MemoryStore::new()), url, secret)
    }

    #[test]
    fn a_webhook_is_never_sent_to_a_metadata_service_or_signed_with_a_short_secret() {
        let secret = "whsec_0123456789abcdef";
        for url in [
            "http://169.254.169.254/latest/meta-data/",
            "http://[fe80::1]/hooks",
            "http://[::ffff:169.254.169.254]/",
            "http://metadata.google.internal/computeMetadata/v1/",
            "http://METADATA.GOOGLE.INTERNAL./",
            "ftp://billing.example.com/hooks",
        ] {
            assert!(dispatcher(url, secret).is_err(), "{url} was taken");
        }
        for short in ["", "x", "whsec_short"] {
            let refused = dispatcher("https://billing.example.com/hooks", short);
            assert!(refused.is_err(), "{short:?}");
        }
        for url in [
            "https://billing.example.com/hooks",
            "http://127.0.0.1:9000/hooks",
            "http://10.0.0.5/h",
        ] {
            assert!(dispatcher(url, secret).is_ok(), "{url} was refused");
        }
    }

    #[test]
    fn the_wait_doubles_up_to_an_hour() {
        let first = Duration::from_secs(5);
        assert_eq!(backoff(first, 1), first);
        assert_eq!(backoff(first, 2), Duration::from_secs(10));
        assert_eq!(backoff(first, 5), Duration::from_secs(80));
        assert_eq!(backoff(first, 15), MAX_BACKOFF);
    }
}
