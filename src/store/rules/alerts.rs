//! When a ledger write is told to the operator as an event, written in its transaction: an
//! account's balance falling below its threshold (`account.balance_low`), and a key's
//! reservation leaving too little of its limit for another call like it
//! (`key.limit_reached`, once per window).
//!
//! The balance counted is what the account can spend: its credits free of what calls under way
//! hold, without subscription credits whose period has ended. It is told when a write takes it
//! from at least the threshold to below it, so it is told again only after a grant or refunds
//! have brought it back up.

use chrono::{DateTime, Utc};

use super::allowance::Allowance;
use crate::credits::Credits;

/// Whether a balance going from `before` to `after` falls below `threshold` (none, or zero:
/// never told).
pub fn falls_below(threshold: Option<Credits>, before: Credits, after: Credits) -> bool {
    threshold.is_some_and(|threshold| {
        threshold > Credits::ZERO && before >= threshold && after < threshold
    })
}

/// Whether a key's reaching its limit is told, and in which window it last was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitAlert {
    /// Not told (the store writes no events).
    Off,
    /// Told once per window: `told_in` is the last window it was told in.
    Armed {
        /// The window it was last told in (see [`LimitPeriod::window`](crate::call::LimitPeriod::window)).
        told_in: Option<i64>,
    },
}

impl LimitAlert {
    /// Whether a reservation of `price` made at `at`, which `allowance` (beside `held`, what the
    /// key's calls hold in memory) now counts, is to be told: it leaves too little for another
    /// call at the same price, in a window not yet told.
    pub fn due(
        self,
        allowance: &Allowance,
        held: Credits,
        price: Credits,
        at: DateTime<Utc>,
    ) -> bool {
        let LimitAlert::Armed { told_in } = self else {
            return false;
        };
        told_in != Some(allowance.limit.period.window(at)) && !allowance.admits(held, price, at)
    }

    /// The same, told at `at`.
    pub fn told(self, allowance: &Allowance, at: DateTime<Utc>) -> LimitAlert {
        match self {
            LimitAlert::Off => LimitAlert::Off,
            LimitAlert::Armed { .. } => LimitAlert::Armed {
                told_in: Some(allowance.limit.period.window(at)),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use chrono::{Duration, TimeZone};

    use super::*;
    use crate::call::{KeyLimit, LimitPeriod};

    fn credits(amount: i64) -> Credits {
        Credits::new(amount)
    }

    #[test]
    fn a_balance_is_told_when_it_crosses_its_threshold_and_not_while_it_stays_below() {
        let threshold = Some(credits(10));
        assert!(falls_below(threshold, credits(10), credits(9)));
        assert!(falls_below(threshold, credits(50), credits(0)));
        assert!(!falls_below(threshold, credits(9), credits(5)));
        assert!(!falls_below(threshold, credits(12), credits(10)));
        assert!(!falls_below(threshold, credits(5), credits(12)));
    }

    #[test]
    fn no_threshold_or_a_zero_one_is_never_told() {
        assert!(!falls_below(None, credits(10), credits(0)));
        assert!(!falls_below(Some(Credits::ZERO), credits(10), credits(0)));
    }

    fn day(n: i64) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, 2, 12, 0, 0).unwrap() + Duration::days(n)
    }

    fn spent(amount: i64) -> Allowance {
        Allowance {
            limit: KeyLimit {
                credits: credits(10),
                period: LimitPeriod::Day,
            },
            spent: amount,
            window: LimitPeriod::Day.window(day(0)),
        }
    }

    #[test]
    fn a_limit_is_told_once_a_reservation_leaves_too_little_for_another_like_it() {
        let armed = LimitAlert::Armed { told_in: None };
        assert!(!armed.due(&spent(6), Credits::ZERO, credits(4), day(0)));
        assert!(armed.due(&spent(7), Credits::ZERO, credits(4), day(0)));
        assert!(armed.due(&spent(6), credits(1), credits(4), day(0)));
        assert!(armed.due(&spent(10), Credits::ZERO, credits(1), day(0)));
    }

    #[test]
    fn a_limit_is_told_once_per_window() {
        let told = LimitAlert::Armed { told_in: None }.told(&spent(10), day(0));
        assert!(!told.due(&spent(10), Credits::ZERO, credits(1), day(0)));
        // The next day's window starts from nothing: told again once it is spent.
        let next_day = Allowance {
            window: LimitPeriod::Day.window(day(1)),
            ..spent(10)
        };
        assert!(told.due(&next_day, Credits::ZERO, credits(1), day(1)));
    }

    #[test]
    fn a_store_without_events_never_tells_a_limit() {
        assert!(!LimitAlert::Off.due(&spent(10), Credits::ZERO, credits(1), day(0)));
        assert_eq!(LimitAlert::Off.told(&spent(10), day(0)), LimitAlert::Off);
    }
}
