//! How a failure to reach a provider is described: what failed and why, never the URL.

/// A transport failure, described without the URL (it may carry credentials in a query), with
/// its causes (reqwest's own text alone, "error sending request", does not say what failed).
pub(super) fn transport_error(error: reqwest::Error) -> String {
    let what = if error.is_timeout() {
        "timed out"
    } else if error.is_connect() {
        "connection failed"
    } else if error.is_body() || error.is_decode() {
        "reply body unreadable"
    } else {
        "request failed"
    };
    let error = error.without_url();
    let mut text = format!("{what}: {error}");
    let mut source = std::error::Error::source(&error);
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}
