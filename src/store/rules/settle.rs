//! The settle rule: what a call is charged once its cost is known.
//!
//! A reservation takes (or holds) the most the call can cost: its price per call, or for a
//! model priced by tokens a ceiling estimated before the call. The settle charges the cost the
//! provider's usage says, in the same write that returns the rest of the reservation. A cost
//! above the reservation (an estimate that was low) takes what the account can pay beyond it
//! (free credits, subscription first), and the entry records what it could not pay: the
//! account never goes below zero, and nothing is charged twice.

use crate::credits::{Balance, Credits, Split};

/// What a settle moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Settlement {
    /// What the call is charged, bucket by bucket (what the entry records).
    pub(crate) charged: Split,
    /// What goes back of what the reservation took (its cost was below the reservation).
    pub(crate) returned: Split,
    /// What is taken beyond the reservation (its cost was above it), from free credits.
    pub(crate) extra: Split,
    /// What the account could not pay of the cost.
    pub(crate) shortfall: Credits,
}

/// Settles a call whose reservation took `taken` and whose cost is `cost` (`None`: the
/// reservation is the cost, as for a price per call), with `free` what the account can spend
/// now besides it (no bucket below zero; a subscription whose period ended counts as empty).
pub(crate) fn decide_settle(taken: Split, cost: Option<Credits>, free: Balance) -> Settlement {
    let reserved = taken.total();
    let cost = cost.unwrap_or(reserved).max(Credits::ZERO);
    if cost <= reserved {
        // Charged from what was taken, subscription first; the rest goes back where it came from.
        let subscription = taken.subscription.min(cost);
        let charged = Split {
            subscription,
            topup: cost.minus(subscription),
        };
        return Settlement {
            charged,
            returned: Split {
                subscription: taken.subscription.minus(charged.subscription),
                topup: taken.topup.minus(charged.topup),
            },
            extra: Split::default(),
            shortfall: Credits::ZERO,
        };
    }
    let over = cost.minus(reserved);
    let subscription = free.subscription.max(Credits::ZERO).min(over);
    let topup = free.topup.max(Credits::ZERO).min(over.minus(subscription));
    let extra = Split {
        subscription,
        topup,
    };
    Settlement {
        charged: taken.plus(extra),
        returned: Split::default(),
        extra,
        shortfall: over.minus(extra.total()),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::store::rules::test_values::{balance, split};

    #[test]
    fn a_price_per_call_charges_what_was_reserved() {
        let settled = decide_settle(split(2, 1), None, balance(50, 50));
        assert_eq!(settled.charged, split(2, 1));
        assert_eq!(
            (settled.returned, settled.extra),
            (split(0, 0), split(0, 0))
        );
        assert_eq!(settled.shortfall, Credits::ZERO);
    }

    #[test]
    fn a_cost_below_the_reservation_returns_the_rest_top_up_first() {
        // Reserved 5 subscription + 5 top-up, cost 7: subscription is charged first, so the
        // 3 that go back are top-up credits.
        let settled = decide_settle(split(5, 5), Some(Credits::new(7)), balance(0, 0));
        assert_eq!(settled.charged, split(5, 2));
        assert_eq!(settled.returned, split(0, 3));
        assert_eq!(settled.shortfall, Credits::ZERO);
        let nothing = decide_settle(split(5, 5), Some(Credits::ZERO), balance(0, 0));
        assert_eq!(
            (nothing.charged, nothing.returned),
            (split(0, 0), split(5, 5))
        );
    }

    #[test]
    fn a_cost_above_the_reservation_takes_free_credits_then_records_the_shortfall() {
        let settled = decide_settle(split(0, 4), Some(Credits::new(10)), balance(2, 1));
        assert_eq!(settled.extra, split(2, 1));
        assert_eq!(settled.charged, split(2, 5));
        assert_eq!(settled.shortfall, Credits::new(3));
        let covered = decide_settle(split(0, 4), Some(Credits::new(6)), balance(5, 5));
        assert_eq!(
            (covered.extra, covered.shortfall),
            (split(2, 0), Credits::ZERO)
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(10_000))]

        /// A settle charges exactly the cost less the shortfall; it returns only what was taken,
        /// takes beyond it only what is free, and leaves a shortfall only when nothing free is
        /// left; no amount is below zero.
        #[test]
        fn a_settle_charges_the_cost_or_all_it_can(
            taken_sub in 0i64..1_000, taken_topup in 0i64..1_000,
            free_sub in 0i64..1_000, free_topup in 0i64..1_000,
            cost in prop::option::of(0i64..4_000),
        ) {
            let taken = split(taken_sub, taken_topup);
            let free = balance(free_sub, free_topup);
            let s = decide_settle(taken, cost.map(Credits::new), free);
            let cost = cost.unwrap_or(taken_sub + taken_topup);
            for part in [s.charged, s.returned, s.extra] {
                prop_assert!(part.subscription.get() >= 0 && part.topup.get() >= 0, "{s:?}");
            }
            prop_assert!(s.shortfall.get() >= 0);
            prop_assert_eq!(s.charged.total().get() + s.shortfall.get(), cost);
            // What was taken is charged or returned, never both, never lost.
            prop_assert_eq!(s.charged.plus(s.returned), taken.plus(s.extra));
            prop_assert!(s.extra.subscription.get() <= free_sub && s.extra.topup.get() <= free_topup);
            if s.shortfall.get() > 0 {
                prop_assert_eq!(s.extra, split(free_sub, free_topup));
            }
            if s.returned.total().get() > 0 {
                prop_assert_eq!(s.extra.total(), Credits::ZERO);
                prop_assert!(s.returned.subscription.get() == 0 || s.charged.topup.get() == 0,
                    "subscription is charged before top-up: {s:?}");
            }
        }
    }
}
