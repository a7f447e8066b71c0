//! The mock's embeddings: a deterministic unit vector per input (the same input, the same
//! vector).

use serde_json::json;

/// Dimensions of a mock embedding when the request does not ask for `dimensions`: those of
/// `OpenAI`'s `text-embedding-3-small`, which retrieval pipelines often assume.
pub const MOCK_EMBEDDING_DIMENSIONS: usize = 1536;

/// The most `dimensions` the mock gives.
const MAX_MOCK_EMBEDDING_DIMENSIONS: usize = 4096;

/// `OpenAI`'s embeddings reply for a request `body`: one unit vector per input (a string, a
/// token array, or each item of an array of them), the same for the same input; as floats, or
/// as base64 of little-endian `f32`s when `encoding_format` says `base64` (as the SDKs ask).
/// Usage counts a token per four bytes of text, or the tokens given.
pub(super) fn embeddings(model: &str, body: &[u8]) -> serde_json::Value {
    #[derive(serde::Deserialize)]
    struct Asked {
        #[serde(default)]
        input: serde_json::Value,
        dimensions: Option<usize>,
        encoding_format: Option<String>,
    }
    let asked: Asked = serde_json::from_slice(body).unwrap_or(Asked {
        input: serde_json::Value::Null,
        dimensions: None,
        encoding_format: None,
    });
    let inputs: Vec<&serde_json::Value> = match &asked.input {
        serde_json::Value::Array(items) if items.iter().all(serde_json::Value::is_number) => {
            vec![&asked.input]
        }
        serde_json::Value::Array(items) => items.iter().collect(),
        one => vec![one],
    };
    let dimensions = asked
        .dimensions
        .unwrap_or(MOCK_EMBEDDING_DIMENSIONS)
        .clamp(1, MAX_MOCK_EMBEDDING_DIMENSIONS);
    let base64 = asked.encoding_format.as_deref() == Some("base64");
    let mut tokens = 0;
    let data: Vec<serde_json::Value> = inputs
        .iter()
        .enumerate()
        .map(|(index, input)| {
            tokens += match input {
                serde_json::Value::Array(ids) => ids.len(),
                text => (text.as_str().map_or(0, str::len) / 4).max(1),
            };
            let vector = unit_vector(input.to_string().as_bytes(), dimensions);
            let embedding = if base64 {
                use base64::Engine;
                let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(vector)
            };
            json!({ "object": "embedding", "index": index, "embedding": embedding })
        })
        .collect();
    json!({
        "object": "list",
        "data": data,
        "model": model,
        "usage": { "prompt_tokens": tokens, "total_tokens": tokens }
    })
}

/// A unit vector of `dimensions` drawn from `seed`'s SHA-256: the same seed, the same vector.
fn unit_vector(seed: &[u8], dimensions: usize) -> Vec<f32> {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(seed);
    let mut rng = fastrand::Rng::with_seed(u64::from_le_bytes(
        digest[..8].try_into().expect("a SHA-256 has 32 bytes"),
    ));
    let raw: Vec<f32> = (0..dimensions).map(|_| rng.f32() * 2.0 - 1.0).collect();
    let norm = raw
        .iter()
        .map(|x| x * x)
        .sum::<f32>()
        .sqrt()
        .max(f32::MIN_POSITIVE);
    raw.iter().map(|x| x / norm).collect()
}
