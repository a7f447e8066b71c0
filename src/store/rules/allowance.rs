//! A key's allowance under its spending limit: what it has spent in the current window, what
//! a reservation may add, and how settles and refunds change it. A call counts in the window it
//! was reserved in: its refund gives back only while that window lasts (a window that has ended
//! is never reopened), and a new window starts from nothing.

use chrono::{DateTime, Utc};

use crate::call::KeyLimit;
use crate::credits::Credits;

/// A limited key's spending, as stored beside the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allowance {
    /// The key's limit.
    pub limit: KeyLimit,
    /// Spent in window `window`: reserved and not given back.
    pub spent: i64,
    /// The window `spent` counts in (see [`LimitPeriod::window`](crate::call::LimitPeriod::window)).
    pub window: i64,
}

impl Allowance {
    /// What counts as spent at `at`: nothing once `at` is past the stored window.
    pub fn spent_at(&self, at: DateTime<Utc>) -> i64 {
        if self.limit.period.window(at) == self.window {
            self.spent
        } else {
            0
        }
    }

    /// Whether a call reserved at `at` may take `price` more, beside `held` (what the key's
    /// calls held in memory hold, not yet in `spent`).
    pub fn admits(&self, held: Credits, price: Credits, at: DateTime<Utc>) -> bool {
        let after =
            i128::from(self.spent_at(at)) + i128::from(held.get()) + i128::from(price.get());
        after <= i128::from(self.limit.credits.get())
    }

    /// What a call reserved at `reserved_at` may still add to the key's spending at `now`,
    /// beside `held` (what the key's calls hold in memory, not yet in `spent`): what the limit
    /// leaves in the call's window, and nothing once that window has ended (a call is counted in
    /// the window it was reserved in, and an ended window is never reopened).
    pub fn room(&self, held: Credits, reserved_at: DateTime<Utc>, now: DateTime<Utc>) -> Credits {
        let window = self.limit.period.window(reserved_at);
        if window != self.limit.period.window(now) {
            return Credits::ZERO;
        }
        let spent = if self.window == window { self.spent } else { 0 };
        let left =
            i128::from(self.limit.credits.get()) - i128::from(spent) - i128::from(held.get());
        let room = Credits::new(i64::try_from(left.max(0)).unwrap_or(i64::MAX));
        debug_assert!(
            room <= self.limit.credits,
            "no room beyond the limit itself"
        );
        room
    }

    /// Adds `amount` (less than zero: gives it back) for a call reserved at `reserved_at`: in
    /// its window if that is the current one (a later window starts it afresh); an ended
    /// window's call changes nothing. Never below zero.
    pub fn record(&mut self, amount: i64, reserved_at: DateTime<Utc>) {
        let window = self.limit.period.window(reserved_at);
        if window > self.window {
            self.window = window;
            self.spent = 0;
        }
        if window == self.window {
            self.spent = self.spent.saturating_add(amount).max(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use chrono::{Duration, TimeZone};
    use proptest::prelude::*;

    use super::*;
    use crate::call::LimitPeriod;

    fn day(n: i64) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, 1, 12, 0, 0).unwrap() + Duration::days(n)
    }

    fn daily(credits: i64) -> Allowance {
        Allowance {
            limit: KeyLimit {
                credits: Credits::new(credits),
                period: LimitPeriod::Day,
            },
            spent: 0,
            window: LimitPeriod::Day.window(day(0)),
        }
    }

    #[test]
    fn a_reservation_is_admitted_up_to_the_limit_and_not_past_it() {
        let mut allowance = daily(10);
        assert!(allowance.admits(Credits::ZERO, Credits::new(10), day(0)));
        allowance.record(7, day(0));
        assert!(allowance.admits(Credits::ZERO, Credits::new(3), day(0)));
        assert!(!allowance.admits(Credits::ZERO, Credits::new(4), day(0)));
        assert!(
            !allowance.admits(Credits::new(1), Credits::new(3), day(0)),
            "what is held counts"
        );
    }

    #[test]
    fn a_refund_gives_back_in_its_window_only() {
        let mut allowance = daily(10);
        allowance.record(10, day(0));
        allowance.record(-4, day(0));
        assert_eq!(allowance.spent_at(day(0)), 6);
        // The next day starts from nothing; a refund of yesterday's call changes nothing.
        assert!(allowance.admits(Credits::ZERO, Credits::new(10), day(1)));
        allowance.record(5, day(1));
        allowance.record(-6, day(0));
        assert_eq!(allowance.spent_at(day(1)), 5);
        assert_eq!(allowance.spent_at(day(2)), 0);
    }

    #[test]
    fn the_room_left_is_the_limit_less_what_the_window_spent_and_holds() {
        let mut allowance = daily(10);
        allowance.record(4, day(0));
        assert_eq!(
            allowance.room(Credits::ZERO, day(0), day(0)),
            Credits::new(6)
        );
        assert_eq!(
            allowance.room(Credits::new(5), day(0), day(0)),
            Credits::new(1)
        );
        assert_eq!(
            allowance.room(Credits::new(50), day(0), day(0)),
            Credits::ZERO
        );
        // A call of yesterday settled today: its window has ended, nothing more is counted.
        assert_eq!(allowance.room(Credits::ZERO, day(0), day(1)), Credits::ZERO);
    }

    proptest! {
        /// Whatever reservations, settles and refunds happen in whatever order over three days,
        /// a reservation is admitted only if the window's spending stays within the limit, and
        /// what is spent is never negative.
        #[test]
        fn the_limit_is_never_passed_by_admitted_reservations(
            steps in prop::collection::vec((0i64..3, 1i64..8, any::<bool>()), 1..60),
            limit in 1i64..30,
        ) {
            let mut allowance = daily(limit);
            let mut reserved: Vec<(i64, i64)> = Vec::new();
            for (when, price, refund_one) in steps {
                if refund_one && let Some((at, price)) = reserved.pop() {
                    allowance.record(-price, day(at));
                    continue;
                }
                let at = day(when.max(reserved.last().map_or(0, |(at, _)| *at)));
                if allowance.admits(Credits::ZERO, Credits::new(price), at) {
                    allowance.record(price, at);
                    reserved.push((when.max(reserved.last().map_or(0, |(at, _)| *at)), price));
                }
                prop_assert!(allowance.spent_at(at) <= limit);
                prop_assert!(allowance.spent >= 0);
                let in_window: i64 = reserved
                    .iter()
                    .filter(|(reserved_at, _)| LimitPeriod::Day.window(day(*reserved_at)) == allowance.window)
                    .map(|(_, price)| price)
                    .sum();
                prop_assert_eq!(allowance.spent, in_window);
            }
        }
    }
}
