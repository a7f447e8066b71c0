//! What a call may hold of an escrow pot: the credits an instance took from an account into an
//! escrow row of its own (see the escrow mode's docs in `store::sea`).

use chrono::{DateTime, Utc};

use super::reserve::{Payer, decide_reserve};
use crate::credits::{Balance, Credits, Split};

/// An escrow pot as the instance that owns it sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Pot {
    /// The escrow row as this instance last wrote or read it.
    pub(crate) row: Balance,
    /// What held calls take from it.
    pub(crate) held: Balance,
    /// A refill or a give-back is being written: nothing may be held until it is known.
    pub(crate) writing: bool,
    /// The account's subscription period when the pot was last refilled.
    pub(crate) period_end: Option<DateTime<Utc>>,
}

/// What the account's own row says, read when the call arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AccountRow {
    /// Subscription credits left in the row (outside every escrow).
    pub(crate) subscription: Credits,
    /// When the account's subscription period ends.
    pub(crate) subscription_ends_at: Option<DateTime<Utc>>,
}

/// What a call of `price` made at `at` holds of `pot`, or `None` when the pot cannot pay it now
/// and must be refilled first: while it is being written; while it holds subscription credits
/// of another period than the account's (a lapse took them); when it cannot pay; or when the
/// call would take top-up credits from it while the account's row still has subscription
/// credits to spend (subscription first, across the row and the pot: the refill swaps them).
pub(crate) fn decide_pot_hold(
    pot: Pot,
    account: AccountRow,
    at: DateTime<Utc>,
    price: Credits,
) -> Option<Split> {
    if pot.writing {
        return None;
    }
    let period = account.subscription_ends_at;
    if pot.row.subscription > Credits::ZERO && period != pot.period_end {
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

#[cfg(test)]
mod tests {
    use chrono::Duration;
    use proptest::prelude::*;

    use super::*;
    use crate::store::rules::test_values::balance;

    fn account(subscription: i64) -> AccountRow {
        AccountRow {
            subscription: Credits::new(subscription),
            subscription_ends_at: None,
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
        };
        assert_eq!(decide_pot_hold(pot, renewed, now, Credits::new(1)), None);
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
    }
}
