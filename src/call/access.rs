//! [`AccessEntry`]: what the layers learn of one request, written as its access-log line once
//! the request is over.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use http::{Method, StatusCode, Uri};

use super::{CallId, RequestId};
use crate::catalogue::ModelRoute;

/// The log target of the access lines, for `RUST_LOG` (`model_gateway::access=off` silences
/// them).
pub const ACCESS_LOG_TARGET: &str = "model_gateway::access";

/// The longest model name a client sent that a line repeats (a name not in the catalogue is
/// the client's text, of any length).
const MAX_LOGGED_NAME_CHARS: usize = 64;

/// One request's access-log line in the making. Request extension added by
/// [`AccessLog`](crate::access_log::AccessLog), which writes the line when the answer leaves;
/// [`ApiKeyAuth`](crate::ApiKeyAuth) notes the key's display prefix,
/// [`ProtocolRouter`](crate::ProtocolRouter) the model, and
/// [`RefundOnUpstreamError`](crate::RefundOnUpstreamError) the call's outcome and credits; for a
/// stream billed at its end, the end writes the line. A line is written exactly once: should
/// nobody write it (the client went away before its answer), the last holder does when it
/// lets go, with status 499 as nginx logs such requests.
///
/// The line is an `INFO` event of target [`ACCESS_LOG_TARGET`], outside any span, with the
/// fields `request_id`, `method`, `path`, `status`, `duration_ms`, and where known `model`
/// (the catalogue's name), `requested_model` (the name the client sent, when it was an alias
/// or unknown), `key` (the key's display prefix, never the key), `call`, `outcome` (`ok`,
/// `refunded`), `credits` (charged) and `error` (a refusal's reason).
#[derive(Debug, Clone)]
pub struct AccessEntry(Arc<Entry>);

#[derive(Debug)]
struct Entry {
    request_id: Option<RequestId>,
    method: Method,
    uri: Uri,
    started: Instant,
    notes: Mutex<Notes>,
}

#[derive(Debug, Default)]
struct Notes {
    key: Option<Box<str>>,
    model: Option<Arc<ModelRoute>>,
    requested_model: Option<Box<str>>,
    status: Option<StatusCode>,
    refusal: Option<&'static str>,
    call: Option<CallId>,
    /// `Some(true)`: settled; `Some(false)`: refunded.
    settled: Option<bool>,
    credits: i64,
    /// The answer is a stream, whose end writes the line.
    stream: bool,
    ended: Option<Instant>,
    written: bool,
}

impl AccessEntry {
    /// The entry of a request with this id, method and URI, started now.
    pub fn new(request_id: Option<RequestId>, method: Method, uri: Uri) -> AccessEntry {
        AccessEntry(Arc::new(Entry {
            request_id,
            method,
            uri,
            started: Instant::now(),
            notes: Mutex::new(Notes::default()),
        }))
    }

    fn notes(&self) -> std::sync::MutexGuard<'_, Notes> {
        // A panic while a note was taken leaves nothing half-written worth refusing.
        self.0.notes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The caller's key, as its display prefix ([`crate::keys::display_prefix`]); a key too
    /// short to have one is not noted.
    pub fn key(&self, presented: &str) {
        if let Some(prefix) = crate::keys::display_prefix(presented) {
            self.notes().key = Some(prefix.into());
        }
    }

    /// The model the request resolved to, and the name it was asked by when that was an alias.
    pub fn model(&self, model: &Arc<ModelRoute>, alias: Option<&str>) {
        let mut notes = self.notes();
        notes.model = Some(model.clone());
        notes.requested_model = alias.map(bounded);
    }

    /// A model name the catalogue does not have, as the client sent it.
    pub fn unknown_model(&self, name: &str) {
        self.notes().requested_model = Some(bounded(name));
    }

    /// The answer is a stream billed when it ends: the end writes the line
    /// ([`call_ended`](Self::call_ended)).
    pub fn stream_follows(&self) {
        self.notes().stream = true;
    }

    /// The call `call` ended, settled (charged `credits`) or refunded. The end of a stream
    /// writes the line.
    pub fn call_ended(&self, call: CallId, settled: bool, credits: i64) {
        let mut notes = self.notes();
        notes.call = Some(call);
        notes.settled = Some(settled);
        notes.credits = if settled { credits } else { 0 };
        if notes.stream {
            notes.ended = Some(Instant::now());
            if notes.status.is_some() {
                self.write(notes);
            }
        }
    }

    /// The answer left with `status` (and a refusal's reason): the line is written, unless a
    /// stream follows whose end will write it.
    pub fn answered(&self, status: StatusCode, refusal: Option<&'static str>) {
        let mut notes = self.notes();
        notes.status = Some(status);
        notes.refusal = refusal;
        if !notes.stream || notes.ended.is_some() {
            self.write(notes);
        }
    }

    /// Writes the line, once, outside the lock.
    fn write(&self, mut notes: std::sync::MutexGuard<'_, Notes>) {
        if notes.written {
            return;
        }
        let taken = std::mem::take(&mut *notes);
        notes.written = true;
        drop(notes);
        self.0.write(taken);
    }
}

impl Entry {
    fn write(&self, notes: Notes) {
        let ended = notes.ended.unwrap_or_else(Instant::now);
        let duration_ms = ended.duration_since(self.started).as_micros() as f64 / 1000.0;
        // 499: the client went away before it was answered (nginx's code for it).
        let status = notes.status.map_or(499, |status| status.as_u16());
        let outcome = notes
            .settled
            .map(|settled| if settled { "ok" } else { "refunded" });
        tracing::info!(
            target: ACCESS_LOG_TARGET,
            parent: None,
            request_id = self.request_id.as_ref().map(RequestId::as_str),
            method = self.method.as_str(),
            path = self.uri.path(),
            status,
            duration_ms,
            model = notes.model.as_ref().map(|model| model.name.as_str()),
            // The client's text; both formats quote and escape text fields, so it cannot
            // forge a line.
            requested_model = notes.requested_model.as_deref(),
            key = notes.key.as_deref(),
            call = notes.call.map(|call| call.0),
            outcome,
            credits = notes.settled.map(|_| notes.credits),
            error = notes.refusal,
            "request"
        );
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        let notes = std::mem::take(self.notes.get_mut().unwrap_or_else(PoisonError::into_inner));
        if !notes.written {
            self.write(notes);
        }
    }
}

fn bounded(name: &str) -> Box<str> {
    match name.char_indices().nth(MAX_LOGGED_NAME_CHARS) {
        Some((end, _)) => name[..end].into(),
        None => name.into(),
    }
}
