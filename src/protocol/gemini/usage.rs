//! Google's `usageMetadata`, mapped to the gateway's disjoint kinds: `promptTokenCount`
//! includes `cachedContentTokenCount` (moved out of it, as a cache read), and
//! `toolUsePromptTokenCount` is input beside it; `thoughtsTokenCount` is outside
//! `candidatesTokenCount` (added to the output, and shown as its reasoning).

use serde::Deserialize;

use super::super::{Count, Counts, TokenUsage};

/// A Gemini reply's (or stream chunk's) `usageMetadata`.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct UsageMetadata {
    prompt_token_count: Option<Count>,
    cached_content_token_count: Option<Count>,
    tool_use_prompt_token_count: Option<Count>,
    candidates_token_count: Option<Count>,
    thoughts_token_count: Option<Count>,
}

impl From<UsageMetadata> for TokenUsage {
    fn from(reported: UsageMetadata) -> TokenUsage {
        let mut counts = Counts::default();
        let prompt = counts.take(reported.prompt_token_count);
        let cached = counts
            .take(reported.cached_content_token_count)
            .filter(|cached| *cached > 0);
        let tool_use = counts.take(reported.tool_use_prompt_token_count);
        let uncached = match (prompt, cached) {
            (Some(prompt), Some(cached)) => {
                if cached > prompt {
                    counts.malformed = true;
                }
                Some(prompt.saturating_sub(cached).max(0))
            }
            (prompt, _) => prompt,
        };
        let input_tokens = match (uncached, tool_use) {
            (None, None) => None,
            (uncached, tool_use) => uncached
                .unwrap_or(0)
                .checked_add(tool_use.unwrap_or(0))
                .or_else(|| {
                    counts.malformed = true;
                    None
                }),
        };
        let candidates = counts.take(reported.candidates_token_count);
        let thoughts = counts.take(reported.thoughts_token_count);
        let output_tokens = match (candidates, thoughts) {
            (None, None) => None,
            (candidates, thoughts) => candidates
                .unwrap_or(0)
                .checked_add(thoughts.unwrap_or(0))
                .or_else(|| {
                    counts.malformed = true;
                    None
                }),
        };
        TokenUsage {
            input_tokens,
            output_tokens,
            cache_read_tokens: cached,
            reasoning_tokens: thoughts,
            malformed: counts.malformed,
            ..TokenUsage::default()
        }
    }
}
