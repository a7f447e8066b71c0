//! One module per table. Table names carry the `mg_` prefix so that they sit beside a host
//! application's own tables without clashing.

pub(super) mod account;
pub(super) mod api_key;
pub(super) mod call;
pub(super) mod code;
pub(super) mod code_batch;
pub(super) mod credit_grant;
pub(super) mod escrow;
pub(super) mod idempotent_call;
pub(super) mod instance;
pub(super) mod response;
pub(super) mod subscription_lapse;
pub(super) mod webhook_event;
