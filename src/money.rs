//! Amounts of the operator's own money (what a call cost him, what he earned): exact, in
//! billionths of his currency's unit, never a float.
//!
//! Credits are what a client pays ([`Credits`]); [`Money`] is what the operator pays his
//! provider and what a credit is worth to him (the catalogue's `currency` and `credit_value`).
//! A cost is worked out from prices kept to a millionth of a unit per million tokens, so the
//! cost of one call is exact to a billionth of a unit (rounded half up once, at the end), and a
//! sum of calls is exact.
//!
//! ```
//! use model_gateway::money::Money;
//!
//! let cost: Money = "0.065".parse().unwrap();
//! assert_eq!(cost.nanos(), 65_000_000);
//! assert_eq!(cost.to_string(), "0.065");
//! // In JSON, a decimal number written exactly.
//! assert_eq!(serde_json::to_string(&cost).unwrap(), "0.065");
//! ```

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::credits::Credits;

/// Billionths in a unit of money.
pub const NANOS: i64 = 1_000_000_000;

/// An amount of the operator's currency, in billionths of its unit. Negative amounts are a
/// margin below zero (a call sold for less than it cost).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Money(i64);

impl Money {
    /// Nothing.
    pub const ZERO: Money = Money(0);

    /// `nanos` billionths of a unit.
    pub const fn from_nanos(nanos: i64) -> Money {
        Money(nanos)
    }

    /// The amount in billionths of a unit.
    pub const fn nanos(self) -> i64 {
        self.0
    }

    /// `units` of the currency as the catalogue writes them (a TOML number), rounded to a
    /// billionth; `None` when not finite or beyond what an amount holds (about 9.2 billion).
    pub fn from_units(units: f64) -> Option<Money> {
        let nanos = (units * NANOS as f64).round();
        (nanos.is_finite() && nanos.abs() < 9.2e18).then_some(Money(nanos as i64))
    }

    /// `self - other`, saturating (no sum the gateway makes comes near the bounds).
    pub fn minus(self, other: Money) -> Money {
        Money(self.0.saturating_sub(other.0))
    }

    /// `self + other`, saturating.
    pub fn plus(self, other: Money) -> Money {
        Money(self.0.saturating_add(other.0))
    }

    /// What `credits` are worth at `self` a credit, saturating.
    pub fn times(self, credits: Credits) -> Money {
        Money::saturating(i128::from(self.0) * i128::from(credits.get()))
    }

    /// An exact sum in billionths, saturating at the bounds of an amount.
    pub(crate) fn saturating(nanos: i128) -> Money {
        Money(i64::try_from(nanos).unwrap_or(if nanos > 0 { i64::MAX } else { i64::MIN }))
    }
}

/// Writes an exact decimal of billionths: `nanos` as units, without trailing zeros
/// (`65000000` as `0.065`, `-1500000000` as `-1.5`, `0` as `0`). Sums of many amounts are
/// written by this too.
pub fn write_decimal(nanos: i128, out: &mut impl fmt::Write) -> fmt::Result {
    let sign = if nanos < 0 { "-" } else { "" };
    let magnitude = nanos.unsigned_abs();
    let (whole, fraction) = (magnitude / NANOS as u128, magnitude % NANOS as u128);
    if fraction == 0 {
        return write!(out, "{sign}{whole}");
    }
    let digits = format!("{fraction:09}");
    write!(out, "{sign}{whole}.{}", digits.trim_end_matches('0'))
}

/// `nanos` as an exact decimal (see [`write_decimal`]).
pub fn decimal(nanos: i128) -> String {
    let mut text = String::new();
    write_decimal(nanos, &mut text).expect("writing to a String");
    text
}

/// `nanos` as a JSON number written exactly (no float between), for sums as for amounts.
pub fn json_number(nanos: i128) -> Box<serde_json::value::RawValue> {
    serde_json::value::RawValue::from_string(decimal(nanos)).expect("a decimal is JSON")
}

impl fmt::Display for Money {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_decimal(i128::from(self.0), f)
    }
}

/// Why a text is not an amount of money.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not an amount of money (a decimal number with at most nine decimals)")]
pub struct NotMoney(String);

impl std::str::FromStr for Money {
    type Err = NotMoney;

    /// A decimal number (`12`, `-0.5`, `0.000000001`), exactly; at most nine decimals.
    fn from_str(text: &str) -> Result<Money, NotMoney> {
        let fail = || NotMoney(text.to_owned());
        let (negative, digits) = match text.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        let (whole, fraction) = digits.split_once('.').unwrap_or((digits, ""));
        let all_digits = |part: &str| part.bytes().all(|byte| byte.is_ascii_digit());
        if whole.is_empty() || !all_digits(whole) || !all_digits(fraction) || fraction.len() > 9 {
            return Err(fail());
        }
        if digits.ends_with('.') {
            return Err(fail());
        }
        let whole: i128 = whole.parse().map_err(|_| fail())?;
        let fraction: i128 = format!("{fraction:0<9}").parse().map_err(|_| fail())?;
        let nanos = whole
            .checked_mul(i128::from(NANOS))
            .and_then(|nanos| nanos.checked_add(fraction))
            .ok_or_else(fail)?;
        let nanos = if negative { -nanos } else { nanos };
        i64::try_from(nanos).map(Money).map_err(|_| fail())
    }
}

impl Serialize for Money {
    /// A JSON number written exactly, as `0.065`.
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        json_number(i128::from(self.0)).serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Money {
    /// A number (read through its decimal text, so `0.065` is exact) or a string holding one.
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Money, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            Text(String),
            Number(f64),
        }
        match Written::deserialize(deserializer)? {
            Written::Text(text) => text.parse().map_err(serde::de::Error::custom),
            // A float's shortest decimal is the one the writer meant, up to nine decimals.
            Written::Number(number) => Money::from_units(number)
                .ok_or_else(|| serde::de::Error::custom(format!("{number} is not an amount"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn decimals_are_written_exactly_without_trailing_zeros() {
        for (nanos, text) in [
            (0, "0"),
            (65_000_000, "0.065"),
            (-1_500_000_000, "-1.5"),
            (1, "0.000000001"),
            (12 * NANOS, "12"),
            (-7, "-0.000000007"),
        ] {
            assert_eq!(Money(nanos).to_string(), text);
            assert_eq!(text.parse::<Money>(), Ok(Money(nanos)), "{text}");
            assert_eq!(serde_json::to_string(&Money(nanos)).unwrap(), text);
        }
    }

    #[test]
    fn what_is_not_an_amount_is_refused() {
        for bad in [
            "",
            "-",
            ".5",
            "1.",
            "1.0000000001",
            "1e3",
            "0x10",
            "1,5",
            "+1",
            "99999999999",
        ] {
            assert!(bad.parse::<Money>().is_err(), "{bad}");
        }
    }

    #[test]
    fn catalogue_numbers_round_to_the_billionth() {
        assert_eq!(Money::from_units(0.01), Some(Money(10_000_000)));
        assert_eq!(Money::from_units(2.5), Some(Money(2_500_000_000)));
        assert_eq!(Money::from_units(f64::NAN), None);
        assert_eq!(Money::from_units(1e12), None);
        assert_eq!(
            Money::from_units(0.01).unwrap().times(Credits::new(7)),
            Money(70_000_000)
        );
    }

    proptest! {
        #[test]
        fn every_amount_reads_back_what_it_writes(nanos in any::<i64>()) {
            let money = Money(nanos);
            prop_assert_eq!(money.to_string().parse::<Money>(), Ok(money));
            let json = serde_json::to_string(&money).unwrap();
            let back: serde_json::Value = serde_json::from_str(&json).unwrap();
            prop_assert!(back.is_number());
        }
    }
}
