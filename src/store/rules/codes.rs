//! Whether a redemption code may be redeemed: unused, not revoked, and before its batch's end.
//! Every store asks this before it grants a code's credits; a database store claims the code in
//! the grant's transaction as well, so that two redemptions of one code never both grant.

use chrono::{DateTime, Utc};

/// A code as a store reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CodeState {
    /// Already redeemed.
    pub used: bool,
    /// Its batch was revoked before it was used.
    pub revoked: bool,
    /// When its batch stops working, if ever.
    pub expires_at: Option<DateTime<Utc>>,
}

/// Whether `code` may be redeemed at `at`: a used or revoked code never is, and an expiring one
/// only before its end.
pub fn redeemable(code: CodeState, at: DateTime<Utc>) -> bool {
    let valid = !code.used && !code.revoked && code.expires_at.is_none_or(|end| at < end);
    debug_assert!(
        !valid || !code.used,
        "a code redeemed once is redeemable again: {code:?}"
    );
    valid
}

#[cfg(test)]
mod tests {
    use chrono::{Duration, TimeZone};
    use proptest::prelude::*;

    use super::*;

    fn at(seconds: i64) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0).unwrap() + Duration::seconds(seconds)
    }

    const FRESH: CodeState = CodeState {
        used: false,
        revoked: false,
        expires_at: None,
    };

    #[test]
    fn a_code_is_redeemed_once() {
        assert!(redeemable(FRESH, at(0)));
        let used = CodeState {
            used: true,
            ..FRESH
        };
        assert!(!redeemable(used, at(0)));
    }

    #[test]
    fn a_revoked_code_is_never_redeemed() {
        let revoked = CodeState {
            revoked: true,
            ..FRESH
        };
        assert!(!redeemable(revoked, at(0)));
    }

    #[test]
    fn an_expiring_code_is_redeemed_only_before_its_end() {
        let expiring = CodeState {
            expires_at: Some(at(60)),
            ..FRESH
        };
        assert!(redeemable(expiring, at(59)));
        assert!(!redeemable(expiring, at(60)), "its end is past it");
        assert!(!redeemable(expiring, at(61)));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(10_000))]

        /// Redeemable exactly when unused, unrevoked and before any end; and a code that is,
        /// once used, never is again, at any time.
        #[test]
        fn a_code_grants_at_most_once_and_only_while_valid(
            used in any::<bool>(),
            revoked in any::<bool>(),
            end in prop::option::of(-1_000i64..1_000),
            now in -1_000i64..1_000,
            later in 0i64..10_000,
        ) {
            let code = CodeState { used, revoked, expires_at: end.map(at) };
            let valid = redeemable(code, at(now));
            prop_assert_eq!(valid, !used && !revoked && end.is_none_or(|end| now < end));
            if valid {
                let spent = CodeState { used: true, ..code };
                prop_assert!(!redeemable(spent, at(now + later)));
            }
        }
    }
}
