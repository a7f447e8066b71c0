"""OpenAI's Responses API through the example gateway, as its own clients call it: the official
Python SDK's `responses.create` and `responses.stream` with a function tool round trip, and the
OpenAI Agents SDK's default `Agent` + `Runner.run`, each against mock mode, a fake provider that
serves the Responses API itself (`responses = "native"`), and one that speaks only chat
completions (`responses = "translate"`).
"""

import json

import agents
import fake_provider
import openai
import pytest
from test_sdks import CHAT_MODEL, CHAT_PRICE, MOCK_TEXT, openai_client, start_gateway

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather at a location",
    "parameters": {
        "type": "object",
        "properties": {"location": {"type": "string"}, "unit": {"type": "string"}},
        "required": ["location", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
WEATHER_REPORT = "18°C, cloudy"


@pytest.fixture(scope="module")
def mock_gateway(tmp_path_factory):
    yield from start_gateway(tmp_path_factory, GATEWAY_STREAMING="1")


def provider_gateway(tmp_path_factory, responses):
    provider, base = fake_provider.start()
    catalogue = tmp_path_factory.mktemp("catalogue") / "models.toml"
    catalogue.write_text(
        "streaming = true\n"
        f'[[upstreams]]\nname = "fake"\nkind = "openai"\nbase_url = "{base}/v1"\n'
        f'api_key_env = "FAKE_PROVIDER_KEY"\nresponses = "{responses}"\n'
        f'[[models]]\nname = "{CHAT_MODEL}"\nprotocol = "chat_completions"\nprice = {CHAT_PRICE}\nupstream = "fake"\n'
    )
    yield from start_gateway(
        tmp_path_factory, MOCK_UPSTREAM="0", GATEWAY_MODELS=str(catalogue), FAKE_PROVIDER_KEY="sk-fake"
    )
    provider.shutdown()


@pytest.fixture(scope="module", params=["native", "translate"])
def upstream_gateway(request, tmp_path_factory):
    """The gateway in front of a fake provider, reached natively and by translation."""
    gateway = provider_gateway(tmp_path_factory, request.param)
    handle = next(gateway)
    handle.responses = request.param
    yield handle
    next(gateway, None)


def last_request_to(path_end):
    return [body for path, body in fake_provider.seen() if path.endswith(path_end)][-1]


def assert_the_provider_was_reached_as(gateway, stream):
    """A native upstream got a Responses request; a translating one a chat request."""
    if gateway.responses == "native":
        request = last_request_to("/v1/responses")
        assert request["input"][-1]["type"] == "function_call_output"
    else:
        request = last_request_to("/v1/chat/completions")
        assert request["messages"][-1] == {"role": "tool", "tool_call_id": "call_fake", "content": WEATHER_REPORT}
        assert request["messages"][-2]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert request.get("stream", False) == stream


def test_responses_create_answers_the_mock_text_charged_as_a_chat_call(mock_gateway):
    key = mock_gateway.new_key(subscription=10)
    response = openai_client(mock_gateway, key).responses.create(
        model=CHAT_MODEL, instructions="Be brief.", input="Hello", tools=[WEATHER_TOOL]
    )
    assert response.output_text == MOCK_TEXT
    assert response.status == "completed"
    assert response.usage.output_tokens == 16
    assert mock_gateway.balance(key)["total"] == 10 - CHAT_PRICE
    [entry] = mock_gateway.logs(key)
    assert (entry["protocol"], entry["model"], entry["status"]) == ("responses", CHAT_MODEL, "ok")


def test_responses_stream_delivers_the_mock_text_in_several_deltas(mock_gateway):
    key = mock_gateway.new_key(subscription=10)
    with openai_client(mock_gateway, key).responses.stream(model=CHAT_MODEL, input="Hello") as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == MOCK_TEXT
    assert len(deltas) > 1
    assert final.output_text == MOCK_TEXT
    # The mock counts the request's input as the gateway estimates it, and the log records it.
    assert final.usage.input_tokens > 0
    assert [(e["status"], e["input_tokens"]) for e in mock_gateway.logs(key)] == [
        ("ok", final.usage.input_tokens)
    ]


def test_responses_refusals_raise_the_sdks_errors_uncharged(mock_gateway):
    key = mock_gateway.new_key(subscription=1)
    client = openai_client(mock_gateway, key)
    with pytest.raises(openai.BadRequestError) as raised:
        # A built-in tool is dropped by a translating upstream; a choice that forces it cannot be.
        client.responses.create(
            model=CHAT_MODEL,
            input="x",
            tools=[{"type": "web_search"}],
            tool_choice={"type": "web_search"},
        )
    assert "tool_choice" in raised.value.body["detail"]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="claude-haiku-4-5", input="x")
    with pytest.raises(openai.APIStatusError) as raised:
        client.responses.create(model=CHAT_MODEL, input="x")
    assert raised.value.status_code == 402
    assert mock_gateway.logs(key) == []


def test_responses_create_makes_a_function_tool_round_trip(upstream_gateway):
    gateway = upstream_gateway
    key = gateway.new_key(subscription=10)
    client = openai_client(gateway, key)
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.responses.create(model=CHAT_MODEL, input=asked, tools=[WEATHER_TOOL])
    [call] = [item for item in first.output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", fake_provider.TOOL_INPUT)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": WEATHER_REPORT}
    second = client.responses.create(
        model=CHAT_MODEL, input=asked + [call.model_dump(exclude_none=True), result], tools=[WEATHER_TOOL]
    )
    assert second.output_text == fake_provider.FINAL_TEXT
    assert_the_provider_was_reached_as(gateway, stream=False)
    entries = gateway.logs(key)
    assert [(e["protocol"], e["status"]) for e in entries] == [("responses", "ok")] * 2
    assert sorted(e["output_tokens"] for e in entries) == [10, 20]
    assert gateway.balance(key)["total"] == 10 - 2 * CHAT_PRICE


def test_responses_stream_makes_a_function_tool_round_trip(upstream_gateway):
    gateway = upstream_gateway
    key = gateway.new_key(subscription=10)
    client = openai_client(gateway, key)
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    with client.responses.stream(model=CHAT_MODEL, input=asked, tools=[WEATHER_TOOL]) as stream:
        pieces = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        first = stream.get_final_response()
    assert len(pieces) > 1
    [call] = [item for item in first.output if item.type == "function_call"]
    assert json.loads("".join(pieces)) == json.loads(call.arguments) == fake_provider.TOOL_INPUT
    result = {"type": "function_call_output", "call_id": call.call_id, "output": WEATHER_REPORT}
    with client.responses.stream(
        model=CHAT_MODEL, input=asked + [call.model_dump(exclude_none=True), result], tools=[WEATHER_TOOL]
    ) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        second = stream.get_final_response()
    assert text == second.output_text == fake_provider.FINAL_TEXT
    assert_the_provider_was_reached_as(gateway, stream=True)
    entries = gateway.logs(key)
    assert [e["status"] for e in entries] == ["ok", "ok"]
    assert sorted(e["output_tokens"] for e in entries) == [10, 20]
    assert gateway.balance(key)["total"] == 10 - 2 * CHAT_PRICE


APPLY_PATCH_TOOL = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edits files with a patch.",
    "format": {
        "type": "grammar",
        "syntax": "lark",
        "definition": 'start: "*** Begin Patch" LF hunk+ "*** End Patch" LF?\nhunk: /[^\\n]*/ LF\n%import common.LF',
    },
}


@pytest.fixture(scope="module")
def translating_gateway(tmp_path_factory):
    """The gateway in front of a fake chat-completions provider, reached by translation."""
    yield from provider_gateway(tmp_path_factory, "translate")


@pytest.mark.parametrize("stream", [False, True])
def test_responses_make_a_custom_tool_round_trip_through_a_translated_upstream(translating_gateway, stream):
    """A custom tool (free-form input under a grammar, as coding agents define `apply_patch`)
    reaches a chat-completions provider as a chat custom tool, its call comes back as a
    `custom_tool_call` item (streamed as `response.custom_tool_call_input` events), and its
    output goes back as a tool message."""
    gateway = translating_gateway
    key = gateway.new_key(subscription=10)
    client = openai_client(gateway, key)
    asked = [{"role": "user", "content": "Add hello.txt."}]
    # The tools the model may call this turn, from a list kept the same across turns.
    allowed = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "custom", "name": "apply_patch"}]}
    request = dict(model=CHAT_MODEL, input=asked, tools=[APPLY_PATCH_TOOL], tool_choice=allowed)
    if stream:
        with client.responses.stream(**request) as events:
            pieces = [e.delta for e in events if e.type == "response.custom_tool_call_input.delta"]
            first = events.get_final_response()
        assert len(pieces) > 1 and "".join(pieces) == fake_provider.PATCH
    else:
        first = client.responses.create(**request)
    [call] = first.output
    assert isinstance(call, openai.types.responses.ResponseCustomToolCall)
    assert (call.name, call.input, call.call_id) == ("apply_patch", fake_provider.PATCH, "call_custom")
    assert last_request_to("/v1/chat/completions")["tool_choice"] == {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "custom", "custom": {"name": "apply_patch"}}]}}
    offered = last_request_to("/v1/chat/completions")["tools"]
    assert offered == [{"type": "custom", "custom": {
        "name": "apply_patch", "description": "Edits files with a patch.",
        "format": {"type": "grammar", "grammar": {
            "definition": APPLY_PATCH_TOOL["format"]["definition"], "syntax": "lark"}}}}]

    result = {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done: A hello.txt"}
    request["input"] = asked + [call.model_dump(exclude_none=True), result]
    del request["tool_choice"]
    if stream:
        with client.responses.stream(**request) as events:
            second = events.get_final_response()
    else:
        second = client.responses.create(**request)
    assert second.output_text == fake_provider.FINAL_TEXT
    sent = last_request_to("/v1/chat/completions")["messages"]
    assert sent[-2]["tool_calls"] == [
        {"id": "call_custom", "type": "custom", "custom": {"name": "apply_patch", "input": fake_provider.PATCH}}
    ]
    assert sent[-1] == {"role": "tool", "tool_call_id": "call_custom", "content": "Done: A hello.txt"}
    assert [e["status"] for e in gateway.logs(key)] == ["ok", "ok"]
    assert gateway.balance(key)["total"] == 10 - 2 * CHAT_PRICE


def run_weather_agent(gateway, key):
    """The Agents SDK in its default mode (the Responses API), one function tool."""
    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"{gateway.base}/v1", api_key=key, max_retries=0)
    agents.set_default_openai_client(client, use_for_tracing=False)
    reports = []

    @agents.function_tool
    def get_weather(location: str, unit: str) -> str:
        """The current weather at a location."""
        reports.append((location, unit))
        return WEATHER_REPORT

    agent = agents.Agent(
        name="Weather",
        instructions="Answer with the weather tool.",
        model=CHAT_MODEL,
        tools=[get_weather],
    )
    return agents.Runner.run_sync(agent, "What is the weather in Paris?"), reports


def test_the_agents_sdk_runs_an_agent_against_the_mock(mock_gateway):
    key = mock_gateway.new_key(subscription=10)
    result, reports = run_weather_agent(mock_gateway, key)
    assert result.final_output == MOCK_TEXT
    assert reports == []
    assert [e["protocol"] for e in mock_gateway.logs(key)] == ["responses"]


def test_the_agents_sdk_runs_an_agent_that_calls_a_tool(upstream_gateway):
    gateway = upstream_gateway
    key = gateway.new_key(subscription=10)
    result, reports = run_weather_agent(gateway, key)
    assert reports == [(fake_provider.TOOL_INPUT["location"], fake_provider.TOOL_INPUT["unit"])]
    assert result.final_output == fake_provider.FINAL_TEXT
    assert_the_provider_was_reached_as(gateway, stream=False)
    assert [e["status"] for e in gateway.logs(key)] == ["ok", "ok"]
    assert gateway.balance(key)["total"] == 10 - 2 * CHAT_PRICE


def test_a_stored_response_is_retrieved_and_continued_by_its_account_only(upstream_gateway):
    gateway = upstream_gateway
    owner, other = gateway.new_key(subscription=10), gateway.new_key(subscription=10)
    client = openai_client(gateway, owner)
    made = client.responses.create(model=CHAT_MODEL, input="Weather in Paris?", tools=[WEATHER_TOOL])
    if gateway.responses == "translate":
        # A translating upstream keeps nothing: the SDK's continuation is refused, uncharged.
        assert made.store is False
        with pytest.raises(openai.BadRequestError) as raised:
            client.responses.create(model=CHAT_MODEL, input="And Tokyo?", previous_response_id=made.id)
        assert "previous_response_id" in raised.value.body["detail"]
        assert len(gateway.logs(owner)) == 1
        return
    assert client.responses.retrieve(made.id).id == made.id
    with pytest.raises(openai.NotFoundError) as raised:
        openai_client(gateway, other).responses.retrieve(made.id)
    assert raised.value.body["detail"] == "响应不存在"
    [call] = [item for item in made.output if item.type == "function_call"]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": WEATHER_REPORT}
    continued = client.responses.create(
        model=CHAT_MODEL, input=[result], previous_response_id=made.id, tools=[WEATHER_TOOL]
    )
    assert continued.output_text == fake_provider.FINAL_TEXT
    assert last_request_to("/v1/responses")["previous_response_id"] == made.id
    with pytest.raises(openai.NotFoundError):
        openai_client(gateway, other).responses.create(
            model=CHAT_MODEL, input=[result], previous_response_id=made.id
        )
    assert gateway.logs(other) == []
    assert [e["status"] for e in gateway.logs(owner)] == ["ok", "ok"]
