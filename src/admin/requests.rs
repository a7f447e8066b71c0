//! What the operator asks for, read from JSON with every mistake named by its field: a typo in
//! a field name is refused, not ignored.

use chrono::{DateTime, Utc};
use serde_json::{Map, Value};

use crate::call::{KeyLimit, LimitPeriod};
use crate::credits::{Balance, Bucket, Credits};
use crate::error::GatewayError;

/// Longest account name.
const MAX_NAME_CHARS: usize = 200;
/// Longest grant reason.
const MAX_REASON_CHARS: usize = 500;
/// Longest idempotency key.
const MAX_IDEMPOTENCY_KEY_BYTES: usize = 255;

fn invalid(field: impl Into<std::borrow::Cow<'static, str>>, reason: &'static str) -> GatewayError {
    GatewayError::InvalidField {
        field: field.into(),
        reason,
    }
}

/// The body as an object whose fields are all among `known`.
fn object<'a>(body: &'a Value, known: &[&str]) -> Result<&'a Map<String, Value>, GatewayError> {
    let object = body.as_object().ok_or(GatewayError::InvalidJson)?;
    if let Some(unknown) = object.keys().find(|field| !known.contains(&field.as_str())) {
        return Err(invalid(unknown.clone(), "未知字段"));
    }
    Ok(object)
}

/// A whole number of credits, `0` when absent.
fn credits(object: &Map<String, Value>, field: &'static str) -> Result<i64, GatewayError> {
    match object.get(field) {
        None | Some(Value::Null) => Ok(0),
        Some(value) => value
            .as_i64()
            .filter(|amount| *amount >= 0)
            .ok_or(invalid(field, "必须是非负整数")),
    }
}

fn text<'a>(
    object: &'a Map<String, Value>,
    field: &'static str,
) -> Result<Option<&'a str>, GatewayError> {
    match object.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(text)) => Ok(Some(text)),
        Some(_) => Err(invalid(field, "必须是字符串")),
    }
}

/// `period_days`, if given: a whole number of days (its range is checked with the rest).
fn period_days(object: &Map<String, Value>) -> Result<Option<u32>, GatewayError> {
    match object.get("period_days") {
        None | Some(Value::Null) => Ok(None),
        Some(days) => days
            .as_u64()
            .and_then(|days| u32::try_from(days).ok())
            .map(Some)
            .ok_or(invalid("period_days", "必须是 1 到 3660 之间的整数")),
    }
}

/// A time field, if given: RFC 3339.
fn moment(
    object: &Map<String, Value>,
    field: &'static str,
) -> Result<Option<DateTime<Utc>>, GatewayError> {
    text(object, field)?
        .map(|at| {
            DateTime::parse_from_rfc3339(at)
                .map(|at| at.with_timezone(&Utc))
                .map_err(|_| invalid(field, "必须是 RFC 3339 时间"))
        })
        .transpose()
}

/// `POST /admin/accounts`: a name and the first credits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewAccount {
    /// The operator's label.
    pub name: String,
    /// Subscription credits to grant at once.
    pub subscription: i64,
    /// Top-up credits to grant at once.
    pub topup: i64,
}

impl NewAccount {
    /// Reads `{"name", "subscription", "topup"}` (the amounts default to 0).
    pub fn from_json(body: &Value) -> Result<NewAccount, GatewayError> {
        let object = object(body, &["name", "subscription", "topup"])?;
        let new = NewAccount {
            name: text(object, "name")?
                .ok_or(invalid("name", "必填"))?
                .to_owned(),
            subscription: credits(object, "subscription")?,
            topup: credits(object, "topup")?,
        };
        new.check()?;
        Ok(new)
    }

    pub(super) fn check(&self) -> Result<(), GatewayError> {
        if self.name.trim().is_empty() || self.name.chars().count() > MAX_NAME_CHARS {
            return Err(invalid("name", "不能为空, 最长 200 个字符"));
        }
        if self.subscription < 0 {
            return Err(invalid("subscription", "必须是非负整数"));
        }
        if self.topup < 0 {
            return Err(invalid("topup", "必须是非负整数"));
        }
        both_fit(Balance::default(), self.subscription, self.topup)
    }
}

/// `PATCH /admin/accounts/{id}`: what to change of the account; a field absent stays as it is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AccountPatch {
    /// Its own low-balance threshold: `Some(None)` goes back to the gateway's default
    /// (`GATEWAY_LOW_BALANCE_CREDITS`); `Some(Some(0))` tells it never.
    pub low_balance_credits: Option<Option<Credits>>,
}

impl AccountPatch {
    /// Reads `{"low_balance_credits": N | null}`.
    pub fn from_json(body: &Value) -> Result<AccountPatch, GatewayError> {
        let object = object(body, &["low_balance_credits"])?;
        let low_balance_credits = object
            .get("low_balance_credits")
            .map(|value| match value {
                Value::Null => Ok(None),
                value => value
                    .as_i64()
                    .filter(|amount| *amount >= 0)
                    .map(|amount| Some(Credits::new(amount)))
                    .ok_or(invalid("low_balance_credits", "必须是非负整数, 或 null")),
            })
            .transpose()?;
        Ok(AccountPatch {
            low_balance_credits,
        })
    }
}

/// `PATCH /admin/keys/{id}`: the rules to change; a field absent stays as it is, `null` lifts
/// the rule.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyPatch {
    /// `Some(None)`: every model; `Some(Some(list))`: only those.
    pub models: Option<Option<Vec<String>>>,
    /// `Some(None)`: never expires.
    pub expires_at: Option<Option<DateTime<Utc>>>,
    /// `Some(None)`: no limit.
    pub rpm: Option<Option<u32>>,
    /// `Some(None)`: no spending limit.
    pub limit: Option<Option<KeyLimit>>,
}

impl KeyPatch {
    /// Reads `{"models": [...] | null, "expires_at": RFC 3339 | null, "rpm": N | null,
    /// "limit": {"credits": N, "period": "day" | "week" | "month" | "none"} | null}`.
    pub fn from_json(body: &Value) -> Result<KeyPatch, GatewayError> {
        let object = object(body, &["models", "expires_at", "rpm", "limit"])?;
        let models = object
            .get("models")
            .map(|models| match models {
                Value::Null => Ok(None),
                Value::Array(names) => names
                    .iter()
                    .map(|name| {
                        name.as_str()
                            .filter(|name| !name.is_empty())
                            .map(str::to_owned)
                    })
                    .collect::<Option<Vec<_>>>()
                    .map(Some)
                    .ok_or(invalid("models", "必须是模型名 (字符串) 的数组, 或 null")),
                _ => Err(invalid("models", "必须是模型名 (字符串) 的数组, 或 null")),
            })
            .transpose()?;
        let expires_at = object
            .get("expires_at")
            .map(|at| match at {
                Value::Null => Ok(None),
                Value::String(at) => DateTime::parse_from_rfc3339(at)
                    .map(|at| Some(at.with_timezone(&Utc)))
                    .map_err(|_| invalid("expires_at", "必须是 RFC 3339 时间, 或 null")),
                _ => Err(invalid("expires_at", "必须是 RFC 3339 时间, 或 null")),
            })
            .transpose()?;
        let rpm = object
            .get("rpm")
            .map(|rpm| match rpm {
                Value::Null => Ok(None),
                rpm => rpm
                    .as_u64()
                    .filter(|rpm| *rpm > 0 && *rpm <= i32::MAX as u64)
                    .map(|rpm| Some(rpm as u32))
                    .ok_or(invalid("rpm", "必须是正整数, 或 null")),
            })
            .transpose()?;
        let limit = object
            .get("limit")
            .map(|limit| match limit {
                Value::Null => Ok(None),
                limit => key_limit(limit).map(Some),
            })
            .transpose()?;
        Ok(KeyPatch {
            models,
            expires_at,
            rpm,
            limit,
        })
    }
}

/// `{"credits": N, "period": "day" | "week" | "month" | "none"}`.
fn key_limit(limit: &Value) -> Result<KeyLimit, GatewayError> {
    const WHAT: &str = "必须是 {\"credits\": 正整数, \"period\": \"day\" | \"week\" | \"month\" | \"none\"}, 或 null";
    let object = limit.as_object().ok_or(invalid("limit", WHAT))?;
    if let Some(unknown) = object
        .keys()
        .find(|field| !["credits", "period"].contains(&field.as_str()))
    {
        return Err(invalid(format!("limit.{unknown}"), "未知字段"));
    }
    let credits = object
        .get("credits")
        .and_then(Value::as_i64)
        .filter(|credits| *credits > 0)
        .ok_or(invalid("limit.credits", "必须是正整数"))?;
    let period = object
        .get("period")
        .and_then(Value::as_str)
        .and_then(LimitPeriod::parse)
        .ok_or(invalid("limit.period", "必须是 day, week, month 或 none"))?;
    Ok(KeyLimit {
        credits: Credits(credits),
        period,
    })
}

/// `POST /admin/accounts/{id}/grants`: credits for one bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrantRequest {
    /// The bucket.
    pub bucket: Bucket,
    /// How many; positive.
    pub credits: Credits,
    /// Why, for the books.
    pub reason: Option<String>,
    /// Subscription only: the credits are for a period of this many days from now; what was
    /// left of the previous period lapses.
    pub period_days: Option<u32>,
    /// Subscription only: the credits are for a period that ends then (instead of
    /// `period_days`).
    pub ends_at: Option<DateTime<Utc>>,
}

/// Longest subscription period, in days (ten years).
const MAX_PERIOD_DAYS: u32 = 3660;

impl GrantRequest {
    /// `credits` for `bucket`, without a reason or a period.
    pub fn new(bucket: Bucket, credits: Credits) -> GrantRequest {
        GrantRequest {
            bucket,
            credits,
            reason: None,
            period_days: None,
            ends_at: None,
        }
    }

    /// When the period this grant starts ends, if it starts one.
    pub fn period_end(&self, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.ends_at.or_else(|| {
            self.period_days
                .map(|days| now + chrono::Duration::days(i64::from(days)))
        })
    }

    /// The same grant, for a subscription period of `days` days from now.
    #[must_use]
    pub fn period_days(mut self, days: u32) -> GrantRequest {
        self.period_days = Some(days);
        self
    }

    /// The same grant, with a reason.
    #[must_use]
    pub fn reason(mut self, reason: impl Into<String>) -> GrantRequest {
        self.reason = Some(reason.into());
        self
    }

    /// Reads `{"bucket": "subscription" | "topup", "credits": N, "period_days": N, "reason":
    /// "..."}`.
    pub fn from_json(body: &Value) -> Result<GrantRequest, GatewayError> {
        let object = object(
            body,
            &["bucket", "credits", "period_days", "ends_at", "reason"],
        )?;
        let bucket = text(object, "bucket")?
            .and_then(Bucket::parse)
            .ok_or(invalid("bucket", "必须是 subscription 或 topup"))?;
        let credits = object
            .get("credits")
            .and_then(Value::as_i64)
            .filter(|credits| *credits > 0)
            .ok_or(invalid("credits", "必须是正整数"))?;
        let grant = GrantRequest {
            bucket,
            credits: Credits(credits),
            reason: text(object, "reason")?.map(str::to_owned),
            period_days: period_days(object)?,
            ends_at: moment(object, "ends_at")?,
        };
        grant.check()?;
        Ok(grant)
    }

    pub(super) fn check(&self) -> Result<(), GatewayError> {
        if self.credits.get() <= 0 {
            return Err(invalid("credits", "必须是正整数"));
        }
        if self.ends_at.is_some() {
            if self.bucket != Bucket::Subscription {
                return Err(invalid("ends_at", "只用于 subscription"));
            }
            if self.period_days.is_some() {
                return Err(invalid("ends_at", "不能与 period_days 同时给出"));
            }
        }
        match self.period_days {
            Some(_) if self.bucket != Bucket::Subscription => {
                return Err(invalid("period_days", "只用于 subscription"));
            }
            Some(days) if days == 0 || days > MAX_PERIOD_DAYS => {
                return Err(invalid("period_days", "必须是 1 到 3660 之间的整数"));
            }
            _ => {}
        }
        if self
            .reason
            .as_ref()
            .is_some_and(|reason| reason.chars().count() > MAX_REASON_CHARS)
        {
            return Err(invalid("reason", "最长 500 个字符"));
        }
        Ok(())
    }
}

/// Most codes in one batch.
pub const MAX_CODES_PER_BATCH: u32 = 10_000;
/// Longest batch label.
const MAX_LABEL_CHARS: usize = 200;

/// `POST /admin/codes`: a batch of redemption codes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewCodes {
    /// How many codes (1 to [`MAX_CODES_PER_BATCH`]).
    pub count: u32,
    /// What each code grants; positive.
    pub credits: Credits,
    /// The bucket it goes to.
    pub bucket: Bucket,
    /// Subscription only: a code starts a period of this many days from its redemption.
    pub period_days: Option<u32>,
    /// When the codes stop working.
    pub expires_at: Option<DateTime<Utc>>,
    /// The operator's label.
    pub label: Option<String>,
}

impl NewCodes {
    /// Reads `{"count", "credits", "bucket", "period_days"?, "expires_at"?, "label"?}`.
    pub fn from_json(body: &Value) -> Result<NewCodes, GatewayError> {
        let object = object(
            body,
            &[
                "count",
                "credits",
                "bucket",
                "period_days",
                "expires_at",
                "label",
            ],
        )?;
        let codes = NewCodes {
            count: object
                .get("count")
                .and_then(Value::as_u64)
                .and_then(|count| u32::try_from(count).ok())
                .ok_or(invalid("count", "必须是 1 到 10000 之间的整数"))?,
            credits: Credits(
                object
                    .get("credits")
                    .and_then(Value::as_i64)
                    .ok_or(invalid("credits", "必须是正整数"))?,
            ),
            bucket: text(object, "bucket")?
                .and_then(Bucket::parse)
                .ok_or(invalid("bucket", "必须是 subscription 或 topup"))?,
            period_days: period_days(object)?,
            expires_at: moment(object, "expires_at")?,
            label: text(object, "label")?.map(str::to_owned),
        };
        codes.check(Utc::now())?;
        Ok(codes)
    }

    pub(super) fn check(&self, now: DateTime<Utc>) -> Result<(), GatewayError> {
        if self.count == 0 || self.count > MAX_CODES_PER_BATCH {
            return Err(invalid("count", "必须是 1 到 10000 之间的整数"));
        }
        if self.credits.get() <= 0 {
            return Err(invalid("credits", "必须是正整数"));
        }
        match self.period_days {
            Some(_) if self.bucket != Bucket::Subscription => {
                return Err(invalid("period_days", "只用于 subscription"));
            }
            Some(days) if days == 0 || days > MAX_PERIOD_DAYS => {
                return Err(invalid("period_days", "必须是 1 到 3660 之间的整数"));
            }
            _ => {}
        }
        if self.expires_at.is_some_and(|at| at <= now) {
            return Err(invalid("expires_at", "必须在将来"));
        }
        if self.label.as_ref().is_some_and(|label| {
            label.chars().count() > MAX_LABEL_CHARS || label.chars().any(char::is_control)
        }) {
            return Err(invalid("label", "最长 200 个字符, 不含控制字符"));
        }
        Ok(())
    }
}

/// Whether `subscription` and `topup` more credits both fit in `balance` (each bucket and the
/// total within the largest balance), so that neither is granted without the other.
pub(super) fn both_fit(
    balance: Balance,
    subscription: i64,
    topup: i64,
) -> Result<(), GatewayError> {
    balance
        .checked_grant(Bucket::Subscription, Credits(subscription))
        .and_then(|balance| balance.checked_grant(Bucket::Topup, Credits(topup)))
        .map(|_| ())
        .ok_or(GatewayError::BalanceOverflow)
}

pub(super) fn check_idempotency_key(key: Option<&str>) -> Result<(), GatewayError> {
    if key.is_some_and(|key| key.is_empty() || key.len() > MAX_IDEMPOTENCY_KEY_BYTES) {
        return Err(invalid("Idempotency-Key", "长度须为 1 到 255 字节"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn field_of(refusal: GatewayError) -> String {
        match refusal {
            GatewayError::InvalidField { field, .. } => field.into_owned(),
            other => panic!("expected a field refusal, got {other:?}"),
        }
    }

    #[test]
    fn a_new_account_needs_a_name_and_non_negative_credits() {
        let read = NewAccount::from_json(&json!({"name": "a", "topup": 3})).unwrap();
        assert_eq!((read.subscription, read.topup), (0, 3));
        assert_eq!(
            field_of(NewAccount::from_json(&json!({})).unwrap_err()),
            "name"
        );
        let negative = json!({"name": "a", "subscription": -1});
        assert_eq!(
            field_of(NewAccount::from_json(&negative).unwrap_err()),
            "subscription"
        );
        let both_max = json!({"name": "a", "subscription": i64::MAX, "topup": 1});
        assert_eq!(
            NewAccount::from_json(&both_max).unwrap_err(),
            GatewayError::BalanceOverflow
        );
    }

    #[test]
    fn a_misspelt_field_is_named_not_ignored() {
        let refusal = KeyPatch::from_json(&json!({"rmp": 5})).unwrap_err();
        assert_eq!(field_of(refusal), "rmp");
    }

    #[test]
    fn a_patch_tells_absent_from_null() {
        let patch = KeyPatch::from_json(&json!({"models": null, "rpm": 5})).unwrap();
        assert_eq!(patch.models, Some(None));
        assert_eq!(patch.rpm, Some(Some(5)));
        assert_eq!(patch.expires_at, None);
        let bad_time = json!({"expires_at": "tomorrow"});
        assert_eq!(
            field_of(KeyPatch::from_json(&bad_time).unwrap_err()),
            "expires_at"
        );
        assert_eq!(
            field_of(KeyPatch::from_json(&json!({"rpm": 0})).unwrap_err()),
            "rpm"
        );
        let not_names = json!({"models": [1]});
        assert_eq!(
            field_of(KeyPatch::from_json(&not_names).unwrap_err()),
            "models"
        );
    }

    #[test]
    fn a_batch_of_codes_is_read_with_every_mistake_named() {
        let ok = json!({"count": 3, "credits": 50, "bucket": "subscription", "period_days": 30,
            "label": "launch"});
        let read = NewCodes::from_json(&ok).unwrap();
        assert_eq!((read.count, read.credits), (3, Credits(50)));
        for (body, field) in [
            (
                json!({"count": 0, "credits": 5, "bucket": "topup"}),
                "count",
            ),
            (
                json!({"count": 10001, "credits": 5, "bucket": "topup"}),
                "count",
            ),
            (
                json!({"count": 1, "credits": 0, "bucket": "topup"}),
                "credits",
            ),
            (json!({"count": 1, "credits": 5}), "bucket"),
            (
                json!({"count": 1, "credits": 5, "bucket": "topup", "period_days": 30}),
                "period_days",
            ),
            (
                json!({"count": 1, "credits": 5, "bucket": "topup",
                    "expires_at": "2001-01-01T00:00:00Z"}),
                "expires_at",
            ),
            (
                json!({"count": 1, "credits": 5, "bucket": "topup", "colour": 1}),
                "colour",
            ),
        ] {
            assert_eq!(field_of(NewCodes::from_json(&body).unwrap_err()), field);
        }
    }

    #[test]
    fn a_limit_is_credits_per_period_or_null() {
        let patch = KeyPatch::from_json(&json!({"limit": {"credits": 50, "period": "week"}}));
        assert_eq!(
            patch.unwrap().limit,
            Some(Some(KeyLimit {
                credits: Credits(50),
                period: LimitPeriod::Week
            }))
        );
        let lifted = KeyPatch::from_json(&json!({"limit": null})).unwrap();
        assert_eq!(lifted.limit, Some(None));
        for (body, field) in [
            (
                json!({"limit": {"credits": 0, "period": "day"}}),
                "limit.credits",
            ),
            (
                json!({"limit": {"credits": 5, "period": "year"}}),
                "limit.period",
            ),
            (json!({"limit": {"credits": 5}}), "limit.period"),
            (
                json!({"limit": {"credits": 5, "period": "day", "x": 1}}),
                "limit.x",
            ),
            (json!({"limit": 5}), "limit"),
        ] {
            assert_eq!(field_of(KeyPatch::from_json(&body).unwrap_err()), field);
        }
    }

    #[test]
    fn a_grant_needs_a_bucket_and_positive_credits() {
        let ok = json!({"bucket": "topup", "credits": 5, "reason": "pack"});
        assert_eq!(GrantRequest::from_json(&ok).unwrap().credits, Credits(5));
        let zero = json!({"bucket": "topup", "credits": 0});
        assert_eq!(
            field_of(GrantRequest::from_json(&zero).unwrap_err()),
            "credits"
        );
        let bucket = json!({"bucket": "gold", "credits": 5});
        assert_eq!(
            field_of(GrantRequest::from_json(&bucket).unwrap_err()),
            "bucket"
        );
        assert_eq!(
            GrantRequest::from_json(&json!([1])).unwrap_err(),
            GatewayError::InvalidJson
        );
    }
}
