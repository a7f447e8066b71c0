//! What a call may hold of an escrow pot: the credits an instance took from an account into an
//! escrow row of its own (see the escrow mode's docs in `store::sea`).

use chrono::{DateTime, Utc};

use super::reserve::{Payer, decide_reserve};
use crate::credits::{Balance, Credits, Split};

/// An escrow pot as the instance that owns it sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pot {
    /// The escrow row as this instance last wrote or read it.
    pub row: Balance,
    /// What held calls take from it.
    pub held: Balance,
    /// A refill or a give-back is being written: nothing may be held until it is known.
    pub writing: bool,
    /// The account's subscription period when the pot was last refilled.
    pub period_end: Option<DateTime<Utc>>,
    /// The id of the account's last lapse when the pot was last refilled (0: none).
    pub last_lapse: i64,
}

/// What the account's own row says, read when the call arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AccountRow {
    /// Subscription credits left in the row (outside every escrow).
    pub subscription: Credits,
    /// When the account's subscription period ends.
    pub subscription_ends_at: Option<DateTime<Utc>>,
    /// The id of the account's last lapse (0: none).
    pub last_lapse: i64,
}

/// What a call of `price` made at `at` holds of `pot`, or `None` when the pot cannot pay it now
/// and must be refilled first: while it is being written; while it holds subscription credits
/// of another period than the account's (a lapse took them); when it cannot pay; or when the
/// call would take top-up credits from it while the account's row still has subscription
/// credits to spend (subscription first, across the row and the pot: the refill swaps them).
pub fn decide_pot_hold(
    pot: Pot,
    account: AccountRow,
    at: DateTime<Utc>,
    price: Credits,
) -> Option<Split> {
    if pot.writing {
        return None;
    }
    let period = account.subscription_ends_at;
    let lapsed_since = period != pot.period_end || account.last_lapse > pot.last_lapse;
    if pot.row.subscription > Credits::ZERO && lapsed_since {
        return None;
    }
    let payer = Payer {
        balance: pot.row,
        held: pot.held,
        subscription_ends_at: period,
    };
    // The key was found active when the escrow read the account.
    let taken = decide_reserve(true, None, Some(payer), at, price).ok()?;
    let row_subscription = Balance {
        subscription: account.subscription,
        topup: Credits::ZERO,
    }
    .spendable(period, at)
    .subscription;
    if taken.topup > Credits::ZERO && row_subscription > Credits::ZERO {
        return None;
    }
    Some(taken)
}

/// A slice is never more than this share of what the account has to spend (1/8), so that other
/// instances find some, and so that what an instance holds when the account runs low is small.
pub const SLICE_SHARE: i64 = 8;

/// How many calls' worth an account must have to spend (in its row and this instance's free
/// escrow) for a refill to take a slice. Below that its calls are reserved in the database,
/// where every instance sees the same credits, so that an account running low is refused only
/// when it cannot pay, save for what other instances still have in escrow (what each took at
/// its last refill, at most an eighth of what the account had then).
pub const ESCROW_FROM_CALLS: i64 = 256;

/// What a refill asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slice {
    /// Some calls' worth at `price`.
    Calls {
        /// The price of the call that asked.
        price: Credits,
        /// How many calls' worth.
        calls: i64,
    },
    /// What a settle needs beyond what its call holds.
    Exactly(Credits),
}

/// What a refill takes into a pot from what the account has to `spendable` (its row and the
/// pot's free credits together), keeping `keep` (its low-balance threshold) out of a slice:
/// subscription credits first. A slice of calls is at most an eighth of what is there, and
/// nothing from an account with fewer than [`ESCROW_FROM_CALLS`] calls' worth; an exact amount
/// is what is there, at most.
pub fn refill(spendable: Balance, keep: Credits, slice: Slice) -> Split {
    let total = spendable.total().get();
    let want = match slice {
        Slice::Calls { price, calls } => {
            if total >= price.get().saturating_mul(ESCROW_FROM_CALLS) {
                Ord::min(price.get().saturating_mul(calls), total / SLICE_SHARE)
                    .min((total - keep.get()).max(0))
            } else {
                0
            }
        }
        Slice::Exactly(amount) => Ord::min(amount.get(), total),
    }
    .max(0);
    let from_subscription = Ord::min(spendable.subscription.get().max(0), want);
    let take = Split {
        subscription: Credits::new(from_subscription),
        topup: Credits::new(Ord::min(
            spendable.topup.get().max(0),
            want - from_subscription,
        )),
    };
    debug_assert!(
        take.subscription >= Credits::ZERO
            && take.topup >= Credits::ZERO
            && take.subscription <= spendable.subscription.max(Credits::ZERO)
            && take.topup <= spendable.topup.max(Credits::ZERO),
        "a refill takes more than there is: {take:?} of {spendable:?}"
    );
    take
}

#[cfg(test)]
mod tests {
    use chrono::Duration;
    use proptest::prelude::*;

    use super::*;
    use crate::store::rules::test_values::{balance, split};

    fn account(subscription: i64) -> AccountRow {
        AccountRow {
            subscription: Credits::new(subscription),
            subscription_ends_at: None,
            last_lapse: 0,
        }
    }

    #[test]
    fn nothing_is_held_while_the_pot_is_being_written() {
        let pot = Pot {
            row: balance(10, 0),
            writing: true,
            ..Pot::default()
        };
        assert_eq!(
            decide_pot_hold(pot, account(0), Utc::now(), Credits::new(1)),
            None
        );
    }

    #[test]
    fn top_up_in_escrow_waits_while_the_row_has_subscription_credits() {
        let pot = Pot {
            row: balance(1, 10),
            ..Pot::default()
        };
        let now = Utc::now();
        assert_eq!(decide_pot_hold(pot, account(5), now, Credits::new(2)), None);
        let paid = decide_pot_hold(pot, account(0), now, Credits::new(2)).unwrap();
        assert_eq!((paid.subscription.get(), paid.topup.get()), (1, 1));
    }

    #[test]
    fn subscription_credits_of_another_period_are_not_spent() {
        let now = Utc::now();
        let pot = Pot {
            row: balance(10, 0),
            period_end: Some(now + Duration::days(1)),
            ..Pot::default()
        };
        let renewed = AccountRow {
            subscription: Credits::ZERO,
            subscription_ends_at: Some(now + Duration::days(31)),
            last_lapse: 0,
        };
        assert_eq!(decide_pot_hold(pot, renewed, now, Credits::new(1)), None);
    }

    /// A renewal to the same period end lapses what was left, the pot's subscription credits
    /// too: the period alone does not show it, the lapse does.
    #[test]
    fn subscription_credits_a_renewal_lapsed_are_not_spent() {
        let now = Utc::now();
        let end = Some(now + Duration::days(1));
        let pot = Pot {
            row: balance(10, 5),
            period_end: end,
            last_lapse: 3,
            ..Pot::default()
        };
        let renewed = AccountRow {
            subscription: Credits::new(100),
            subscription_ends_at: end,
            last_lapse: 4,
        };
        assert_eq!(decide_pot_hold(pot, renewed, now, Credits::new(1)), None);
        // The lapse the pot's refill saw, or an older one: the pot pays.
        let seen = AccountRow {
            last_lapse: 3,
            ..renewed
        };
        assert_eq!(
            decide_pot_hold(pot, seen, now, Credits::new(1)),
            Some(split(1, 0))
        );
        // Top-up credits alone are never lapsed.
        let topup_only = Pot {
            row: balance(0, 5),
            ..pot
        };
        let drained = AccountRow {
            subscription: Credits::ZERO,
            ..renewed
        };
        assert_eq!(
            decide_pot_hold(topup_only, drained, now, Credits::new(1)),
            Some(split(0, 1))
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(10_000))]

        /// What a call holds of a pot is its price, from what the pot has free, and never
        /// top-up credits while the account's row has subscription credits to spend.
        #[test]
        fn a_pot_holds_the_price_from_what_it_has_free_subscription_first(
            row in (0i64..500, 0i64..500),
            held in (0i64..600, 0i64..600),
            row_subscription in 0i64..50,
            price in 0i64..1_200,
        ) {
            let pot = Pot { row: balance(row.0, row.1), held: balance(held.0, held.1), ..Pot::default() };
            let at = Utc::now();
            if let Some(taken) = decide_pot_hold(pot, account(row_subscription), at, Credits::new(price)) {
                prop_assert_eq!(taken.total().get(), price);
                prop_assert!(taken.subscription.get() <= (row.0 - held.0).max(0));
                prop_assert!(taken.topup.get() <= (row.1 - held.1).max(0));
                prop_assert!(taken.topup.get() == 0 || row_subscription == 0);
            } else {
                let free = (row.0 - held.0).max(0) + (row.1 - held.1).max(0);
                let sub_free = (row.0 - held.0).max(0);
                prop_assert!(free < price || (row_subscription > 0 && sub_free < price));
            }
        }

        /// A refill takes subscription credits first, never more than there is of either
        /// bucket, a slice of calls at most an eighth of it and none of the threshold kept,
        /// and an exact amount in full whenever the account has it.
        #[test]
        fn a_refill_takes_subscription_first_and_no_more_than_there_is(
            spendable in (0i64..100_000, 0i64..100_000),
            keep in 0i64..10_000,
            price in 1i64..100,
            calls in 1i64..1_024,
            exact in prop::option::of(0i64..300_000),
        ) {
            let spendable = balance(spendable.0, spendable.1);
            let total = spendable.total().get();
            let slice = match exact {
                Some(amount) => Slice::Exactly(Credits::new(amount)),
                None => Slice::Calls { price: Credits::new(price), calls },
            };
            let take = refill(spendable, Credits::new(keep), slice);
            prop_assert!(take.subscription.get() >= 0 && take.topup.get() >= 0);
            prop_assert!(take.subscription <= spendable.subscription && take.topup <= spendable.topup);
            prop_assert!(take.topup == Credits::ZERO || take.subscription == spendable.subscription);
            match exact {
                Some(amount) => prop_assert_eq!(take.total().get(), amount.min(total)),
                None if total < price * ESCROW_FROM_CALLS => prop_assert_eq!(take.total(), Credits::ZERO),
                None => {
                    prop_assert!(take.total().get() <= total / SLICE_SHARE);
                    prop_assert!(take.total().get() <= (total - keep).max(0));
                    prop_assert!(take.total().get() <= price * calls);
                }
            }
        }
    }

    #[test]
    fn a_refill_takes_a_slice_of_calls_subscription_first() {
        let take = refill(
            balance(3_000, 5_000),
            Credits::ZERO,
            Slice::Calls {
                price: Credits::new(10),
                calls: 64,
            },
        );
        assert_eq!(take, split(640, 0));
        let take = refill(
            balance(300, 5_000),
            Credits::ZERO,
            Slice::Calls {
                price: Credits::new(10),
                calls: 64,
            },
        );
        assert_eq!(take, split(300, 340));
    }

    #[test]
    fn a_refill_takes_nothing_from_an_account_running_low() {
        let slice = Slice::Calls {
            price: Credits::new(10),
            calls: 64,
        };
        // Fewer than 256 calls' worth.
        assert_eq!(
            refill(balance(2_000, 550), Credits::ZERO, slice),
            split(0, 0)
        );
        // An eighth at most, and never the threshold kept.
        assert_eq!(
            refill(balance(2_560, 0), Credits::ZERO, slice),
            split(320, 0)
        );
        assert_eq!(
            refill(balance(2_560, 0), Credits::new(2_400), slice),
            split(160, 0)
        );
    }

    #[test]
    fn a_refill_for_a_settle_takes_what_it_needs_or_what_there_is() {
        assert_eq!(
            refill(
                balance(5, 20),
                Credits::new(1_000),
                Slice::Exactly(Credits::new(12))
            ),
            split(5, 7)
        );
        assert_eq!(
            refill(
                balance(5, 20),
                Credits::ZERO,
                Slice::Exactly(Credits::new(99))
            ),
            split(5, 20)
        );
    }
}
