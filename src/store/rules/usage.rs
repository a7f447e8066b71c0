//! What a call that did not report its output is charged for: the output the gateway passed on,
//! counted by the gateway (a stream's content as it went by, or a complete reply's body), and
//! marked [`estimated`](TokenUsage::estimated) so that the charge resting on it is never more
//! than the call's reservation (`pricing::Metered::charge`, which also takes the request's
//! estimate for input not reported).
//!
//! Before a stream's end a provider has reported at most a running count, so the larger of it
//! and the gateway's count is what a client leaving then pays; at the end, the provider's
//! count, when it gave one, is the call's.

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

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

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
