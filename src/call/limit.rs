//! A key's spending limit: at most so many credits per period (a UTC day, an ISO week from
//! Monday, a calendar month, or for good), so that a team's account can give each member a key
//! with an allowance of its own.
//!
//! A period is numbered (its window): what a key spent is counted in the window it was
//! reserved in, and a new window starts from nothing.
//!
//! ```
//! use chrono::{TimeZone, Utc};
//! use model_gateway::call::LimitPeriod;
//!
//! let friday = Utc.with_ymd_and_hms(2026, 11, 27, 15, 0, 0).unwrap();
//! let window = LimitPeriod::Week.window(friday);
//! assert_eq!(
//!     LimitPeriod::Week.window_end(window),
//!     Some(Utc.with_ymd_and_hms(2026, 11, 30, 0, 0, 0).unwrap()) // the next Monday
//! );
//! assert_eq!(LimitPeriod::None.window_end(0), None);
//! ```

use chrono::{DateTime, Datelike, Duration, NaiveDate, TimeZone, Utc};
use serde::{Deserialize, Serialize};

use crate::credits::Credits;

/// How often a key's allowance starts again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LimitPeriod {
    /// Each UTC day.
    Day,
    /// Each week, from Monday 00:00 UTC.
    Week,
    /// Each calendar month, from the 1st 00:00 UTC.
    Month,
    /// Never: a total for the key's life.
    None,
}

impl LimitPeriod {
    /// Its name: `day`, `week`, `month` or `none`.
    pub fn as_str(self) -> &'static str {
        match self {
            LimitPeriod::Day => "day",
            LimitPeriod::Week => "week",
            LimitPeriod::Month => "month",
            LimitPeriod::None => "none",
        }
    }

    /// The period named `name`.
    pub fn parse(name: &str) -> Option<LimitPeriod> {
        match name {
            "day" => Some(LimitPeriod::Day),
            "week" => Some(LimitPeriod::Week),
            "month" => Some(LimitPeriod::Month),
            "none" => Some(LimitPeriod::None),
            _ => None,
        }
    }

    /// The number of the window `at` falls in: days or weeks since 1970-01-01 (weeks from a
    /// Monday), months since year 0, or 0 for [`LimitPeriod::None`]. Later windows have larger
    /// numbers.
    pub fn window(self, at: DateTime<Utc>) -> i64 {
        let days = at.timestamp().div_euclid(86_400);
        match self {
            LimitPeriod::Day => days,
            // 1970-01-01 was a Thursday: three days on, weeks start on Mondays.
            LimitPeriod::Week => (days + 3).div_euclid(7),
            LimitPeriod::Month => i64::from(at.year()) * 12 + i64::from(at.month0()),
            LimitPeriod::None => 0,
        }
    }

    /// When `window` ends and the next starts; `None` for [`LimitPeriod::None`] (or a window
    /// past what a date can hold).
    pub fn window_end(self, window: i64) -> Option<DateTime<Utc>> {
        let day =
            |days: i64| DateTime::<Utc>::UNIX_EPOCH.checked_add_signed(Duration::try_days(days)?);
        match self {
            LimitPeriod::Day => day(window.checked_add(1)?),
            LimitPeriod::Week => day(window.checked_add(1)?.checked_mul(7)? - 3),
            LimitPeriod::Month => {
                let next = window.checked_add(1)?;
                let year = i32::try_from(next.div_euclid(12)).ok()?;
                let month = u32::try_from(next.rem_euclid(12)).ok()? + 1;
                let date = NaiveDate::from_ymd_opt(year, month, 1)?;
                Some(Utc.from_utc_datetime(&date.and_hms_opt(0, 0, 0)?))
            }
            LimitPeriod::None => None,
        }
    }
}

/// At most `credits` per `period` for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct KeyLimit {
    /// The most the key may spend in one period; positive.
    pub credits: Credits,
    /// How often it starts again.
    pub period: LimitPeriod,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(y: i32, m: u32, d: u32, h: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(y, m, d, h, 0, 0).unwrap()
    }

    #[test]
    fn each_period_ends_where_the_next_window_begins() {
        for period in [LimitPeriod::Day, LimitPeriod::Week, LimitPeriod::Month] {
            for moment in [
                at(2026, 11, 26, 15),
                at(2024, 2, 29, 23),
                at(1969, 12, 31, 1),
            ] {
                let window = period.window(moment);
                let end = period.window_end(window).unwrap();
                assert!(end > moment, "{period:?} {moment}");
                assert_eq!(period.window(end), window + 1, "{period:?} {moment}");
                assert_eq!(
                    period.window(end - Duration::nanoseconds(1)),
                    window,
                    "{period:?} {moment}"
                );
            }
        }
    }

    #[test]
    fn weeks_start_on_monday_and_months_on_the_first() {
        let sunday = at(2026, 11, 29, 23);
        let monday = at(2026, 11, 30, 0);
        assert_eq!(
            LimitPeriod::Week.window(monday),
            LimitPeriod::Week.window(sunday) + 1
        );
        assert_eq!(
            LimitPeriod::Month.window_end(LimitPeriod::Month.window(at(2026, 12, 5, 0))),
            Some(at(2027, 1, 1, 0))
        );
        assert_eq!(LimitPeriod::None.window(sunday), 0);
        assert_eq!(LimitPeriod::parse("week"), Some(LimitPeriod::Week));
        assert_eq!(LimitPeriod::parse("year"), None);
    }
}
