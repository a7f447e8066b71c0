//! What every dialect's mock reply shares: its text, its output and how a stream cuts it.

use super::TokenUsage;

/// The text of every mock reply.
pub const MOCK_REPLY_TEXT: &str =
    "This is a demo reply from model-gateway's mock upstream; no model was called.";

/// The output tokens every mock reply reports.
pub(crate) const MOCK_OUTPUT_TOKENS: u64 = 16;

/// How many pieces the mock's streamed text comes in.
pub(crate) const MOCK_STREAM_DELTAS: usize = 4;

/// A token count as the ledger keeps it.
pub(crate) fn tokens(count: u64) -> i64 {
    i64::try_from(count).unwrap_or(i64::MAX)
}

/// The usage of a mock reply of `input` tokens in and [`MOCK_OUTPUT_TOKENS`] out.
pub(crate) fn counted(input: u64) -> TokenUsage {
    TokenUsage {
        input_tokens: Some(tokens(input)),
        output_tokens: Some(tokens(MOCK_OUTPUT_TOKENS)),
        ..TokenUsage::default()
    }
}

/// Seconds since the Unix epoch, as `created` says it (without the calendar date that
/// `chrono::Utc::now` works out).
pub(crate) fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            i64::try_from(since.as_secs()).unwrap_or(i64::MAX)
        })
}

/// `text` cut into `count` pieces at character boundaries.
pub(crate) fn text_pieces(text: &str, count: usize) -> Vec<&str> {
    let size = text.len().div_ceil(count);
    let mut pieces = Vec::with_capacity(count);
    let mut rest = text;
    while !rest.is_empty() {
        let mut cut = size.min(rest.len());
        while !rest.is_char_boundary(cut) {
            cut += 1;
        }
        let (piece, tail) = rest.split_at(cut);
        pieces.push(piece);
        rest = tail;
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Responses reply writes the text between quotes as it is.
    #[test]
    fn the_reply_text_holds_nothing_json_escapes() {
        assert_eq!(
            serde_json::to_string(MOCK_REPLY_TEXT).unwrap(),
            format!("\"{MOCK_REPLY_TEXT}\"")
        );
    }

    #[test]
    fn text_pieces_put_together_are_the_text() {
        for text in [MOCK_REPLY_TEXT, "你好, 世界! 🌍", "a"] {
            let pieces = text_pieces(text, MOCK_STREAM_DELTAS);
            assert!(pieces.len() <= MOCK_STREAM_DELTAS, "{pieces:?}");
            assert_eq!(pieces.concat(), text);
        }
        assert!(text_pieces(MOCK_REPLY_TEXT, MOCK_STREAM_DELTAS).len() > 1);
    }
}
