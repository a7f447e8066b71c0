//! What a call priced by tokens is charged from what its provider reported. Output it did not
//! report is what the gateway passed on, counted by the gateway (a stream's content as it went
//! by, or a complete reply's body: [`unreported`]); input it did not report is the request's
//! estimate ([`charge`]). Either is marked [`estimated`](TokenUsage::estimated), and a charge
//! resting on it is never more than the call's reservation. A report that fails the checks
//! ([`Metered::check`]) is charged the reservation.
//!
//! Before a stream's end a provider has reported at most a running count, so the larger of it
//! and the gateway's count is what a client leaving then pays; at the end, the provider's
//! count, when it gave one, is the call's.

use crate::pricing::{Charge, Metered};
use crate::protocol::TokenUsage;

/// What the gateway counted of a call's output itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counted {
    /// Output tokens the gateway passed on, when it counted them.
    pub output: Option<u64>,
    /// Whether the reply ended normally (a provider's final count, if it sends one, is in).
    pub ended: bool,
}

/// `reported` with the gateway's count where the provider's is missing, or, before the end,
/// smaller.
pub fn unreported(reported: TokenUsage, counted: Counted) -> TokenUsage {
    let mut usage = reported;
    if let Some(count) = counted.output {
        let count = i64::try_from(count).unwrap_or(i64::MAX);
        let use_count = match reported.output_tokens {
            None => true,
            Some(reported) => !counted.ended && count > reported,
        };
        if use_count {
            usage.output_tokens = Some(count);
            usage.estimated = true;
        }
    }
    debug_assert!(
        usage.estimated || usage == reported,
        "a provider's count replaced without a mark: {reported:?} -> {usage:?}"
    );
    debug_assert!(
        usage.output_tokens >= reported.output_tokens || !counted.ended,
        "a count below the provider's taken at the end: {reported:?} -> {usage:?}"
    );
    usage
}

/// What a call of `metered` that reported `usage` (with the gateway's count of its output in,
/// see [`unreported`]) is charged. Input the provider did not report is the request's estimate
/// ([`Metered::input_estimate`]), and a charge resting on the gateway's own counts is never
/// more than the reservation. A report that fails [`Metered::check`] is charged the
/// reservation, the call's ceiling, and marked rejected. A cost above the reservation is the
/// settle's to bound ([`CallSuccess::beyond_reservation`](crate::store::CallSuccess::beyond_reservation)).
pub fn charge(metered: &Metered, usage: &TokenUsage) -> Charge {
    let mut usage = *usage;
    // A provider that says nothing of its tier served the one asked for.
    usage.service_tier = usage.service_tier.or(metered.asked_tier);
    if metered.check(&usage).is_err() {
        return Charge {
            cost: metered.reserved,
            usage_rejected: true,
            usage,
        };
    }
    if usage.all_input_tokens().is_none() {
        usage.input_tokens = Some(i64::try_from(metered.input_estimate).unwrap_or(i64::MAX));
        usage.estimated = true;
    }
    let cost = metered.pricing.cost(&usage);
    let cost = if usage.estimated {
        cost.min(metered.reserved)
    } else {
        cost
    };
    debug_assert!(
        !usage.estimated || cost <= metered.reserved,
        "a charge on the gateway's own counts above the reservation: {usage:?} -> {cost:?}"
    );
    Charge {
        cost,
        usage_rejected: false,
        usage,
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::credits::Credits;
    use crate::pricing::{Pricing, TokenPrices, TokenRate};

    fn rate(per_million: f64) -> TokenRate {
        TokenRate::per_million(per_million).unwrap()
    }

    fn usage(input: i64, output: i64) -> TokenUsage {
        TokenUsage {
            input_tokens: Some(input),
            output_tokens: Some(output),
            ..TokenUsage::default()
        }
    }

    fn metered(reserved: i64) -> Metered {
        Metered {
            pricing: Pricing::tokens(TokenPrices::new(rate(1_000.0), rate(2_000.0))),
            input_estimate: 1_000,
            reserved: Credits::new(reserved),
            input_bound: 100_000,
            output_bound: 10_000,
            asked_tier: None,
        }
    }

    fn cost(metered: &Metered, usage: &TokenUsage) -> Credits {
        let charge = charge(metered, usage);
        assert!(!charge.usage_rejected, "{usage:?} was rejected");
        charge.cost
    }

    #[test]
    fn input_not_reported_is_the_estimate_and_an_estimated_charge_stays_within_the_reservation() {
        let metered = metered(5);
        // Reported in full: the exact cost, above the reservation if it is (the settle bounds it).
        assert_eq!(cost(&metered, &usage(1_000, 2_000)), Credits::new(5));
        assert_eq!(cost(&metered, &usage(3_000, 3_000)), Credits::new(9));
        // No input reported: the estimate (1 credit) plus the output.
        let output_only = TokenUsage {
            output_tokens: Some(1_000),
            ..TokenUsage::default()
        };
        assert_eq!(cost(&metered, &output_only), Credits::new(3));
        // Counted by the gateway, never above the reservation.
        let counted = TokenUsage {
            output_tokens: Some(100_000),
            estimated: true,
            ..usage(10, 0)
        };
        assert_eq!(cost(&metered, &counted), Credits::new(5));
        let nothing = TokenUsage::default();
        assert_eq!(
            cost(&metered, &nothing),
            Credits::new(1),
            "never zero: the input was sent"
        );
    }

    #[test]
    fn an_implausible_report_is_charged_the_ceiling_and_marked_rejected() {
        let metered = metered(35);
        let rejected = |usage: TokenUsage| {
            let charge = charge(&metered, &usage);
            assert!(charge.usage_rejected, "{usage:?} was trusted");
            assert_eq!(charge.cost, Credits::new(35), "{usage:?}");
        };
        // Beyond the input the call could send, or the output it allowed.
        rejected(usage(100_001, 10));
        rejected(usage(10, 10_001));
        rejected(usage(i64::MAX, 0));
        rejected(TokenUsage {
            cache_read_tokens: Some(1_000_000),
            ..usage(10, 10)
        });
        // Below zero, or more reasoning than output.
        rejected(usage(-1_000, 10));
        rejected(TokenUsage {
            reasoning_tokens: Some(11),
            ..usage(10, 10)
        });
        // A count that was no count (a float or a string, read as `malformed`).
        rejected(TokenUsage {
            malformed: true,
            ..usage(10, 10)
        });
        // At the bounds, trusted.
        assert_eq!(cost(&metered, &usage(100_000, 10_000)), Credits::new(120));
    }

    fn output(tokens: Option<i64>) -> TokenUsage {
        TokenUsage {
            output_tokens: tokens,
            ..TokenUsage::default()
        }
    }

    #[test]
    fn output_not_reported_is_what_the_gateway_counted_and_marked_estimated() {
        let usage = unreported(
            output(None),
            Counted {
                output: Some(12),
                ended: true,
            },
        );
        assert_eq!(usage.output_tokens, Some(12));
        assert!(usage.estimated);
    }

    #[test]
    fn the_providers_final_count_is_the_calls() {
        let usage = unreported(
            output(Some(5)),
            Counted {
                output: Some(12),
                ended: true,
            },
        );
        assert_eq!(usage, output(Some(5)));
    }

    #[test]
    fn before_the_end_the_larger_count_is_paid() {
        let counted = Counted {
            output: Some(12),
            ended: false,
        };
        assert_eq!(unreported(output(Some(5)), counted).output_tokens, Some(12));
        assert_eq!(unreported(output(Some(40)), counted), output(Some(40)));
    }

    #[test]
    fn nothing_counted_leaves_the_report_as_it_is() {
        let reported = output(None);
        assert_eq!(unreported(reported, Counted::default()), reported);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(10_000))]

        /// A report that fails the checks is charged the reservation; one resting on the
        /// gateway's counts (input or output) never more; every charge at least a credit, and
        /// one on a report in full its exact cost.
        #[test]
        fn a_charge_on_the_gateways_counts_stays_within_the_reservation(
            input in prop::option::of(-10i64..300_000),
            output in prop::option::of(0i64..30_000),
            counted in any::<bool>(),
            reserved in 1i64..200,
        ) {
            let metered = metered(reserved);
            let usage = TokenUsage { input_tokens: input, output_tokens: output, estimated: counted, ..TokenUsage::default() };
            let charged = charge(&metered, &usage);
            prop_assert!(charged.cost >= Credits::new(1));
            if metered.check(&usage).is_err() {
                prop_assert!(charged.usage_rejected);
                prop_assert_eq!(charged.cost, metered.reserved);
            } else if counted || input.is_none() {
                prop_assert!(charged.cost <= metered.reserved);
            } else {
                prop_assert_eq!(charged.cost, metered.pricing.cost(&usage));
            }
        }

        /// The output charged is the provider's count whenever it is final, else never less
        /// than either count; a count of the gateway's, used, is always marked estimated.
        #[test]
        fn unreported_output_is_the_gateways_count_and_never_below_a_running_report(
            reported in prop::option::of(0i64..1_000_000),
            counted in prop::option::of(0u64..1_000_000),
            ended in any::<bool>(),
        ) {
            let usage = unreported(output(reported), Counted { output: counted, ended });
            match (reported, counted) {
                (Some(reported), _) if ended => prop_assert_eq!(usage, output(Some(reported))),
                (None, None) => prop_assert_eq!(usage, output(None)),
                (reported, counted) => {
                    let charged = usage.output_tokens.unwrap();
                    prop_assert!(charged >= reported.unwrap_or(0));
                    prop_assert!(charged >= counted.map_or(0, |c| i64::try_from(c).unwrap()));
                    prop_assert_eq!(usage.estimated, Some(charged) != reported);
                }
            }
        }
    }
}
