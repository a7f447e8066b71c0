//! A complete gateway server on axum, plus the operator commands. It only wires the library:
//! the router is [`model_gateway::Gateway`], the commands are [`model_gateway::admin::Admin`]'s
//! operations (the admin API's too, so both print the same JSON).
//!
//! ```text
//! MOCK_UPSTREAM=1 cargo run --release --example gateway            # serve (the default)
//! cargo run --example gateway -- keys create --subscription 100    # prints the key last
//! cargo run --example gateway -- credits add --key KEY --topup 50
//! cargo run --example gateway -- balance --key KEY
//! cargo run --example gateway -- logs --key KEY --limit 20
//! cargo run --example gateway -- accounts list
//! cargo run --example gateway -- keys update --id 3 --models gpt-4o-mini --rpm 60
//! ```
//!
//! Every command reads `DATABASE_URL` (default `sqlite://gateway.db?mode=rwc`), so the operator
//! commands work against a running server's database.

use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use std::time::Duration;

#[cfg(feature = "api")]
use model_gateway::admin::AdminToken;
use model_gateway::admin::{
    AccountPatch, Admin, CallFilter, DEMO_SUBSCRIPTION_CREDITS, GrantRequest, KeyPatch, NewAccount,
    NewCodes,
};
use model_gateway::call::{KeyLimit, LimitPeriod};
use model_gateway::catalogue::LiveCatalogue;
use model_gateway::events::EventType;
use model_gateway::rate_limit::RateLimiter;
use model_gateway::recovery::{DEFAULT_LEASE_TTL, Upkeep};
use model_gateway::reload::CatalogueReloader;
use model_gateway::server::{self, ServerLimits};
use model_gateway::store::ChargingMode;
use model_gateway::webhooks::WebhookDispatcher;
use model_gateway::{
    AccountId, CallId, Catalogue, Credits, Gateway, KeyId, SeaOrmStore, Upstream, credits::Bucket,
    error::ErrorBody, router::BodyLimits, router::DEFAULT_BODY_BUDGET_BYTES,
    router::DEFAULT_BODY_DEADLINE, router::DEFAULT_BODY_IDLE_TIMEOUT,
    router::DEFAULT_MAX_BODY_BYTES, router::DEFAULT_UNFUNDED_MAX_BODY_BYTES, store::CallStatus,
    store::DEFAULT_IDEMPOTENCY_WINDOW, upstream::HttpUpstream, upstream::MockUpstream,
};

#[derive(Parser)]
#[command(
    name = "gateway",
    about = "A billing gateway in front of LLM providers"
)]
struct Cli {
    /// Database URL: <sqlite://FILE?mode=rwc> or postgres://...
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "sqlite://gateway.db?mode=rwc",
        global = true
    )]
    database_url: String,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the gateway (the default).
    Serve(Box<ServeArgs>),
    /// Manage API keys.
    Keys {
        #[command(subcommand)]
        action: KeysCommand,
    },
    /// Manage credits.
    Credits {
        #[command(subcommand)]
        action: CreditsCommand,
    },
    /// Manage accounts (prints what the admin API answers).
    Accounts {
        #[command(subcommand)]
        action: AccountsCommand,
    },
    /// Grant credits to an account (prints what the admin API answers).
    Grants {
        #[command(subcommand)]
        action: GrantsCommand,
    },
    /// Sell credits as redemption codes (prints what the admin API answers).
    Codes {
        #[command(subcommand)]
        action: CodesCommand,
    },
    /// Print an account's call log as the admin API pages it.
    Calls {
        /// The account id.
        #[arg(long)]
        account: i64,
        /// Most entries.
        #[arg(long)]
        limit: Option<u64>,
        /// Entries older than this call id.
        #[arg(long)]
        before: Option<i64>,
        /// Only `pending`, `ok` or `refunded`.
        #[arg(long, value_parser = parse_status)]
        status: Option<CallStatus>,
        /// Only this model.
        #[arg(long)]
        model: Option<String>,
    },
    /// Print the balance of a key's account as JSON.
    Balance {
        /// The API key.
        #[arg(long)]
        key: String,
    },
    /// Check every account's books; exits non-zero on any mismatch.
    Audit,
    /// Refund reservations left pending by a gateway that stopped mid-call: at once those whose
    /// instance's lease ended, by age those made under no lease.
    Recover,
    /// Print a key's account's call log as JSON, newest first.
    Logs {
        /// The API key.
        #[arg(long)]
        key: String,
        /// How many entries.
        #[arg(long, default_value_t = 50)]
        limit: u64,
    },
}

#[derive(clap::Args, Default)]
struct ServeArgs {
    /// Address to listen on.
    #[arg(long, env = "GATEWAY_LISTEN", default_value = "127.0.0.1:8080")]
    listen: String,
    /// Connections the kernel may complete before the gateway accepts them: room for a burst of
    /// clients connecting at once (the OS caps it; on Linux at `net.core.somaxconn`).
    #[arg(long, env = "GATEWAY_LISTEN_BACKLOG", default_value_t = server::DEFAULT_LISTEN_BACKLOG)]
    listen_backlog: u32,
    /// Model catalogue (TOML); the built-in demo catalogue when unset.
    #[arg(long, env = "GATEWAY_MODELS")]
    models: Option<std::path::PathBuf>,
    /// Answer every call with a fixed demo reply instead of calling providers.
    #[arg(long, env = "MOCK_UPSTREAM", value_parser = clap::builder::FalseyValueParser::new())]
    mock: bool,
    /// Serve `stream: true` as server-sent events (default: the catalogue's `streaming`, off);
    /// when set, this wins over the catalogue.
    #[arg(long, env = "GATEWAY_STREAMING", value_name = "1|0", hide_possible_values = true, value_parser = clap::builder::FalseyValueParser::new())]
    streaming: Option<bool>,
    /// Refusals' bodies: `detail` (exactly `{"detail": ...}`, as specified) or `compatible`
    /// (also the client protocol's own error object, which the OpenAI SDKs read; default: the
    /// catalogue's `error_body`, `detail`); when set, this wins over the catalogue.
    #[arg(long, env = "GATEWAY_ERROR_BODY")]
    error_body: Option<ErrorBody>,
    /// Largest request body accepted, in bytes.
    #[arg(long, env = "GATEWAY_MAX_BODY_BYTES", default_value_t = DEFAULT_MAX_BODY_BYTES)]
    max_body_bytes: usize,
    /// Longest pause between two chunks of a request body, in seconds (408 beyond).
    #[arg(long, env = "GATEWAY_BODY_IDLE_TIMEOUT_SECS", default_value_t = DEFAULT_BODY_IDLE_TIMEOUT.as_secs())]
    body_idle_timeout_secs: u64,
    /// Longest time to receive a whole request body, in seconds (408 beyond).
    #[arg(long, env = "GATEWAY_BODY_DEADLINE_SECS", default_value_t = DEFAULT_BODY_DEADLINE.as_secs())]
    body_deadline_secs: u64,
    /// Memory for request bodies being read at once, in bytes (503 when full); 0 for no budget.
    #[arg(long, env = "GATEWAY_BODY_BUDGET_BYTES", default_value_t = DEFAULT_BODY_BUDGET_BYTES)]
    body_budget_bytes: usize,
    /// Largest body from a key whose credits cannot pay for any model, in bytes (413 beyond).
    #[arg(long, env = "GATEWAY_UNFUNDED_MAX_BODY_BYTES", default_value_t = DEFAULT_UNFUNDED_MAX_BODY_BYTES)]
    unfunded_max_body_bytes: usize,
    /// Time a client has to send a request's headers, in seconds.
    #[arg(long, env = "GATEWAY_HEADER_TIMEOUT_SECS", default_value_t = server::DEFAULT_HEADER_TIMEOUT.as_secs())]
    header_timeout_secs: u64,
    /// Time a connection may go without completing a request, in seconds.
    #[arg(long, env = "GATEWAY_IDLE_TIMEOUT_SECS", default_value_t = server::DEFAULT_IDLE_TIMEOUT.as_secs())]
    idle_timeout_secs: u64,
    /// Most client connections at once (default: from the open-file limit, raised to its hard
    /// value at start).
    #[arg(long, env = "GATEWAY_MAX_CONNECTIONS")]
    max_connections: Option<usize>,
    /// Serve Prometheus metrics at `GET /metrics` on this address (off when unset). With an
    /// admin token, `/metrics` is also served on the main address behind it.
    #[arg(long, env = "GATEWAY_METRICS_LISTEN")]
    metrics_listen: Option<String>,
    /// Turns on the admin API (`/admin/*`) for `Authorization: Bearer <this token>`; at least
    /// 16 characters. Unset: `/admin` does not exist.
    #[arg(long, env = "GATEWAY_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// Deliver webhook events (codes redeemed, subscriptions lapsed, upstreams' breakers) to
    /// this URL, signed with `GATEWAY_WEBHOOK_SECRET`; unset: no events are recorded.
    #[arg(long, env = "GATEWAY_WEBHOOK_URL", requires = "webhook_secret")]
    webhook_url: Option<String>,
    /// Which events to deliver, comma-separated (`account.balance_low,key.limit_reached`);
    /// unset: every type.
    #[arg(long, env = "GATEWAY_WEBHOOK_EVENTS", value_delimiter = ',', value_parser = parse_event_type)]
    webhook_events: Option<Vec<EventType>>,
    /// Tell `account.balance_low` when a call takes what an account can spend below this many
    /// credits (accounts may set their own); 0: never.
    #[arg(long, env = "GATEWAY_LOW_BALANCE_CREDITS", default_value_t = 0,
          value_parser = clap::value_parser!(i64).range(0..))]
    low_balance_credits: i64,
    /// The secret webhook signatures are made with (HMAC-SHA256).
    #[arg(long, env = "GATEWAY_WEBHOOK_SECRET", hide_env_values = true)]
    webhook_secret: Option<String>,
    /// How long one webhook delivery may take, in seconds.
    #[arg(long, env = "GATEWAY_WEBHOOK_TIMEOUT_SECS", default_value_t = model_gateway::webhooks::DEFAULT_TIMEOUT.as_secs())]
    webhook_timeout_secs: u64,
    /// Count keys' requests per minute in this Redis (`redis://127.0.0.1:6379/0`), so limits
    /// hold across gateway instances; unset, or while it cannot be reached: per instance.
    #[arg(long, env = "GATEWAY_REDIS_URL")]
    redis_url: Option<String>,
    /// Prefix of the rate limiter's Redis keys.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    #[arg(long, env = "GATEWAY_REDIS_PREFIX", default_value = "mg:")]
    redis_prefix: String,
    /// Largest request header block, in bytes (431 beyond).
    #[arg(long, env = "GATEWAY_MAX_HEADER_BYTES", default_value_t = server::DEFAULT_MAX_HEADER_BYTES)]
    max_header_bytes: usize,
    /// Refund reservations still pending after this many seconds (default: the call deadline
    /// plus margins). Shorter than any call can last is unsafe while other gateways serve.
    #[arg(long, env = "GATEWAY_RECOVERY_AGE_SECS")]
    recovery_age_secs: Option<u64>,
    /// How long this instance's lease holds without renewal, in seconds: how soon another
    /// instance refunds this one's reservations if it dies (renewed every fifth of it).
    #[arg(long, env = "GATEWAY_LEASE_SECS", default_value_t = DEFAULT_LEASE_TTL.as_secs())]
    lease_secs: u64,
    /// How long an `Idempotency-Key` holds after its call, in seconds: a retry within it is
    /// answered from the kept reply, never billed again.
    #[arg(long, env = "GATEWAY_IDEMPOTENCY_WINDOW_SECS", default_value_t = DEFAULT_IDEMPOTENCY_WINDOW.as_secs())]
    idempotency_window_secs: u64,
    /// On a `SQLite` file, keep reservations in the database so that several gateways may
    /// serve the file at once. By default the gateway owns the file: reservations are held in
    /// memory, each call is written once, and a second gateway on the file is refused.
    #[arg(long, env = "GATEWAY_SQLITE_SHARED", value_parser = clap::builder::FalseyValueParser::new())]
    sqlite_shared: bool,
    /// On `PostgreSQL`, charge against credit escrow: each instance moves a slice of each
    /// account's credits into an escrow row of its own and writes each call once, when it
    /// ends, without touching the account's row (see `SeaOrmStore::with_escrow`).
    #[arg(long, env = "GATEWAY_PG_ESCROW", value_parser = clap::builder::FalseyValueParser::new())]
    pg_escrow: bool,
}

impl ServeArgs {
    fn body_limits(&self) -> BodyLimits {
        BodyLimits::new(self.max_body_bytes)
            .idle_timeout(Duration::from_secs(self.body_idle_timeout_secs))
            .deadline(Duration::from_secs(self.body_deadline_secs))
            .budget_bytes((self.body_budget_bytes > 0).then_some(self.body_budget_bytes))
            .unfunded_max_bytes(self.unfunded_max_body_bytes)
    }

    /// The server's limits; raises the open-file limit first when the connection limit is
    /// derived from it.
    fn server_limits(&self) -> ServerLimits {
        let mut limits = ServerLimits::default();
        limits.header_timeout = Duration::from_secs(self.header_timeout_secs);
        limits.idle_timeout = Duration::from_secs(self.idle_timeout_secs);
        limits.max_header_bytes = self.max_header_bytes;
        limits.max_connections = self
            .max_connections
            .unwrap_or_else(|| server::connections_for_file_limit(server::raise_file_limit()));
        limits
    }

    fn recovery_age(&self, catalogue: &Catalogue) -> std::time::Duration {
        self.recovery_age_secs.map_or_else(
            || model_gateway::recovery::recovery_age(catalogue),
            std::time::Duration::from_secs,
        )
    }
}

#[derive(Subcommand)]
enum KeysCommand {
    /// Create an account with a key and credits; prints the key alone on the last line.
    Create {
        /// Subscription credits to grant.
        #[arg(long, default_value_t = 0)]
        subscription: i64,
        /// Top-up credits to grant.
        #[arg(long, default_value_t = 0)]
        topup: i64,
        /// Account name.
        #[arg(long, default_value = "account")]
        name: String,
    },
    /// Revoke a key: refused from its next call on, on every gateway sharing the database.
    Revoke {
        /// The API key, in clear.
        #[arg(long, conflicts_with = "id", required_unless_present = "id")]
        key: Option<String>,
        /// The key's id (prints the key as the admin API shows it).
        #[arg(long)]
        id: Option<i64>,
    },
    /// Add a key to an account; prints it once.
    Add {
        /// The account id.
        #[arg(long)]
        account: i64,
    },
    /// Change a key's rules; prints the key as the admin API shows it.
    Update {
        /// The key's id.
        #[arg(long)]
        id: i64,
        /// Only these models (comma-separated).
        #[arg(long, value_delimiter = ',', conflicts_with = "all_models")]
        models: Option<Vec<String>>,
        /// Every model again.
        #[arg(long)]
        all_models: bool,
        /// Stops working at this time (RFC 3339).
        #[arg(long, conflicts_with = "no_expiry")]
        expires_at: Option<String>,
        /// Never expires.
        #[arg(long)]
        no_expiry: bool,
        /// Requests per minute.
        #[arg(long, conflicts_with = "no_rpm")]
        rpm: Option<u32>,
        /// No rate limit.
        #[arg(long)]
        no_rpm: bool,
        /// Credits the key may spend per `--limit-period`.
        #[arg(long, conflicts_with = "no_limit", requires = "limit_period")]
        limit_credits: Option<i64>,
        /// `day`, `week`, `month` or `none` (for good).
        #[arg(long, value_parser = parse_period, requires = "limit_credits")]
        limit_period: Option<LimitPeriod>,
        /// No spending limit.
        #[arg(long)]
        no_limit: bool,
    },
}

fn parse_period(name: &str) -> Result<LimitPeriod, String> {
    LimitPeriod::parse(name).ok_or_else(|| "day, week, month or none".to_owned())
}

#[derive(Subcommand)]
enum AccountsCommand {
    /// Create an account with a key and credits; prints it (and the key, once) as JSON.
    Create {
        /// Account name.
        #[arg(long)]
        name: String,
        /// Subscription credits to grant.
        #[arg(long, default_value_t = 0)]
        subscription: i64,
        /// Top-up credits to grant.
        #[arg(long, default_value_t = 0)]
        topup: i64,
    },
    /// List accounts with their balances, a page at a time.
    List {
        /// Accounts with a larger id than this.
        #[arg(long)]
        after: Option<i64>,
        /// Most accounts.
        #[arg(long)]
        limit: Option<u64>,
        /// Part of a name, the start of a key, or a whole key.
        #[arg(long)]
        search: Option<String>,
    },
    /// One account with its balance and keys.
    Show {
        /// The account id.
        id: i64,
    },
    /// Change an account: its own low-balance threshold (`account.balance_low`).
    Update {
        /// The account id.
        id: i64,
        /// Tell when what it can spend falls below this many credits (0: never).
        #[arg(long, conflicts_with = "default_low_balance")]
        low_balance_credits: Option<i64>,
        /// Go back to the gateway's default threshold (`GATEWAY_LOW_BALANCE_CREDITS`).
        #[arg(long)]
        default_low_balance: bool,
    },
}

#[derive(Subcommand)]
enum GrantsCommand {
    /// Grant credits to one bucket.
    Add {
        /// The account id.
        #[arg(long)]
        account: i64,
        /// `subscription` or `topup`.
        #[arg(long, value_parser = parse_bucket)]
        bucket: Bucket,
        /// How many credits.
        #[arg(long)]
        credits: i64,
        /// Why, for the books.
        #[arg(long)]
        reason: Option<String>,
        /// Applied once per account however often it is sent with this key.
        #[arg(long)]
        idempotency_key: Option<String>,
        /// Subscription credits for a period of this many days from now (what was left of the
        /// previous period lapses).
        #[arg(long, conflicts_with = "ends_at")]
        period_days: Option<u32>,
        /// Subscription credits for a period ending then (RFC 3339).
        #[arg(long)]
        ends_at: Option<String>,
    },
}

#[derive(Subcommand)]
enum CodesCommand {
    /// Create a batch of codes; prints the batch and its codes, shown this once.
    Create {
        /// How many codes.
        #[arg(long)]
        count: u32,
        /// Credits each code grants.
        #[arg(long)]
        credits: i64,
        /// `subscription` or `topup`.
        #[arg(long, value_parser = parse_bucket)]
        bucket: Bucket,
        /// Subscription codes: a period of this many days from the redemption.
        #[arg(long)]
        period_days: Option<u32>,
        /// The codes stop working then (RFC 3339).
        #[arg(long)]
        expires_at: Option<String>,
        /// A label for the batch.
        #[arg(long)]
        label: Option<String>,
    },
    /// List the batches with their used and unused counts.
    List,
    /// Revoke a batch's unused codes.
    Revoke {
        /// The batch id.
        batch: i64,
    },
}

fn parse_event_type(name: &str) -> Result<EventType, String> {
    EventType::parse(name.trim()).ok_or_else(|| {
        let known: Vec<_> = EventType::ALL.iter().map(|kind| kind.as_str()).collect();
        format!("unknown event type {name:?}; one of {}", known.join(", "))
    })
}

fn parse_bucket(name: &str) -> Result<Bucket, String> {
    Bucket::parse(name).ok_or_else(|| "subscription or topup".to_owned())
}

fn parse_status(name: &str) -> Result<CallStatus, String> {
    CallStatus::parse(name).ok_or_else(|| "pending, ok or refunded".to_owned())
}

#[derive(Subcommand)]
enum CreditsCommand {
    /// Grant credits to a key's account.
    Add {
        /// The API key, in clear.
        #[arg(long, conflicts_with = "account", required_unless_present = "account")]
        key: Option<String>,
        /// The account id.
        #[arg(long)]
        account: Option<i64>,
        /// Subscription credits to grant.
        #[arg(long, default_value_t = 0)]
        subscription: i64,
        /// Top-up credits to grant.
        #[arg(long, default_value_t = 0)]
        topup: i64,
    },
}

/// jemalloc rather than the system allocator. A profile of the load test put a seventh of all
/// CPU in glibc's `malloc` and `free`; on the 2-core dev VM jemalloc took the gateway from 39k
/// to 70k requests per second on the in-memory store and from 19.5k to 29.5k on an owned
/// `SQLite` file (concurrency 64), for 5 MiB more with 1000 idle connections (BENCHMARKS.md,
/// "The allocator"). The library leaves the choice to the binary that embeds it.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let logs = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,sqlx=warn,sea_orm=warn".into()),
        )
        .with_writer(std::io::stderr);
    if std::env::var("GATEWAY_LOG_FORMAT").as_deref() == Ok("json") {
        // One JSON object per line, the request's span (with its id) in each.
        logs.json().with_current_span(true).init();
    } else {
        // Colour only for a person at a terminal, not in a file or a log collector.
        logs.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init();
    }
    match run(Cli::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

fn print_json(value: &impl serde::Serialize) -> Result<(), Box<dyn std::error::Error>> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

async fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    let command = cli
        .command
        .unwrap_or_else(|| Command::Serve(Box::new(ServeArgs::parse_from_env())));
    let store = SeaOrmStore::connect(&cli.database_url).await?;
    if let Command::Serve(args) = command {
        return serve(store, *args).await;
    }
    let admin = Admin::new(Arc::new(store));
    match command {
        Command::Serve(_) => unreachable!("served above"),
        Command::Keys { action } => keys(&admin, action).await?,
        Command::Accounts { action } => match action {
            AccountsCommand::Create {
                name,
                subscription,
                topup,
            } => {
                let new = NewAccount {
                    name,
                    subscription,
                    topup,
                };
                print_json(&admin.create_account(&new).await?)?;
            }
            AccountsCommand::List {
                after,
                limit,
                search,
            } => print_json(
                &admin
                    .accounts(after.map(AccountId), limit, search.as_deref())
                    .await?,
            )?,
            AccountsCommand::Show { id } => print_json(&admin.account(AccountId(id)).await?)?,
            AccountsCommand::Update {
                id,
                low_balance_credits,
                default_low_balance,
            } => {
                let threshold = match (low_balance_credits, default_low_balance) {
                    (Some(credits), _) if credits < 0 => {
                        return Err("--low-balance-credits cannot be negative".into());
                    }
                    (Some(credits), _) => Some(Some(Credits::new(credits))),
                    (None, true) => Some(None),
                    (None, false) => None,
                };
                let patch = AccountPatch {
                    low_balance_credits: threshold,
                };
                print_json(&admin.update_account(AccountId(id), &patch).await?)?;
            }
        },
        Command::Grants {
            action:
                GrantsCommand::Add {
                    account,
                    bucket,
                    credits,
                    reason,
                    idempotency_key,
                    period_days,
                    ends_at,
                },
        } => {
            let mut grant = GrantRequest::new(bucket, Credits::new(credits));
            grant.reason = reason;
            grant.period_days = period_days;
            grant.ends_at = ends_at
                .map(|at| chrono::DateTime::parse_from_rfc3339(&at))
                .transpose()
                .map_err(|error| format!("--ends-at: {error}"))?
                .map(|at| at.with_timezone(&chrono::Utc));
            let granted = admin
                .grant(AccountId(account), &grant, idempotency_key.as_deref())
                .await?;
            print_json(&granted)?;
        }
        Command::Codes { action } => match action {
            CodesCommand::Create {
                count,
                credits,
                bucket,
                period_days,
                expires_at,
                label,
            } => {
                let new = NewCodes {
                    count,
                    credits: Credits::new(credits),
                    bucket,
                    period_days,
                    expires_at: expires_at
                        .map(|at| chrono::DateTime::parse_from_rfc3339(&at))
                        .transpose()
                        .map_err(|error| format!("--expires-at: {error}"))?
                        .map(|at| at.with_timezone(&chrono::Utc)),
                    label,
                };
                print_json(&admin.create_codes(&new).await?)?;
            }
            CodesCommand::List => print_json(&admin.code_batches().await?)?,
            CodesCommand::Revoke { batch } => print_json(&admin.revoke_codes(batch).await?)?,
        },
        Command::Calls {
            account,
            limit,
            before,
            status,
            model,
        } => {
            let filter = CallFilter {
                limit,
                before: before.map(CallId),
                status,
                model,
            };
            print_json(&admin.calls(AccountId(account), &filter).await?)?;
        }
        Command::Audit => {
            // The catalogue says how long a call may take, past which a reservation is overdue.
            let catalogue = load_catalogue(&ServeArgs::parse_from_env())?;
            let admin = Admin::new(admin.store().clone()).with_catalogue(Arc::new(catalogue));
            let report = admin.audit().await?;
            for line in &report.accounts {
                println!("{line}");
            }
            let accounts = report.accounts.len();
            if !report.ok {
                let failures = report
                    .accounts
                    .iter()
                    .filter(|line| line["ok"] != serde_json::Value::Bool(true))
                    .count();
                return Err(format!(
                    "audit FAILED for {failures} of {accounts} accounts: balances differ from grants minus ok and pending charges"
                )
                .into());
            }
            println!(
                "audit passed: {accounts} accounts; in both buckets every balance equals grants minus ok and pending charges, and none is negative"
            );
            let overdue = report.overdue_reservations;
            if overdue.calls > 0 {
                eprintln!(
                    "warning: {} reservations ({} credits) are still pending past the longest a call can take: credits held by no live call",
                    overdue.calls, overdue.credits
                );
            }
        }
        Command::Recover => {
            let args = ServeArgs::parse_from_env();
            let age = args.recovery_age(&load_catalogue(&args)?);
            let store = admin.store().as_ref();
            let orphaned = model_gateway::recovery::recover_orphaned_reservations(store).await?;
            let stale = model_gateway::recovery::recover_stale_reservations(store, age).await?;
            println!(
                "refunded {} reservations of stopped instances and {} stale reservations",
                orphaned.len(),
                stale.len()
            );
        }
        Command::Credits {
            action:
                CreditsCommand::Add {
                    key,
                    account,
                    subscription,
                    topup,
                },
        } => {
            let account = match (key, account) {
                (Some(key), _) => admin.account_of_key(&key).await?,
                (None, Some(account)) => AccountId(account),
                (None, None) => return Err("give --key KEY or --account ID".into()),
            };
            let balance = admin.add_credits(account, subscription, topup).await?;
            println!("{}", serde_json::to_string(&balance)?);
        }
        Command::Balance { key } => {
            let account = admin.account_of_key(&key).await?;
            println!(
                "{}",
                serde_json::to_string(&admin.account(account).await?.balance)?
            );
        }
        Command::Logs { key, limit } => {
            let account = admin.account_of_key(&key).await?;
            let filter = CallFilter {
                limit: Some(limit),
                ..CallFilter::default()
            };
            print_json(&admin.calls(account, &filter).await?.data)?;
        }
    }
    Ok(())
}

async fn keys(
    admin: &Admin<SeaOrmStore>,
    action: KeysCommand,
) -> Result<(), Box<dyn std::error::Error>> {
    match action {
        KeysCommand::Create {
            subscription,
            topup,
            name,
        } => {
            let new = NewAccount {
                name: name.clone(),
                subscription,
                topup,
            };
            let created = admin.create_account(&new).await?;
            println!(
                "created account `{name}` (id {}) with {subscription} subscription and {topup} top-up credits",
                created.id.0
            );
            println!("{}", created.key);
        }
        KeysCommand::Revoke { key: Some(key), .. } => {
            admin.revoke_clear_key(&key).await?;
            println!("revoked");
        }
        KeysCommand::Revoke { id, .. } => {
            let id = id.ok_or("give --key KEY or --id ID")?;
            print_json(&admin.revoke_key(KeyId(id)).await?)?;
        }
        KeysCommand::Add { account } => print_json(&admin.create_key(AccountId(account)).await?)?,
        KeysCommand::Update {
            id,
            models,
            all_models,
            expires_at,
            no_expiry,
            rpm,
            no_rpm,
            limit_credits,
            limit_period,
            no_limit,
        } => {
            let expires_at = expires_at
                .map(|at| chrono::DateTime::parse_from_rfc3339(&at))
                .transpose()
                .map_err(|error| format!("--expires-at: {error}"))?
                .map(|at| at.with_timezone(&chrono::Utc));
            let patch = KeyPatch {
                models: if all_models {
                    Some(None)
                } else {
                    models.map(Some)
                },
                expires_at: if no_expiry {
                    Some(None)
                } else {
                    expires_at.map(Some)
                },
                rpm: if no_rpm { Some(None) } else { rpm.map(Some) },
                limit: if no_limit {
                    Some(None)
                } else {
                    match (limit_credits, limit_period) {
                        (Some(credits), Some(period)) if credits > 0 => Some(Some(KeyLimit {
                            credits: Credits::new(credits),
                            period,
                        })),
                        (Some(_), _) => return Err("--limit-credits must be positive".into()),
                        _ => None,
                    }
                },
            };
            print_json(&admin.update_key(KeyId(id), &patch).await?)?;
        }
    }
    Ok(())
}

impl ServeArgs {
    /// `serve`'s settings when no subcommand was given: its flags' environment variables.
    fn parse_from_env() -> ServeArgs {
        #[derive(Parser)]
        struct Only {
            #[command(flatten)]
            serve: ServeArgs,
        }
        Only::parse_from(["gateway"]).serve
    }
}

fn load_catalogue(args: &ServeArgs) -> Result<Catalogue, model_gateway::catalogue::CatalogueError> {
    CatalogueSource::of(args).load()
}

/// Where the catalogue is read from, at start and on each reload: the file, and the switches
/// that override it.
#[derive(Clone)]
struct CatalogueSource {
    models: Option<std::path::PathBuf>,
    streaming: Option<bool>,
    error_body: Option<ErrorBody>,
}

impl CatalogueSource {
    fn of(args: &ServeArgs) -> CatalogueSource {
        CatalogueSource {
            models: args.models.clone(),
            streaming: args.streaming,
            error_body: args.error_body,
        }
    }

    fn load(&self) -> Result<Catalogue, model_gateway::catalogue::CatalogueError> {
        let catalogue = match &self.models {
            Some(path) => Catalogue::from_path(path)?,
            None => Catalogue::demo(),
        };
        let catalogue = match self.streaming {
            Some(streaming) => catalogue.with_streaming(streaming),
            None => catalogue,
        };
        Ok(match self.error_body {
            Some(body) => catalogue.with_error_body(body),
            None => catalogue,
        })
    }
}

async fn serve(store: SeaOrmStore, args: ServeArgs) -> Result<(), Box<dyn std::error::Error>> {
    let source = CatalogueSource::of(&args);
    let catalogue = Arc::new(source.load()?);
    let window = Duration::from_secs(args.idempotency_window_secs);
    let mode = ChargingMode::choose(&store, args.sqlite_shared, args.pg_escrow);
    let store = store.in_mode(mode)?;
    tracing::info!(mode = mode.as_str(), "charging mode");
    let store = store.with_idempotency_window(window);
    let store = Arc::new(match &args.webhook_url {
        Some(_) => store
            .with_webhook_events()
            .with_webhook_event_types(args.webhook_events.clone().unwrap_or(EventType::ALL.into()))
            .with_low_balance_alert(Credits::new(args.low_balance_credits)),
        None => store,
    });
    // Delivers the outbox beside the calls; stopped with the process.
    if let Some(url) = &args.webhook_url
        && points_at_itself(url, &args.listen)
    {
        return Err(format!(
            "GATEWAY_WEBHOOK_URL points at this gateway itself ({url}): events would be sent to \
             its own endpoints"
        )
        .into());
    }
    let _webhooks = match (&args.webhook_url, &args.webhook_secret) {
        (Some(url), Some(secret)) => Some(
            WebhookDispatcher::new(store.clone(), url.clone(), secret.clone())
                .map_err(|error| format!("GATEWAY_WEBHOOK_URL: {error}"))?
                .timeout(Duration::from_secs(args.webhook_timeout_secs))
                .spawn(),
        ),
        _ => None,
    };
    let upstream = if args.mock {
        if let Some(demo) = Admin::new(store.clone()).ensure_demo_account().await? {
            println!(
                "created a demo account with {DEMO_SUBSCRIPTION_CREDITS} credits; its key (shown once): {}",
                demo.key
            );
        }
        Upstream::Mock(MockUpstream::new())
    } else {
        Upstream::Http(HttpUpstream::from_env(&catalogue)?)
    };
    // Holds this instance's lease and, before serving, refunds what a crashed predecessor left.
    let upkeep = Upkeep::new(store.clone(), args.recovery_age(&catalogue))
        .lease_ttl(Duration::from_secs(args.lease_secs))
        .start()
        .await?;
    let limiter = rate_limiter(&args)?;
    // `SIGHUP` and `POST /admin/catalogue/reload` read the catalogue again.
    let live = LiveCatalogue::new(catalogue.clone());
    let reloader = CatalogueReloader::new(live.clone(), upstream.clone(), move || source.load());
    tokio::spawn(reload_on_hangup(reloader.clone()));
    let gateway = Gateway::new(store, live, upstream)
        .catalogue_reloader(reloader)
        .body_limits(args.body_limits())
        .rate_limiter(limiter);
    let router = operator_apis(gateway, &args).await?.router();
    let limits = args.server_limits();
    let listener = server::bind(&args.listen, args.listen_backlog).await?;
    let address = listener.local_addr()?;
    tracing::info!(
        %address,
        mock = args.mock,
        streaming = catalogue.streaming(),
        error_body = catalogue.error_body().as_str(),
        admin_api = args.admin_token.is_some(),
        shared_rate_limits = args.redis_url.is_some(),
        models = catalogue.models().count(),
        max_connections = limits.max_connections,
        "model-gateway listening on http://{address}"
    );
    server::serve(listener, router, limits, shutdown_signal()).await?;
    upkeep.stop().await;
    tracing::info!("shut down");
    Ok(())
}

/// Counts keys' requests per minute in Redis when `GATEWAY_REDIS_URL` is set (the `redis`
/// feature), else in this process.
fn rate_limiter(args: &ServeArgs) -> Result<RateLimiter, Box<dyn std::error::Error>> {
    let Some(url) = &args.redis_url else {
        return Ok(RateLimiter::local());
    };
    #[cfg(feature = "redis")]
    return Ok(RateLimiter::redis(url, args.redis_prefix.clone())
        .map_err(|error| format!("GATEWAY_REDIS_URL: {error}"))?);
    #[cfg(not(feature = "redis"))]
    return Err({
        let _ = url;
        needs_feature("GATEWAY_REDIS_URL", "redis")
    });
}

/// The admin API and console (`GATEWAY_ADMIN_TOKEN`, the `api` feature) and Prometheus metrics
/// (`GATEWAY_METRICS_LISTEN` or the admin token, the `metrics` feature).
async fn operator_apis<S: model_gateway::Store + 'static>(
    gateway: Gateway<S>,
    args: &ServeArgs,
) -> Result<Gateway<S>, Box<dyn std::error::Error>> {
    #[cfg(feature = "api")]
    let admin_token = args
        .admin_token
        .clone()
        .map(AdminToken::new)
        .transpose()
        .map_err(|error| format!("GATEWAY_ADMIN_TOKEN: {error}"))?;
    #[cfg(not(feature = "api"))]
    if args.admin_token.is_some() {
        return Err(needs_feature("GATEWAY_ADMIN_TOKEN", "api"));
    }
    #[cfg(feature = "metrics")]
    {
        #[cfg(not(feature = "api"))]
        let admin_token: Option<()> = None;
        let metrics = match (&args.metrics_listen, &admin_token) {
            (None, None) => None,
            _ => Some(model_gateway::telemetry::install_prometheus()?),
        };
        if let (Some(address), Some(metrics)) = (&args.metrics_listen, metrics.clone()) {
            let listener = tokio::net::TcpListener::bind(address).await?;
            tracing::info!(address = %listener.local_addr()?, "metrics at /metrics");
            let router = axum::Router::new().route(
                "/metrics",
                axum::routing::get(move || std::future::ready(metrics.render())),
            );
            tokio::spawn(server::serve(
                listener,
                router,
                ServerLimits::default(),
                std::future::pending(),
            ));
        }
        #[cfg(feature = "api")]
        if let (Some(metrics), Some(_)) = (metrics, &admin_token) {
            let gateway = gateway.admin_token(admin_token);
            return Ok(gateway.metrics(move || metrics.render()));
        }
    }
    #[cfg(not(feature = "metrics"))]
    if args.metrics_listen.is_some() {
        return Err(needs_feature("GATEWAY_METRICS_LISTEN", "metrics"));
    }
    #[cfg(feature = "api")]
    let gateway = gateway.admin_token(admin_token);
    Ok(gateway)
}

/// A setting this build cannot honour: refused at start rather than silently ignored.
#[cfg(not(all(feature = "api", feature = "metrics", feature = "redis")))]
fn needs_feature(setting: &str, feature: &str) -> Box<dyn std::error::Error> {
    format!(
        "{setting} needs the `{feature}` feature: cargo run --release --example gateway --features {feature}"
    )
    .into()
}

/// Reloads the catalogue on each `SIGHUP` (on Unix): a bad one is logged and the old one
/// serves on.
async fn reload_on_hangup(reloader: CatalogueReloader) {
    #[cfg(unix)]
    {
        let Ok(mut hangups) =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        else {
            return;
        };
        while hangups.recv().await.is_some() {
            match reloader.reload().await {
                Ok(catalogue) => tracing::info!(
                    models = catalogue.models().count(),
                    "SIGHUP: catalogue reloaded"
                ),
                Err(error) => {
                    tracing::error!(%error, "SIGHUP: catalogue refused; the old one serves on");
                }
            }
        }
    }
    #[cfg(not(unix))]
    let _ = reloader;
}

/// Ctrl-C, or SIGTERM on Unix: stop accepting, finish the calls under way, exit.
async fn shutdown_signal() {
    let ctrl_c = async {
        tokio::signal::ctrl_c().await.ok();
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
}

/// Whether webhook `url` names the address this gateway listens on (`listen`, `host:port`):
/// the same port on a loopback, unspecified or the listening host.
fn points_at_itself(url: &str, listen: &str) -> bool {
    let (Ok(url), Ok(listen)) = (
        reqwest::Url::parse(url),
        listen.parse::<std::net::SocketAddr>(),
    ) else {
        return false;
    };
    if url.port_or_known_default() != Some(listen.port()) {
        return false;
    }
    let host = url.host_str().unwrap_or_default();
    let host = host.trim_start_matches('[').trim_end_matches(']');
    match host.parse::<std::net::IpAddr>() {
        Ok(ip) => ip.is_loopback() || ip.is_unspecified() || ip == listen.ip(),
        Err(_) => host.eq_ignore_ascii_case("localhost"),
    }
}
