//! The Gemini API's endpoints beside its calls, for a key holder's Google clients: the
//! catalogue's models on the Gemini API in Google's shape, and counting a request's tokens.
//!
//! | Endpoint | Answer |
//! |---|---|
//! | `GET /v1beta/models?pageSize=&pageToken=` | `{"models": [...], "nextPageToken"}`: the models the key may call on the Gemini API (protocol `gemini`, or `endpoints` listing it), by catalogue name, as Google's `Model` objects |
//! | `GET /v1beta/models/{model}` | one of them, by its name or an alias; `404 模型不存在` |
//! | `POST /v1beta/models/{model}:countTokens` | `{"totalTokens"}`: the provider's count at a Gemini upstream, else the gateway's estimate; free, no call-log entry |
//!
//! Google's newer SDKs call the API's `v1` (`/v1/models/{model}:countTokens`, served here too);
//! `GET /v1/models` and `/v1/models/{model}` answer in Google's shape to a request that carries
//! its key as Google's clients do (`x-goog-api-key`, `?key=`).

use std::sync::Arc;

use axum::Router;
use axum::extract::{Extension, Query, State};
use axum::http::{HeaderMap, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{DEFAULT_PAGE, LARGEST_PAGE, Shared, counted, refuse};
use crate::call::{Caller, KeyRules};
use crate::catalogue::{Catalogue, ModelRoute};
use crate::error::GatewayError;
use crate::protocol::Protocol;
use crate::router::{read_beside_calls, route_named};
use crate::store::Store;

/// The verb of a count request's path, after the model.
const COUNT_TOKENS: &str = ":countTokens";

/// The Gemini API's routes beside the calls, with `shared`'s state still to give (its `v1`
/// model list and lookup are the key holders' own, answering in Google's shape when
/// [`asked_by_google`]).
pub(super) fn routes<S: Store + 'static>() -> Router<Arc<Shared<S>>> {
    Router::new()
        .route("/v1beta/models", get(list_models::<S>))
        .route(
            "/v1beta/models/{model}",
            get(one_model::<S>).post(count_tokens::<S>),
        )
        .route("/v1/models/{id}", post(count_tokens::<S>))
}

/// Whether a request comes from one of Google's clients: its key sent as they send it.
pub(super) fn asked_by_google(headers: &HeaderMap, uri: &Uri) -> bool {
    headers.contains_key("x-goog-api-key")
        || uri.query().is_some_and(|query| {
            form_urlencoded::parse(query.as_bytes()).any(|(name, _)| name == "key")
        })
}

/// The model as Google's `Model` object (its token limits where the catalogue gives them).
fn google_model(model: &ModelRoute) -> Value {
    let mut item = json!({
        "name": format!("models/{}", model.name),
        "baseModelId": model.name,
        "version": "001",
        "displayName": model.name,
        "description": format!("{} on model-gateway", model.name),
        "supportedGenerationMethods": ["generateContent", "streamGenerateContent", "countTokens"],
    });
    if let Some(window) = model.context_window {
        item["inputTokenLimit"] = json!(window);
    }
    if let Some(limit) = model.max_output_tokens {
        item["outputTokenLimit"] = json!(limit);
    }
    item
}

/// The model `name` (with or without Google's `models/` prefix) names, if the key may call
/// it on the Gemini API.
fn served<'a>(
    catalogue: &'a Catalogue,
    rules: &KeyRules,
    name: &str,
) -> Option<&'a Arc<ModelRoute>> {
    let name = name.strip_prefix("models/").unwrap_or(name);
    catalogue
        .model(name)
        .filter(|model| model.endpoints.contains(&Protocol::Gemini) && rules.allows(&model.name))
}

/// What follows the models' path in `uri`'s path.
fn path_model(uri: &Uri) -> &str {
    crate::protocol::gemini::path_target(uri.path()).unwrap_or_default()
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ModelsPage {
    page_size: Option<u64>,
    page_token: Option<String>,
}

async fn list_models<S>(
    State(shared): State<Arc<Shared<S>>>,
    Extension(rules): Extension<KeyRules>,
    uri: Uri,
) -> Response {
    model_list(&shared.catalogue.current(), &rules, &uri)
}

/// The models the key may call on the Gemini API, a page as `uri`'s query asks.
pub(super) fn model_list(catalogue: &Catalogue, rules: &KeyRules, uri: &Uri) -> Response {
    let Ok(Query(page)) = Query::<ModelsPage>::try_from_uri(uri) else {
        return refuse(GatewayError::InvalidQuery);
    };
    let mut models: Vec<_> = catalogue
        .models()
        .filter(|model| model.endpoints.contains(&Protocol::Gemini) && rules.allows(&model.name))
        .collect();
    models.sort_by(|a, b| a.name.cmp(&b.name));
    let size = page
        .page_size
        .unwrap_or(DEFAULT_PAGE)
        .clamp(1, LARGEST_PAGE) as usize;
    // The token is the name of the last model of the page before.
    let start = page.page_token.as_deref().map_or(0, |after| {
        models.partition_point(|model| model.name.as_str() <= after)
    });
    let window = &models[start.min(models.len())..];
    let listed: Vec<Value> = window.iter().take(size).map(|m| google_model(m)).collect();
    let mut answer = json!({ "models": listed });
    if window.len() > size {
        answer["nextPageToken"] = json!(window[size - 1].name);
    }
    axum::Json(answer).into_response()
}

async fn one_model<S>(
    State(shared): State<Arc<Shared<S>>>,
    Extension(rules): Extension<KeyRules>,
    uri: Uri,
) -> Response {
    one(&shared.catalogue.current(), &rules, path_model(&uri))
}

/// The model `name` names, if the key may call it on the Gemini API.
pub(super) fn one(catalogue: &Catalogue, rules: &KeyRules, name: &str) -> Response {
    match served(catalogue, rules, name) {
        Some(model) => axum::Json(google_model(model)).into_response(),
        None => refuse(GatewayError::ModelNotFound),
    }
}

/// `POST /v1beta/models/{model}:countTokens` (any other verb on this path is no endpoint of
/// this router: the calls' verbs are served by the stack).
async fn count_tokens<S: Store + 'static>(
    State(shared): State<Arc<Shared<S>>>,
    Extension(rules): Extension<KeyRules>,
    Extension(caller): Extension<Caller>,
    request: axum::extract::Request,
) -> Response {
    let target = path_model(request.uri()).to_owned();
    let Some(name) = target.strip_suffix(COUNT_TOKENS) else {
        return refuse(GatewayError::UnknownPath);
    };
    let ledger: Arc<dyn crate::store::Ledger> = shared.store.clone();
    let catalogue = shared.catalogue.current();
    let read = read_beside_calls(request, &catalogue, &shared.body, ledger).await;
    let (headers, body, _permit) = match read {
        Ok((parts, body, permit)) => (parts.headers, body, permit),
        Err(refusal) => return refuse(refusal),
    };
    if body.trim_ascii_start().first() != Some(&b'{') {
        return refuse(GatewayError::InvalidJson);
    }
    let routed = match served(&catalogue, &rules, name) {
        Some(model) => route_named(&catalogue, Protocol::Gemini, &model.name),
        None => Err(GatewayError::ModelNotFound),
    };
    let routed = match routed {
        Ok(routed) => routed,
        Err(refusal) => return refuse(refusal),
    };
    counted(&shared, caller, &routed, &headers, &body).await
}
