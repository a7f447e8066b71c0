//! What an ended subscription period's lapse takes: the subscription credits left in the
//! account's row and in its escrow pots, except what calls the lapsing store holds still count
//! on (they were made within the period and take it when they end).

use crate::credits::Credits;

/// One escrow pot's subscription credits, as the lapse reads them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PotSubscription {
    /// Subscription credits in the pot.
    pub in_pot: Credits,
    /// What the lapsing store's own calls hold on it (zero for another instance's pot).
    pub held_here: Credits,
}

/// What a lapse takes, and what it leaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LapsePlan {
    /// Taken from the account's row.
    pub from_row: Credits,
    /// What each pot keeps, in the order given.
    pub kept: Vec<Credits>,
    /// Lapsed in all: `from_row` and what the pots gave up.
    pub lapsed: Credits,
}

/// The lapse of an account whose row holds `row` subscription credits, of which the lapsing
/// store's calls hold `held`, and which has `pots` in escrow.
pub fn decide_lapse(row: Credits, held: Credits, pots: &[PotSubscription]) -> LapsePlan {
    let from_row = Credits::new(row.get().saturating_sub(held.get()).max(0));
    let kept: Vec<Credits> = pots
        .iter()
        .map(|pot| Credits::new(pot.in_pot.get().min(pot.held_here.get()).max(0)))
        .collect();
    let from_pots: i64 = pots
        .iter()
        .zip(&kept)
        .map(|(pot, kept)| pot.in_pot.get().max(0) - kept.get())
        .sum();
    let lapsed = Credits::new(from_row.get() + from_pots);
    debug_assert!(
        from_row <= Credits::new(row.get().max(0)) && from_pots >= 0,
        "a lapse takes more than the subscription holds: {row:?} held {held:?}, {pots:?}"
    );
    debug_assert!(
        pots.iter()
            .zip(&kept)
            .all(|(pot, kept)| *kept >= Credits::ZERO && kept.get() <= pot.in_pot.get().max(0)),
        "a pot keeps more than it has: {pots:?} {kept:?}"
    );
    LapsePlan {
        from_row,
        kept,
        lapsed,
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn pot(in_pot: i64, held_here: i64) -> PotSubscription {
        PotSubscription {
            in_pot: Credits::new(in_pot),
            held_here: Credits::new(held_here),
        }
    }

    #[test]
    fn a_lapse_takes_what_is_left_of_the_subscription() {
        let plan = decide_lapse(Credits::new(30), Credits::ZERO, &[]);
        assert_eq!(plan.from_row, Credits::new(30));
        assert_eq!(plan.lapsed, Credits::new(30));
    }

    #[test]
    fn a_lapse_leaves_what_the_lapsing_stores_calls_hold() {
        let plan = decide_lapse(Credits::new(30), Credits::new(12), &[pot(20, 5), pot(8, 0)]);
        assert_eq!(plan.from_row, Credits::new(18));
        assert_eq!(plan.kept, [Credits::new(5), Credits::ZERO]);
        assert_eq!(plan.lapsed, Credits::new(18 + 15 + 8));
    }

    #[test]
    fn a_lapse_takes_nothing_from_a_row_its_calls_hold_entirely() {
        let plan = decide_lapse(Credits::new(10), Credits::new(25), &[pot(4, 9)]);
        assert_eq!(plan.from_row, Credits::ZERO);
        assert_eq!(plan.kept, [Credits::new(4)]);
        assert_eq!(plan.lapsed, Credits::ZERO);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(10_000))]

        /// What lapses plus what is kept (in the row and the pots) is what the subscription
        /// held; nothing is below zero; a lapse takes no more than the subscription holds.
        #[test]
        fn a_lapse_takes_no_more_than_the_subscription_holds(
            row in 0i64..1_000,
            held in 0i64..1_000,
            pots in prop::collection::vec((0i64..1_000, 0i64..1_000), 0..4),
        ) {
            let pots: Vec<_> = pots.into_iter().map(|(in_pot, held)| pot(in_pot, held)).collect();
            let plan = decide_lapse(Credits::new(row), Credits::new(held), &pots);
            let total = row + pots.iter().map(|pot| pot.in_pot.get()).sum::<i64>();
            let kept_in_row = row - plan.from_row.get();
            let kept_in_pots: i64 = plan.kept.iter().map(|kept| kept.get()).sum();
            prop_assert_eq!(plan.lapsed.get() + kept_in_row + kept_in_pots, total);
            prop_assert!(plan.lapsed.get() >= 0 && plan.lapsed.get() <= total);
            prop_assert!(kept_in_row >= 0 && kept_in_row <= row.min(held));
            for (pot, kept) in pots.iter().zip(&plan.kept) {
                prop_assert!(*kept >= Credits::ZERO && *kept <= pot.in_pot.min(pot.held_here));
            }
        }
    }
}
