"""The official Anthropic SDK on a model whose provider speaks only chat completions: its
`messages.create` and `messages.stream` with a tool round trip, each call translated to chat
completions and back by the gateway and charged once.
"""

import json

import anthropic
import fake_provider
import pytest
from test_sdks import anthropic_client, start_gateway

MODEL, PRICE = "chat-on-messages", 2
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The current weather at a location",
    "input_schema": {"type": "object", "properties": {"location": {"type": "string"}, "unit": {"type": "string"}}},
}
WEATHER_REPORT = "18°C, cloudy"


@pytest.fixture(scope="module")
def chat_only_gateway(tmp_path_factory):
    """The gateway in front of a fake provider that is asked only chat completions."""
    provider, base = fake_provider.start()
    catalogue = tmp_path_factory.mktemp("catalogue") / "models.toml"
    catalogue.write_text(
        "streaming = true\n"
        f'[[upstreams]]\nname = "chat-only"\nkind = "openai"\nbase_url = "{base}/v1"\napi_key_env = "FAKE_PROVIDER_KEY"\n'
        f'[[models]]\nname = "{MODEL}"\nprotocol = "chat_completions"\nendpoints = ["chat_completions", "messages"]\n'
        f'price = {PRICE}\nupstream = "chat-only"\n'
    )
    yield from start_gateway(
        tmp_path_factory, MOCK_UPSTREAM="0", GATEWAY_MODELS=str(catalogue), FAKE_PROVIDER_KEY="sk-fake"
    )
    provider.shutdown()


def question():
    return [{"role": "user", "content": "Weather in Paris?"}]


def answer(tool_use):
    """The conversation after the model's tool call, with the tool's result."""
    return question() + [
        {"role": "assistant", "content": [tool_use.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": WEATHER_REPORT}]},
    ]


def last_chat_request():
    path, body = fake_provider.seen()[-1]
    assert path == "/v1/chat/completions"
    return body


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_anthropic_sdk_runs_a_tool_round_trip_on_a_chat_completions_model(chat_only_gateway, stream):
    key = chat_only_gateway.new_key(subscription=10)
    client = anthropic_client(chat_only_gateway, key)

    def ask(messages):
        arguments = dict(model=MODEL, max_tokens=256, tools=[WEATHER_TOOL], messages=messages)
        if not stream:
            return client.messages.create(**arguments)
        with client.messages.stream(**arguments) as events:
            return events.get_final_message()

    first = ask(question())
    [tool_use] = first.content
    assert (tool_use.type, tool_use.name, tool_use.input) == ("tool_use", "get_weather", fake_provider.TOOL_INPUT)
    assert first.stop_reason == "tool_use"
    assert first.model == MODEL
    sent = last_chat_request()
    assert sent["tools"][0]["function"]["name"] == "get_weather"
    assert sent.get("stream", False) == stream

    second = ask(answer(tool_use))
    assert second.content[0].text == fake_provider.FINAL_TEXT
    assert second.stop_reason == "end_turn"
    sent = last_chat_request()
    call = sent["messages"][1]["tool_calls"][0]
    assert (call["id"], json.loads(call["function"]["arguments"])) == (tool_use.id, fake_provider.TOOL_INPUT)
    assert sent["messages"][2] == {"role": "tool", "tool_call_id": tool_use.id, "content": WEATHER_REPORT}
    # The usage the SDK reads is the provider's; the entries say the same, charged once each.
    assert (second.usage.input_tokens, second.usage.output_tokens) == (80, 10)
    entries = chat_only_gateway.logs(key)
    assert [(e["protocol"], e["status"]) for e in entries] == [("messages", "ok")] * 2
    assert sorted(e["output_tokens"] for e in entries) == [10, 20]
    assert chat_only_gateway.balance(key)["total"] == 10 - 2 * PRICE


def test_anthropic_sdk_sees_an_untranslatable_field_as_a_bad_request_and_nothing_is_charged(chat_only_gateway):
    key = chat_only_gateway.new_key(subscription=10)
    with pytest.raises(anthropic.BadRequestError) as raised:
        anthropic_client(chat_only_gateway, key).messages.create(
            model=MODEL, max_tokens=16, messages=question(), extra_body={"top_k": 5}
        )
    assert "top_k" in raised.value.body["detail"]
    assert chat_only_gateway.logs(key) == []
    assert chat_only_gateway.balance(key)["total"] == 10
