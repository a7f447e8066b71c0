//! How many tokens a text is, where the provider did not say: counted with a tokenizer, or
//! estimated from its size.

/// Output tokens in `text` the provider did not count: about four bytes of text a token,
/// rounded up (an approximation; providers report the real count in their usage).
pub fn estimated_text_tokens(text_bytes: usize) -> u64 {
    (text_bytes as u64).div_ceil(BYTES_PER_TOKEN)
}

/// Tokens in `text` the gateway passed on, counted with `OpenAI`'s tokenizer (`o200k_base`,
/// the `tokenizer` feature) or else estimated as [`estimated_text_tokens`]; never zero for text
/// that is not empty. Other providers' tokenizers differ: for them it is an approximation.
pub fn counted_text_tokens(text: &str) -> u64 {
    if text.is_empty() {
        return 0;
    }
    #[cfg(feature = "tokenizer")]
    let tokens = tiktoken_rs::o200k_base_singleton()
        .encode_ordinary(text)
        .len() as u64;
    #[cfg(not(feature = "tokenizer"))]
    let tokens = estimated_text_tokens(text.len());
    tokens.max(1)
}

/// Bytes of text per token, for [`estimated_input_tokens`](crate::pricing::estimated_input_tokens) and [`estimated_text_tokens`].
pub(crate) const BYTES_PER_TOKEN: u64 = 4;
