//! Money: credits are whole numbers in an integer newtype, never floats.

use serde::{Deserialize, Serialize};

/// An amount of credits. Balances and prices are never negative; the type allows negative values
/// only so that arithmetic mistakes are caught by checks rather than by wrap-around.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Credits(pub(crate) i64);

impl Credits {
    /// The largest balance a bucket, or an account's two buckets together, can hold.
    pub const MAX: Credits = Credits(i64::MAX);

    /// No credits.
    pub const ZERO: Credits = Credits(0);

    /// An amount of credits.
    pub const fn new(amount: i64) -> Credits {
        Credits(amount)
    }

    /// The amount as a plain integer.
    pub const fn get(self) -> i64 {
        self.0
    }

    /// `self + other`, checked: no amount the ledger keeps can reach `i64`'s bounds (grants are
    /// refused past [`Credits::MAX`]), so an overflow is a bug, asserted in debug builds; it
    /// saturates rather than wraps.
    pub(crate) fn plus(self, other: Credits) -> Credits {
        let sum = self.0.checked_add(other.0);
        debug_assert!(sum.is_some(), "credits overflowed: {self} + {other}");
        Credits(sum.unwrap_or(if other.0 > 0 { i64::MAX } else { i64::MIN }))
    }

    /// `self - other`, checked as [`plus`](Self::plus).
    pub(crate) fn minus(self, other: Credits) -> Credits {
        let difference = self.0.checked_sub(other.0);
        debug_assert!(difference.is_some(), "credits overflowed: {self} - {other}");
        Credits(difference.unwrap_or(if other.0 > 0 { i64::MIN } else { i64::MAX }))
    }
}

impl std::fmt::Display for Credits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// The two pools of an account's credits. Calls spend subscription credits first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Bucket {
    /// Credits that come with a subscription; spent first.
    Subscription,
    /// Credits bought as top-up packs; spent once the subscription credits are gone.
    Topup,
}

impl Bucket {
    /// The name stored in the database.
    pub fn as_str(self) -> &'static str {
        match self {
            Bucket::Subscription => "subscription",
            Bucket::Topup => "topup",
        }
    }

    /// Parses the stored name.
    pub fn parse(name: &str) -> Option<Bucket> {
        match name {
            "subscription" => Some(Bucket::Subscription),
            "topup" => Some(Bucket::Topup),
            _ => None,
        }
    }
}

/// An account's credits, bucket by bucket.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Balance {
    /// Subscription credits left.
    pub subscription: Credits,
    /// Top-up credits left.
    pub topup: Credits,
}

impl Balance {
    /// Both buckets together. Never wraps: grants that would take the total past
    /// [`Credits::MAX`] are refused, and a total past it (a database edited by hand) reads as
    /// [`Credits::MAX`], which the audit reports.
    pub fn total(self) -> Credits {
        Credits(self.subscription.0.saturating_add(self.topup.0))
    }

    /// Both buckets together, if that can be represented.
    pub fn checked_total(self) -> Option<Credits> {
        self.subscription.0.checked_add(self.topup.0).map(Credits)
    }

    /// What a call made at `at` may spend: nothing of a subscription whose period ended
    /// (`subscription_ends_at`) by then.
    pub fn spendable(
        self,
        subscription_ends_at: Option<chrono::DateTime<chrono::Utc>>,
        at: chrono::DateTime<chrono::Utc>,
    ) -> Balance {
        if subscription_ends_at.is_some_and(|end| end <= at) {
            Balance {
                subscription: Credits::ZERO,
                topup: self.topup,
            }
        } else {
            self
        }
    }

    /// This balance with `amount` more in `bucket`, if the bucket and the total stay within
    /// [`Credits::MAX`].
    pub fn checked_grant(self, bucket: Bucket, amount: Credits) -> Option<Balance> {
        let mut granted = self;
        let credited = match bucket {
            Bucket::Subscription => &mut granted.subscription,
            Bucket::Topup => &mut granted.topup,
        };
        *credited = Credits(credited.0.checked_add(amount.0)?);
        granted.checked_total().map(|_| granted)
    }

    /// This balance with `split` added, bucket by bucket (credits given back, or held).
    pub(crate) fn plus(self, split: Split) -> Balance {
        Balance {
            subscription: self.subscription.plus(split.subscription),
            topup: self.topup.plus(split.topup),
        }
    }

    /// Two balances added bucket by bucket (what several holds hold together).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))] // escrow's
    pub(crate) fn and(self, other: Balance) -> Balance {
        Balance {
            subscription: self.subscription.plus(other.subscription),
            topup: self.topup.plus(other.topup),
        }
    }

    /// This balance less `other`, bucket by bucket; a bucket can go below zero, as with
    /// [`minus`](Self::minus).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))] // escrow's
    pub(crate) fn less(self, other: Balance) -> Balance {
        Balance {
            subscription: self.subscription.minus(other.subscription),
            topup: self.topup.minus(other.topup),
        }
    }

    /// This balance with `split` taken, bucket by bucket. A bucket can go below zero; callers
    /// that must not let it check the result.
    pub(crate) fn minus(self, split: Split) -> Balance {
        Balance {
            subscription: self.subscription.minus(split.subscription),
            topup: self.topup.minus(split.topup),
        }
    }

    /// What is left of this balance once `held` is set aside: no bucket below zero, for one
    /// emptied under its holds (by another connection) has nothing left to spend.
    pub(crate) fn free_of(self, held: Balance) -> Balance {
        Balance {
            subscription: Credits((self.subscription.0 - held.subscription.0).max(0)),
            topup: Credits((self.topup.0 - held.topup.0).max(0)),
        }
    }

    /// How a charge of `price` is taken from this balance: subscription first, the rest from
    /// top-up. `None` when the two buckets together cannot pay.
    pub fn split_charge(self, price: Credits) -> Option<Split> {
        if price.0 < 0 || self.total() < price {
            return None;
        }
        let subscription = Credits(self.subscription.0.clamp(0, price.0));
        Some(Split {
            subscription,
            topup: Credits(price.0 - subscription.0),
        })
    }
}

/// How many credits a call took from each bucket; a refund returns exactly these.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Split {
    /// Taken from the subscription bucket.
    pub subscription: Credits,
    /// Taken from the top-up bucket.
    pub topup: Credits,
}

impl Split {
    /// Both parts together: the price charged.
    pub fn total(self) -> Credits {
        Credits(self.subscription.0 + self.topup.0)
    }

    /// Two splits added bucket by bucket (what several calls took together).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))] // escrow's
    pub(crate) fn plus(self, other: Split) -> Split {
        Split {
            subscription: self.subscription.plus(other.subscription),
            topup: self.topup.plus(other.topup),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn balance(subscription: i64, topup: i64) -> Balance {
        Balance {
            subscription: Credits(subscription),
            topup: Credits(topup),
        }
    }

    #[test]
    fn held_credits_are_set_aside_bucket_by_bucket_and_never_below_zero() {
        let taken = Split {
            subscription: Credits(3),
            topup: Credits(2),
        };
        assert_eq!(balance(5, 5).minus(taken), balance(2, 3));
        assert_eq!(balance(2, 3).plus(taken), balance(5, 5));
        assert_eq!(balance(1, 1).minus(taken), balance(-2, -1));
        assert_eq!(balance(10, 4).free_of(balance(3, 6)), balance(7, 0));
    }

    #[test]
    fn a_grant_past_the_largest_balance_is_refused_in_a_bucket_or_in_total() {
        let full = balance(0, i64::MAX);
        assert_eq!(full.checked_grant(Bucket::Topup, Credits(1)), None);
        assert_eq!(full.checked_grant(Bucket::Subscription, Credits(1)), None);
        assert_eq!(
            balance(1, i64::MAX - 2).checked_grant(Bucket::Subscription, Credits(1)),
            Some(balance(2, i64::MAX - 2))
        );
        assert_eq!(balance(i64::MAX, 1).total(), Credits::MAX);
        assert_eq!(balance(i64::MAX, 1).checked_total(), None);
    }

    #[test]
    fn charge_takes_subscription_credits_first() {
        let split = balance(10, 10).split_charge(Credits(3)).unwrap();
        assert_eq!((split.subscription, split.topup), (Credits(3), Credits(0)));
    }

    #[test]
    fn charge_splits_across_buckets_when_subscription_is_short() {
        let split = balance(2, 10).split_charge(Credits(5)).unwrap();
        assert_eq!((split.subscription, split.topup), (Credits(2), Credits(3)));
    }

    #[test]
    fn charge_spends_the_last_credit_exactly() {
        let split = balance(1, 2).split_charge(Credits(3)).unwrap();
        assert_eq!(split.total(), Credits(3));
        assert_eq!(balance(1, 1).split_charge(Credits(3)), None);
    }
}
