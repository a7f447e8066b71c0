"""Any client on any model: the official Anthropic SDK on a model whose provider speaks only
chat completions (`messages.create` and `messages.stream` with a tool round trip), and the
OpenAI SDK (chat completions and the Responses API, complete and streamed) and the Agents SDK's
default agent on a model whose provider speaks only Anthropic's messages. Each call translated
both ways by the gateway and charged once.
"""

import json

import agents
import anthropic
import fake_provider
import openai
import pytest
from test_sdks import anthropic_client, openai_client, start_gateway

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
    # Each logged as the call it was, on the endpoint the client called.
    for entry in entries:
        assert any(f"call={entry['id']} " in line for line in chat_only_gateway.access_lines("/v1/messages", 200))
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


# --- The OpenAI SDKs on a model whose provider speaks only Anthropic's messages ------------------

CLAUDE, CLAUDE_PRICE = "claude-for-openai-clients", 3
OPENAI_WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The current weather at a location",
                 "parameters": {"type": "object", "properties": {"location": {"type": "string"}, "unit": {"type": "string"}}}},
}
RESPONSES_WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The current weather at a location",
                          "parameters": OPENAI_WEATHER_TOOL["function"]["parameters"]}


@pytest.fixture(scope="module")
def messages_only_gateway(tmp_path_factory):
    """The gateway in front of a fake provider that is asked only Anthropic's messages."""
    provider, base = fake_provider.start()
    catalogue = tmp_path_factory.mktemp("catalogue") / "models.toml"
    catalogue.write_text(
        "streaming = true\n"
        f'[[upstreams]]\nname = "messages-only"\nkind = "anthropic"\nbase_url = "{base}"\napi_key_env = "FAKE_PROVIDER_KEY"\n'
        f'[[models]]\nname = "{CLAUDE}"\nprotocol = "messages"\nendpoints = ["messages", "chat_completions", "responses"]\n'
        f'price = {CLAUDE_PRICE}\nupstream = "messages-only"\nmax_output_tokens = 1024\n'
    )
    yield from start_gateway(
        tmp_path_factory, MOCK_UPSTREAM="0", GATEWAY_MODELS=str(catalogue), FAKE_PROVIDER_KEY="sk-fake"
    )
    provider.shutdown()


def last_messages_request():
    path, body = fake_provider.seen()[-1]
    assert path == "/v1/messages"
    return body


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_openai_sdk_chat_completions_run_a_tool_round_trip_on_an_anthropic_model(messages_only_gateway, stream):
    gateway = messages_only_gateway
    key = gateway.new_key(subscription=20)
    client = openai_client(gateway, key)
    asked = [{"role": "user", "content": "Weather in Paris?"}]

    def ask(messages):
        arguments = dict(model=CLAUDE, messages=messages, tools=[OPENAI_WEATHER_TOOL])
        if not stream:
            return client.chat.completions.create(**arguments).choices[0]
        chunks = list(client.chat.completions.create(**arguments, stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
        # The SDK's own helper puts the chunks back together.
        with client.chat.completions.stream(**arguments) as events:
            return events.get_final_completion().choices[0]

    first = ask(asked)
    assert first.finish_reason == "tool_calls"
    [call] = first.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", fake_provider.TOOL_INPUT)
    sent = last_messages_request()
    assert sent["tools"][0]["input_schema"] == OPENAI_WEATHER_TOOL["function"]["parameters"]
    assert sent["max_tokens"] == 1024

    answered = asked + [first.message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id, "content": WEATHER_REPORT}]
    second = ask(answered)
    assert second.message.content == fake_provider.FINAL_TEXT
    assert second.finish_reason == "stop"
    blocks = last_messages_request()["messages"][-1]["content"]
    assert blocks == [{"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": WEATHER_REPORT}]}]
    calls = 4 if stream else 2
    entries = gateway.logs(key)
    assert [(e["protocol"], e["status"]) for e in entries] == [("chat_completions", "ok")] * calls
    assert gateway.balance(key)["total"] == 20 - calls * CLAUDE_PRICE


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_openai_sdk_responses_run_a_tool_round_trip_on_an_anthropic_model(messages_only_gateway, stream):
    gateway = messages_only_gateway
    key = gateway.new_key(subscription=10)
    client = openai_client(gateway, key)
    asked = [{"role": "user", "content": "Weather in Paris?"}]

    def ask(items):
        arguments = dict(model=CLAUDE, input=items, tools=[RESPONSES_WEATHER_TOOL])
        if not stream:
            return client.responses.create(**arguments)
        with client.responses.stream(**arguments) as events:
            return events.get_final_response()

    first = ask(asked)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", fake_provider.TOOL_INPUT)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": WEATHER_REPORT}
    second = ask(asked + [call.model_dump(exclude_none=True), result])
    assert second.output_text == fake_provider.FINAL_TEXT
    assert last_messages_request()["messages"][-1]["content"][0]["type"] == "tool_result"
    assert second.usage.input_tokens == 80 and second.usage.output_tokens == 10
    entries = gateway.logs(key)
    assert [(e["protocol"], e["status"]) for e in entries] == [("responses", "ok")] * 2
    assert gateway.balance(key)["total"] == 10 - 2 * CLAUDE_PRICE


def test_the_agents_sdks_default_agent_runs_a_tool_on_an_anthropic_model(messages_only_gateway):
    gateway = messages_only_gateway
    key = gateway.new_key(subscription=10)
    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(
        openai.AsyncOpenAI(base_url=f"{gateway.base}/v1", api_key=key, max_retries=0), use_for_tracing=False
    )
    reports = []

    @agents.function_tool
    def get_weather(location: str, unit: str) -> str:
        """The current weather at a location."""
        reports.append((location, unit))
        return WEATHER_REPORT

    agent = agents.Agent(name="Weather", instructions="Answer with the weather tool.", model=CLAUDE, tools=[get_weather])
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?")
    assert result.final_output == fake_provider.FINAL_TEXT
    assert reports == [(fake_provider.TOOL_INPUT["location"], fake_provider.TOOL_INPUT["unit"])]
    entries = gateway.logs(key)
    assert [(e["protocol"], e["status"]) for e in entries] == [("responses", "ok")] * 2
    assert gateway.balance(key)["total"] == 10 - 2 * CLAUDE_PRICE
