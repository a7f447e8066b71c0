//! The web console: static pages compiled into the binary that call only the public key-holder
//! endpoints and the admin API, so they can do nothing those do not allow.
//!
//! | Path | Page |
//! |---|---|
//! | `/console/` | key holders: sign in with an API key (kept in the tab's session storage), balance and subscription end, redeeming a code, calls and credits per day and model over 30 days, the call log |
//! | `/console/admin` | operators, only when the admin API is on: redemption codes (create a batch, shown once; list; revoke the unused), accounts and search, keys (create, shown once; revoke), grants, calls, the audit |
//!
//! Every page and asset is served with a Content-Security-Policy that allows scripts and styles
//! from this origin only (no inline script or style can run), and the pages put every value
//! from the database on the page as text, never as HTML.

use axum::Router;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;

/// What the pages may load: their own scripts, styles and API calls, nothing inline, no frames.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; connect-src 'self'; img-src 'self'; base-uri 'none'; \
     form-action 'self'; frame-ancestors 'none'";

const INDEX_HTML: &str = include_str!("assets/index.html");
const ADMIN_HTML: &str = include_str!("assets/admin.html");
const I18N_JS: &str = include_str!("assets/i18n.js");
const KEYHOLDER_JS: &str = include_str!("assets/keyholder.js");
const ADMIN_JS: &str = include_str!("assets/admin.js");
const CONSOLE_CSS: &str = include_str!("assets/console.css");

fn asset(body: &'static str, content_type: &'static str) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// The console's routes; `admin` adds the operators' page (give it only when the admin API is
/// mounted too).
pub fn router(admin: bool) -> Router {
    let html = "text/html; charset=utf-8";
    let js = "text/javascript; charset=utf-8";
    let mut router = Router::new()
        .route(
            "/console",
            get(|| async { Redirect::permanent("/console/") }),
        )
        .route(
            "/console/",
            get(move || async move { asset(INDEX_HTML, html) }),
        )
        .route(
            "/console/i18n.js",
            get(move || async move { asset(I18N_JS, js) }),
        )
        .route(
            "/console/keyholder.js",
            get(move || async move { asset(KEYHOLDER_JS, js) }),
        )
        .route(
            "/console/console.css",
            get(|| async { asset(CONSOLE_CSS, "text/css; charset=utf-8") }),
        );
    if admin {
        router = router
            .route(
                "/console/admin",
                get(move || async move { asset(ADMIN_HTML, html) }),
            )
            .route(
                "/console/admin.js",
                get(move || async move { asset(ADMIN_JS, js) }),
            );
    }
    router
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The policy forbids inline scripts and styles: the pages must have none to work.
    #[test]
    fn the_pages_have_no_inline_script_style_or_handler() {
        for page in [INDEX_HTML, ADMIN_HTML] {
            for (at, _) in page.match_indices("<script") {
                let tag = &page[at..at + page[at..].find('>').unwrap()];
                assert!(tag.contains(" src="), "inline script: {tag}");
            }
            assert!(!page.contains("<style"), "inline style element");
            assert!(!page.contains(" style="), "inline style attribute");
            assert!(!page.contains(" on"), "inline event handler");
        }
    }

    /// Values from the database reach the page through `textContent` only.
    #[test]
    fn the_scripts_never_write_html() {
        for script in [I18N_JS, KEYHOLDER_JS, ADMIN_JS] {
            for sink in [
                "innerHTML",
                "outerHTML",
                "insertAdjacentHTML",
                "document.write",
                "eval(",
            ] {
                assert!(!script.contains(sink), "{sink} in a console script");
            }
        }
    }
}
