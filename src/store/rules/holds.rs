//! What a reservation holds and what its end moves, bucket by bucket.
//!
//! Two ways to keep a reservation: its credits are **taken** from the balance at once (shared
//! mode, the in-memory store), and a refund gives them back; or they are **held** beside the
//! balance (an owned file, escrow), and a settle debits them from the balance while a refund
//! moves nothing. What a settle charges is [`super::settle`]'s.

use chrono::{DateTime, Utc};

use crate::call::LimitPeriod;
use crate::credits::{Balance, Credits, Split};

/// The balance with a refunded call's credits back in the buckets they came from.
pub fn give_back(balance: Balance, taken: Split) -> Balance {
    debug_assert!(is_split(taken), "a reservation took {taken:?}");
    balance.plus(taken)
}

/// The balance once a reservation takes its credits from it at once.
pub fn take(balance: Balance, taken: Split) -> Balance {
    let left = balance.minus(taken);
    debug_assert!(
        left.subscription.get() >= 0 && left.topup.get() >= 0,
        "a reservation took more than the balance had: {taken:?} of {balance:?}"
    );
    left
}

/// What is held with one more call's credits.
pub fn hold(held: Balance, taken: Split) -> Balance {
    debug_assert!(is_split(taken), "a reservation took {taken:?}");
    held.plus(taken)
}

/// What is held once a held call ends, settled or refunded.
pub fn release(held: Balance, taken: Split) -> Balance {
    let left = held.minus(taken);
    debug_assert!(
        left.subscription.get() >= 0 && left.topup.get() >= 0,
        "a hold released twice, or one never held: {taken:?} of {held:?}"
    );
    left
}

/// The balance once a held call's settle debits it: `None` when a bucket would go below zero
/// (another writer, a lapse, took the credits), and the call then ends unbilled.
pub fn debit_held(balance: Balance, taken: Split) -> Option<Balance> {
    debug_assert!(is_split(taken), "a reservation took {taken:?}");
    let after = balance.minus(taken);
    (after.subscription.get() >= 0 && after.topup.get() >= 0).then_some(after)
}

/// Whether what is held on each account (or pot) is the sum of its held calls' credits:
/// `held` lists each account's hold, `calls` each held call's account and credits.
#[cfg(any(feature = "sqlite", feature = "postgres", test))]
pub fn sums_agree<K: Ord + Copy>(
    held: impl IntoIterator<Item = (K, Balance)>,
    calls: impl IntoIterator<Item = (K, Split)>,
) -> bool {
    let mut sums = std::collections::BTreeMap::<K, Balance>::new();
    for (on, taken) in calls {
        let sum = sums.entry(on).or_default();
        *sum = sum.plus(taken);
    }
    let held: std::collections::BTreeMap<K, Balance> = held
        .into_iter()
        .filter(|(_, balance)| *balance != Balance::default())
        .collect();
    sums.retain(|_, sum| *sum != Balance::default());
    held == sums
}

/// What one key's held calls hold: in all, and each with when it was reserved (a spending
/// limit counts a call in the window it was reserved in, so calls of a window that has ended
/// do not count against the next). A store that holds reservations apart from the balance
/// keeps one for each key with calls under way, and adds what they hold to the key's stored
/// spending when it decides a reservation ([`reserve::Limited::held`](super::reserve::Limited::held)).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct KeyHolds {
    total: Credits,
    calls: Vec<(DateTime<Utc>, Credits)>,
}

impl KeyHolds {
    /// Holds a call of `taken` credits reserved at `reserved_at`.
    pub fn add(&mut self, reserved_at: DateTime<Utc>, taken: Credits) {
        debug_assert!(taken >= Credits::ZERO, "a call holds {taken:?}");
        self.total = Credits::new(self.total.get() + taken.get());
        self.calls.push((reserved_at, taken));
        debug_assert!(self.sums_agree(), "{self:?}");
    }

    /// Takes an ended call off; `true` if none is left. A call never held takes nothing off.
    pub fn remove(&mut self, reserved_at: DateTime<Utc>, taken: Credits) -> bool {
        if let Some(at) = (self.calls.iter()).position(|call| *call == (reserved_at, taken)) {
            self.calls.swap_remove(at);
            self.total = Credits::new(self.total.get() - taken.get());
        }
        debug_assert!(self.sums_agree(), "{self:?}");
        self.calls.is_empty()
    }

    /// What the calls reserved in `period`'s window of `at` hold.
    pub fn in_window(&self, period: LimitPeriod, at: DateTime<Utc>) -> Credits {
        let window = period.window(at);
        let earlier: i64 = (self.calls.iter())
            .filter(|(reserved_at, _)| period.window(*reserved_at) != window)
            .map(|(_, taken)| taken.get())
            .sum();
        let held = Credits::new(self.total.get() - earlier);
        debug_assert!(
            held >= Credits::ZERO && held <= self.total,
            "a window holds {held:?} of {self:?}"
        );
        held
    }

    /// What all the key's held calls hold.
    pub fn total(&self) -> Credits {
        self.total
    }

    fn sums_agree(&self) -> bool {
        self.total.get() == self.calls.iter().map(|(_, taken)| taken.get()).sum::<i64>()
    }
}

/// Whether `split` is what a reservation can take: no part below zero.
fn is_split(split: Split) -> bool {
    split.subscription.get() >= 0 && split.topup.get() >= 0
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::store::rules::test_values::{balance, split};

    #[test]
    fn holds_agree_with_their_calls_only_when_each_is_their_sum() {
        let calls = [(1, split(1, 2)), (1, split(3, 0)), (2, split(0, 5))];
        assert!(sums_agree([(1, balance(4, 2)), (2, balance(0, 5))], calls));
        assert!(!sums_agree([(1, balance(4, 2)), (2, balance(0, 4))], calls));
        assert!(!sums_agree([(1, balance(4, 2))], calls), "a hold missing");
        assert!(sums_agree(
            [(1, balance(4, 2)), (2, balance(0, 5)), (3, balance(0, 0))],
            calls
        ));
    }

    #[test]
    fn a_refund_returns_credits_to_the_buckets_they_came_from() {
        assert_eq!(give_back(balance(1, 2), split(3, 4)), balance(4, 6));
    }

    #[test]
    fn a_settle_debits_a_held_call_only_while_its_credits_are_there() {
        assert_eq!(debit_held(balance(5, 5), split(2, 3)), Some(balance(3, 2)));
        assert_eq!(debit_held(balance(1, 5), split(2, 0)), None);
        assert_eq!(debit_held(balance(5, 2), split(0, 3)), None);
    }

    fn at(day: i64) -> DateTime<Utc> {
        use chrono::TimeZone;
        Utc.with_ymd_and_hms(2030, 1, 1, 12, 0, 0).unwrap() + chrono::Duration::days(day)
    }

    #[test]
    fn a_keys_held_calls_count_in_the_window_they_were_reserved_in() {
        let mut key = KeyHolds::default();
        key.add(at(0), Credits::new(5));
        key.add(at(1), Credits::new(7));
        assert_eq!(key.total(), Credits::new(12));
        assert_eq!(key.in_window(LimitPeriod::Day, at(1)), Credits::new(7));
        assert_eq!(key.in_window(LimitPeriod::None, at(1)), Credits::new(12));
        assert!(!key.remove(at(0), Credits::new(5)));
        assert_eq!(key.in_window(LimitPeriod::Day, at(0)), Credits::ZERO);
        // A call never held takes nothing off.
        assert!(!key.remove(at(3), Credits::new(7)));
        assert_eq!(key.total(), Credits::new(7));
        assert!(key.remove(at(1), Credits::new(7)));
        assert_eq!(key.total(), Credits::ZERO);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(10_000))]

        /// What a key's calls hold is the sum of those still held; a window holds no more than
        /// all of them and no less than nothing; the windows of one period add up to the total.
        #[test]
        fn a_keys_holds_are_the_sum_of_its_calls_still_held(
            calls in prop::collection::vec((0i64..4, 0i64..1_000), 0..20),
            ended in prop::collection::vec(any::<bool>(), 20),
        ) {
            let mut key = KeyHolds::default();
            for (day, taken) in &calls {
                key.add(at(*day), Credits::new(*taken));
            }
            let mut left = 0;
            for ((day, taken), end) in calls.iter().zip(&ended) {
                if *end {
                    key.remove(at(*day), Credits::new(*taken));
                } else {
                    left += taken;
                }
            }
            prop_assert_eq!(key.total(), Credits::new(left));
            let by_day: i64 = (0..4).map(|day| key.in_window(LimitPeriod::Day, at(day)).get()).sum();
            prop_assert_eq!(by_day, left);
            for day in 0..4 {
                let held = key.in_window(LimitPeriod::Day, at(day));
                prop_assert!(held >= Credits::ZERO && held <= key.total());
            }
        }

        /// Holding calls and releasing each once leaves nothing held; what is held at any moment
        /// is the sum of the calls still held.
        #[test]
        fn what_is_held_is_the_sum_of_the_calls_still_held(
            calls in prop::collection::vec((0i64..1_000, 0i64..1_000), 0..20),
            order in any::<prop::sample::Index>(),
        ) {
            let taken: Vec<Split> = calls.iter().map(|&(s, t)| split(s, t)).collect();
            let mut held = Balance::default();
            for &call in &taken {
                held = hold(held, call);
            }
            let mut still: Vec<Split> = taken.clone();
            while !still.is_empty() {
                let ended = still.remove(order.index(still.len()));
                held = release(held, ended);
                let sum = still.iter().fold(Balance::default(), |sum, &call| sum.plus(call));
                prop_assert_eq!(held, sum);
            }
            prop_assert_eq!(held, Balance::default());
        }

        /// A settle of a held call takes exactly what the call holds, bucket by bucket, and
        /// never leaves a bucket below zero; a refund of a taken call gives exactly that back.
        #[test]
        fn a_settle_moves_what_the_call_holds_and_a_refund_what_it_took(
            subscription in 0i64..2_000,
            topup in 0i64..2_000,
            taken_sub in 0i64..1_500,
            taken_topup in 0i64..1_500,
        ) {
            let before = balance(subscription, topup);
            let taken = split(taken_sub, taken_topup);
            match debit_held(before, taken) {
                Some(after) => {
                    prop_assert_eq!(after.plus(taken), before);
                    prop_assert!(after.subscription.get() >= 0 && after.topup.get() >= 0);
                }
                None => prop_assert!(taken_sub > subscription || taken_topup > topup),
            }
            prop_assert_eq!(give_back(before.minus(taken), taken), before);
        }
    }
}
