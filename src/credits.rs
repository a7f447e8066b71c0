//! Money: credits are whole numbers in an integer newtype, never floats.

use serde::{Deserialize, Serialize};

/// An amount of credits. Balances and prices are never negative; the type allows negative values
/// only so that arithmetic mistakes are caught by checks rather than by wrap-around.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Credits(pub i64);

impl Credits {
    /// No credits.
    pub const ZERO: Credits = Credits(0);

    /// The amount as a plain integer.
    pub fn get(self) -> i64 {
        self.0
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
    /// Both buckets together.
    pub fn total(self) -> Credits {
        Credits(self.subscription.0 + self.topup.0)
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
