//! Where requests are counted: one-minute windows of wall-clock time, per key (or per what
//! else is [`Counted`]), in this process or in Redis.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::call::KeyId;

/// The length of a window.
const WINDOW: Duration = Duration::from_secs(60);

/// What is counted in a window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Counted {
    /// A key's requests.
    Requests(KeyId),
    /// A key's failed redemptions of codes.
    FailedRedemptions(KeyId),
    /// A client address's failed redemptions of codes, whatever the key.
    FailedRedemptionsFrom(IpAddr),
}

impl Counted {
    /// Its name in Redis, after the limiter's prefix.
    #[cfg(feature = "redis")]
    fn name(self, window: u64) -> String {
        match self {
            Counted::Requests(key) => format!("rl:{}:{window}", key.0),
            Counted::FailedRedemptions(key) => format!("rd:k:{}:{window}", key.0),
            Counted::FailedRedemptionsFrom(address) => format!("rd:a:{address}:{window}"),
        }
    }
}

/// The current window, and the time left in it.
fn current_window() -> (u64, Duration) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let window = now.as_secs() / WINDOW.as_secs();
    let retry_after = WINDOW - Duration::from_secs(now.as_secs() % WINDOW.as_secs());
    (window, retry_after)
}

/// What a request may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Go on.
    Allowed,
    /// Over the limit until the window ends.
    Limited {
        /// Time left in the window.
        retry_after: Duration,
    },
}

/// Counts each key's requests in the current minute; see the [module docs](super).
#[derive(Debug, Clone)]
pub struct RateLimiter {
    local: Arc<LocalWindows>,
    #[cfg(feature = "redis")]
    shared: Option<Arc<redis_windows::RedisWindows>>,
}

impl RateLimiter {
    /// Counts in this process: each gateway instance enforces each limit on its own.
    pub fn local() -> RateLimiter {
        RateLimiter {
            local: Arc::default(),
            #[cfg(feature = "redis")]
            shared: None,
        }
    }

    /// Counts in the Redis at `url` (`redis://127.0.0.1:6379/0`), under keys starting with
    /// `prefix`, so the limits hold across every gateway using it; in this process while Redis
    /// cannot be reached. Fails only on a URL that is not a Redis URL; nothing is connected
    /// until the first limited request.
    #[cfg(feature = "redis")]
    pub fn redis(url: &str, prefix: impl Into<String>) -> Result<RateLimiter, tower::BoxError> {
        Ok(RateLimiter {
            local: Arc::default(),
            shared: Some(Arc::new(redis_windows::RedisWindows::new(
                url,
                prefix.into(),
            )?)),
        })
    }

    /// Counts one request of `key`, limited to `rpm` a minute.
    pub async fn check(&self, key: KeyId, rpm: u32) -> Decision {
        let counted = Counted::Requests(key);
        let (window, retry_after) = current_window();
        #[cfg(feature = "redis")]
        if let Some(shared) = &self.shared
            && let Some(count) = shared.count(&counted.name(window)).await
        {
            return decide(count <= u64::from(rpm), retry_after);
        }
        decide(self.local.count_if_under(counted, window, rpm), retry_after)
    }

    /// Counts one attempt of `counted` if it is under `limit` in the current minute; an
    /// attempt that turns out well is [`forgiven`](RateLimiter::forgive), so that only failures
    /// use up the limit, and attempts under way count too (a guesser cannot run past the limit
    /// by sending many at once).
    pub async fn attempt(&self, counted: Counted, limit: u32) -> Decision {
        let (window, retry_after) = current_window();
        #[cfg(feature = "redis")]
        if let Some(shared) = &self.shared
            && let Some(count) = shared.add(&counted.name(window), 1).await
        {
            if count > u64::from(limit) {
                // Refused attempts do not count.
                shared.add(&counted.name(window), -1).await;
                return Decision::Limited { retry_after };
            }
            return Decision::Allowed;
        }
        decide(
            self.local.count_if_under(counted, window, limit),
            retry_after,
        )
    }

    /// Takes back an [`attempt`](RateLimiter::attempt) of `counted` in the current minute.
    pub async fn forgive(&self, counted: Counted) {
        let (window, _) = current_window();
        #[cfg(feature = "redis")]
        if let Some(shared) = &self.shared
            && shared.add(&counted.name(window), -1).await.is_some()
        {
            return;
        }
        self.local.forgive(counted, window);
    }

    /// Whether the counts are shared between gateways right now (Redis configured and
    /// answering the last time it was asked).
    pub fn shared(&self) -> bool {
        #[cfg(feature = "redis")]
        if let Some(shared) = &self.shared {
            return shared.up();
        }
        false
    }
}

fn decide(allowed: bool, retry_after: Duration) -> Decision {
    if allowed {
        Decision::Allowed
    } else {
        Decision::Limited { retry_after }
    }
}

/// Each key's count in its latest window.
#[derive(Debug, Default)]
struct LocalWindows {
    counts: Mutex<HashMap<Counted, (u64, u32)>>,
}

/// Keys remembered before the stale windows are swept out.
const LOCAL_SWEEP_AT: usize = 10_000;

impl LocalWindows {
    /// Takes one back from what `counted` counts in `window`.
    fn forgive(&self, counted: Counted, window: u64) {
        let mut counts = self
            .counts
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some((seen, count)) = counts.get_mut(&counted)
            && *seen == window
        {
            *count = count.saturating_sub(1);
        }
    }

    /// Counts the request if the key is under `rpm` in `window`; `false` (not counted) if not.
    fn count_if_under(&self, key: Counted, window: u64, rpm: u32) -> bool {
        // Each change is one assignment: a panicking holder leaves the map consistent.
        let mut counts = self
            .counts
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if counts.len() >= LOCAL_SWEEP_AT {
            counts.retain(|_, (seen, _)| *seen == window);
        }
        let entry = counts.entry(key).or_insert((window, 0));
        if entry.0 != window {
            *entry = (window, 0);
        }
        if entry.1 >= rpm {
            return false;
        }
        entry.1 += 1;
        true
    }
}

#[cfg(feature = "redis")]
mod redis_windows {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use redis::aio::MultiplexedConnection;
    use tokio::sync::Mutex;
    use tokio::time::Instant;

    /// How long a request waits for Redis before it is counted here instead.
    const ANSWER_WITHIN: Duration = Duration::from_millis(250);
    /// How long after a failure Redis is left alone.
    const RETRY_AFTER: Duration = Duration::from_secs(1);
    /// Window keys outlive their minute by this much, then Redis drops them.
    const KEY_LIFETIME_SECS: i64 = 120;

    #[derive(Debug)]
    pub(super) struct RedisWindows {
        client: redis::Client,
        prefix: String,
        connection: Mutex<Connection>,
        up: AtomicBool,
    }

    #[derive(Debug, Default)]
    struct Connection {
        open: Option<MultiplexedConnection>,
        retry_at: Option<Instant>,
    }

    impl RedisWindows {
        pub(super) fn new(url: &str, prefix: String) -> Result<RedisWindows, tower::BoxError> {
            Ok(RedisWindows {
                client: redis::Client::open(url)?,
                prefix,
                connection: Mutex::default(),
                up: AtomicBool::new(true),
            })
        }

        pub(super) fn up(&self) -> bool {
            self.up.load(Ordering::Relaxed)
        }

        /// The count of `name` after this one; `None` when Redis did not answer.
        pub(super) async fn count(&self, name: &str) -> Option<u64> {
            self.add(name, 1).await
        }

        /// Adds `by` to the count of `name`; the count afterwards, `None` when Redis did not
        /// answer.
        pub(super) async fn add(&self, name: &str, by: i64) -> Option<u64> {
            let mut connection = self.connection().await?;
            let name = format!("{}{name}", self.prefix);
            let mut pipe = redis::pipe();
            pipe.atomic()
                .incr(&name, by)
                .expire(&name, KEY_LIFETIME_SECS)
                .ignore();
            let counted = pipe.query_async::<(i64,)>(&mut connection);
            match tokio::time::timeout(ANSWER_WITHIN, counted).await {
                Ok(Ok((count,))) => {
                    let count = u64::try_from(count).unwrap_or(0);
                    if !self.up.swap(true, Ordering::Relaxed) {
                        tracing::warn!("Redis answers again: rate limits are shared again");
                    }
                    Some(count)
                }
                Ok(Err(error)) => self.failed(&error.to_string()).await,
                Err(_) => self.failed("no answer in time").await,
            }
        }

        async fn connection(&self) -> Option<MultiplexedConnection> {
            let mut connection = self.connection.lock().await;
            if let Some(open) = &connection.open {
                return Some(open.clone());
            }
            if connection.retry_at.is_some_and(|at| Instant::now() < at) {
                return None;
            }
            let config = redis::AsyncConnectionConfig::new()
                .set_connection_timeout(Some(ANSWER_WITHIN))
                .set_response_timeout(Some(ANSWER_WITHIN));
            match self
                .client
                .get_multiplexed_async_connection_with_config(&config)
                .await
            {
                Ok(open) => {
                    connection.open = Some(open.clone());
                    connection.retry_at = None;
                    Some(open)
                }
                Err(error) => {
                    connection.retry_at = Some(Instant::now() + RETRY_AFTER);
                    drop(connection);
                    self.note_down(&error.to_string());
                    None
                }
            }
        }

        async fn failed(&self, why: &str) -> Option<u64> {
            let mut connection = self.connection.lock().await;
            connection.open = None;
            connection.retry_at = Some(Instant::now() + RETRY_AFTER);
            drop(connection);
            self.note_down(why);
            None
        }

        fn note_down(&self, why: &str) {
            if self.up.swap(false, Ordering::Relaxed) {
                tracing::warn!(
                    error = why,
                    "Redis cannot be reached: rate limits are counted per gateway instance until it answers"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_gets_its_rpm_in_a_window_and_again_in_the_next() {
        let windows = LocalWindows::default();
        let key = Counted::Requests(KeyId(1));
        assert!(windows.count_if_under(key, 10, 2));
        assert!(windows.count_if_under(key, 10, 2));
        assert!(!windows.count_if_under(key, 10, 2));
        assert!(
            windows.count_if_under(Counted::Requests(KeyId(2)), 10, 2),
            "keys count apart"
        );
        assert!(
            windows.count_if_under(key, 11, 2),
            "a new window starts at zero"
        );
    }

    #[tokio::test]
    async fn the_limited_answer_says_how_long_is_left_in_the_minute() {
        let limiter = RateLimiter::local();
        assert_eq!(limiter.check(KeyId(3), 1).await, Decision::Allowed);
        match limiter.check(KeyId(3), 1).await {
            Decision::Limited { retry_after } => {
                assert!(retry_after > Duration::ZERO && retry_after <= WINDOW)
            }
            Decision::Allowed => panic!("the second request of a 1 rpm key passed"),
        }
        assert!(!limiter.shared());
    }

    #[tokio::test]
    async fn attempts_use_up_the_limit_unless_forgiven() {
        let limiter = RateLimiter::local();
        let failed = Counted::FailedRedemptions(KeyId(4));
        for _ in 0..5 {
            assert_eq!(limiter.attempt(failed, 3).await, Decision::Allowed);
            limiter.forgive(failed).await;
        }
        for _ in 0..3 {
            assert_eq!(limiter.attempt(failed, 3).await, Decision::Allowed);
        }
        assert!(matches!(
            limiter.attempt(failed, 3).await,
            Decision::Limited { .. }
        ));
        assert_eq!(
            limiter.check(KeyId(4), 1).await,
            Decision::Allowed,
            "requests count apart"
        );
        let elsewhere = Counted::FailedRedemptionsFrom([127, 0, 0, 1].into());
        assert_eq!(limiter.attempt(elsewhere, 1).await, Decision::Allowed);
    }
}
