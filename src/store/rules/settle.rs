//! The settle rule: what a call is charged once its cost is known.
//!
//! A reservation takes (or holds) the most the call can cost: its price per call, or for a
//! model priced by tokens a ceiling the gateway sets before the call. The settle charges the
//! cost the provider's usage says, in the same write that returns the rest of the reservation.
//! A cost above the reservation is charged the reservation and the entry records the rest as
//! its shortfall, unless the operator lets a call be charged beyond its ceiling: then it takes
//! what the account can pay beyond it (free credits, subscription first) and what the key's
//! spending limit still allows ([`Beyond`]), and records the rest. The account never goes below
//! zero, a key's limit is never passed, and nothing is charged twice.

use crate::credits::{Balance, Credits, Split};

/// What a settle moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settlement {
    /// What the call is charged, bucket by bucket (what the entry records).
    pub charged: Split,
    /// What goes back of what the reservation took (its cost was below the reservation).
    pub returned: Split,
    /// What is taken beyond the reservation (its cost was above it), from free credits.
    pub extra: Split,
    /// What the account could not pay of the cost.
    pub shortfall: Credits,
}

/// How much a settle may take beyond what its reservation took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Beyond {
    /// Nothing: the reservation is the most a call is charged (the default).
    Nothing,
    /// What the account can pay, within `key_room` when the call's key has a spending limit
    /// (what that limit still allows in the window the call was reserved in).
    Free {
        /// Within this, for a key with a spending limit.
        key_room: Option<Credits>,
    },
}

impl Beyond {
    /// For a call whose success says whether it may be charged beyond its reservation, on a key
    /// with `key_room` left under its limit (`None`: no limit).
    pub fn of(allowed: bool, key_room: Option<Credits>) -> Beyond {
        if allowed {
            Beyond::Free { key_room }
        } else {
            Beyond::Nothing
        }
    }

    /// The most a settle may take beyond the reservation.
    fn cap(self) -> Credits {
        match self {
            Beyond::Nothing => Credits::ZERO,
            Beyond::Free { key_room } => key_room.unwrap_or(Credits::MAX).max(Credits::ZERO),
        }
    }
}

/// Settles a call whose reservation took `taken` and whose cost is `cost` (`None`: the
/// reservation is the cost, as for a price per call), with `free` what the account can spend
/// now besides it (no bucket below zero; a subscription whose period ended counts as empty), and
/// `beyond` how much beyond the reservation it may take at all.
pub fn decide_settle(
    taken: Split,
    cost: Option<Credits>,
    free: Balance,
    beyond: Beyond,
) -> Settlement {
    let settled = settle_within(taken, cost, free, beyond);
    debug_assert_eq!(
        settled.charged.plus(settled.returned),
        taken.plus(settled.extra),
        "what was taken is charged or returned, never lost"
    );
    debug_assert!(
        settled.extra.total() <= beyond.cap()
            && settled.extra.subscription <= free.subscription.max(Credits::ZERO)
            && settled.extra.topup <= free.topup.max(Credits::ZERO),
        "beyond the reservation only what is free and allowed: {settled:?}"
    );
    settled
}

fn settle_within(taken: Split, cost: Option<Credits>, free: Balance, beyond: Beyond) -> Settlement {
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
    let may_take = over.min(beyond.cap());
    let subscription = free.subscription.max(Credits::ZERO).min(may_take);
    let topup = free
        .topup
        .max(Credits::ZERO)
        .min(may_take.minus(subscription));
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
        let settled = decide_settle(split(2, 1), None, balance(50, 50), Beyond::Nothing);
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
        let settled = decide_settle(
            split(5, 5),
            Some(Credits::new(7)),
            balance(0, 0),
            Beyond::Nothing,
        );
        assert_eq!(settled.charged, split(5, 2));
        assert_eq!(settled.returned, split(0, 3));
        assert_eq!(settled.shortfall, Credits::ZERO);
        let nothing = decide_settle(
            split(5, 5),
            Some(Credits::ZERO),
            balance(0, 0),
            Beyond::Nothing,
        );
        assert_eq!(
            (nothing.charged, nothing.returned),
            (split(0, 0), split(5, 5))
        );
    }

    const ANY: Beyond = Beyond::Free { key_room: None };

    #[test]
    fn a_cost_above_the_reservation_is_charged_the_reservation_by_default() {
        let settled = decide_settle(
            split(1, 3),
            Some(Credits::new(50_000)),
            balance(100, 100),
            Beyond::Nothing,
        );
        assert_eq!(settled.charged, split(1, 3));
        assert_eq!(settled.extra, split(0, 0));
        assert_eq!(settled.returned, split(0, 0));
        assert_eq!(settled.shortfall, Credits::new(49_996));
    }

    #[test]
    fn beyond_the_reservation_a_settle_takes_no_more_than_the_keys_limit_allows() {
        // The key has 6 credits left under its limit; the account could pay 200.
        let room = Beyond::Free {
            key_room: Some(Credits::new(6)),
        };
        let settled = decide_settle(
            split(0, 4),
            Some(Credits::new(2_000)),
            balance(100, 100),
            room,
        );
        assert_eq!(settled.extra, split(6, 0));
        assert_eq!(settled.charged, split(6, 4));
        assert_eq!(settled.shortfall, Credits::new(1_990));
        let spent = Beyond::Free {
            key_room: Some(Credits::ZERO),
        };
        let settled = decide_settle(split(0, 4), Some(Credits::new(9)), balance(100, 100), spent);
        assert_eq!(
            (settled.charged, settled.shortfall),
            (split(0, 4), Credits::new(5))
        );
    }

    #[test]
    fn a_cost_above_the_reservation_takes_free_credits_then_records_the_shortfall() {
        let settled = decide_settle(split(0, 4), Some(Credits::new(10)), balance(2, 1), ANY);
        assert_eq!(settled.extra, split(2, 1));
        assert_eq!(settled.charged, split(2, 5));
        assert_eq!(settled.shortfall, Credits::new(3));
        let covered = decide_settle(split(0, 4), Some(Credits::new(6)), balance(5, 5), ANY);
        assert_eq!(
            (covered.extra, covered.shortfall),
            (split(2, 0), Credits::ZERO)
        );
    }

    /// A count as an adversarial provider may report it: absent, small, large, at the edges of
    /// an `i64`, below zero.
    fn reported() -> impl Strategy<Value = Option<i64>> {
        prop_oneof![
            2 => Just(None),
            4 => (0i64..5_000).prop_map(Some),
            2 => (0i64..2_000_000).prop_map(Some),
            1 => prop_oneof![Just(i64::MAX), Just(i64::MIN), Just(-1_000i64), Just(1_000_000_000)]
                .prop_map(Some),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(10_000))]

        /// A settle charges exactly the cost less the shortfall; it returns only what was taken,
        /// takes beyond it only what is free and allowed, and leaves a shortfall only when
        /// nothing free and allowed is left; no amount is below zero.
        #[test]
        fn a_settle_charges_the_cost_or_all_it_can(
            taken_sub in 0i64..1_000, taken_topup in 0i64..1_000,
            free_sub in 0i64..1_000, free_topup in 0i64..1_000,
            cost in prop::option::of(0i64..4_000),
            beyond in prop::option::of(prop::option::of(0i64..2_000)),
        ) {
            let taken = split(taken_sub, taken_topup);
            let free = balance(free_sub, free_topup);
            let beyond = beyond.map_or(Beyond::Nothing, |room| Beyond::Free { key_room: room.map(Credits::new) });
            let s = decide_settle(taken, cost.map(Credits::new), free, beyond);
            let cost = cost.unwrap_or(taken_sub + taken_topup);
            for part in [s.charged, s.returned, s.extra] {
                prop_assert!(part.subscription.get() >= 0 && part.topup.get() >= 0, "{s:?}");
            }
            prop_assert!(s.shortfall.get() >= 0);
            prop_assert_eq!(s.charged.total().get() + s.shortfall.get(), cost);
            // What was taken is charged or returned, never both, never lost.
            prop_assert_eq!(s.charged.plus(s.returned), taken.plus(s.extra));
            prop_assert!(s.extra.subscription.get() <= free_sub && s.extra.topup.get() <= free_topup);
            prop_assert!(s.extra.total() <= beyond.cap(), "never beyond what is allowed: {s:?}");
            if s.shortfall.get() > 0 {
                let allowed = beyond.cap().get().min(free_sub + free_topup);
                prop_assert_eq!(s.extra.total().get(), allowed, "all it may take: {:?}", s);
            }
            if s.returned.total().get() > 0 {
                prop_assert_eq!(s.extra.total(), Credits::ZERO);
                prop_assert!(s.returned.subscription.get() == 0 || s.charged.topup.get() == 0,
                    "subscription is charged before top-up: {s:?}");
            }
        }

        /// Whatever a client sets (its output limits, `n`, its body) and whatever its provider
        /// reports (any count, a malformed one), a call is charged at most its reservation, or
        /// with `beyond` at most what its key's limit and the account's free credits add; never
        /// below zero; and a report that passes the checks never costs more than the ceiling
        /// the gateway set from the request.
        #[test]
        fn no_client_field_or_usage_report_bends_a_charge(
            body in 0usize..300_000, media in 0u64..4,
            limits in prop::collection::vec(prop::option::of(0u64..300_000), 3),
            n in 1u64..=128, model_max in 1u64..100_000,
            input in reported(), output in reported(), cached in reported(),
            written in reported(), reasoning in reported(), malformed in any::<bool>(),
            rates in prop::array::uniform3(0u64..2_000_000_000),
            free_sub in 0i64..100_000, free_topup in 0i64..100_000,
            key_room in prop::option::of(0i64..100_000), beyond in any::<bool>(),
        ) {
            use crate::pricing::{MEDIA_PART_TOKENS, Metered, PROVIDER_PROMPT_TOKENS, Pricing, TokenPrices, TokenRate};
            use crate::protocol::TokenUsage;
            let [input_rate, output_rate, cache_rate] = rates.map(|rate| TokenRate::per_million(rate as f64 / 1_000.0).unwrap());
            let prices = TokenPrices::new(input_rate, output_rate).with_cache_read(cache_rate);
            let pricing = Pricing::tokens(prices);
            // As the router sets them: a token a byte and a bound a media part; the largest
            // output limit (else the model's), for each reply.
            let input_ceiling = body as u64 + media * MEDIA_PART_TOKENS + PROVIDER_PROMPT_TOKENS;
            let output_ceiling = limits.iter().flatten().max().copied().unwrap_or(model_max) * n;
            let reserved = pricing.ceiling(input_ceiling, output_ceiling);
            // The account could pay it (else the call was refused 402, before anything).
            let taken = split(0, reserved.get());
            let metered = Metered {
                pricing,
                input_estimate: body as u64 / 4,
                reserved,
                input_bound: input_ceiling,
                output_bound: output_ceiling,
                asked_tier: None,
            };
            let usage = TokenUsage {
                input_tokens: input,
                output_tokens: output,
                cache_read_tokens: cached,
                cache_write_tokens: written,
                cache_write_1h_tokens: None,
                reasoning_tokens: reasoning,
                estimated: false,
                malformed,
                service_tier: None,
            };
            let charge = super::super::usage::charge(&metered, &usage);
            if charge.usage_rejected {
                prop_assert_eq!(charge.cost, reserved);
            } else {
                prop_assert!(charge.cost <= reserved, "a trusted report above the ceiling: {usage:?}");
            }
            let room = key_room.map(Credits::new);
            let free = balance(free_sub, free_topup);
            let settled = decide_settle(taken, Some(charge.cost), free, Beyond::of(beyond, room));
            let most = if beyond {
                reserved.get() + room.map_or(i64::MAX, Credits::get).min(free_sub + free_topup)
            } else {
                reserved.get()
            };
            prop_assert!(settled.charged.total().get() <= most, "{settled:?}");
            for part in [settled.charged, settled.returned, settled.extra] {
                prop_assert!(part.subscription.get() >= 0 && part.topup.get() >= 0, "{settled:?}");
            }
            prop_assert!(settled.extra.subscription.get() <= free_sub && settled.extra.topup.get() <= free_topup);
            prop_assert_eq!(settled.charged.total().get() + settled.shortfall.get(), charge.cost.get());
        }
    }
}
