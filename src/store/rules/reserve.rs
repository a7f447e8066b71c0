//! The reservation rule: the caller's key is active, its account exists, the key's spending
//! limit leaves room for the price, and what the account can spend at the call's time, free of
//! what calls under way already hold, pays it: subscription credits first (none of a period
//! that has ended), the rest from top-up.

use chrono::{DateTime, Utc};

use super::allowance::Allowance;
use crate::call::AccountId;
use crate::credits::{Balance, Credits, Split};
use crate::store::types::{ReserveError, unknown_account};

/// What a reservation sees of the account that pays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Payer {
    /// The balance as the store keeps it (the row, or an escrow pot).
    pub balance: Balance,
    /// What calls under way hold of it and it has not yet been charged (zero where a
    /// reservation takes its credits from the balance at once).
    pub held: Balance,
    /// When the subscription period ends, if it does.
    pub subscription_ends_at: Option<DateTime<Utc>>,
}

impl Payer {
    /// What it may spend at `at`: its balance free of what is held, without subscription
    /// credits whose period has ended.
    pub fn free(&self, at: DateTime<Utc>) -> Balance {
        self.balance
            .free_of(self.held)
            .spendable(self.subscription_ends_at, at)
    }

    /// A balance that reservations take from at once: nothing held beside it.
    pub fn unheld(balance: Balance, subscription_ends_at: Option<DateTime<Utc>>) -> Payer {
        Payer {
            balance,
            held: Balance::default(),
            subscription_ends_at,
        }
    }
}

/// Why a reservation is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The caller's key is revoked or unknown.
    KeyRevoked,
    /// No such account.
    UnknownAccount,
    /// The key's spending limit leaves too little for the price.
    KeyLimitReached,
    /// The account cannot pay the price now.
    InsufficientCredits,
}

impl Refusal {
    /// The error a store answers with, for `account`.
    pub fn into_error(self, account: AccountId) -> ReserveError {
        match self {
            Refusal::KeyRevoked => ReserveError::KeyRevoked,
            Refusal::UnknownAccount => unknown_account(account).into(),
            Refusal::KeyLimitReached => ReserveError::KeyLimitReached,
            Refusal::InsufficientCredits => ReserveError::InsufficientCredits,
        }
    }
}

/// What a reservation sees of a key with a spending limit: its allowance as stored, what its
/// calls held in memory hold beside it, and when the reservation is recorded (its entry's
/// `created_at`: the window it counts in, then and when it is refunded).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limited {
    /// The allowance as stored.
    pub allowance: Allowance,
    /// What the key's calls held in memory hold beside it.
    pub held: Credits,
    /// When the reservation is recorded.
    pub at: DateTime<Utc>,
}

/// Decides a reservation of `price` made at `at` by a caller whose key is `key_active` (and
/// `limited`, if it has a spending limit), paid by `payer` (`None`: no such account): what it
/// takes of each bucket, or why it is refused.
pub fn decide_reserve(
    key_active: bool,
    limited: Option<Limited>,
    payer: Option<Payer>,
    at: DateTime<Utc>,
    price: Credits,
) -> Result<Split, Refusal> {
    if !key_active {
        return Err(Refusal::KeyRevoked);
    }
    let payer = payer.ok_or(Refusal::UnknownAccount)?;
    if limited.is_some_and(|limited| !limited.allowance.admits(limited.held, price, limited.at)) {
        return Err(Refusal::KeyLimitReached);
    }
    let spendable = payer.free(at);
    let taken = spendable
        .split_charge(price)
        .ok_or(Refusal::InsufficientCredits)?;
    debug_assert_eq!(taken.total(), price, "a reservation holds its price");
    debug_assert!(
        taken.subscription <= spendable.subscription && taken.topup <= spendable.topup,
        "a reservation takes only what is free to spend: {taken:?} of {spendable:?}"
    );
    Ok(taken)
}

#[cfg(test)]
mod tests {
    use chrono::Duration;
    use proptest::prelude::*;

    use super::*;
    use crate::store::rules::test_values::{balance, split};

    fn payer(subscription: i64, topup: i64) -> Option<Payer> {
        Some(Payer::unheld(balance(subscription, topup), None))
    }

    #[test]
    fn a_revoked_key_is_refused_before_the_account_is_looked_at() {
        let now = Utc::now();
        assert_eq!(
            decide_reserve(false, None, None, now, Credits::new(1)),
            Err(Refusal::KeyRevoked)
        );
        assert_eq!(
            decide_reserve(true, None, None, now, Credits::new(1)),
            Err(Refusal::UnknownAccount)
        );
    }

    #[test]
    fn a_key_whose_limit_is_reached_is_refused_whatever_the_account_has() {
        use crate::call::{KeyLimit, LimitPeriod};
        let now = Utc::now();
        let limited = |spent, held| Limited {
            allowance: Allowance {
                limit: KeyLimit {
                    credits: Credits::new(10),
                    period: LimitPeriod::None,
                },
                spent,
                window: 0,
            },
            held: Credits::new(held),
            at: now,
        };
        let price = Credits::new(4);
        assert_eq!(
            decide_reserve(true, Some(limited(6, 0)), payer(100, 0), now, price),
            Ok(split(4, 0))
        );
        assert_eq!(
            decide_reserve(true, Some(limited(6, 1)), payer(100, 0), now, price),
            Err(Refusal::KeyLimitReached)
        );
        assert_eq!(
            decide_reserve(true, Some(limited(7, 0)), payer(100, 0), now, price),
            Err(Refusal::KeyLimitReached)
        );
    }

    #[test]
    fn subscription_credits_go_first_then_top_up() {
        let now = Utc::now();
        let price = Credits::new(5);
        assert_eq!(
            decide_reserve(true, None, payer(10, 10), now, price),
            Ok(split(5, 0))
        );
        assert_eq!(
            decide_reserve(true, None, payer(2, 10), now, price),
            Ok(split(2, 3))
        );
        assert_eq!(
            decide_reserve(true, None, payer(2, 2), now, price),
            Err(Refusal::InsufficientCredits)
        );
    }

    #[test]
    fn credits_held_by_calls_under_way_are_not_spent_twice() {
        let now = Utc::now();
        let held = Payer {
            balance: balance(5, 5),
            held: balance(4, 5),
            subscription_ends_at: None,
        };
        assert_eq!(
            decide_reserve(true, None, Some(held), now, Credits::new(1)),
            Ok(split(1, 0))
        );
        assert_eq!(
            decide_reserve(true, None, Some(held), now, Credits::new(2)),
            Err(Refusal::InsufficientCredits)
        );
    }

    #[test]
    fn a_subscription_whose_period_ended_pays_nothing() {
        let now = Utc::now();
        let ended = Some(Payer::unheld(
            balance(10, 1),
            Some(now - Duration::seconds(1)),
        ));
        assert_eq!(
            decide_reserve(true, None, ended, now, Credits::new(2)),
            Err(Refusal::InsufficientCredits)
        );
        assert_eq!(
            decide_reserve(true, None, ended, now, Credits::new(1)),
            Ok(split(0, 1))
        );
        let running = Some(Payer::unheld(
            balance(10, 1),
            Some(now + Duration::seconds(1)),
        ));
        assert_eq!(
            decide_reserve(true, None, running, now, Credits::new(2)),
            Ok(split(2, 0))
        );
    }

    fn any_payer() -> impl Strategy<Value = Payer> {
        (
            0i64..1_000,
            0i64..1_000,
            0i64..1_200,
            0i64..1_200,
            prop::option::of(-5i64..5),
        )
            .prop_map(|(subscription, topup, held_sub, held_topup, ends)| Payer {
                balance: balance(subscription, topup),
                held: balance(held_sub, held_topup),
                subscription_ends_at: ends.map(|seconds| epoch() + Duration::seconds(seconds)),
            })
    }

    fn epoch() -> DateTime<Utc> {
        DateTime::<Utc>::UNIX_EPOCH + Duration::days(20_000)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(10_000))]

        /// A reservation takes exactly its price, never from credits held by calls under way,
        /// never from a subscription whose period ended, subscription credits first; it is
        /// refused exactly when what is free to spend cannot pay.
        #[test]
        fn a_reservation_takes_its_price_from_free_credits_subscription_first(
            payer in any_payer(),
            price in 0i64..2_500,
        ) {
            let at = epoch();
            let price = Credits::new(price);
            let free_sub = (payer.balance.subscription.get() - payer.held.subscription.get()).max(0);
            let free_sub = if payer.subscription_ends_at.is_some_and(|end| end <= at) { 0 } else { free_sub };
            let free_topup = (payer.balance.topup.get() - payer.held.topup.get()).max(0);
            match decide_reserve(true, None, Some(payer), at, price) {
                Ok(taken) => {
                    prop_assert_eq!(taken.total(), price);
                    prop_assert!(taken.subscription.get() <= free_sub);
                    prop_assert!(taken.topup.get() <= free_topup);
                    prop_assert!(taken.subscription.get() >= 0 && taken.topup.get() >= 0);
                    if taken.topup.get() > 0 {
                        prop_assert_eq!(taken.subscription.get(), free_sub);
                    }
                }
                Err(refusal) => {
                    prop_assert_eq!(refusal, Refusal::InsufficientCredits);
                    prop_assert!(free_sub + free_topup < price.get());
                }
            }
        }
    }
}
