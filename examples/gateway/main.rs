//! A complete gateway server on axum, plus the operator commands.
//!
//! ```text
//! MOCK_UPSTREAM=1 cargo run --release --example gateway            # serve (the default)
//! cargo run --example gateway -- keys create --subscription 100    # prints the key last
//! cargo run --example gateway -- credits add --key KEY --topup 50
//! cargo run --example gateway -- balance --key KEY
//! cargo run --example gateway -- logs --key KEY --limit 20
//! ```
//!
//! Every command reads `DATABASE_URL` (default `sqlite://gateway.db?mode=rwc`), so the operator
//! commands work against a running server's database.

mod app;

use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use std::time::Duration;

use model_gateway::server::{self, ServerLimits};
use model_gateway::{
    BodyLimits, Catalogue, DEFAULT_BODY_BUDGET_BYTES, DEFAULT_BODY_DEADLINE,
    DEFAULT_BODY_IDLE_TIMEOUT, DEFAULT_MAX_BODY_BYTES, DEFAULT_UNFUNDED_MAX_BODY_BYTES,
    HttpUpstream, MockUpstream, SeaOrmStore, Upstream,
};

#[derive(Parser)]
#[command(
    name = "gateway",
    about = "A billing gateway in front of LLM providers"
)]
struct Cli {
    /// Database URL: sqlite://FILE?mode=rwc or postgres://...
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
    Serve(ServeArgs),
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
    /// Print the balance of a key's account as JSON.
    Balance {
        /// The API key.
        #[arg(long)]
        key: String,
    },
    /// Check every account's books; exits non-zero on any mismatch.
    Audit,
    /// Refund reservations left pending by a gateway that stopped mid-call.
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
    /// Model catalogue (TOML); the built-in demo catalogue when unset.
    #[arg(long, env = "GATEWAY_MODELS")]
    models: Option<std::path::PathBuf>,
    /// Answer every call with a fixed demo reply instead of calling providers.
    #[arg(long, env = "MOCK_UPSTREAM", value_parser = clap::builder::FalseyValueParser::new())]
    mock: bool,
    /// Serve `stream: true` as server-sent events (default: the catalogue's `streaming`, off);
    /// when set, this wins over the catalogue.
    #[arg(long, env = "GATEWAY_STREAMING", value_parser = clap::builder::FalseyValueParser::new())]
    streaming: Option<bool>,
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
    /// Serve Prometheus metrics at `GET /metrics` on this address (off when unset).
    #[arg(long, env = "GATEWAY_METRICS_LISTEN")]
    metrics_listen: Option<String>,
    /// Largest request header block, in bytes (431 beyond).
    #[arg(long, env = "GATEWAY_MAX_HEADER_BYTES", default_value_t = server::DEFAULT_MAX_HEADER_BYTES)]
    max_header_bytes: usize,
    /// Refund reservations still pending after this many seconds (default: the call deadline
    /// plus margins). Shorter than any call can last is unsafe while other gateways serve.
    #[arg(long, env = "GATEWAY_RECOVERY_AGE_SECS")]
    recovery_age_secs: Option<u64>,
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
            || model_gateway::recovery_age(catalogue),
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
        /// The API key.
        #[arg(long)]
        key: String,
    },
}

#[derive(Subcommand)]
enum CreditsCommand {
    /// Grant credits to a key's account.
    Add {
        /// The API key.
        #[arg(long)]
        key: String,
        /// Subscription credits to grant.
        #[arg(long, default_value_t = 0)]
        subscription: i64,
        /// Top-up credits to grant.
        #[arg(long, default_value_t = 0)]
        topup: i64,
    },
}

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

async fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    let command = cli
        .command
        .unwrap_or_else(|| Command::Serve(ServeArgs::parse_from_env()));
    let store = SeaOrmStore::connect(&cli.database_url).await?;
    match command {
        Command::Serve(args) => serve(store, args).await?,
        Command::Keys {
            action: KeysCommand::Revoke { key },
        } => {
            app::revoke(&store, &key).await?;
            println!("revoked");
        }
        Command::Audit => {
            let report = app::audit(&store).await?;
            for line in &report.lines {
                println!("{line}");
            }
            let accounts = report.lines.len();
            if report.failures > 0 {
                return Err(format!(
                    "audit FAILED for {} of {accounts} accounts: balances differ from grants minus ok and pending charges",
                    report.failures
                )
                .into());
            }
            println!(
                "audit passed: {accounts} accounts; in both buckets every balance equals grants minus ok and pending charges, and none is negative"
            );
        }
        Command::Recover => {
            let args = ServeArgs::parse_from_env();
            let age = args.recovery_age(&load_catalogue(&args)?);
            let refunded = model_gateway::recover_stale_reservations(&store, age).await?;
            println!("refunded {} stale reservations", refunded.len());
        }
        Command::Keys {
            action:
                KeysCommand::Create {
                    subscription,
                    topup,
                    name,
                },
        } => {
            let key = app::create_key(&store, &name, subscription, topup).await?;
            println!(
                "created account `{name}` with {subscription} subscription and {topup} top-up credits"
            );
            println!("{}", key.reveal());
        }
        Command::Credits {
            action:
                CreditsCommand::Add {
                    key,
                    subscription,
                    topup,
                },
        } => {
            let balance = app::add_credits(&store, &key, subscription, topup).await?;
            println!(
                "{}",
                serde_json::json!({
                    "subscription": balance.subscription,
                    "topup": balance.topup,
                    "total": balance.total(),
                })
            );
        }
        Command::Balance { key } => println!("{}", app::balance_json(&store, &key).await?),
        Command::Logs { key, limit } => {
            let entries = app::logs(&store, &key, limit).await?;
            println!("{}", serde_json::to_string_pretty(&entries)?);
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

fn load_catalogue(args: &ServeArgs) -> Result<Catalogue, model_gateway::CatalogueError> {
    let catalogue = match &args.models {
        Some(path) => Catalogue::from_path(path)?,
        None => Catalogue::demo(),
    };
    Ok(match args.streaming {
        Some(streaming) => catalogue.with_streaming(streaming),
        None => catalogue,
    })
}

/// How often a serving gateway looks for reservations left pending by a stopped gateway.
const RECOVERY_INTERVAL: std::time::Duration = std::time::Duration::from_secs(60);

/// Refunds stale reservations now, then every [`RECOVERY_INTERVAL`], for as long as it runs.
async fn recover_periodically(store: Arc<SeaOrmStore>, older_than: std::time::Duration) {
    let mut ticks = tokio::time::interval(RECOVERY_INTERVAL);
    loop {
        ticks.tick().await;
        match model_gateway::recover_stale_reservations(store.as_ref(), older_than).await {
            Ok(refunded) if !refunded.is_empty() => {
                tracing::warn!(count = refunded.len(), "refunded stale reservations")
            }
            Ok(_) => {}
            Err(error) => tracing::error!(%error, "recovery pass failed; will retry"),
        }
    }
}

async fn serve(store: SeaOrmStore, args: ServeArgs) -> Result<(), Box<dyn std::error::Error>> {
    let catalogue = Arc::new(load_catalogue(&args)?);
    let upstream = if args.mock {
        if let Some(key) = app::ensure_demo_account(&store).await? {
            println!(
                "created a demo account with {} credits; its key (shown once): {}",
                app::DEMO_SUBSCRIPTION_CREDITS,
                key.reveal()
            );
        }
        Upstream::Mock(MockUpstream::new())
    } else {
        Upstream::Http(HttpUpstream::from_env(&catalogue)?)
    };
    let store = Arc::new(store);
    let recovery = tokio::spawn(recover_periodically(
        store.clone(),
        args.recovery_age(&catalogue),
    ));
    let router = app::router(store, catalogue.clone(), upstream, args.body_limits());
    let limits = args.server_limits();
    if let Some(address) = &args.metrics_listen {
        let metrics = model_gateway::telemetry::install_prometheus()?;
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
    let listener = tokio::net::TcpListener::bind(&args.listen).await?;
    let address = listener.local_addr()?;
    tracing::info!(
        %address,
        mock = args.mock,
        streaming = catalogue.streaming(),
        models = catalogue.models().count(),
        max_connections = limits.max_connections,
        "model-gateway listening on http://{address}"
    );
    server::serve(listener, router, limits, shutdown_signal()).await?;
    recovery.abort();
    tracing::info!("shut down");
    Ok(())
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
