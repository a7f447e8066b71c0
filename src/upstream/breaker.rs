//! A circuit breaker per upstream, so that one dead provider does not add its time-out to every
//! call: after `threshold` consecutive retryable failures the upstream is skipped for a
//! cool-down; then one call may try it (half-open): success closes the breaker, failure opens
//! it again for another cool-down.

use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug)]
pub(crate) struct CircuitBreaker {
    threshold: u32,
    cooldown: Duration,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    consecutive_failures: u32,
    open_until: Option<Instant>,
    /// When the half-open trial call started; a trial that never reports back (its call was
    /// cancelled) stops blocking others after one cool-down.
    trial_since: Option<Instant>,
}

impl CircuitBreaker {
    pub(crate) fn new(threshold: u32, cooldown: Duration) -> CircuitBreaker {
        CircuitBreaker {
            threshold,
            cooldown,
            state: Mutex::new(State::default()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether a call may try this upstream now. In the half-open state this admits one trial.
    pub(crate) fn admits(&self, now: Instant) -> bool {
        let mut state = self.state();
        match state.open_until {
            None => true,
            Some(until) if now < until => false,
            Some(_) => {
                let trial_running = state
                    .trial_since
                    .is_some_and(|since| now.duration_since(since) < self.cooldown);
                if trial_running {
                    return false;
                }
                state.trial_since = Some(now);
                true
            }
        }
    }

    /// Records a success; `true` if it closed the breaker (it was open).
    pub(crate) fn record_success(&self) -> bool {
        let mut state = self.state();
        let was_open = state.open_until.is_some();
        *state = State::default();
        was_open
    }

    /// Records a retryable failure; `true` if it opened the breaker (it was closed).
    pub(crate) fn record_failure(&self, now: Instant) -> bool {
        let mut state = self.state();
        state.consecutive_failures = state.consecutive_failures.saturating_add(1);
        state.trial_since = None;
        if state.consecutive_failures >= self.threshold {
            let was_closed = state.open_until.is_none();
            state.open_until = Some(now + self.cooldown);
            return was_closed;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COOLDOWN: Duration = Duration::from_secs(10);

    #[test]
    fn opens_after_the_threshold_and_admits_one_trial_after_the_cooldown() {
        let breaker = CircuitBreaker::new(2, COOLDOWN);
        let start = Instant::now();
        assert!(!breaker.record_failure(start));
        assert!(breaker.admits(start), "one failure is below the threshold");
        assert!(breaker.record_failure(start), "the second opens it");
        assert!(!breaker.admits(start + COOLDOWN / 2));
        let later = start + COOLDOWN;
        assert!(breaker.admits(later), "the trial");
        assert!(!breaker.admits(later), "only one trial at a time");
    }

    #[test]
    fn a_failed_trial_reopens_and_a_successful_one_closes() {
        let breaker = CircuitBreaker::new(1, COOLDOWN);
        let start = Instant::now();
        breaker.record_failure(start);
        let trial = start + COOLDOWN;
        assert!(breaker.admits(trial));
        breaker.record_failure(trial);
        assert!(!breaker.admits(trial + COOLDOWN / 2));
        assert!(breaker.admits(trial + COOLDOWN));
        breaker.record_success();
        assert!(breaker.admits(trial + COOLDOWN) && breaker.admits(trial + COOLDOWN));
    }

    #[test]
    fn a_success_resets_the_count_of_consecutive_failures() {
        let breaker = CircuitBreaker::new(2, COOLDOWN);
        let now = Instant::now();
        breaker.record_failure(now);
        breaker.record_success();
        breaker.record_failure(now);
        assert!(breaker.admits(now));
    }

    #[test]
    fn an_abandoned_trial_stops_blocking_after_a_cooldown() {
        let breaker = CircuitBreaker::new(1, COOLDOWN);
        let start = Instant::now();
        breaker.record_failure(start);
        assert!(breaker.admits(start + COOLDOWN));
        assert!(breaker.admits(start + COOLDOWN * 2));
    }
}
