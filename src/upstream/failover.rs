//! Failover across a model's channels: in what order they are tried, which are skipped, when
//! to move on, when to wait for a `Retry-After`, and when the call's deadline ends it. It knows
//! nothing of HTTP: a channel is anything with a name and a breaker ([`Channel`]), and one
//! attempt on it is a future the caller gives; so it is tested with fake channels.
//!
//! A call tries the channels in the order it is given (see [`attempt_order`]), skipping those
//! whose circuit breaker is open, until one answers:
//! - an attempt that fails for reasons of its channel ([`AttemptError::Retryable`]: a
//!   connection failure, a time-out, 429, 5xx, the channel's own credentials refused, a 2xx
//!   that is not a reply) moves on to the next channel and counts against its breaker;
//! - an attempt refused for reasons of the request itself ([`AttemptError::Rejected`]) ends
//!   the call: no other channel would do better;
//! - a 429's `Retry-After` is honoured within the call's deadline: when every channel has
//!   failed, the call waits that long and tries that channel once more.
//!
//! If every channel's breaker is open, they are all tried anyway: a call never fails untried.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;

use super::breaker::CircuitBreaker;
use crate::catalogue::ModelChannel;
use crate::error::UpstreamError;
use crate::events::{EventType, WebhookEvent};
use crate::store::EventOutbox;

/// How one attempt on one channel ended, when it did not succeed.
#[derive(Debug)]
pub(crate) enum AttemptError {
    /// Worth trying another channel.
    Retryable {
        status: Option<u16>,
        message: String,
        retry_after: Option<Duration>,
    },
    /// The provider refused the request itself: no other channel will do better.
    Rejected(UpstreamError),
}

/// What failover needs of a channel: the upstream's name (for metrics, events and messages)
/// and its breaker. A channel is passed by value to each attempt: a reference, or a small
/// `Copy` of references.
pub(crate) trait Channel: Copy {
    fn name(&self) -> &str;
    fn breaker(&self) -> &CircuitBreaker;
}

/// One call's failover: the channels to try, its deadline, and where breakers' turns are told.
pub(crate) struct Failover<'a, C> {
    /// Each channel the catalogue names for the call, in the order to try them, by name; `None`
    /// where no channel of that name is configured.
    planned: Vec<(&'a str, Option<C>)>,
    deadline: Instant,
    events: Option<&'a Arc<dyn EventOutbox>>,
}

/// What the failover does after one attempt.
enum Next<R> {
    /// Stop: the call's answer.
    Answer(Result<R, UpstreamError>),
    /// Try the next channel; a 429's `Retry-After`, if it gave one.
    GoOn(Option<Duration>),
}

impl<'a, C: Channel> Failover<'a, C> {
    pub(crate) fn new(
        planned: Vec<(&'a str, Option<C>)>,
        deadline: Instant,
        events: Option<&'a Arc<dyn EventOutbox>>,
    ) -> Failover<'a, C> {
        Failover {
            planned,
            deadline,
            events,
        }
    }

    /// Runs the call: `attempt` once on each channel in turn (see the module docs) until one
    /// answers; the failures of every attempt, joined, when none does.
    pub(crate) async fn run<R, F, Fut>(self, mut attempt: F) -> Result<R, UpstreamError>
    where
        F: FnMut(C) -> Fut,
        Fut: Future<Output = Result<R, AttemptError>>,
    {
        let mut failures: Vec<String> = Vec::new();
        let mut last_status = None;
        let mut retry_later: Option<(C, Instant)> = None;

        // Channels whose breaker is open are skipped, unless that would leave none at all.
        let now = Instant::now();
        let admitted: Vec<bool> = (self.planned.iter())
            .map(|(_, channel)| {
                (channel.as_ref()).is_none_or(|channel| channel.breaker().admits(now))
            })
            .collect();
        let any_admitted = admitted.contains(&true);
        let mut plan = Vec::with_capacity(self.planned.len());
        for ((name, channel), admitted) in self.planned.iter().zip(admitted) {
            if admitted || !any_admitted {
                plan.push((*name, *channel));
            } else {
                failures.push(format!("{name}: skipped, circuit open"));
            }
        }

        for (name, channel) in plan {
            let Some(channel) = channel else {
                failures.push(format!("{name}: not configured"));
                continue;
            };
            if Instant::now() >= self.deadline {
                failures.push("call deadline reached".to_owned());
                break;
            }
            let started = Instant::now();
            let outcome = attempt(channel).await;
            let recorded = self.record(
                &channel,
                name,
                (outcome, started.elapsed()),
                &mut failures,
                &mut last_status,
            );
            match recorded {
                Next::Answer(answer) => return answer,
                Next::GoOn(Some(wait)) => {
                    let at = Instant::now() + wait;
                    if retry_later.is_none() && at < self.deadline {
                        retry_later = Some((channel, at));
                    }
                }
                Next::GoOn(None) => {}
            }
        }

        if let Some((channel, at)) = retry_later {
            tokio::time::sleep_until(at.into()).await;
            let started = Instant::now();
            let outcome = attempt(channel).await;
            let label = format!("{} after Retry-After", channel.name());
            if let Next::Answer(answer) = self.record(
                &channel,
                &label,
                (outcome, started.elapsed()),
                &mut failures,
                &mut last_status,
            ) {
                return answer;
            }
        }
        Err(UpstreamError {
            status: last_status,
            message: failures.join("; "),
            client_message: None,
        })
    }

    /// Feeds one attempt's outcome (and how long it took) to the channel's breaker, the metrics
    /// and the call's list of failures (labelled `label`), and says whether the call is decided.
    fn record<R>(
        &self,
        channel: &C,
        label: &str,
        (outcome, took): (Result<R, AttemptError>, Duration),
        failures: &mut Vec<String>,
        last_status: &mut Option<u16>,
    ) -> Next<R> {
        let kind = match &outcome {
            Ok(_) => "ok",
            Err(AttemptError::Rejected(_)) => "rejected",
            Err(AttemptError::Retryable { .. }) => "retryable",
        };
        let name = channel.name();
        crate::telemetry::upstream_attempt(name, kind, took.as_secs_f64());
        let (next, turned) = record_outcome(channel, label, outcome, failures, last_status);
        crate::telemetry::breaker(name, !channel.breaker().admits(Instant::now()));
        if let (Some(kind), Some(events)) = (turned, self.events) {
            // Recorded aside: a store that is slow or down never holds the call up.
            let event =
                WebhookEvent::new(kind, serde_json::json!({ "upstream": name }), Utc::now());
            let events = events.clone();
            tokio::spawn(async move {
                if let Err(error) = events.record_event(&event).await {
                    tracing::warn!(%error, "could not record the breaker's event");
                }
            });
        }
        next
    }
}

/// What to do next, and the breaker's turn if it opened or closed.
fn record_outcome<C: Channel, R>(
    channel: &C,
    label: &str,
    outcome: Result<R, AttemptError>,
    failures: &mut Vec<String>,
    last_status: &mut Option<u16>,
) -> (Next<R>, Option<EventType>) {
    match outcome {
        Ok(response) => {
            let closed = channel.breaker().record_success();
            let turned = closed.then_some(EventType::UpstreamBreakerClosed);
            (Next::Answer(Ok(response)), turned)
        }
        Err(AttemptError::Rejected(mut error)) => {
            failures.push(std::mem::take(&mut error.message));
            error.message = failures.join("; ");
            (Next::Answer(Err(error)), None)
        }
        Err(AttemptError::Retryable {
            status,
            message,
            retry_after,
        }) => {
            let opened = channel.breaker().record_failure(Instant::now());
            failures.push(format!("{label}: {message}"));
            *last_status = status.or(*last_status);
            let turned = opened.then_some(EventType::UpstreamBreakerOpened);
            (Next::GoOn(retry_after), turned)
        }
    }
}

/// The order in which to try a model's channels: by priority; equals in weighted random order.
pub(crate) fn attempt_order(channels: &[ModelChannel]) -> Vec<&ModelChannel> {
    let mut order = Vec::with_capacity(channels.len());
    for group in channels.chunk_by(|a, b| a.priority == b.priority) {
        let mut rest: Vec<&ModelChannel> = group.iter().collect();
        while !rest.is_empty() {
            let total: u64 = rest.iter().map(|c| u64::from(c.weight)).sum();
            let mut pick = fastrand::u64(0..total);
            let index = rest
                .iter()
                .position(|c| {
                    let weight = u64::from(c.weight);
                    if pick < weight {
                        true
                    } else {
                        pick -= weight;
                        false
                    }
                })
                .unwrap_or(0);
            order.push(rest.remove(index));
        }
    }
    order
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::Mutex;

    use super::*;

    /// A channel whose attempts end as scripted, counting them.
    struct Fake {
        name: &'static str,
        breaker: CircuitBreaker,
        script: Mutex<VecDeque<Result<&'static str, AttemptError>>>,
        tried: Mutex<u32>,
    }

    impl Fake {
        fn new(name: &'static str, script: Vec<Result<&'static str, AttemptError>>) -> Fake {
            Fake {
                name,
                breaker: CircuitBreaker::new(3, Duration::from_secs(60)),
                script: Mutex::new(script.into()),
                tried: Mutex::new(0),
            }
        }

        fn tried(&self) -> u32 {
            *self.tried.lock().unwrap()
        }

        async fn attempt(&self) -> Result<&'static str, AttemptError> {
            *self.tried.lock().unwrap() += 1;
            (self.script.lock().unwrap().pop_front()).unwrap_or(Ok(self.name))
        }
    }

    impl Channel for &Fake {
        fn name(&self) -> &str {
            self.name
        }

        fn breaker(&self) -> &CircuitBreaker {
            &self.breaker
        }
    }

    fn down(status: u16) -> Result<&'static str, AttemptError> {
        Err(AttemptError::Retryable {
            status: Some(status),
            message: format!("answered {status}"),
            retry_after: None,
        })
    }

    fn busy(wait: Duration) -> Result<&'static str, AttemptError> {
        Err(AttemptError::Retryable {
            status: Some(429),
            message: "answered 429".into(),
            retry_after: Some(wait),
        })
    }

    fn refused() -> Result<&'static str, AttemptError> {
        Err(AttemptError::Rejected(UpstreamError {
            status: Some(400),
            message: "b: answered 400".into(),
            client_message: Some("bad request".into()),
        }))
    }

    async fn run(channels: &[&Fake], deadline: Duration) -> Result<&'static str, UpstreamError> {
        let planned = (channels.iter())
            .map(|channel| (channel.name, Some(*channel)))
            .collect();
        Failover::new(planned, Instant::now() + deadline, None)
            .run(|channel: &Fake| channel.attempt())
            .await
    }

    const LONG: Duration = Duration::from_secs(60);

    #[tokio::test]
    async fn a_channel_that_fails_moves_the_call_on_and_the_first_answer_ends_it() {
        let (a, b, c) = (
            Fake::new("a", vec![down(503)]),
            Fake::new("b", vec![]),
            Fake::new("c", vec![]),
        );
        assert_eq!(run(&[&a, &b, &c], LONG).await.unwrap(), "b");
        assert_eq!((a.tried(), b.tried(), c.tried()), (1, 1, 0));
    }

    #[tokio::test]
    async fn a_request_the_provider_refuses_is_not_tried_elsewhere() {
        let (a, b, c) = (
            Fake::new("a", vec![down(500)]),
            Fake::new("b", vec![refused()]),
            Fake::new("c", vec![]),
        );
        let error = run(&[&a, &b, &c], LONG).await.unwrap_err();
        assert_eq!(c.tried(), 0);
        assert_eq!(error.status, Some(400));
        assert_eq!(error.client_message.as_deref(), Some("bad request"));
        assert_eq!(error.message, "a: answered 500; b: answered 400");
    }

    #[tokio::test]
    async fn every_failure_is_named_and_the_last_status_kept() {
        let (a, b) = (
            Fake::new("a", vec![down(502)]),
            Fake::new("b", vec![down(503)]),
        );
        let error = run(&[&a, &b], LONG).await.unwrap_err();
        assert_eq!(error.status, Some(503));
        assert_eq!(error.message, "a: answered 502; b: answered 503");
        assert_eq!(error.client_message, None);
    }

    #[tokio::test]
    async fn an_open_breaker_is_skipped_unless_every_breaker_is_open() {
        let (a, b) = (Fake::new("a", vec![]), Fake::new("b", vec![]));
        for _ in 0..3 {
            a.breaker.record_failure(Instant::now());
        }
        assert_eq!(run(&[&a, &b], LONG).await.unwrap(), "b");
        assert_eq!(a.tried(), 0, "skipped while open");

        let (a2, b2) = (Fake::new("a", vec![down(503)]), Fake::new("b", vec![]));
        for channel in [&a2, &b2] {
            for _ in 0..3 {
                channel.breaker.record_failure(Instant::now());
            }
        }
        assert_eq!(run(&[&a2, &b2], LONG).await.unwrap(), "b", "never untried");
        assert_eq!((a2.tried(), b2.tried()), (1, 1));
    }

    #[tokio::test]
    async fn a_retry_after_is_waited_for_once_every_channel_failed() {
        let wait = Duration::from_millis(80);
        let (a, b) = (
            Fake::new("a", vec![busy(wait)]),
            Fake::new("b", vec![down(503)]),
        );
        let started = Instant::now();
        assert_eq!(run(&[&a, &b], LONG).await.unwrap(), "a");
        assert!(started.elapsed() >= wait, "{:?}", started.elapsed());
        assert_eq!((a.tried(), b.tried()), (2, 1));
    }

    #[tokio::test]
    async fn a_retry_after_past_the_deadline_is_not_waited_for() {
        let (a, b) = (
            Fake::new("a", vec![busy(Duration::from_secs(30))]),
            Fake::new("b", vec![down(503)]),
        );
        let started = Instant::now();
        let error = run(&[&a, &b], Duration::from_secs(1)).await.unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(1));
        assert_eq!((a.tried(), b.tried()), (1, 1));
        assert_eq!(error.status, Some(503));
    }

    #[tokio::test]
    async fn no_channel_is_tried_past_the_deadline() {
        let (a, b) = (Fake::new("a", vec![]), Fake::new("b", vec![]));
        let planned = vec![("gone", None), ("a", Some(&a)), ("b", Some(&b))];
        let error = Failover::new(planned, Instant::now(), None)
            .run(|channel: &Fake| channel.attempt())
            .await
            .unwrap_err();
        assert_eq!((a.tried(), b.tried()), (0, 0));
        assert_eq!(error.message, "gone: not configured; call deadline reached");
    }

    #[tokio::test]
    async fn enough_failures_open_the_breaker_and_a_success_closes_it() {
        let a = Fake::new("a", vec![down(500), down(500), down(500)]);
        for _ in 0..3 {
            assert!(run(&[&a], LONG).await.is_err());
        }
        assert!(!a.breaker.admits(Instant::now()), "open after three");
        let b = Fake::new("b", vec![]);
        assert_eq!(run(&[&a, &b], LONG).await.unwrap(), "b");
        assert_eq!(a.tried(), 3);
    }
}
