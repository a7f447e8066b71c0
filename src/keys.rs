//! API keys: generated from the operating system's CSPRNG, stored only as a SHA-256 hash plus a
//! short display prefix. The clear key exists once, when it is created.

use sha2::{Digest, Sha256};

/// Every key starts with this, so that a leaked key is recognisable (e.g. by secret scanners).
pub const KEY_PREFIX: &str = "sk-mg-";

/// Random bytes in a key: 192 bits.
const KEY_RANDOM_BYTES: usize = 24;

/// How many leading characters of a key are kept in clear, to tell keys apart in listings.
const DISPLAY_PREFIX_LEN: usize = KEY_PREFIX.len() + 6;

/// The display prefix of a key a client presented: its first characters, as listings show them;
/// `None` for a text too short to keep any of it back (a short text is not a gateway key, and
/// showing its start would show most of it).
pub fn display_prefix(presented: &str) -> Option<&str> {
    let long_enough = presented.len() >= KEY_PREFIX.len() + 2 * KEY_RANDOM_BYTES;
    presented.get(..DISPLAY_PREFIX_LEN).filter(|_| long_enough)
}

/// A newly generated key. The clear text is only available here; store [`NewApiKey::hash`].
#[derive(Clone)]
pub struct NewApiKey {
    clear: String,
}

impl NewApiKey {
    /// Draws a fresh key from the operating system's CSPRNG.
    pub fn generate() -> NewApiKey {
        let mut random = [0u8; KEY_RANDOM_BYTES];
        getrandom::fill(&mut random).expect("the operating system's random source is available");
        NewApiKey {
            clear: format!("{KEY_PREFIX}{}", hex::encode(random)),
        }
    }

    /// The key to hand to the user, once.
    pub fn reveal(&self) -> &str {
        &self.clear
    }

    /// What the store keeps to recognise the key.
    pub fn hash(&self) -> KeyHash {
        KeyHash::of(&self.clear)
    }

    /// The first characters, safe to show in listings.
    pub fn display_prefix(&self) -> &str {
        &self.clear[..DISPLAY_PREFIX_LEN]
    }
}

impl std::fmt::Debug for NewApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NewApiKey({}…)", self.display_prefix())
    }
}

/// The SHA-256 of a key, as 64 lowercase hex characters: the only form in which keys are stored
/// and looked up.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct KeyHash(String);

impl KeyHash {
    /// Hashes a key as presented by a client.
    pub fn of(presented: &str) -> KeyHash {
        // Into a buffer at once: `hex::encode` goes character by character, and this runs on
        // every request.
        let mut text = [0u8; 64];
        hex::encode_to_slice(Sha256::digest(presented.as_bytes()), &mut text)
            .expect("64 hex digits hold a SHA-256");
        KeyHash(String::from_utf8(text.to_vec()).expect("hex digits are ASCII"))
    }

    /// Wraps a hash read back from storage.
    pub fn from_stored(hex: String) -> KeyHash {
        KeyHash(hex)
    }

    /// The hex text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for KeyHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KeyHash({}…)", &self.0[..8])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_prefixed_and_carry_192_random_bits() {
        let key = NewApiKey::generate();
        let random = key.reveal().strip_prefix(KEY_PREFIX).unwrap();
        assert_eq!(random.len(), KEY_RANDOM_BYTES * 2);
        assert!(random.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_ne!(key.reveal(), NewApiKey::generate().reveal());
    }

    #[test]
    fn the_stored_hash_is_the_sha256_of_the_presented_key() {
        let key = NewApiKey::generate();
        assert_eq!(key.hash(), KeyHash::of(key.reveal()));
        assert_eq!(
            KeyHash::of("abc").as_str(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn debug_output_never_shows_the_whole_key() {
        let key = NewApiKey::generate();
        assert!(!format!("{key:?}").contains(key.reveal()));
        assert!(!format!("{:?}", key.hash()).contains(key.hash().as_str()));
    }
}
