//! `OpenAI`'s organization usage API, `GET /v1/organization/usage/completions`
//! (`start_time`, `end_time` in Unix seconds, `bucket_width=1d`, `group_by=model`; an admin key),
//! as its API reference spells the page: `data` a list of buckets (`start_time`, `end_time`,
//! `results`), each result with `input_tokens` (cached ones included), `input_cached_tokens`,
//! `output_tokens`, `num_model_requests` and `model`; `has_more` and `next_page` for the next
//! page.

use chrono::DateTime;
use serde::Deserialize;

use super::{DayUsage, Page, Tokens, read_page};

#[derive(Deserialize)]
struct Bucket {
    start_time: i64,
    results: Vec<Result>,
}

#[derive(Deserialize)]
struct Result {
    #[serde(default)]
    input_tokens: i64,
    #[serde(default)]
    input_cached_tokens: i64,
    #[serde(default)]
    output_tokens: i64,
    num_model_requests: Option<i64>,
    model: Option<String>,
}

/// Reads one page of the completions usage report; `None` when it is not that shape.
pub fn usage_page(body: &[u8]) -> Option<Page> {
    read_page(body, |bucket: Bucket| {
        let day = DateTime::from_timestamp(bucket.start_time, 0)?.date_naive();
        let rows = bucket.results.into_iter().map(|result| DayUsage {
            day,
            model: result.model.unwrap_or_default(),
            // Cached input is counted inside the input: moved out, as the gateway keeps it.
            tokens: Tokens {
                input: result.input_tokens - result.input_cached_tokens,
                cache_read: result.input_cached_tokens,
                output: result.output_tokens,
                ..Tokens::default()
            },
            requests: result.num_model_requests,
        });
        Some(rows.collect())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_is_read_as_the_reference_spells_it() {
        let body = br#"{
          "object": "page",
          "data": [{
            "object": "bucket", "start_time": 1762128000, "end_time": 1762214400,
            "results": [{
              "object": "organization.usage.completions.result",
              "input_tokens": 14350791, "input_cached_tokens": 1200000, "output_tokens": 96969,
              "input_audio_tokens": 0, "output_audio_tokens": 0, "num_model_requests": 270,
              "project_id": null, "user_id": null, "api_key_id": null,
              "model": "gpt-5-2025-08-07", "batch": null
            }]
          }],
          "has_more": true,
          "next_page": "page_AAAA"
        }"#;
        let page = usage_page(body).unwrap();
        assert_eq!(page.next_page.as_deref(), Some("page_AAAA"));
        let row = &page.rows[0];
        assert_eq!(row.day.to_string(), "2025-11-03");
        assert_eq!(row.model, "gpt-5-2025-08-07");
        assert_eq!(
            (row.tokens.input, row.tokens.cache_read, row.tokens.output),
            (13_150_791, 1_200_000, 96_969)
        );
        assert_eq!(row.requests, Some(270));
        let last = br#"{"object":"page","data":[],"has_more":false,"next_page":null}"#;
        assert_eq!(usage_page(last).unwrap().next_page, None);
        assert_eq!(usage_page(b"{}"), None);
    }
}
