//! Anthropic's usage report, `GET /v1/organizations/usage_report/messages` (`starting_at`,
//! `ending_at` in RFC 3339, `bucket_width=1d`, `group_by[]=model`; an admin key), as its API
//! reference spells the page: `data` a list of buckets (`starting_at`, `ending_at`, `results`),
//! each result with `uncached_input_tokens`, `cache_read_input_tokens`, `cache_creation`
//! (`ephemeral_5m_input_tokens`, `ephemeral_1h_input_tokens`), `output_tokens` and `model`;
//! `has_more` and `next_page` for the next page.

use chrono::DateTime;
use serde::Deserialize;

use super::{DayUsage, Page, Tokens, read_page};

#[derive(Deserialize)]
struct Bucket {
    starting_at: String,
    results: Vec<Result>,
}

#[derive(Deserialize)]
struct Result {
    #[serde(default)]
    uncached_input_tokens: i64,
    #[serde(default)]
    cache_read_input_tokens: i64,
    #[serde(default)]
    cache_creation: CacheCreation,
    #[serde(default)]
    output_tokens: i64,
    model: Option<String>,
}

#[derive(Deserialize, Default)]
struct CacheCreation {
    #[serde(default)]
    ephemeral_5m_input_tokens: i64,
    #[serde(default)]
    ephemeral_1h_input_tokens: i64,
}

/// Reads one page of the messages usage report; `None` when it is not that shape.
pub fn usage_page(body: &[u8]) -> Option<Page> {
    read_page(body, |bucket: Bucket| {
        let day = DateTime::parse_from_rfc3339(&bucket.starting_at)
            .ok()?
            .with_timezone(&chrono::Utc)
            .date_naive();
        let rows = bucket.results.into_iter().map(|result| DayUsage {
            day,
            model: result.model.unwrap_or_default(),
            tokens: Tokens {
                input: result.uncached_input_tokens,
                cache_read: result.cache_read_input_tokens,
                cache_write: result.cache_creation.ephemeral_5m_input_tokens,
                cache_write_1h: result.cache_creation.ephemeral_1h_input_tokens,
                output: result.output_tokens,
            },
            requests: None,
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
          "data": [{
            "starting_at": "2026-11-03T00:00:00Z", "ending_at": "2026-11-04T00:00:00Z",
            "results": [{
              "uncached_input_tokens": 1500, "cache_read_input_tokens": 200000,
              "cache_creation": {"ephemeral_1h_input_tokens": 1000, "ephemeral_5m_input_tokens": 500},
              "output_tokens": 500, "server_tool_use": {"web_search_requests": 0},
              "api_key_id": null, "workspace_id": null, "model": "claude-sonnet-4-5-20250929",
              "service_tier": null, "context_window": null
            }]
          }],
          "has_more": false,
          "next_page": null
        }"#;
        let page = usage_page(body).unwrap();
        assert_eq!(page.next_page, None);
        let row = &page.rows[0];
        assert_eq!(row.day.to_string(), "2026-11-03");
        assert_eq!(row.model, "claude-sonnet-4-5-20250929");
        assert_eq!(
            row.tokens,
            Tokens {
                input: 1500,
                cache_read: 200_000,
                cache_write: 500,
                cache_write_1h: 1000,
                output: 500
            }
        );
    }
}
