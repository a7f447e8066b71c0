"""Token-priced models through the official SDKs, in mock mode (the mock reports the input the
gateway estimates from the request, and 16 output tokens): streams on both protocols and on the
Responses API settle on the usage the stream reported; a chat stream whose client did not ask
for usage gets none, though the gateway asked for it; a complete reply says what it cost."""

import math

import pytest
from test_sdks import MOCK_TEXT, anthropic_client, openai_client, start_gateway

CHAT_INPUT, CHAT_OUTPUT = 100_000, 400_000
CLAUDE_INPUT, CLAUDE_OUTPUT = 100_000, 500_000
MOCK_OUTPUT_TOKENS = 16

CATALOGUE = f"""
streaming = true
[[upstreams]]
name = "openai"
kind = "openai"
base_url = "http://127.0.0.1:9/v1"
api_key_env = "UNUSED_KEY"
[[upstreams]]
name = "anthropic"
kind = "anthropic"
base_url = "http://127.0.0.1:9"
api_key_env = "UNUSED_KEY"
[[models]]
name = "metered-chat"
protocol = "chat_completions"
upstream = "openai"
max_output_tokens = 200
tokens = {{ input = {CHAT_INPUT}, output = {CHAT_OUTPUT} }}
[[models]]
name = "metered-claude"
protocol = "messages"
upstream = "anthropic"
max_output_tokens = 200
tokens = {{ input = {CLAUDE_INPUT}, output = {CLAUDE_OUTPUT} }}
"""


@pytest.fixture(scope="module")
def metered_gateway(tmp_path_factory):
    catalogue = tmp_path_factory.mktemp("catalogue") / "models.toml"
    catalogue.write_text(CATALOGUE)
    yield from start_gateway(tmp_path_factory, GATEWAY_MODELS=str(catalogue))


def cost(input_tokens, output_tokens, input_price, output_price):
    """Credits: the exact sum in credits per million tokens, rounded up once."""
    return math.ceil((input_tokens * input_price + output_tokens * output_price) / 1_000_000)


def only_call(gateway, key):
    [entry] = gateway.logs(key)
    assert entry["status"] == "ok"
    return entry


def test_a_chat_stream_settles_on_usage_the_client_never_sees(metered_gateway):
    key = metered_gateway.new_key(subscription=1_000)
    chunks = list(
        openai_client(metered_gateway, key).chat.completions.create(
            model="metered-chat", messages=[{"role": "user", "content": "Hello"}], stream=True
        )
    )
    # The gateway asked for the usage chunk (no choices), not the client: it is kept from it.
    assert all(chunk.choices for chunk in chunks)
    assert all(chunk.usage is None for chunk in chunks)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == MOCK_TEXT
    entry = only_call(metered_gateway, key)
    assert entry["input_tokens"] > 0 and entry["output_tokens"] == MOCK_OUTPUT_TOKENS
    charged = cost(entry["input_tokens"], MOCK_OUTPUT_TOKENS, CHAT_INPUT, CHAT_OUTPUT)
    assert entry["price"] == charged
    assert metered_gateway.balance(key)["total"] == 1_000 - charged


def test_a_chat_stream_that_asks_for_usage_gets_it_and_is_charged_by_it(metered_gateway):
    key = metered_gateway.new_key(subscription=1_000)
    chunks = list(
        openai_client(metered_gateway, key).chat.completions.create(
            model="metered-chat",
            messages=[{"role": "user", "content": "Hello"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == MOCK_OUTPUT_TOKENS
    entry = only_call(metered_gateway, key)
    assert entry["input_tokens"] == usage.prompt_tokens
    assert entry["price"] == cost(usage.prompt_tokens, usage.completion_tokens, CHAT_INPUT, CHAT_OUTPUT)


def test_a_messages_stream_is_charged_by_the_usage_it_reported(metered_gateway):
    key = metered_gateway.new_key(subscription=1_000)
    with anthropic_client(metered_gateway, key).messages.stream(
        model="metered-claude", max_tokens=100, messages=[{"role": "user", "content": "Hello"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == MOCK_TEXT
    entry = only_call(metered_gateway, key)
    assert (entry["input_tokens"], entry["output_tokens"]) == (final.usage.input_tokens, final.usage.output_tokens)
    charged = cost(final.usage.input_tokens, final.usage.output_tokens, CLAUDE_INPUT, CLAUDE_OUTPUT)
    assert entry["price"] == charged
    assert metered_gateway.balance(key)["total"] == 1_000 - charged


def test_a_responses_stream_is_charged_by_the_usage_it_reported(metered_gateway):
    key = metered_gateway.new_key(subscription=1_000)
    with openai_client(metered_gateway, key).responses.stream(model="metered-chat", input="Hello") as stream:
        final = stream.get_final_response()
    assert final.output_text == MOCK_TEXT
    entry = only_call(metered_gateway, key)
    assert entry["protocol"] == "responses"
    assert (entry["input_tokens"], entry["output_tokens"]) == (final.usage.input_tokens, final.usage.output_tokens)
    assert entry["price"] == cost(final.usage.input_tokens, final.usage.output_tokens, CHAT_INPUT, CHAT_OUTPUT)


def test_a_complete_reply_says_what_it_cost(metered_gateway):
    key = metered_gateway.new_key(subscription=1_000)
    raw = openai_client(metered_gateway, key).chat.completions.with_raw_response.create(
        model="metered-chat", messages=[{"role": "user", "content": "Hello"}], max_tokens=50
    )
    reply = raw.parse()
    charged = cost(reply.usage.prompt_tokens, reply.usage.completion_tokens, CHAT_INPUT, CHAT_OUTPUT)
    assert raw.headers["x-gateway-credits"] == str(charged)
    assert only_call(metered_gateway, key)["price"] == charged
    assert metered_gateway.balance(key)["total"] == 1_000 - charged
