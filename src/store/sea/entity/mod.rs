//! One module per table. Table names carry the `mg_` prefix so that they sit beside a host
//! application's own tables without clashing.

pub mod account;
pub mod api_key;
pub mod call;
pub mod credit_grant;
pub mod subscription_lapse;
