//! Redemption codes: what an operator sells and a key holder redeems for credits.
//!
//! A code is `MG-` and five groups of five characters from Crockford's base-32 alphabet
//! (`MG-7K2QD-...`): 125 random bits from the operating system's CSPRNG. Guessing is hopeless:
//! with a billion codes outstanding, one guess finds one with a chance of 2⁻⁹⁵, and failed
//! attempts are rate-limited besides. Like keys, codes are stored only as a SHA-256 hash and
//! exist in clear once, when their batch is created.
//!
//! What a person types is forgiven: case, spaces, missing or extra hyphens, and the letters
//! Crockford reads as digits (`O` as `0`, `I` and `L` as `1`).
//!
//! ```
//! use model_gateway::codes::{CodeHash, NewCode};
//!
//! let code = NewCode::generate();
//! let typed = code.reveal().to_lowercase().replace('-', " ");
//! assert_eq!(CodeHash::of(&typed), Some(code.hash()));
//! assert_eq!(CodeHash::of("MG-NOT-A-CODE"), None);
//! ```

use sha2::{Digest, Sha256};

/// Every code starts with this.
pub const CODE_PREFIX: &str = "MG";

/// Crockford's base-32 alphabet: no `I`, `L`, `O` or `U`.
const ALPHABET: &[u8; 32] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";
/// Characters after the prefix.
const CODE_CHARS: usize = 25;
/// Characters per group in the clear code.
const GROUP: usize = 5;
/// Random bits in a code.
pub const CODE_BITS: u32 = 125;

/// A newly generated code. The clear text is only available here; store [`NewCode::hash`].
#[derive(Clone)]
pub struct NewCode {
    clear: String,
}

impl NewCode {
    /// Draws a fresh code from the operating system's CSPRNG.
    pub fn generate() -> NewCode {
        let mut random = [0u8; CODE_CHARS];
        getrandom::fill(&mut random).expect("the operating system's random source is available");
        let mut clear = String::with_capacity(CODE_PREFIX.len() + CODE_CHARS + CODE_CHARS / GROUP);
        clear.push_str(CODE_PREFIX);
        for (index, byte) in random.iter().enumerate() {
            if index % GROUP == 0 {
                clear.push('-');
            }
            // 256 is a multiple of 32: five bits of a uniform byte are uniform.
            clear.push(char::from(ALPHABET[usize::from(byte & 31)]));
        }
        NewCode { clear }
    }

    /// The code to hand out, once.
    pub fn reveal(&self) -> &str {
        &self.clear
    }

    /// What the store keeps to recognise the code.
    pub fn hash(&self) -> CodeHash {
        CodeHash::of(&self.clear).expect("a generated code is well formed")
    }
}

impl std::fmt::Debug for NewCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NewCode(..)")
    }
}

/// The SHA-256 of a code's canonical form, in hex: what the store keeps.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CodeHash(String);

impl CodeHash {
    /// The hash of a code as a person typed it; `None` when it cannot be a code (wrong prefix,
    /// length or characters), so that it is refused without a lookup.
    pub fn of(typed: &str) -> Option<CodeHash> {
        let mut canonical = String::with_capacity(CODE_PREFIX.len() + CODE_CHARS);
        for c in typed.chars() {
            if c == '-' || c.is_whitespace() {
                continue;
            }
            let c = match c.to_ascii_uppercase() {
                'O' => '0',
                'I' | 'L' => '1',
                c => c,
            };
            canonical.push(c);
            if canonical.len() > CODE_PREFIX.len() + CODE_CHARS {
                return None;
            }
        }
        let body = canonical.strip_prefix(CODE_PREFIX)?;
        if body.len() != CODE_CHARS || !body.bytes().all(|b| ALPHABET.contains(&b)) {
            return None;
        }
        Some(CodeHash(hex::encode(Sha256::digest(canonical.as_bytes()))))
    }

    /// Wraps a hash read back from storage.
    pub fn from_stored(hex: String) -> CodeHash {
        CodeHash(hex)
    }

    /// The hex text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generated_code_reads_back_however_it_is_typed() {
        let code = NewCode::generate();
        let clear = code.reveal();
        assert_eq!(clear.len(), 2 + 5 * 6);
        assert!(clear.starts_with("MG-"));
        let hash = code.hash();
        assert_eq!(CodeHash::of(&clear.to_lowercase()), Some(hash.clone()));
        assert_eq!(CodeHash::of(&clear.replace('-', "")), Some(hash.clone()));
        assert_eq!(
            CodeHash::of(&format!("  {} ", clear.replace('-', " - "))),
            Some(hash)
        );
    }

    #[test]
    fn letters_read_as_digits_are_forgiven() {
        let typed = "MG-0011A-BCDEF-GHJKM-NPQRS-TVWXY";
        assert_eq!(
            CodeHash::of("mg-oO1la-bcdef-ghjkm-npqrs-tvwxy"),
            CodeHash::of(typed)
        );
        assert!(CodeHash::of(typed).is_some());
    }

    #[test]
    fn what_cannot_be_a_code_is_refused_without_a_lookup() {
        for typed in [
            "",
            "MG",
            "MG-0011A-BCDEF-GHJKM-NPQRS-TVWX",
            "MG-0011A-BCDEF-GHJKM-NPQRS-TVWXYZ",
            "XX-0011A-BCDEF-GHJKM-NPQRS-TVWXY",
            "MG-0011A-BCDEF-GHJKM-NPQRS-TVWXU",
            "MG-0011A-BCDEF-GHJKM-NPQRS-TVWX\u{e9}",
        ] {
            assert_eq!(CodeHash::of(typed), None, "{typed:?}");
        }
    }

    #[test]
    fn codes_differ() {
        let codes: std::collections::HashSet<_> =
            (0..1000).map(|_| NewCode::generate().hash()).collect();
        assert_eq!(codes.len(), 1000);
    }
}
