//! The model catalogue: which models exist, on which protocol, at what price, served by which
//! upstream. Loaded from TOML and validated once at start; lookups afterwards are a hash-map read.
//!
//! ```
//! use model_gateway::{Catalogue, Protocol};
//!
//! let catalogue = Catalogue::from_toml(r#"
//!     [[upstreams]]
//!     name = "openai"
//!     kind = "openai"
//!     base_url = "https://api.openai.com/v1"
//!     api_key_env = "OPENAI_API_KEY"
//!
//!     [[models]]
//!     name = "gpt-4o-mini"
//!     protocol = "chat_completions"
//!     price = 2
//!     upstream = "openai"
//! "#).unwrap();
//! let model = catalogue.model("gpt-4o-mini").unwrap();
//! assert_eq!(model.protocol, Protocol::ChatCompletions);
//! assert_eq!(model.pricing.per_call.get(), 2);
//! ```
//!
//! A model may be priced by tokens instead, in credits per million tokens (decimals allowed),
//! or by both (a base per call plus tokens); see [`pricing`](crate::pricing):
//!
//! ```toml
//! [[models]]
//! name = "gpt-4o"
//! protocol = "chat_completions"
//! upstream = "openai"
//! max_output_tokens = 16384   # what a call reserves for output when the client sets no limit
//! context_window = 128000     # optional: a usage report claiming more input is not trusted
//! [models.tokens]             # credits per million tokens
//! input = 250
//! output = 1000
//! cache_read = 125
//! ```

mod live;
mod prices;

pub use crate::protocol::{BuiltinTools, ResponsesRoute, UpstreamKind};
pub use live::{LiveCatalogue, StartOnlySetting};

use foldhash::{HashMap, HashMapExt};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::credits::Credits;
use crate::error::ErrorBody;
use crate::money::Money;
use crate::pricing::{CostPrices, Pricing};
use crate::protocol::Protocol;

/// The catalogue used when no file is given: two OpenAI-style vendors, one operator-own chat
/// model, an embeddings model and two Anthropic messages models.
pub const DEMO_CATALOGUE: &str = include_str!("demo.toml");

/// Default total time-out of one upstream attempt.
pub const DEFAULT_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(120);

/// Default time allowed to open a connection to an upstream.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Default deadline of one call, across every channel and retry.
pub const DEFAULT_CALL_DEADLINE: Duration = Duration::from_secs(300);

/// Default longest a streamed reply may last, from its first event.
pub const DEFAULT_STREAM_DEADLINE: Duration = Duration::from_secs(600);

/// Default longest a streamed reply may go without a complete event (providers send pings).
pub const DEFAULT_STREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Default largest complete reply read from a provider: past it the call fails and is refunded.
pub const DEFAULT_MAX_REPLY_BYTES: usize = 32 * 1024 * 1024;

/// Default largest single event of a provider's stream (or its unfinished tail): past it the
/// stream fails and is refunded.
pub const DEFAULT_MAX_EVENT_BYTES: usize = 4 * 1024 * 1024;

/// Default number of consecutive failures that open an upstream's circuit breaker.
pub const DEFAULT_BREAKER_FAILURES: u32 = 5;

/// Default time an open circuit breaker skips its upstream.
pub const DEFAULT_BREAKER_COOLDOWN: Duration = Duration::from_secs(30);

/// One upstream provider endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamConfig {
    /// Name models refer to.
    pub name: String,
    /// Wire format.
    pub kind: UpstreamKind,
    /// Base URL, without a trailing slash.
    pub base_url: String,
    /// Environment variable holding the provider key.
    pub api_key_env: String,
    /// Total time-out of one attempt (connect, send, read the whole reply).
    pub timeout: Duration,
    /// Time allowed to open a connection.
    pub connect_timeout: Duration,
    /// HTTP(S) proxy every request to this upstream goes through.
    pub proxy: Option<String>,
    /// Extra headers sent with every request to this upstream.
    pub headers: Vec<(String, String)>,
    /// Consecutive retryable failures that open the circuit breaker.
    pub breaker_failures: u32,
    /// How long an open breaker skips this upstream before letting one call try it again.
    pub breaker_cooldown: Duration,
    /// How it serves `/v1/responses` (`OpenAI` kind only; ignored for Anthropic).
    pub responses: ResponsesRoute,
    /// What a call it translates does with built-in tools.
    pub builtin_tools: BuiltinTools,
    /// Where the provider's models run: its own API, or a cloud platform that hosts them under
    /// its own paths and credentials (Amazon Bedrock, Google Vertex AI).
    pub hosting: Hosting,
}

impl UpstreamConfig {
    /// The `kind` the catalogue gave it: `openai`, `anthropic`, `gemini`, `bedrock` or
    /// `vertex`.
    pub fn kind_name(&self) -> &'static str {
        match (&self.hosting, self.kind) {
            (Hosting::Bedrock(_), _) => "bedrock",
            (Hosting::Vertex(_), _) => "vertex",
            (Hosting::Direct, UpstreamKind::Openai) => "openai",
            (Hosting::Direct, UpstreamKind::Anthropic) => "anthropic",
            (Hosting::Direct, UpstreamKind::Gemini) => "gemini",
        }
    }
}

/// Where an upstream's models run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Hosting {
    /// The provider's own API (`openai`, `anthropic` and `gemini` kinds): a static key in a
    /// header, the model in the body (or, for Gemini, the path).
    #[default]
    Direct,
    /// Amazon Bedrock (`kind = "bedrock"`): Anthropic's models at
    /// `{base_url}/model/{model id}/invoke` and `/invoke-with-response-stream`, signed with AWS
    /// Signature Version 4, or with a Bedrock API key when its variable is set.
    Bedrock(BedrockSettings),
    /// Google Vertex AI (`kind = "vertex"`): Anthropic's or Google's models under
    /// `{base_url}/v1/projects/{project}/locations/{region}/publishers/{publisher}/models/`,
    /// with a service account's access tokens.
    Vertex(VertexSettings),
}

impl Hosting {
    /// The default base URL of a hosted upstream in its region; `None` for a direct one.
    fn default_base_url(&self) -> Option<String> {
        match self {
            Hosting::Direct => None,
            Hosting::Bedrock(bedrock) => Some(format!(
                "https://bedrock-runtime.{}.amazonaws.com",
                bedrock.region
            )),
            Hosting::Vertex(vertex) if vertex.region == "global" => {
                Some("https://aiplatform.googleapis.com".to_owned())
            }
            Hosting::Vertex(vertex) => Some(format!(
                "https://{}-aiplatform.googleapis.com",
                vertex.region
            )),
        }
    }
}

/// A Bedrock upstream's region and where its AWS credentials are read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BedrockSettings {
    /// The AWS region (`us-east-1`), part of each request's signature.
    pub region: String,
    /// The variable holding the access key id (`AWS_ACCESS_KEY_ID` unless the catalogue
    /// names another as `access_key_id_env`).
    pub access_key_id_env: String,
    /// The variable holding the secret access key (`AWS_SECRET_ACCESS_KEY`, or
    /// `secret_access_key_env`).
    pub secret_access_key_env: String,
    /// The variable holding a session token of temporary credentials, when set
    /// (`AWS_SESSION_TOKEN`, or `session_token_env`).
    pub session_token_env: String,
}

/// A Vertex AI upstream's project, region, publisher and service account.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VertexSettings {
    /// The Google Cloud project.
    pub project: String,
    /// The region (`us-east5`), or `global`.
    pub region: String,
    /// Whose models it serves: `anthropic` (Claude, the messages protocol) or `google`
    /// (Gemini).
    pub publisher: VertexPublisher,
    /// The service account's key file (`credentials_file`); `None`: the file
    /// `GOOGLE_APPLICATION_CREDENTIALS` names.
    pub credentials_file: Option<String>,
}

/// Whose models a Vertex AI upstream serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VertexPublisher {
    /// Anthropic's Claude (`:rawPredict`, `:streamRawPredict`), on the messages protocol.
    Anthropic,
    /// Google's Gemini (`:generateContent`, `:streamGenerateContent`), on the Gemini protocol.
    Google,
}

/// One model clients can call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelRoute {
    /// The name clients send in `model`.
    pub name: String,
    /// Other names clients may call it by (a provider's dated id, a client's default name): a
    /// call by an alias is a call of this model, billed and logged under [`name`](Self::name).
    pub aliases: Vec<String>,
    /// The protocol its upstreams speak for it (`chat_completions`, `messages`, `embeddings`).
    pub protocol: Protocol,
    /// The endpoints it answers on, by their protocol; a call on any other is `404 模型不存在`.
    /// The catalogue's `endpoints`, else what [`Protocol`] serves it by default: a
    /// `chat_completions` model on chat completions and Responses, a `messages` model on
    /// messages, an embeddings model on embeddings.
    pub endpoints: Vec<Protocol>,
    /// What a successful call is charged: a price per call, token prices, or both.
    pub pricing: Pricing,
    /// The most output a call of a token-priced model is reserved for when the client sets no
    /// limit of its own (`max_tokens`, `max_completion_tokens`, `max_output_tokens`).
    pub max_output_tokens: Option<u32>,
    /// The most input tokens a call of it can hold, when the operator says: a provider's usage
    /// report claiming more is not trusted (the call is charged its ceiling). Unset: a report
    /// may claim up to the call's input ceiling.
    pub context_window: Option<u32>,
    /// Who can serve it; tried by ascending `priority`, spread by `weight` within a priority.
    pub channels: Vec<ModelChannel>,
    /// What a call of it costs the operator (`[models.cost]`), unless its channel says
    /// otherwise ([`ModelChannel::cost`]).
    pub cost: Option<CostPrices>,
    /// What one credit is worth in the operator's currency (the catalogue's `credit_value`):
    /// what a call's margin is worked out with.
    pub credit_value: Option<Money>,
}

impl ModelRoute {
    /// The least a call of this model can be charged that an account must be able to pay
    /// (a model priced by tokens alone: one credit).
    pub fn least_charge(&self) -> Credits {
        self.pricing.per_call.max(Credits(1))
    }
}

/// One upstream that can serve a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelChannel {
    /// The upstream.
    pub upstream: Arc<UpstreamConfig>,
    /// The model name sent to this upstream, when it differs from the catalogue name.
    pub upstream_model: Option<String>,
    /// Lower is preferred. Channels of equal priority are equals.
    pub priority: u32,
    /// Share of calls among equals.
    pub weight: u32,
    /// What a call served here costs the operator: the channel's own `cost`, else the model's.
    pub cost: Option<CostPrices>,
}

/// A validated set of upstreams and models.
#[derive(Debug, Clone)]
pub struct Catalogue {
    models: HashMap<String, Arc<ModelRoute>>,
    /// Each alias, and the model it names.
    aliases: HashMap<String, Arc<ModelRoute>>,
    upstreams: Vec<Arc<UpstreamConfig>>,
    error_body: ErrorBody,
    call_deadline: Duration,
    streaming: bool,
    stream_deadline: Duration,
    stream_idle_timeout: Duration,
    max_reply_bytes: usize,
    max_event_bytes: usize,
    charge_beyond_ceiling: bool,
    /// [`Catalogue::cheapest_charge`], worked out once (every request with a large body asks).
    cheapest: std::sync::OnceLock<Option<Credits>>,
    /// The operator's currency (`currency`), when he gives cost prices.
    currency: Option<String>,
    /// The request header a client may name its service tier in, when the operator names one.
    service_tier_header: Option<http::HeaderName>,
    /// Whether a complete reply's usage says what the call was charged (`usage_cost`).
    usage_cost: bool,
}

impl Default for Catalogue {
    /// An empty catalogue with the default settings.
    fn default() -> Catalogue {
        Catalogue {
            models: HashMap::new(),
            aliases: HashMap::new(),
            upstreams: Vec::new(),
            error_body: ErrorBody::Detail,
            call_deadline: DEFAULT_CALL_DEADLINE,
            streaming: false,
            stream_deadline: DEFAULT_STREAM_DEADLINE,
            stream_idle_timeout: DEFAULT_STREAM_IDLE_TIMEOUT,
            max_reply_bytes: DEFAULT_MAX_REPLY_BYTES,
            max_event_bytes: DEFAULT_MAX_EVENT_BYTES,
            charge_beyond_ceiling: false,
            cheapest: std::sync::OnceLock::new(),
            currency: None,
            service_tier_header: None,
            usage_cost: false,
        }
    }
}

/// Why a catalogue was refused.
#[derive(Debug, thiserror::Error)]
pub enum CatalogueError {
    /// The file could not be read.
    #[error("cannot read model catalogue {path}: {source}")]
    Read {
        /// The path given.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Not valid TOML, an unknown field, or a value of the wrong type.
    #[error("invalid model catalogue: {0}")]
    Syntax(#[from] toml::de::Error),
    /// Two upstreams share a name.
    #[error("invalid model catalogue: upstream `{0}` is defined twice")]
    DuplicateUpstream(String),
    /// Two models share a name.
    #[error("invalid model catalogue: model `{0}` is defined twice")]
    DuplicateModel(String),
    /// A model's alias is another model's name or alias, its own name, or empty.
    #[error("invalid model catalogue: alias `{alias}` of model `{model}` {problem}")]
    AliasTaken {
        /// The alias.
        alias: String,
        /// The model that lists it.
        model: String,
        /// What is wrong: `is already the name of model ...`, `is already an alias of model
        /// ...`, `is empty`.
        problem: String,
    },
    /// A model names an upstream that is not defined.
    #[error("invalid model catalogue: model `{model}` uses unknown upstream `{upstream}`")]
    UnknownUpstream {
        /// The model.
        model: String,
        /// The name it gave.
        upstream: String,
    },
    /// A price of zero or less.
    #[error("invalid model catalogue: model `{model}` has price {price}; prices must be positive")]
    NonPositivePrice {
        /// The model.
        model: String,
        /// The price given.
        price: i64,
    },
    /// A model with neither `price` nor `[models.tokens]`.
    #[error(
        "invalid model catalogue: model `{0}` has no price; give `price` (credits per call), a `[models.tokens]` table (credits per million tokens), or both"
    )]
    NoPrice(String),
    /// A token price that is negative, not a finite number, or absurdly high.
    #[error(
        "invalid model catalogue: model `{model}` has token price `{kind}` = {value}; token prices must be finite, at least 0 and at most {max}"
    )]
    InvalidTokenPrice {
        /// The model.
        model: String,
        /// Which price (`input`, `output`, `cache_read`, ...).
        kind: &'static str,
        /// The value given.
        value: f64,
        /// The highest price taken.
        max: f64,
    },
    /// A price table that is not whole or not valid: a tier without `input` or `output`, a
    /// long-context threshold of zero, a minimum that is no amount, a cost table without a price.
    #[error("invalid model catalogue: model `{model}`: {problem}")]
    InvalidPrices {
        /// The model.
        model: String,
        /// What is wrong, naming the table and key.
        problem: String,
    },
    /// Cost prices without the catalogue's `currency` and `credit_value`.
    #[error(
        "invalid model catalogue: model `{0}` gives cost prices; give `currency` (as \"USD\") and `credit_value` (what one credit is worth in it) at the top of the catalogue"
    )]
    NoCurrency(String),
    /// A `currency` or `credit_value` that is not valid, or one without the other.
    #[error("invalid model catalogue: {0}")]
    InvalidCurrency(String),
    /// A token-priced model without `max_output_tokens`, which a call reserves for when its
    /// client sets no output limit.
    #[error(
        "invalid model catalogue: model `{0}` is priced by tokens and needs `max_output_tokens` (the output a call reserves for when the client sets no limit)"
    )]
    NoOutputCeiling(String),
    /// A time-out, deadline, cool-down, threshold or weight of zero.
    #[error("invalid model catalogue: {0} must be positive")]
    Zero(String),
    /// A custom header that is not a valid HTTP header.
    #[error("invalid model catalogue: upstream `{upstream}` has an invalid header `{header}`")]
    InvalidHeader {
        /// The upstream.
        upstream: String,
        /// The header name.
        header: String,
    },
    /// A model with neither or both of `upstream` and `upstreams`, or an empty list.
    #[error(
        "invalid model catalogue: model `{0}` needs exactly one of `upstream` or a non-empty `upstreams`"
    )]
    NoChannel(String),
    /// A model that lists the same upstream twice.
    #[error("invalid model catalogue: model `{model}` lists upstream `{upstream}` twice")]
    DuplicateChannel {
        /// The model.
        model: String,
        /// The upstream listed twice.
        upstream: String,
    },
    /// Some channels of a model give a `priority` and some do not.
    #[error("invalid model catalogue: model `{0}` gives `priority` for some upstreams but not all")]
    PartialPriority(String),
    /// `responses` set on an Anthropic-kind upstream.
    #[error(
        "invalid model catalogue: upstream `{0}` is of kind `anthropic`; `responses` applies to `openai` upstreams only"
    )]
    ResponsesOnAnthropic(String),
    /// `responses` set on a Gemini-kind upstream.
    #[error(
        "invalid model catalogue: upstream `{0}` is of kind `gemini`; `responses` applies to `openai` upstreams only"
    )]
    ResponsesOnGemini(String),
    /// An upstream setting its kind needs, missing (`base_url` and `api_key_env` of a direct
    /// kind; `region` of a hosted one; `project` and `publisher` of a Vertex one).
    #[error("invalid model catalogue: upstream `{upstream}` of kind `{kind}` needs `{setting}`")]
    MissingSetting {
        /// The upstream.
        upstream: String,
        /// Its kind.
        kind: &'static str,
        /// The setting it needs.
        setting: &'static str,
    },
    /// An upstream setting that applies to other kinds only.
    #[error(
        "invalid model catalogue: upstream `{upstream}` is of kind `{kind}`; `{setting}` applies to {applies} only"
    )]
    MisplacedSetting {
        /// The upstream.
        upstream: String,
        /// Its kind.
        kind: &'static str,
        /// The setting given.
        setting: &'static str,
        /// The kinds it applies to.
        applies: &'static str,
    },
    /// An upstream kind this build of the gateway leaves out.
    #[error(
        "invalid model catalogue: upstream `{upstream}` is of kind `{kind}`, which this gateway was built without (cargo feature `{feature}`)"
    )]
    NotBuilt {
        /// The upstream.
        upstream: String,
        /// Its kind.
        kind: &'static str,
        /// The cargo feature that builds it.
        feature: &'static str,
    },
    /// A model of protocol `responses`: the chat-completions models serve that endpoint.
    #[error(
        "invalid model catalogue: model `{0}` has protocol `responses`; `/v1/responses` is served by the `chat_completions` models"
    )]
    ResponsesModel(String),
    /// A model whose protocol its upstream cannot serve.
    #[error(
        "invalid model catalogue: model `{model}` is a {protocol} model but upstream `{upstream}` does not serve that protocol"
    )]
    ProtocolMismatch {
        /// The model.
        model: String,
        /// Its protocol.
        protocol: &'static str,
        /// Its upstream.
        upstream: String,
    },
    /// A model whose `endpoints` is an empty list.
    #[error(
        "invalid model catalogue: model `{0}` lists no `endpoints`; leave the setting out for its protocol's"
    )]
    NoEndpoint(String),
    /// An endpoint in a model's `endpoints` that none of its upstreams can serve.
    #[error(
        "invalid model catalogue: model `{model}` lists endpoint `{endpoint}`, which none of its upstreams ({upstreams}) can serve for a {protocol} model"
    )]
    EndpointNotServed {
        /// The model.
        model: String,
        /// The endpoint, by its protocol's name.
        endpoint: &'static str,
        /// The model's protocol.
        protocol: &'static str,
        /// Its upstreams, named.
        upstreams: String,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CatalogueFile {
    call_deadline_secs: Option<u64>,
    #[serde(default)]
    streaming: bool,
    #[serde(default)]
    error_body: ErrorBody,
    stream_deadline_secs: Option<u64>,
    stream_idle_timeout_secs: Option<u64>,
    max_reply_bytes: Option<u64>,
    max_event_bytes: Option<u64>,
    #[serde(default)]
    charge_beyond_ceiling: bool,
    currency: Option<String>,
    credit_value: Option<f64>,
    service_tier_header: Option<String>,
    #[serde(default)]
    usage_cost: bool,
    #[serde(default)]
    upstreams: Vec<UpstreamEntry>,
    #[serde(default)]
    models: Vec<ModelEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UpstreamEntry {
    name: String,
    kind: KindEntry,
    base_url: Option<String>,
    api_key_env: Option<String>,
    region: Option<String>,
    project: Option<String>,
    publisher: Option<VertexPublisher>,
    credentials_file: Option<String>,
    access_key_id_env: Option<String>,
    secret_access_key_env: Option<String>,
    session_token_env: Option<String>,
    timeout_secs: Option<u64>,
    connect_timeout_secs: Option<u64>,
    proxy: Option<String>,
    #[serde(default)]
    headers: std::collections::BTreeMap<String, String>,
    breaker_failures: Option<u32>,
    breaker_cooldown_secs: Option<u64>,
    responses: Option<ResponsesRoute>,
    #[serde(default)]
    builtin_tools: BuiltinTools,
}

/// `kind` of an upstream: a wire format, or a platform hosting one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
enum KindEntry {
    Openai,
    Anthropic,
    Gemini,
    Bedrock,
    Vertex,
}

impl KindEntry {
    fn name(self) -> &'static str {
        match self {
            KindEntry::Openai => "openai",
            KindEntry::Anthropic => "anthropic",
            KindEntry::Gemini => "gemini",
            KindEntry::Bedrock => "bedrock",
            KindEntry::Vertex => "vertex",
        }
    }
}

impl UpstreamEntry {
    /// The wire format, hosting and key variable its `kind` and settings give, checked: each
    /// platform's settings on its kind only, and what each needs present.
    fn hosting(&mut self) -> Result<(UpstreamKind, Hosting, String), CatalogueError> {
        let name = &self.name;
        let kind = self.kind;
        let missing = |setting: &'static str| CatalogueError::MissingSetting {
            upstream: name.clone(),
            kind: kind.name(),
            setting,
        };
        let misplaced =
            |setting: &'static str, applies: &'static str| CatalogueError::MisplacedSetting {
                upstream: name.clone(),
                kind: kind.name(),
                setting,
                applies,
            };
        let not_built = |feature: &'static str| CatalogueError::NotBuilt {
            upstream: name.clone(),
            kind: kind.name(),
            feature,
        };
        let bedrock_only = [
            ("access_key_id_env", self.access_key_id_env.is_some()),
            (
                "secret_access_key_env",
                self.secret_access_key_env.is_some(),
            ),
            ("session_token_env", self.session_token_env.is_some()),
        ];
        let vertex_only = [
            ("project", self.project.is_some()),
            ("publisher", self.publisher.is_some()),
            ("credentials_file", self.credentials_file.is_some()),
        ];
        let hosted = [("region", self.region.is_some())];
        let refuse = |settings: &[(&'static str, bool)], applies| match settings
            .iter()
            .find(|(_, given)| *given)
        {
            Some((setting, _)) => Err(misplaced(setting, applies)),
            None => Ok(()),
        };
        if kind != KindEntry::Bedrock {
            refuse(&bedrock_only, "`bedrock` upstreams")?;
        }
        if kind != KindEntry::Vertex {
            refuse(&vertex_only, "`vertex` upstreams")?;
        }
        let direct = |wire| -> Result<(UpstreamKind, Hosting, String), CatalogueError> {
            refuse(&hosted, "`bedrock` and `vertex` upstreams")?;
            if self.base_url.is_none() {
                return Err(missing("base_url"));
            }
            let key = self
                .api_key_env
                .clone()
                .ok_or_else(|| missing("api_key_env"))?;
            Ok((wire, Hosting::Direct, key))
        };
        match kind {
            KindEntry::Openai => direct(UpstreamKind::Openai),
            KindEntry::Anthropic => direct(UpstreamKind::Anthropic),
            KindEntry::Gemini => direct(UpstreamKind::Gemini),
            KindEntry::Bedrock => {
                if !cfg!(feature = "bedrock") {
                    return Err(not_built("bedrock"));
                }
                let region = self.region.clone().ok_or_else(|| missing("region"))?;
                let env = |given: &Option<String>, standard: &str| {
                    given.clone().unwrap_or_else(|| standard.to_owned())
                };
                let settings = BedrockSettings {
                    region,
                    access_key_id_env: env(&self.access_key_id_env, "AWS_ACCESS_KEY_ID"),
                    secret_access_key_env: env(
                        &self.secret_access_key_env,
                        "AWS_SECRET_ACCESS_KEY",
                    ),
                    session_token_env: env(&self.session_token_env, "AWS_SESSION_TOKEN"),
                };
                // A Bedrock API key, used instead of signing when its variable is set.
                let key = env(&self.api_key_env, "AWS_BEARER_TOKEN_BEDROCK");
                Ok((UpstreamKind::Anthropic, Hosting::Bedrock(settings), key))
            }
            KindEntry::Vertex => {
                if !cfg!(feature = "vertex") {
                    return Err(not_built("vertex"));
                }
                if self.api_key_env.is_some() {
                    return Err(misplaced("api_key_env", "upstreams that send a key"));
                }
                let publisher = self.publisher.ok_or_else(|| missing("publisher"))?;
                let settings = VertexSettings {
                    project: self.project.clone().ok_or_else(|| missing("project"))?,
                    region: self.region.clone().ok_or_else(|| missing("region"))?,
                    publisher,
                    credentials_file: self.credentials_file.clone(),
                };
                let wire = match publisher {
                    VertexPublisher::Anthropic => UpstreamKind::Anthropic,
                    VertexPublisher::Google => UpstreamKind::Gemini,
                };
                Ok((wire, Hosting::Vertex(settings), String::new()))
            }
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelEntry {
    name: String,
    #[serde(default)]
    aliases: Vec<String>,
    protocol: Protocol,
    endpoints: Option<Vec<Protocol>>,
    price: Option<i64>,
    tokens: Option<prices::PriceTableEntry>,
    cost: Option<prices::PriceTableEntry>,
    max_output_tokens: Option<u32>,
    context_window: Option<u32>,
    upstream: Option<String>,
    upstreams: Option<Vec<ChannelEntry>>,
    upstream_model: Option<String>,
}

impl ModelEntry {
    /// The model's pricing, checked.
    fn pricing(&self) -> Result<Pricing, CatalogueError> {
        let per_call = match self.price {
            Some(price) if price <= 0 => {
                return Err(CatalogueError::NonPositivePrice {
                    model: self.name.clone(),
                    price,
                });
            }
            price => Credits(price.unwrap_or(0)),
        };
        let Some(tokens) = &self.tokens else {
            return match self.price {
                Some(_) => Ok(Pricing::per_call(per_call)),
                None => Err(CatalogueError::NoPrice(self.name.clone())),
            };
        };
        let pricing = prices::TableReader { model: &self.name }.sale(per_call, tokens)?;
        // Embeddings have no output to reserve for.
        if self.max_output_tokens.is_none() && self.protocol.dialect().has_output() {
            return Err(CatalogueError::NoOutputCeiling(self.name.clone()));
        }
        Ok(pricing)
    }
}

/// `"name"`, or `{ name = "...", priority = 1, weight = 3, upstream_model = "..." }`.
#[derive(Deserialize)]
#[serde(untagged)]
enum ChannelEntry {
    Name(String),
    Table(ChannelTable),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ChannelTable {
    name: String,
    priority: Option<u32>,
    weight: Option<u32>,
    upstream_model: Option<String>,
    cost: Option<Box<prices::PriceTableEntry>>,
}

impl ChannelEntry {
    fn into_table(self) -> ChannelTable {
        match self {
            ChannelEntry::Name(name) => ChannelTable {
                name,
                priority: None,
                weight: None,
                upstream_model: None,
                cost: None,
            },
            ChannelEntry::Table(table) => table,
        }
    }
}

/// `Some(value)` as a duration in seconds, refusing zero.
fn positive_secs(
    value: Option<u64>,
    default: Duration,
    what: impl FnOnce() -> String,
) -> Result<Duration, CatalogueError> {
    match value {
        None => Ok(default),
        Some(0) => Err(CatalogueError::Zero(what())),
        Some(secs) => Ok(Duration::from_secs(secs)),
    }
}

fn positive_bytes(
    value: Option<u64>,
    default: usize,
    what: impl FnOnce() -> String,
) -> Result<usize, CatalogueError> {
    match value {
        None => Ok(default),
        Some(0) => Err(CatalogueError::Zero(what())),
        Some(bytes) => Ok(usize::try_from(bytes).unwrap_or(usize::MAX)),
    }
}

impl Catalogue {
    /// The built-in demo catalogue.
    pub fn demo() -> Catalogue {
        Catalogue::from_toml(DEMO_CATALOGUE).expect("the built-in catalogue is valid")
    }

    /// Reads and validates a catalogue file.
    pub fn from_path(path: impl AsRef<std::path::Path>) -> Result<Catalogue, CatalogueError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| CatalogueError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Catalogue::from_toml(&text)
    }

    /// Parses and validates a catalogue.
    pub fn from_toml(text: &str) -> Result<Catalogue, CatalogueError> {
        let file: CatalogueFile = toml::from_str(text)?;
        let call_deadline = positive_secs(file.call_deadline_secs, DEFAULT_CALL_DEADLINE, || {
            "call_deadline_secs".to_owned()
        })?;
        let stream_deadline =
            positive_secs(file.stream_deadline_secs, DEFAULT_STREAM_DEADLINE, || {
                "stream_deadline_secs".to_owned()
            })?;
        let stream_idle_timeout = positive_secs(
            file.stream_idle_timeout_secs,
            DEFAULT_STREAM_IDLE_TIMEOUT,
            || "stream_idle_timeout_secs".to_owned(),
        )?;
        let max_reply_bytes =
            positive_bytes(file.max_reply_bytes, DEFAULT_MAX_REPLY_BYTES, || {
                "max_reply_bytes".to_owned()
            })?;
        let max_event_bytes =
            positive_bytes(file.max_event_bytes, DEFAULT_MAX_EVENT_BYTES, || {
                "max_event_bytes".to_owned()
            })?;
        let mut upstreams: HashMap<String, Arc<UpstreamConfig>> = HashMap::new();
        for mut entry in file.upstreams {
            let (kind, hosting, api_key_env) = entry.hosting()?;
            let base_url = entry
                .base_url
                .clone()
                .or_else(|| hosting.default_base_url())
                .unwrap_or_default();
            let name = entry.name;
            let setting = |key: &str| format!("`{key}` of upstream `{name}`");
            for (header, value) in &entry.headers {
                let valid = http::HeaderName::try_from(header.as_str()).is_ok()
                    && http::HeaderValue::try_from(value.as_str()).is_ok();
                if !valid {
                    return Err(CatalogueError::InvalidHeader {
                        upstream: name.clone(),
                        header: header.clone(),
                    });
                }
            }
            let breaker_failures = match entry.breaker_failures {
                Some(0) => return Err(CatalogueError::Zero(setting("breaker_failures"))),
                other => other.unwrap_or(DEFAULT_BREAKER_FAILURES),
            };
            let config = UpstreamConfig {
                timeout: positive_secs(entry.timeout_secs, DEFAULT_UPSTREAM_TIMEOUT, || {
                    setting("timeout_secs")
                })?,
                connect_timeout: positive_secs(
                    entry.connect_timeout_secs,
                    DEFAULT_CONNECT_TIMEOUT,
                    || setting("connect_timeout_secs"),
                )?,
                breaker_cooldown: positive_secs(
                    entry.breaker_cooldown_secs,
                    DEFAULT_BREAKER_COOLDOWN,
                    || setting("breaker_cooldown_secs"),
                )?,
                breaker_failures,
                base_url: base_url.trim_end_matches('/').to_owned(),
                kind,
                api_key_env,
                proxy: entry.proxy,
                headers: entry.headers.into_iter().collect(),
                responses: match (kind, entry.responses) {
                    (_, Some(_)) if hosting != Hosting::Direct => {
                        return Err(CatalogueError::MisplacedSetting {
                            upstream: name,
                            kind: entry.kind.name(),
                            setting: "responses",
                            applies: "`openai` upstreams",
                        });
                    }
                    (UpstreamKind::Anthropic, Some(_)) => {
                        return Err(CatalogueError::ResponsesOnAnthropic(name));
                    }
                    (UpstreamKind::Gemini, Some(_)) => {
                        return Err(CatalogueError::ResponsesOnGemini(name));
                    }
                    (_, route) => route.unwrap_or_default(),
                },
                builtin_tools: entry.builtin_tools,
                hosting,
                name: name.clone(),
            };
            if upstreams.contains_key(&name) {
                return Err(CatalogueError::DuplicateUpstream(name));
            }
            upstreams.insert(name, Arc::new(config));
        }

        let (currency, credit_value) = currency(file.currency, file.credit_value)?;
        let service_tier_header = match &file.service_tier_header {
            None => None,
            Some(name) => Some(http::HeaderName::try_from(name.as_str()).map_err(|_| {
                CatalogueError::InvalidCurrency(format!(
                    "`service_tier_header` = {name:?} is not a header name"
                ))
            })?),
        };
        let mut models = HashMap::new();
        for entry in file.models {
            if entry.protocol.models_protocol() != entry.protocol {
                return Err(CatalogueError::ResponsesModel(entry.name));
            }
            let pricing = entry.pricing()?;
            if entry.max_output_tokens == Some(0) {
                return Err(CatalogueError::Zero(format!(
                    "`max_output_tokens` of model `{}`",
                    entry.name
                )));
            }
            if entry.context_window == Some(0) {
                return Err(CatalogueError::Zero(format!(
                    "`context_window` of model `{}`",
                    entry.name
                )));
            }
            let cost = match &entry.cost {
                Some(cost) => {
                    Some(prices::TableReader { model: &entry.name }.cost("[models.cost]", cost)?)
                }
                None => None,
            };
            let channels = model_channels(&entry, &upstreams, cost)?;
            if credit_value.is_none() && channels.iter().any(|channel| channel.cost.is_some()) {
                return Err(CatalogueError::NoCurrency(entry.name));
            }
            let endpoints = model_endpoints(&entry, &channels)?;
            if models.contains_key(&entry.name) {
                return Err(CatalogueError::DuplicateModel(entry.name));
            }
            let route = ModelRoute {
                name: entry.name.clone(),
                aliases: entry.aliases.clone(),
                protocol: entry.protocol,
                endpoints,
                pricing,
                max_output_tokens: entry.max_output_tokens,
                context_window: entry.context_window,
                channels,
                cost,
                credit_value,
            };
            models.insert(entry.name, Arc::new(route));
        }
        let aliases = model_aliases(&models)?;
        let mut upstreams: Vec<_> = upstreams.into_values().collect();
        upstreams.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Catalogue {
            models,
            aliases,
            upstreams,
            error_body: file.error_body,
            call_deadline,
            streaming: file.streaming,
            stream_deadline,
            stream_idle_timeout,
            max_reply_bytes,
            max_event_bytes,
            charge_beyond_ceiling: file.charge_beyond_ceiling,
            cheapest: std::sync::OnceLock::new(),
            currency,
            service_tier_header,
            usage_cost: file.usage_cost,
        })
    }

    /// The model called `name`, by its name or one of its aliases, on whichever protocol.
    pub fn model(&self, name: &str) -> Option<&Arc<ModelRoute>> {
        self.models.get(name).or_else(|| self.aliases.get(name))
    }

    /// Every model, in no particular order.
    pub fn models(&self) -> impl Iterator<Item = &Arc<ModelRoute>> {
        self.models.values()
    }

    /// Every upstream, by name.
    pub fn upstreams(&self) -> &[Arc<UpstreamConfig>] {
        &self.upstreams
    }

    /// The longest one call may take, across every channel and retry.
    pub fn call_deadline(&self) -> Duration {
        self.call_deadline
    }

    /// Whether `stream: true` is served (as server-sent events) rather than refused with 400.
    /// Off unless the catalogue says `streaming = true` or [`with_streaming`](Self::with_streaming)
    /// turns it on.
    pub fn streaming(&self) -> bool {
        self.streaming
    }

    /// The same catalogue with streaming turned on or off (an operator's switch overriding the
    /// file's `streaming`).
    #[must_use]
    pub fn with_streaming(mut self, streaming: bool) -> Catalogue {
        self.streaming = streaming;
        self
    }

    /// Which body refusals have (`error_body`; default [`ErrorBody::Detail`], exactly the
    /// specified `{"detail": ...}`).
    pub fn error_body(&self) -> ErrorBody {
        self.error_body
    }

    /// The same catalogue with refusals' bodies as `body` (an operator's switch overriding the
    /// file's `error_body`).
    #[must_use]
    pub fn with_error_body(mut self, body: ErrorBody) -> Catalogue {
        self.error_body = body;
        self
    }

    /// The longest a streamed reply may last from its first event (`stream_deadline_secs`).
    pub fn stream_deadline(&self) -> Duration {
        self.stream_deadline
    }

    /// The longest a streamed reply may go without a complete event
    /// (`stream_idle_timeout_secs`).
    pub fn stream_idle_timeout(&self) -> Duration {
        self.stream_idle_timeout
    }

    /// The largest complete reply read from a provider (`max_reply_bytes`, default
    /// [`DEFAULT_MAX_REPLY_BYTES`]); a larger one fails the attempt, so the call is refunded.
    pub fn max_reply_bytes(&self) -> usize {
        self.max_reply_bytes
    }

    /// The largest event a provider's stream may send, or hold unfinished (`max_event_bytes`,
    /// default [`DEFAULT_MAX_EVENT_BYTES`]); past it the stream fails and is refunded.
    pub fn max_event_bytes(&self) -> usize {
        self.max_event_bytes
    }

    /// Whether a token-priced call whose cost passes its ceiling may be charged beyond it, within
    /// what its account can pay and its key's limit allows (`charge_beyond_ceiling`, default
    /// `false`: the ceiling is the most a call is charged; see
    /// [`RefundOnUpstreamErrorLayer::charge_beyond_reservation`](crate::RefundOnUpstreamErrorLayer::charge_beyond_reservation)).
    pub fn charge_beyond_ceiling(&self) -> bool {
        self.charge_beyond_ceiling
    }

    /// The least a call of any model can be charged; `None` for an empty catalogue.
    pub fn cheapest_charge(&self) -> Option<Credits> {
        *self
            .cheapest
            .get_or_init(|| self.models().map(|model| model.least_charge()).min())
    }

    /// The operator's currency, when the catalogue gives cost prices (`currency`).
    pub fn currency(&self) -> Option<&str> {
        self.currency.as_deref()
    }

    /// Whether a complete reply's usage object says what the call was charged: `cost` (credits)
    /// and `cost_details` (the credits and the tokens by kind as billed), as `OpenRouter`'s
    /// replies do (`usage_cost`; off by default, the contract's replies as the provider wrote
    /// them).
    pub fn usage_cost(&self) -> bool {
        self.usage_cost
    }

    /// The request header a client may name its service tier in (`service_tier_header`).
    pub fn service_tier_header(&self) -> Option<&http::HeaderName> {
        self.service_tier_header.as_ref()
    }

    /// The first setting of the whole gateway (not of one model or upstream) that differs in
    /// `other`: those are read when the gateway starts, so a reload cannot change them.
    pub fn start_only_change(&self, other: &Catalogue) -> Option<&'static str> {
        let settings: [(&'static str, bool); 10] = [
            ("usage_cost", self.usage_cost != other.usage_cost),
            // The reports sum costs across entries: one currency for the ledger's life.
            ("currency", self.currency != other.currency),
            ("error_body", self.error_body != other.error_body),
            (
                "call_deadline_secs",
                self.call_deadline != other.call_deadline,
            ),
            ("streaming", self.streaming != other.streaming),
            (
                "stream_deadline_secs",
                self.stream_deadline != other.stream_deadline,
            ),
            (
                "stream_idle_timeout_secs",
                self.stream_idle_timeout != other.stream_idle_timeout,
            ),
            (
                "max_reply_bytes",
                self.max_reply_bytes != other.max_reply_bytes,
            ),
            (
                "max_event_bytes",
                self.max_event_bytes != other.max_event_bytes,
            ),
            (
                "charge_beyond_ceiling",
                self.charge_beyond_ceiling != other.charge_beyond_ceiling,
            ),
        ];
        settings
            .into_iter()
            .find(|(_, changed)| *changed)
            .map(|(name, _)| name)
    }
}

/// Every model's aliases, each checked against every model's name and every other alias.
fn model_aliases(
    models: &HashMap<String, Arc<ModelRoute>>,
) -> Result<HashMap<String, Arc<ModelRoute>>, CatalogueError> {
    // By name, so that which of two colliding aliases is reported does not vary between runs.
    let mut by_name: Vec<&Arc<ModelRoute>> = models.values().collect();
    by_name.sort_by(|a, b| a.name.cmp(&b.name));
    let mut aliases: HashMap<String, Arc<ModelRoute>> = HashMap::new();
    for model in by_name {
        for alias in &model.aliases {
            let problem = if alias.is_empty() {
                Some("is empty".to_owned())
            } else if let Some(named) = models.get(alias) {
                Some(format!("is already the name of model `{}`", named.name))
            } else {
                aliases
                    .get(alias)
                    .map(|other| format!("is already an alias of model `{}`", other.name))
            };
            if let Some(problem) = problem {
                return Err(CatalogueError::AliasTaken {
                    alias: alias.clone(),
                    model: model.name.clone(),
                    problem,
                });
            }
            aliases.insert(alias.clone(), model.clone());
        }
    }
    Ok(aliases)
}

/// The operator's `currency` and `credit_value`, checked: both or neither; a currency a code of
/// letters (`USD`, `EUR`, `CNY`), a credit worth more than nothing.
fn currency(
    currency: Option<String>,
    credit_value: Option<f64>,
) -> Result<(Option<String>, Option<Money>), CatalogueError> {
    let refuse = |problem: String| Err(CatalogueError::InvalidCurrency(problem));
    match (currency, credit_value) {
        (None, None) => Ok((None, None)),
        (Some(code), Some(value)) => {
            if code.is_empty() || code.len() > 8 || !code.bytes().all(|b| b.is_ascii_alphabetic()) {
                return refuse(format!(
                    "`currency` = {code:?} is not a currency code (as \"USD\")"
                ));
            }
            match Money::from_units(value).filter(|money| *money > Money::ZERO) {
                Some(money) => Ok((Some(code), Some(money))),
                None => refuse(format!(
                    "`credit_value` = {value}; one credit must be worth more than 0 (at least 0.000000001)"
                )),
            }
        }
        (Some(_), None) => {
            refuse("`currency` needs `credit_value` (what one credit is worth in it)".into())
        }
        (None, Some(_)) => refuse("`credit_value` needs `currency` (the currency it is in)".into()),
    }
}

/// The channels of one model entry, validated against the upstreams.
fn model_channels(
    entry: &ModelEntry,
    upstreams: &HashMap<String, Arc<UpstreamConfig>>,
    model_cost: Option<CostPrices>,
) -> Result<Vec<ModelChannel>, CatalogueError> {
    let model = &entry.name;
    let tables: Vec<ChannelTable> = match (&entry.upstream, &entry.upstreams) {
        (Some(name), None) => vec![ChannelEntry::Name(name.clone()).into_table()],
        (None, Some(list)) if !list.is_empty() => list
            .iter()
            .map(|channel| match channel {
                ChannelEntry::Name(name) => ChannelEntry::Name(name.clone()).into_table(),
                ChannelEntry::Table(table) => ChannelTable {
                    name: table.name.clone(),
                    priority: table.priority,
                    weight: table.weight,
                    upstream_model: table.upstream_model.clone(),
                    cost: table.cost.clone(),
                },
            })
            .collect(),
        _ => return Err(CatalogueError::NoChannel(model.clone())),
    };
    let with_priority = tables.iter().filter(|t| t.priority.is_some()).count();
    if with_priority != 0 && with_priority != tables.len() {
        return Err(CatalogueError::PartialPriority(model.clone()));
    }
    let mut channels: Vec<ModelChannel> = Vec::with_capacity(tables.len());
    for (position, table) in tables.into_iter().enumerate() {
        let upstream =
            upstreams
                .get(&table.name)
                .cloned()
                .ok_or_else(|| CatalogueError::UnknownUpstream {
                    model: model.clone(),
                    upstream: table.name.clone(),
                })?;
        if channels.iter().any(|c| c.upstream.name == table.name) {
            return Err(CatalogueError::DuplicateChannel {
                model: model.clone(),
                upstream: table.name,
            });
        }
        if !upstream.kind.serves(entry.protocol) {
            return Err(CatalogueError::ProtocolMismatch {
                model: model.clone(),
                protocol: entry.protocol.as_str(),
                upstream: table.name,
            });
        }
        if table.weight == Some(0) {
            return Err(CatalogueError::Zero(format!(
                "`weight` of upstream `{}` in model `{model}`",
                table.name
            )));
        }
        let cost = match &table.cost {
            Some(cost) => Some(
                prices::TableReader { model }
                    .cost(&format!("the `cost` of upstream `{}`", table.name), cost)?,
            ),
            None => model_cost,
        };
        channels.push(ModelChannel {
            upstream,
            upstream_model: table
                .upstream_model
                .or_else(|| entry.upstream_model.clone()),
            // Without explicit priorities, the list order is the order of preference.
            priority: table.priority.unwrap_or(position as u32),
            weight: table.weight.unwrap_or(1),
            cost,
        });
    }
    channels.sort_by_key(|channel| channel.priority);
    Ok(channels)
}

/// The endpoints a model answers on: its `endpoints`, each served by at least one of its
/// channels (a call on it goes to a channel that serves it), or by default those whose
/// models are of its protocol.
fn model_endpoints(
    entry: &ModelEntry,
    channels: &[ModelChannel],
) -> Result<Vec<Protocol>, CatalogueError> {
    let Some(listed) = &entry.endpoints else {
        return Ok(Protocol::ALL
            .into_iter()
            .filter(|endpoint| endpoint.models_protocol() == entry.protocol)
            .collect());
    };
    if listed.is_empty() {
        return Err(CatalogueError::NoEndpoint(entry.name.clone()));
    }
    let mut endpoints: Vec<Protocol> = Vec::with_capacity(listed.len());
    for &endpoint in listed {
        let served = channels
            .iter()
            .any(|channel| endpoint.dialect().served_by(channel.upstream.kind));
        if !served {
            return Err(CatalogueError::EndpointNotServed {
                model: entry.name.clone(),
                endpoint: endpoint.as_str(),
                protocol: entry.protocol.as_str(),
                upstreams: channels
                    .iter()
                    .map(|channel| format!("`{}`", channel.upstream.name))
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
        if !endpoints.contains(&endpoint) {
            endpoints.push(endpoint);
        }
    }
    Ok(endpoints)
}

#[cfg(test)]
mod tests;
