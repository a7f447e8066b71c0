//! Unit tests of the catalogue.

use super::*;
use crate::pricing::{Pricing, TokenRate};

const UPSTREAM: &str = r#"
    [[upstreams]]
    name = "openai"
    kind = "openai"
    base_url = "https://api.openai.com/v1/"
    api_key_env = "OPENAI_API_KEY"
    timeout_secs = 60
"#;

fn with_model(model: &str) -> Result<Catalogue, CatalogueError> {
    Catalogue::from_toml(&format!("{UPSTREAM}\n[[models]]\n{model}"))
}

#[test]
fn the_documented_shape_loads() {
    let catalogue = with_model(
        r#"name = "gpt-4o-mini"
        protocol = "chat_completions"
        price = 2
        upstream = "openai"
        upstream_model = "gpt-4o-mini-2024-07-18""#,
    )
    .unwrap();
    let model = catalogue.model("gpt-4o-mini").unwrap();
    assert_eq!(model.pricing, Pricing::per_call(Credits(2)));
    let channel = &model.channels[0];
    assert_eq!(channel.upstream.base_url, "https://api.openai.com/v1");
    assert_eq!(channel.upstream.timeout, Duration::from_secs(60));
    assert_eq!(
        channel.upstream_model.as_deref(),
        Some("gpt-4o-mini-2024-07-18")
    );
}

#[test]
fn the_demo_catalogue_covers_both_protocols_and_three_vendors() {
    let demo = Catalogue::demo();
    let chat: Vec<_> = demo
        .models()
        .filter(|m| m.protocol == Protocol::ChatCompletions)
        .collect();
    let messages = demo
        .models()
        .filter(|m| m.protocol == Protocol::Messages)
        .count();
    assert!(chat.len() >= 3 && messages >= 2);
    let vendors: std::collections::HashSet<_> = chat
        .iter()
        .map(|m| m.channels[0].upstream.name.as_str())
        .collect();
    assert!(vendors.len() >= 3, "{vendors:?}");
}

#[test]
fn an_unknown_upstream_is_refused_by_name() {
    let error = with_model(
        r#"name = "m"
        protocol = "chat_completions"
        price = 1
        upstream = "nowhere""#,
    )
    .unwrap_err();
    assert!(
        error.to_string().contains("unknown upstream `nowhere`"),
        "{error}"
    );
}

#[test]
fn a_duplicate_model_is_refused_by_name() {
    let model = r#"name = "twice"
        protocol = "chat_completions"
        price = 1
        upstream = "openai""#;
    let error = with_model(&format!("{model}\n[[models]]\n{model}")).unwrap_err();
    assert!(
        error.to_string().contains("model `twice` is defined twice"),
        "{error}"
    );
}

#[test]
fn a_non_positive_price_is_refused() {
    for price in ["0", "-3"] {
        let error = with_model(&format!(
            "name = \"free\"\nprotocol = \"chat_completions\"\nprice = {price}\nupstream = \"openai\""
        ))
        .unwrap_err();
        assert!(
            error.to_string().contains("prices must be positive"),
            "{error}"
        );
    }
}

#[test]
fn a_fractional_price_is_refused() {
    let error = with_model(
        "name = \"m\"\nprotocol = \"chat_completions\"\nprice = 1.5\nupstream = \"openai\"",
    )
    .unwrap_err();
    assert!(matches!(error, CatalogueError::Syntax(_)), "{error}");
}

#[test]
fn an_unknown_field_is_refused_by_name() {
    let error = with_model(
        "name = \"m\"\nprotocol = \"chat_completions\"\nprice = 1\nupstream = \"openai\"\ncost = 3",
    )
    .unwrap_err();
    assert!(error.to_string().contains("cost"), "{error}");
}

#[test]
fn a_messages_model_on_an_openai_upstream_answers_on_messages_translated() {
    let catalogue =
        with_model("name = \"claude\"\nprotocol = \"messages\"\nprice = 1\nupstream = \"openai\"")
            .unwrap();
    let model = catalogue.model("claude").unwrap();
    assert_eq!(model.endpoints, [Protocol::Messages]);
    let route = Protocol::Messages
        .dialect()
        .upstream(UpstreamKind::Openai, ResponsesRoute::Translate)
        .unwrap();
    assert_eq!((route.path, route.translated), ("/chat/completions", true));
}

#[test]
fn an_embeddings_model_on_an_anthropic_upstream_is_refused() {
    let error = Catalogue::from_toml(
        r#"
        [[upstreams]]
        name = "anthropic"
        kind = "anthropic"
        base_url = "https://api.anthropic.com"
        api_key_env = "ANTHROPIC_API_KEY"
        [[models]]
        name = "embed"
        protocol = "embeddings"
        price = 1
        upstream = "anthropic""#,
    )
    .unwrap_err();
    assert!(
        matches!(error, CatalogueError::ProtocolMismatch { .. }),
        "{error}"
    );
}

const TWO_UPSTREAMS: &str = r#"
    [[upstreams]]
    name = "primary"
    kind = "openai"
    base_url = "http://a/v1"
    api_key_env = "A"
    connect_timeout_secs = 2
    proxy = "http://proxy:3128"
    headers = { "x-tenant" = "acme" }
    breaker_failures = 2
    breaker_cooldown_secs = 7
    [[upstreams]]
    name = "backup"
    kind = "openai"
    base_url = "http://b/v1"
    api_key_env = "B"
"#;

fn with_channels(model: &str) -> Result<Catalogue, CatalogueError> {
    Catalogue::from_toml(&format!("{TWO_UPSTREAMS}\n[[models]]\n{model}"))
}

#[test]
fn a_list_of_upstreams_is_an_order_of_preference() {
    let catalogue = with_channels(
        "name = \"m\"\nprotocol = \"chat_completions\"\nprice = 1\nupstream_model = \"m-v2\"\nupstreams = [\"backup\", \"primary\"]",
    )
    .unwrap();
    let channels = &catalogue.model("m").unwrap().channels;
    let names: Vec<_> = channels.iter().map(|c| c.upstream.name.as_str()).collect();
    assert_eq!(names, ["backup", "primary"]);
    assert!(channels[0].priority < channels[1].priority);
    assert!(
        channels
            .iter()
            .all(|c| c.upstream_model.as_deref() == Some("m-v2"))
    );
}

#[test]
fn channels_can_carry_priority_weight_and_their_own_upstream_model() {
    let catalogue = with_channels(
        r#"name = "m"
        protocol = "chat_completions"
        price = 1
        upstreams = [
            { name = "backup", priority = 2 },
            { name = "primary", priority = 1, weight = 3, upstream_model = "m-on-a" },
        ]"#,
    )
    .unwrap();
    let channels = &catalogue.model("m").unwrap().channels;
    assert_eq!(channels[0].upstream.name, "primary");
    assert_eq!((channels[0].weight, channels[1].weight), (3, 1));
    assert_eq!(channels[0].upstream_model.as_deref(), Some("m-on-a"));
    assert_eq!(channels[1].upstream_model, None);
}

#[test]
fn upstream_settings_load_with_defaults() {
    let catalogue = with_channels(
        "name = \"m\"\nprotocol = \"chat_completions\"\nprice = 1\nupstream = \"primary\"",
    )
    .unwrap();
    let primary = &catalogue.upstreams()[1];
    assert_eq!(primary.name, "primary");
    assert_eq!(primary.connect_timeout, Duration::from_secs(2));
    assert_eq!(primary.proxy.as_deref(), Some("http://proxy:3128"));
    assert_eq!(
        primary.headers,
        [("x-tenant".to_owned(), "acme".to_owned())]
    );
    assert_eq!(
        (primary.breaker_failures, primary.breaker_cooldown),
        (2, Duration::from_secs(7))
    );
    let backup = &catalogue.upstreams()[0];
    assert_eq!(backup.breaker_failures, DEFAULT_BREAKER_FAILURES);
    assert_eq!(catalogue.call_deadline(), DEFAULT_CALL_DEADLINE);
}

#[test]
fn bad_channel_lists_are_refused_by_name() {
    let base = "name = \"m\"\nprotocol = \"chat_completions\"\nprice = 1\n";
    let cases = [
        ("", "exactly one of"),
        ("upstreams = []", "exactly one of"),
        (
            "upstream = \"primary\"\nupstreams = [\"backup\"]",
            "exactly one of",
        ),
        (
            "upstreams = [\"primary\", \"primary\"]",
            "lists upstream `primary` twice",
        ),
        (
            "upstreams = [\"primary\", \"nowhere\"]",
            "unknown upstream `nowhere`",
        ),
        (
            "upstreams = [{ name = \"primary\", priority = 1 }, \"backup\"]",
            "not all",
        ),
        (
            "upstreams = [{ name = \"primary\", weight = 0 }]",
            "must be positive",
        ),
    ];
    for (channels, expected) in cases {
        let error = with_channels(&format!("{base}{channels}")).unwrap_err();
        assert!(error.to_string().contains(expected), "{channels}: {error}");
    }
}

#[test]
fn zero_timeouts_and_invalid_headers_are_refused() {
    let error = Catalogue::from_toml("call_deadline_secs = 0").unwrap_err();
    assert!(error.to_string().contains("call_deadline_secs"), "{error}");
    let upstream = |extra: &str| {
        Catalogue::from_toml(&format!(
            "[[upstreams]]\nname = \"u\"\nkind = \"openai\"\nbase_url = \"http://u\"\napi_key_env = \"U\"\n{extra}"
        ))
    };
    assert!(
        upstream("timeout_secs = 0")
            .unwrap_err()
            .to_string()
            .contains("timeout_secs")
    );
    let error = upstream("headers = { \"bad header\" = \"x\" }").unwrap_err();
    assert!(error.to_string().contains("bad header"), "{error}");
}

fn with_models(models: &[&str]) -> Result<Catalogue, CatalogueError> {
    let models: String = models
        .iter()
        .map(|model| format!("\n[[models]]\n{model}\nprotocol = \"chat_completions\"\nprice = 1\nupstream = \"openai\"\n"))
        .collect();
    Catalogue::from_toml(&format!("{UPSTREAM}{models}"))
}

#[test]
fn an_alias_finds_its_model() {
    let catalogue = with_models(&[
        r#"name = "gpt-4o-mini"
        aliases = ["gpt-4o-mini-2024-07-18", "mini"]"#,
        r#"name = "gpt-4o""#,
    ])
    .unwrap();
    for name in ["gpt-4o-mini", "gpt-4o-mini-2024-07-18", "mini"] {
        assert_eq!(catalogue.model(name).unwrap().name, "gpt-4o-mini", "{name}");
    }
    assert_eq!(
        catalogue.model("gpt-4o").unwrap().aliases,
        Vec::<String>::new()
    );
    // The models, once each, by their catalogue names.
    let mut names: Vec<_> = catalogue.models().map(|m| m.name.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["gpt-4o", "gpt-4o-mini"]);
    assert!(catalogue.model("gpt-4o-2024").is_none());
}

#[test]
fn an_alias_that_is_a_model_name_is_refused_naming_both() {
    let error = with_models(&[
        r#"name = "gpt-4o-mini"
        aliases = ["gpt-4o"]"#,
        r#"name = "gpt-4o""#,
    ])
    .unwrap_err();
    assert_eq!(
        error.to_string(),
        "invalid model catalogue: alias `gpt-4o` of model `gpt-4o-mini` is already the name of model `gpt-4o`"
    );
}

#[test]
fn an_alias_of_two_models_is_refused_naming_both() {
    let error = with_models(&[
        r#"name = "b"
        aliases = ["shared"]"#,
        r#"name = "a"
        aliases = ["shared"]"#,
    ])
    .unwrap_err();
    assert_eq!(
        error.to_string(),
        "invalid model catalogue: alias `shared` of model `b` is already an alias of model `a`"
    );
}

#[test]
fn a_models_own_name_or_an_empty_alias_is_refused() {
    let own = with_models(&[r#"name = "a"
        aliases = ["a"]"#])
    .unwrap_err();
    assert!(
        own.to_string()
            .contains("alias `a` of model `a` is already the name of model `a`"),
        "{own}"
    );
    let empty = with_models(&[r#"name = "a"
        aliases = [""]"#])
    .unwrap_err();
    assert!(
        empty.to_string().contains("alias `` of model `a` is empty"),
        "{empty}"
    );
}

#[test]
fn the_demo_catalogue_aliases_the_dated_claude_ids() {
    let demo = Catalogue::demo();
    assert_eq!(
        demo.model("claude-haiku-4-5-20251001").unwrap().name,
        "claude-haiku-4-5"
    );
    assert_eq!(
        demo.model("claude-sonnet-4-5-20250929").unwrap().name,
        "claude-sonnet-4-5"
    );
}

#[test]
fn error_bodies_are_detail_unless_the_catalogue_says_compatible() {
    assert_eq!(Catalogue::demo().error_body(), ErrorBody::Detail);
    let compatible =
        Catalogue::from_toml(&format!("error_body = \"compatible\"\n{UPSTREAM}")).unwrap();
    assert_eq!(compatible.error_body(), ErrorBody::Compatible);
    assert!(Catalogue::from_toml("error_body = \"openai\"").is_err());
}

#[test]
fn an_openai_upstream_translates_responses_unless_it_says_native() {
    let chat = r#"name = "m"
        protocol = "chat_completions"
        price = 1
        upstream = "openai""#;
    let translated = with_model(chat).unwrap();
    assert_eq!(
        translated.upstreams()[0].responses,
        ResponsesRoute::Translate
    );
    let native = Catalogue::from_toml(&format!(
        "{}responses = \"native\"\n[[models]]\n{chat}",
        UPSTREAM
    ))
    .unwrap();
    assert_eq!(native.upstreams()[0].responses, ResponsesRoute::Native);
    let unknown = Catalogue::from_toml(&format!("{UPSTREAM}responses = \"both\"\n"));
    assert!(matches!(unknown, Err(CatalogueError::Syntax(_))));
}

#[test]
fn responses_is_refused_on_an_anthropic_upstream_and_as_a_models_protocol() {
    let anthropic = r#"
        [[upstreams]]
        name = "claude"
        kind = "anthropic"
        base_url = "https://api.anthropic.com"
        api_key_env = "K"
        responses = "native"
    "#;
    let error = Catalogue::from_toml(anthropic).unwrap_err();
    assert!(
        matches!(&error, CatalogueError::ResponsesOnAnthropic(name) if name == "claude"),
        "{error}"
    );
    let gemini = anthropic
        .replace("\"claude\"", "\"google\"")
        .replace("kind = \"anthropic\"", "kind = \"gemini\"");
    let error = Catalogue::from_toml(&gemini).unwrap_err();
    assert!(
        matches!(&error, CatalogueError::ResponsesOnGemini(name) if name == "google"),
        "{error}"
    );
    assert!(error.to_string().contains("kind `gemini`"), "{error}");
    let error = with_model(
        r#"name = "m"
        protocol = "responses"
        price = 1
        upstream = "openai""#,
    )
    .unwrap_err();
    assert!(
        matches!(&error, CatalogueError::ResponsesModel(name) if name == "m"),
        "{error}"
    );
    assert!(error.to_string().contains("chat_completions"));
}

#[test]
fn token_prices_load_with_decimals_and_cache_kinds_defaulting_to_input() {
    let catalogue = with_model(
        r#"name = "gpt-4o"
        protocol = "chat_completions"
        upstream = "openai"
        max_output_tokens = 16384
        [models.tokens]
        input = 2.5
        output = 10
        cache_read = 1.25"#,
    )
    .unwrap();
    let model = catalogue.model("gpt-4o").unwrap();
    let tokens = model.pricing.tokens.expect("token prices").standard.prices;
    assert_eq!(model.pricing.per_call, Credits(0));
    assert_eq!(tokens.input, TokenRate::per_million(2.5).unwrap());
    assert_eq!(tokens.output, TokenRate::per_million(10.0).unwrap());
    assert_eq!(tokens.cache_read, TokenRate::per_million(1.25).unwrap());
    assert_eq!(tokens.cache_write, tokens.input);
    assert_eq!(tokens.cache_write_1h, tokens.input);
    assert_eq!(model.max_output_tokens, Some(16384));
    assert_eq!(model.least_charge(), Credits(1));
}

#[test]
fn a_base_price_and_token_prices_go_together() {
    let catalogue = with_model(
        r#"name = "claude"
        protocol = "chat_completions"
        upstream = "openai"
        price = 3
        max_output_tokens = 1000
        tokens = { input = 3, output = 15, cache_write = 3.75, cache_write_1h = 6 }"#,
    )
    .unwrap();
    let pricing = catalogue.model("claude").unwrap().pricing;
    assert_eq!(pricing.per_call, Credits(3));
    assert_eq!(
        pricing.tokens.unwrap().standard.prices.cache_write_1h,
        TokenRate::per_million(6.0).unwrap()
    );
}

#[test]
fn a_model_without_any_price_is_refused() {
    let error =
        with_model("name = \"free\"\nprotocol = \"chat_completions\"\nupstream = \"openai\"")
            .unwrap_err();
    assert!(
        matches!(error, CatalogueError::NoPrice(ref model) if model == "free"),
        "{error}"
    );
}

#[test]
fn negative_and_non_finite_token_prices_are_refused_by_kind() {
    for (tokens, kind) in [
        ("input = -1, output = 1", "input"),
        ("input = 1, output = nan", "output"),
        ("input = 1, output = 1, cache_read = inf", "cache_read"),
        ("input = 1, output = 1, cache_write = -0.5", "cache_write"),
        (
            "input = 1, output = 1, cache_write_1h = 1e12",
            "cache_write_1h",
        ),
    ] {
        let error = with_model(&format!(
            "name = \"m\"\nprotocol = \"chat_completions\"\nupstream = \"openai\"\n\
             max_output_tokens = 10\ntokens = {{ {tokens} }}"
        ))
        .unwrap_err();
        assert!(
            matches!(error, CatalogueError::InvalidTokenPrice { kind: k, .. } if k == kind),
            "{tokens}: {error}"
        );
    }
}

#[test]
fn unknown_token_kinds_are_refused() {
    let error = with_model(
        r#"name = "m"
        protocol = "chat_completions"
        upstream = "openai"
        max_output_tokens = 10
        tokens = { input = 1, output = 1, reasoning = 2 }"#,
    )
    .unwrap_err();
    assert!(matches!(error, CatalogueError::Syntax(_)), "{error}");
    assert!(error.to_string().contains("reasoning"), "{error}");
}

#[test]
fn a_token_priced_model_needs_an_output_ceiling_unless_it_embeds() {
    let error = with_model(
        r#"name = "m"
        protocol = "chat_completions"
        upstream = "openai"
        tokens = { input = 1, output = 1 }"#,
    )
    .unwrap_err();
    assert!(
        matches!(error, CatalogueError::NoOutputCeiling(ref m) if m == "m"),
        "{error}"
    );
    let zero = with_model(
        r#"name = "m"
        protocol = "chat_completions"
        upstream = "openai"
        max_output_tokens = 0
        tokens = { input = 1, output = 1 }"#,
    )
    .unwrap_err();
    assert!(matches!(zero, CatalogueError::Zero(_)), "{zero}");
    with_model(
        r#"name = "e"
        protocol = "embeddings"
        upstream = "openai"
        tokens = { input = 0.02, output = 0 }"#,
    )
    .expect("an embeddings model reserves no output");
}

#[test]
fn a_models_endpoints_default_to_its_protocols() {
    let demo = Catalogue::demo();
    let endpoints = |name: &str| demo.model(name).unwrap().endpoints.clone();
    assert_eq!(
        endpoints("gpt-4o-mini"),
        [Protocol::ChatCompletions, Protocol::Responses]
    );
    assert_eq!(endpoints("claude-haiku-4-5"), [Protocol::Messages]);
    assert_eq!(endpoints("text-embedding-3-small"), [Protocol::Embeddings]);
}

#[test]
fn a_model_answers_on_the_endpoints_it_lists() {
    let catalogue = with_model(
        r#"name = "chat-only"
        protocol = "chat_completions"
        endpoints = ["chat_completions", "chat_completions"]
        price = 1
        upstream = "openai""#,
    )
    .unwrap();
    let model = catalogue.model("chat-only").unwrap();
    assert_eq!(model.endpoints, [Protocol::ChatCompletions]);
}

#[test]
fn an_endpoint_no_upstream_serves_is_refused_naming_both() {
    let translated = with_model(
        r#"name = "gpt-on-messages"
        protocol = "chat_completions"
        endpoints = ["chat_completions", "messages"]
        price = 1
        upstream = "openai""#,
    )
    .unwrap();
    let model = translated.model("gpt-on-messages").unwrap();
    assert_eq!(
        model.endpoints,
        [Protocol::ChatCompletions, Protocol::Messages]
    );
    let refused = Catalogue::from_toml(
        r#"
        [[upstreams]]
        name = "anthropic"
        kind = "anthropic"
        base_url = "https://api.anthropic.com"
        api_key_env = "ANTHROPIC_API_KEY"
        [[models]]
        name = "claude-on-embeddings"
        protocol = "messages"
        endpoints = ["messages", "embeddings"]
        price = 1
        upstream = "anthropic""#,
    )
    .unwrap_err();
    let message = refused.to_string();
    assert!(
        matches!(refused, CatalogueError::EndpointNotServed { .. }),
        "{message}"
    );
    assert!(
        message.contains("`claude-on-embeddings`")
            && message.contains("`embeddings`")
            && message.contains("`anthropic`"),
        "{message}"
    );
    let none = with_model(
        r#"name = "nowhere"
        protocol = "chat_completions"
        endpoints = []
        price = 1
        upstream = "openai""#,
    )
    .unwrap_err();
    assert!(matches!(none, CatalogueError::NoEndpoint(_)), "{none}");
    let unknown = with_model(
        r#"name = "typo"
        protocol = "chat_completions"
        endpoints = ["chat"]
        price = 1
        upstream = "openai""#,
    )
    .unwrap_err();
    assert!(unknown.to_string().contains("chat"), "{unknown}");
}

#[test]
fn the_demo_catalogue_serves_claude_codes_default_model_names() {
    let demo = Catalogue::demo();
    for name in [
        "claude-opus-5-5",
        "claude-sonnet-5-5",
        "claude-haiku-4-5-20251001",
    ] {
        let model = demo.model(name).unwrap_or_else(|| panic!("{name}"));
        assert!(model.endpoints.contains(&Protocol::Messages), "{name}");
    }
    // A Claude model the OpenAI clients can call too, translated by its Anthropic upstream.
    let claude = demo.model("claude-sonnet-5-5").unwrap();
    assert!(claude.endpoints.contains(&Protocol::Responses));
    assert!(claude.endpoints.contains(&Protocol::ChatCompletions));
    assert_eq!(claude.channels[0].upstream.kind, UpstreamKind::Anthropic);
    // Codex's default model name, on the Responses API.
    let codex = demo.model("gpt-6.2-sol").unwrap();
    assert!(codex.endpoints.contains(&Protocol::Responses));
    // A chat model answering on messages, translated by its chat-completions upstream.
    let chat = demo.model("deepseek-chat").unwrap();
    assert!(chat.endpoints.contains(&Protocol::Messages));
    assert_eq!(chat.channels[0].upstream.kind, UpstreamKind::Openai);
}

/// A catalogue of one upstream, `entry` its settings, and a messages model on it.
fn hosted(entry: &str) -> Result<Catalogue, CatalogueError> {
    Catalogue::from_toml(&format!(
        "[[upstreams]]\nname = \"cloud\"\n{entry}\n\
         [[models]]\nname = \"claude\"\nprotocol = \"messages\"\nprice = 1\nupstream = \"cloud\"\n"
    ))
}

#[cfg(feature = "bedrock")]
#[test]
fn a_bedrock_upstream_speaks_messages_at_its_regions_runtime_with_the_standard_variables() {
    let catalogue = hosted("kind = \"bedrock\"\nregion = \"eu-west-3\"").unwrap();
    let upstream = &catalogue.upstreams()[0];
    assert_eq!(upstream.kind, UpstreamKind::Anthropic);
    assert_eq!(upstream.kind_name(), "bedrock");
    assert_eq!(
        upstream.base_url,
        "https://bedrock-runtime.eu-west-3.amazonaws.com"
    );
    assert_eq!(upstream.api_key_env, "AWS_BEARER_TOKEN_BEDROCK");
    let Hosting::Bedrock(settings) = &upstream.hosting else {
        panic!("{:?}", upstream.hosting);
    };
    assert_eq!(
        (
            settings.access_key_id_env.as_str(),
            settings.secret_access_key_env.as_str(),
            settings.session_token_env.as_str()
        ),
        (
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN"
        )
    );
    let named = hosted(
        "kind = \"bedrock\"\nregion = \"us-east-1\"\naccess_key_id_env = \"A\"\nsecret_access_key_env = \"S\"",
    )
    .unwrap();
    let Hosting::Bedrock(settings) = &named.upstreams()[0].hosting else {
        panic!("bedrock");
    };
    assert_eq!(settings.access_key_id_env, "A");
    let missing = hosted("kind = \"bedrock\"").unwrap_err().to_string();
    assert!(missing.contains("needs `region`"), "{missing}");
}

#[cfg(feature = "vertex")]
#[test]
fn a_vertex_upstream_speaks_its_publishers_protocol_at_its_regions_endpoint() {
    let claude = hosted(
        "kind = \"vertex\"\npublisher = \"anthropic\"\nproject = \"p\"\nregion = \"us-east5\"",
    )
    .unwrap();
    let upstream = &claude.upstreams()[0];
    assert_eq!(
        (upstream.kind, upstream.kind_name()),
        (UpstreamKind::Anthropic, "vertex")
    );
    assert_eq!(
        upstream.base_url,
        "https://us-east5-aiplatform.googleapis.com"
    );
    let global = Catalogue::from_toml(
        "[[upstreams]]\nname = \"g\"\nkind = \"vertex\"\npublisher = \"google\"\nproject = \"p\"\nregion = \"global\"\n\
         [[models]]\nname = \"gemini\"\nprotocol = \"gemini\"\nprice = 1\nupstream = \"g\"\n",
    )
    .unwrap();
    let upstream = &global.upstreams()[0];
    assert_eq!(upstream.kind, UpstreamKind::Gemini);
    assert_eq!(upstream.base_url, "https://aiplatform.googleapis.com");
    let no_publisher = hosted("kind = \"vertex\"\nproject = \"p\"\nregion = \"r\"").unwrap_err();
    assert!(
        no_publisher.to_string().contains("needs `publisher`"),
        "{no_publisher}"
    );
    // Neither publisher serves embeddings.
    let mismatch = Catalogue::from_toml(
        "[[upstreams]]\nname = \"v\"\nkind = \"vertex\"\npublisher = \"anthropic\"\nproject = \"p\"\nregion = \"r\"\n\
         [[models]]\nname = \"e\"\nprotocol = \"embeddings\"\nprice = 1\nupstream = \"v\"\n",
    )
    .unwrap_err();
    assert!(
        mismatch.to_string().contains("does not serve"),
        "{mismatch}"
    );
}

#[test]
fn a_platforms_settings_are_refused_on_the_other_kinds() {
    for (entry, named) in [
        (
            "kind = \"anthropic\"\nbase_url = \"http://x\"\napi_key_env = \"K\"\nregion = \"r\"",
            "`region`",
        ),
        (
            "kind = \"anthropic\"\nbase_url = \"http://x\"\napi_key_env = \"K\"\nproject = \"p\"",
            "`project`",
        ),
        (
            "kind = \"openai\"\nbase_url = \"http://x\"\napi_key_env = \"K\"\naccess_key_id_env = \"A\"",
            "`access_key_id_env`",
        ),
        (
            "kind = \"anthropic\"\napi_key_env = \"K\"",
            "needs `base_url`",
        ),
        (
            "kind = \"anthropic\"\nbase_url = \"http://x\"",
            "needs `api_key_env`",
        ),
    ] {
        let refused = hosted(entry).unwrap_err().to_string();
        assert!(refused.contains(named), "{entry}: {refused}");
    }
    #[cfg(all(feature = "bedrock", feature = "vertex"))]
    for (entry, named) in [
        (
            "kind = \"bedrock\"\nregion = \"r\"\npublisher = \"anthropic\"",
            "`publisher`",
        ),
        (
            "kind = \"bedrock\"\nregion = \"r\"\nresponses = \"native\"",
            "`responses`",
        ),
        (
            "kind = \"vertex\"\npublisher = \"anthropic\"\nproject = \"p\"\nregion = \"r\"\napi_key_env = \"K\"",
            "`api_key_env`",
        ),
    ] {
        let refused = hosted(entry).unwrap_err().to_string();
        assert!(refused.contains(named), "{entry}: {refused}");
    }
}

#[cfg(not(feature = "bedrock"))]
#[test]
fn a_bedrock_upstream_in_a_build_without_it_names_the_feature() {
    let refused = hosted("kind = \"bedrock\"\nregion = \"r\"")
        .unwrap_err()
        .to_string();
    assert!(refused.contains("cargo feature `bedrock`"), "{refused}");
}

/// A catalogue with money: `currency`, `credit_value`, and `model` on two upstreams.
fn with_money(settings: &str, model: &str) -> Result<Catalogue, CatalogueError> {
    Catalogue::from_toml(&format!("{settings}\n{TWO_UPSTREAMS}\n[[models]]\n{model}"))
}

const PRICED: &str = r#"name = "m"
protocol = "chat_completions"
max_output_tokens = 100
upstreams = ["primary", { name = "backup", cost = { input = 2.0, output = 8.0 } }]
[models.tokens]
input = 300
output = 1200
minimum = 2
long_context = { above = 200000, input = 600, output = 1800 }
priority = { input = 510, output = 2040 }
[models.cost]
call = 0.0001
input = 2.5
output = 10.0
flex = { input = 1.25, output = 5.0 }"#;

#[test]
fn cost_prices_tiers_and_the_minimum_load_with_a_channels_own_cost() {
    let catalogue = with_money("currency = \"USD\"\ncredit_value = 0.01", PRICED).unwrap();
    assert_eq!(catalogue.currency(), Some("USD"));
    let model = catalogue.model("m").unwrap();
    assert_eq!(model.credit_value, Some(Money::from_nanos(10_000_000)));
    assert_eq!(model.pricing.minimum, Credits(2));
    let tokens = model.pricing.tokens.unwrap();
    let long = tokens.standard.long_context.unwrap();
    assert_eq!(long.above, 200_000);
    assert_eq!(long.prices.output, TokenRate::per_million(1_800.0).unwrap());
    assert_eq!(
        tokens.priority.unwrap().prices.input,
        TokenRate::per_million(510.0).unwrap()
    );
    assert_eq!(tokens.flex, None);
    let model_cost = model.cost.unwrap();
    assert_eq!(model_cost.per_call, Money::from_nanos(100_000));
    assert!(model_cost.tokens.unwrap().flex.is_some());
    // The first channel costs what the model does; the second, its own.
    assert_eq!(model.channels[0].cost, Some(model_cost));
    let own = model.channels[1].cost.unwrap();
    assert_eq!(own.per_call, Money::ZERO);
    assert_eq!(
        own.tokens.unwrap().standard.prices.input,
        TokenRate::per_million(2.0).unwrap()
    );
}

#[test]
fn money_settings_and_price_tables_that_cannot_be_used_are_refused_at_start() {
    let money = "currency = \"USD\"\ncredit_value = 0.01";
    let refused = |settings: &str, model: &str, says: &str| {
        let error = with_money(settings, model).unwrap_err().to_string();
        assert!(error.contains(says), "{error} (expected {says:?})");
    };
    refused("", PRICED, "give `currency`");
    refused("currency = \"USD\"", PRICED, "needs `credit_value`");
    refused("credit_value = 0.01", PRICED, "needs `currency`");
    refused(
        "currency = \"US D\"\ncredit_value = 0.01",
        PRICED,
        "not a currency code",
    );
    refused(
        "currency = \"USD\"\ncredit_value = 0",
        PRICED,
        "worth more than 0",
    );
    refused(
        money,
        &PRICED.replace("above = 200000", "above = 0"),
        "needs `above`, a positive number",
    );
    refused(
        money,
        &PRICED.replace("above = 200000, ", ""),
        "needs `above`, a positive number",
    );
    // A key in a table that does not take it, named with its table.
    for (from, to, says) in [
        (
            "minimum = 2\n",
            "minimum = 2\nabove = 5\n",
            "[models.tokens] takes no `above`",
        ),
        (
            "priority = { input = 510, output = 2040 }",
            "priority = { input = 510, output = 2040, minimum = 1 }",
            "[models.tokens].priority takes no `minimum`",
        ),
        (
            "flex = { input = 1.25, output = 5.0 }",
            "flex = { input = 1.25, output = 5.0, call = 1 }",
            "[models.cost].flex takes no `call`",
        ),
        (
            "long_context = { above = 200000, input = 600, output = 1800 }",
            "long_context = { above = 200000, input = 600, output = 1800, flex = { input = 1, output = 1 } }",
            "[models.tokens].long_context takes no `priority` or `flex`",
        ),
    ] {
        assert!(PRICED.contains(from), "{from}");
        refused(money, &PRICED.replace(from, to), says);
    }
    refused(
        money,
        &PRICED.replace(
            "priority = { input = 510, output = 2040 }",
            "priority = { input = 510 }",
        ),
        "needs both `input` and `output`",
    );
    refused(
        money,
        &PRICED.replace("minimum = 2", "minimum = 0"),
        "at least 1",
    );
    refused(
        money,
        &PRICED.replace("minimum = 2", "minimum = 1.5"),
        "whole number",
    );
    refused(
        money,
        &PRICED.replace("call = 0.0001", "call = -1"),
        "at least 0",
    );
    refused(
        money,
        &PRICED.replace(
            "flex = { input = 1.25, output = 5.0 }",
            "scale = { input = 1 }",
        ),
        "unknown field `scale`",
    );
    refused(
        money,
        &PRICED.replace(
            "cost = { input = 2.0, output = 8.0 }",
            "cost = { priority = 1 }",
        ),
        // A channel's entry is a name or a table; serde says which part failed only so far.
        "did not match any variant",
    );
    refused(
        money,
        &PRICED.replace("[models.tokens]\n", "[models.tokens]\ncall = 1\n"),
        "takes no `call`",
    );
    refused(
        money,
        &PRICED.replace(
            "call = 0.0001\ninput = 2.5\noutput = 10.0\nflex = { input = 1.25, output = 5.0 }",
            "minimum = 0.5",
        ),
        "gives no price",
    );
}

#[test]
fn a_reload_cannot_change_the_currency() {
    let usd = with_money("currency = \"USD\"\ncredit_value = 0.01", PRICED).unwrap();
    let eur = with_money("currency = \"EUR\"\ncredit_value = 0.01", PRICED).unwrap();
    let dearer = with_money("currency = \"USD\"\ncredit_value = 0.02", PRICED).unwrap();
    assert_eq!(usd.start_only_change(&eur), Some("currency"));
    assert_eq!(
        usd.start_only_change(&dearer),
        None,
        "a credit's value may change"
    );
}
