"""Google's own Python SDK (`google-genai`) on the gateway's Gemini API, changing only base URL and
key: against the mock (`generate_content`, `generate_content_stream`, `count_tokens`, the model
list, refusals in Google's error shape), and against a fake Gemini provider reached natively (a
function call round trip, complete and streamed, the request passed as it came and each call
charged what the provider's `usageMetadata` says).
"""

import json
import urllib.request

import anthropic
import fake_provider
import openai
import pytest
from google import genai
from google.genai import errors, types
from test_sdks import MOCK_TEXT, start_gateway

MOCK_MODEL, MOCK_PRICE = "gemini-3.5-flash-lite", 1
WEATHER = types.FunctionDeclaration(
    name="get_weather",
    description="The current weather at a location",
    parameters=types.Schema(
        type="OBJECT",
        properties={"location": types.Schema(type="STRING"), "unit": types.Schema(type="STRING")},
    ),
)
WEATHER_REPORT = {"report": "18°C, cloudy"}


def client(gateway, key):
    """A client of the gateway (kept in a variable: a client closes once nothing holds it)."""
    return genai.Client(api_key=key, http_options=types.HttpOptions(base_url=gateway.base))


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """The mock, streaming on, refusals also in each protocol's error object."""
    yield from start_gateway(tmp_path_factory, GATEWAY_STREAMING="1", GATEWAY_ERROR_BODY="compatible")


def test_generate_content_gets_the_mock_reply_charged_once(gateway):
    key = gateway.new_key(subscription=10)
    gemini = client(gateway, key)
    reply = gemini.models.generate_content(model=MOCK_MODEL, contents="Hello")
    assert reply.text == MOCK_TEXT
    assert reply.usage_metadata.candidates_token_count == 16
    assert gateway.balance(key)["total"] == 10 - MOCK_PRICE
    [entry] = gateway.logs(key)
    assert (entry["protocol"], entry["model"], entry["status"]) == ("gemini", MOCK_MODEL, "ok")


def test_generate_content_stream_reads_several_chunks_charged_once(gateway):
    key = gateway.new_key(subscription=10)
    gemini = client(gateway, key)
    chunks = list(gemini.models.generate_content_stream(model=MOCK_MODEL, contents="Hello"))
    assert len(chunks) > 1
    assert "".join(chunk.text for chunk in chunks) == MOCK_TEXT
    assert chunks[-1].candidates[0].finish_reason == types.FinishReason.STOP
    assert chunks[-1].usage_metadata.candidates_token_count == 16
    assert gateway.balance(key)["total"] == 10 - MOCK_PRICE
    assert [entry["status"] for entry in gateway.logs(key)] == ["ok"]


def test_a_function_call_round_trip_is_answered_by_the_mock_and_charged_each_turn(gateway):
    key = gateway.new_key(subscription=10)
    gemini = client(gateway, key)
    config = types.GenerateContentConfig(tools=[types.Tool(function_declarations=[WEATHER])])
    call = types.FunctionCall(name="get_weather", args={"location": "Paris"})
    conversation = [
        types.Content(role="user", parts=[types.Part(text="Weather in Paris?")]),
        types.Content(role="model", parts=[types.Part(function_call=call)]),
        types.Content(
            role="user",
            parts=[types.Part(function_response=types.FunctionResponse(name="get_weather", response=WEATHER_REPORT))],
        ),
    ]
    reply = gemini.models.generate_content(model=MOCK_MODEL, contents=conversation, config=config)
    assert reply.text == MOCK_TEXT
    chunks = list(gemini.models.generate_content_stream(model=MOCK_MODEL, contents=conversation, config=config))
    assert "".join(chunk.text for chunk in chunks) == MOCK_TEXT
    assert gateway.balance(key)["total"] == 10 - 2 * MOCK_PRICE


def test_count_tokens_and_the_model_list_are_free(gateway):
    key = gateway.new_key(subscription=10)
    gemini = client(gateway, key)
    counted = gemini.models.count_tokens(model=MOCK_MODEL, contents="Hello there, how are you?")
    assert counted.total_tokens > 0
    names = [model.name for model in gemini.models.list()]
    assert f"models/{MOCK_MODEL}" in names
    # Only the models served on the Gemini API.
    assert "models/gpt-4o-mini" not in names
    assert gemini.models.get(model=MOCK_MODEL).name == f"models/{MOCK_MODEL}"
    assert gateway.balance(key)["total"] == 10
    assert gateway.logs(key) == []


def test_a_key_in_the_query_string_is_served_and_never_logged(gateway):
    """Google's REST examples send `?key=`: served, and the teardown checks no key reached the log."""
    key = gateway.new_key(subscription=10)
    body = json.dumps({"contents": [{"parts": [{"text": "Hello"}]}]}).encode()
    url = f"{gateway.base}/v1beta/models/{MOCK_MODEL}:generateContent?key={key}"
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request) as answer:
        reply = json.load(answer)
    assert reply["candidates"][0]["content"]["parts"][0]["text"] == MOCK_TEXT
    assert gateway.balance(key)["total"] == 10 - MOCK_PRICE
    # The access log names the path, never the query, and the key by its prefix.
    [line] = gateway.access_lines(f"/v1beta/models/{MOCK_MODEL}:generateContent", 200)[-1:]
    assert "?" not in line and key not in line
    assert f'key="{key[:12]}"' in line


def test_refusals_carry_the_gateways_text_in_googles_error_object(gateway):
    key = gateway.new_key()
    broke = client(gateway, key)
    with pytest.raises(errors.ClientError) as refused:
        broke.models.generate_content(model=MOCK_MODEL, contents="Hello")
    assert (refused.value.code, refused.value.status, refused.value.message) == (402, "RESOURCE_EXHAUSTED", "积分不足")
    paid = gateway.new_key(subscription=10)
    # A chat-completions model is not on the Gemini API.
    funded = client(gateway, paid)
    with pytest.raises(errors.ClientError) as missing:
        funded.models.generate_content(model="gpt-4o-mini", contents="Hello")
    assert (missing.value.code, missing.value.message) == (404, "模型不存在")
    stranger = client(gateway, "sk-mg-wrong")
    with pytest.raises(errors.ClientError) as unknown:
        stranger.models.generate_content(model=MOCK_MODEL, contents="Hello")
    assert (unknown.value.code, unknown.value.status) == (401, "UNAUTHENTICATED")
    assert gateway.balance(paid)["total"] == 10


# --- A fake Gemini provider, reached natively -------------------------------------------------

NATIVE_MODEL = "gemini-native"
EVERY_CLIENT_MODEL = "gemini-for-every-client"
TOKEN_MODEL = "gemini-tokens"
# Credits per million tokens: an input token costs 1, a cached one 0.1, an output token 2.
# The fake's usage (50 prompt tokens, 20 of them cached; 10 candidates and 5 thinking tokens)
# costs 30 + 2 + 30 = 62 credits.
TOKEN_CREDITS = 62


@pytest.fixture(scope="module")
def gemini_gateway(tmp_path_factory):
    provider, base = fake_provider.start()
    catalogue = tmp_path_factory.mktemp("catalogue") / "models.toml"
    catalogue.write_text(
        "streaming = true\n"
        f'[[upstreams]]\nname = "google"\nkind = "gemini"\nbase_url = "{base}"\napi_key_env = "FAKE_GEMINI_KEY"\n'
        f'[[models]]\nname = "{NATIVE_MODEL}"\nprotocol = "gemini"\nprice = 2\n'
        'upstreams = [{ name = "google", upstream_model = "gemini-2.5-flash" }]\n'
        f'[[models]]\nname = "{TOKEN_MODEL}"\nprotocol = "gemini"\nupstream = "google"\nmax_output_tokens = 1000\n'
        "[models.tokens]\ninput = 1000000\noutput = 2000000\ncache_read = 100000\n"
        f'[[models]]\nname = "{EVERY_CLIENT_MODEL}"\nprotocol = "gemini"\nprice = 2\nupstream = "google"\n'
        'endpoints = ["gemini", "chat_completions", "responses", "messages"]\n'
    )
    yield from start_gateway(
        tmp_path_factory, MOCK_UPSTREAM="0", GATEWAY_MODELS=str(catalogue), FAKE_GEMINI_KEY="sk-fake-gemini"
    )
    provider.shutdown()


def ask(gemini, contents, stream, model=NATIVE_MODEL):
    config = types.GenerateContentConfig(tools=[types.Tool(function_declarations=[WEATHER])])
    if stream:
        chunks = list(gemini.models.generate_content_stream(model=model, contents=contents, config=config))
        parts = [part for chunk in chunks for part in chunk.candidates[0].content.parts]
        return parts, chunks[-1].usage_metadata
    reply = gemini.models.generate_content(model=model, contents=contents, config=config)
    return reply.candidates[0].content.parts, reply.usage_metadata


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call_round_trip_reaches_the_gemini_provider_as_sent(gemini_gateway, stream):
    key = gemini_gateway.new_key(subscription=10)
    gemini = client(gemini_gateway, key)
    question = [types.Content(role="user", parts=[types.Part(text="Weather in Paris?")])]
    parts, _ = ask(gemini, question, stream)
    [call] = [part.function_call for part in parts if part.function_call]
    assert (call.name, call.args) == ("get_weather", fake_provider.TOOL_INPUT)
    path, sent = fake_provider.seen()[-1]
    verb = "streamGenerateContent?alt=sse" if stream else "generateContent"
    # The channel's name for the model, in the path; the key the provider's own.
    assert path == f"/v1beta/models/gemini-2.5-flash:{verb}"
    assert fake_provider.gemini_keys()[-1] == "sk-fake-gemini"
    assert sent["contents"][0]["parts"] == [{"text": "Weather in Paris?"}]
    assert sent["tools"][0]["functionDeclarations"][0]["name"] == "get_weather"
    answered = question + [
        types.Content(role="model", parts=[types.Part(function_call=call)]),
        types.Content(
            role="user",
            parts=[types.Part(function_response=types.FunctionResponse(name=call.name, response=WEATHER_REPORT))],
        ),
    ]
    parts, _ = ask(gemini, answered, stream)
    assert "".join(part.text for part in parts if part.text) == fake_provider.FINAL_TEXT
    assert gemini_gateway.balance(key)["total"] == 10 - 2 * 2
    assert [entry["status"] for entry in gemini_gateway.logs(key)] == ["ok", "ok"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_token_priced_call_is_charged_what_usage_metadata_says(gemini_gateway, stream):
    key = gemini_gateway.new_key(topup=10_000)
    gemini = client(gemini_gateway, key)
    _, usage = ask(gemini, "Weather in Paris?", stream, model=TOKEN_MODEL)
    assert (usage.prompt_token_count, usage.cached_content_token_count) == (50, 20)
    assert gemini_gateway.balance(key)["total"] == 10_000 - TOKEN_CREDITS
    [entry] = gemini_gateway.logs(key)
    assert entry["price"] == TOKEN_CREDITS
    assert (entry["input_tokens"], entry["cache_read_tokens"], entry["output_tokens"]) == (30, 20, 15)


def test_count_tokens_is_the_providers_count(gemini_gateway):
    key = gemini_gateway.new_key(subscription=10)
    gemini = client(gemini_gateway, key)
    counted = gemini.models.count_tokens(model=NATIVE_MODEL, contents="Hello")
    assert counted.total_tokens == 42
    assert fake_provider.seen()[-1][0] == "/v1beta/models/gemini-2.5-flash:countTokens"
    assert gemini_gateway.balance(key)["total"] == 10


# --- A fake chat-completions provider, reached by translation -----------------------------------

CHAT_MODEL, CHAT_PRICE = "chat-for-gemini", 2


@pytest.fixture(scope="module")
def translating_gateway(tmp_path_factory):
    """The gateway in front of a fake provider that is asked only chat completions."""
    provider, base = fake_provider.start()
    catalogue = tmp_path_factory.mktemp("catalogue") / "models.toml"
    catalogue.write_text(
        "streaming = true\n"
        f'[[upstreams]]\nname = "chat-only"\nkind = "openai"\nbase_url = "{base}/v1"\napi_key_env = "FAKE_PROVIDER_KEY"\n'
        f'[[models]]\nname = "{CHAT_MODEL}"\nprotocol = "chat_completions"\nendpoints = ["chat_completions", "gemini"]\n'
        f'price = {CHAT_PRICE}\nupstream = "chat-only"\n'
    )
    yield from start_gateway(
        tmp_path_factory, MOCK_UPSTREAM="0", GATEWAY_MODELS=str(catalogue), FAKE_PROVIDER_KEY="sk-fake"
    )
    provider.shutdown()


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call_round_trip_on_a_chat_completions_model(translating_gateway, stream):
    key = translating_gateway.new_key(subscription=10)
    gemini = client(translating_gateway, key)
    question = [types.Content(role="user", parts=[types.Part(text="Weather in Paris?")])]
    parts, _ = ask(gemini, question, stream, model=CHAT_MODEL)
    [call] = [part.function_call for part in parts if part.function_call]
    assert (call.name, call.args) == ("get_weather", fake_provider.TOOL_INPUT)
    path, sent = fake_provider.seen()[-1]
    assert path == "/v1/chat/completions"
    assert sent["model"] == CHAT_MODEL
    assert sent["messages"] == [{"role": "user", "content": "Weather in Paris?"}]
    assert sent["tools"][0]["function"]["name"] == "get_weather"
    assert sent["tools"][0]["function"]["parameters"]["type"] == "object"
    answered = question + [
        types.Content(role="model", parts=[types.Part(function_call=call)]),
        types.Content(
            role="user",
            parts=[types.Part(function_response=types.FunctionResponse(id=call.id, name=call.name, response=WEATHER_REPORT))],
        ),
    ]
    parts, usage = ask(gemini, answered, stream, model=CHAT_MODEL)
    assert "".join(part.text for part in parts if part.text) == fake_provider.FINAL_TEXT
    assert usage.prompt_token_count == 80
    _, sent = fake_provider.seen()[-1]
    tool_message = sent["messages"][-1]
    assert tool_message["role"] == "tool"
    assert tool_message["tool_call_id"] == sent["messages"][-2]["tool_calls"][0]["id"]
    assert json.loads(tool_message["content"]) == WEATHER_REPORT
    assert translating_gateway.balance(key)["total"] == 10 - 2 * CHAT_PRICE
    entries = translating_gateway.logs(key)
    assert [(entry["status"], entry["protocol"]) for entry in entries] == [("ok", "gemini")] * 2


def test_count_tokens_on_a_chat_completions_model_is_counted_by_the_gateway(translating_gateway):
    key = translating_gateway.new_key(subscription=10)
    gemini = client(translating_gateway, key)
    counted = gemini.models.count_tokens(model=CHAT_MODEL, contents="Hello there, how are you today?")
    assert 0 < counted.total_tokens < 50
    assert translating_gateway.balance(key)["total"] == 10


def test_a_google_builtin_tool_is_dropped_and_named(translating_gateway):
    key = translating_gateway.new_key(subscription=10)
    gemini = client(translating_gateway, key)
    config = types.GenerateContentConfig(tools=[types.Tool(google_search=types.GoogleSearch())])
    reply = gemini.models.generate_content(model=CHAT_MODEL, contents="Weather in Paris?", config=config)
    assert reply.sdk_http_response.headers["x-gateway-dropped-tools"] == "googleSearch"
    _, sent = fake_provider.seen()[-1]
    assert "tools" not in sent


# --- The OpenAI and Anthropic SDKs on a Gemini model, translated --------------------------------

OPENAI_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather at a location",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}, "unit": {"type": "string"}}},
    },
}
ANTHROPIC_WEATHER = {
    "name": "get_weather",
    "description": "The current weather at a location",
    "input_schema": OPENAI_WEATHER["function"]["parameters"],
}


def last_gemini_request():
    path, body = fake_provider.seen()[-1]
    assert path.startswith(f"/v1beta/models/{EVERY_CLIENT_MODEL}:"), path
    return path, body


@pytest.mark.parametrize("stream", [False, True])
def test_openai_sdk_runs_a_tool_round_trip_on_a_gemini_model(gemini_gateway, stream):
    key = gemini_gateway.new_key(subscription=10)
    chat = openai.OpenAI(base_url=f"{gemini_gateway.base}/v1", api_key=key, max_retries=0)

    def ask(messages):
        if not stream:
            return chat.chat.completions.create(model=EVERY_CLIENT_MODEL, messages=messages, tools=[OPENAI_WEATHER]).choices[0]
        with chat.chat.completions.stream(model=EVERY_CLIENT_MODEL, messages=messages, tools=[OPENAI_WEATHER]) as events:
            return events.get_final_completion().choices[0]

    question = [{"role": "user", "content": "Weather in Paris?"}]
    first = ask(question)
    assert first.finish_reason == "tool_calls"
    [call] = first.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", fake_provider.TOOL_INPUT)
    path, sent = last_gemini_request()
    assert path.endswith(":streamGenerateContent?alt=sse" if stream else ":generateContent")
    assert sent["contents"] == [{"role": "user", "parts": [{"text": "Weather in Paris?"}]}]
    assert sent["tools"][0]["functionDeclarations"][0]["parametersJsonSchema"] == OPENAI_WEATHER["function"]["parameters"]
    answered = question + [
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps(WEATHER_REPORT)},
    ]
    second = ask(answered)
    assert second.message.content == fake_provider.FINAL_TEXT
    _, sent = last_gemini_request()
    assert sent["contents"][-1] == {
        "role": "user",
        "parts": [{"functionResponse": {"name": "get_weather", "response": WEATHER_REPORT}}],
    }
    assert gemini_gateway.balance(key)["total"] == 10 - 2 * 2
    entries = gemini_gateway.logs(key)
    assert [(e["status"], e["protocol"]) for e in entries] == [("ok", "chat_completions")] * 2


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_sdk_runs_a_tool_round_trip_on_a_gemini_model(gemini_gateway, stream):
    key = gemini_gateway.new_key(subscription=10)
    claude = anthropic.Anthropic(base_url=gemini_gateway.base, api_key=key, max_retries=0)

    def ask(messages):
        arguments = {"model": EVERY_CLIENT_MODEL, "max_tokens": 256, "messages": messages, "tools": [ANTHROPIC_WEATHER]}
        if not stream:
            return claude.messages.create(**arguments)
        with claude.messages.stream(**arguments) as events:
            return events.get_final_message()

    question = [{"role": "user", "content": "Weather in Paris?"}]
    first = ask(question)
    assert first.stop_reason == "tool_use"
    [tool_use] = [block for block in first.content if block.type == "tool_use"]
    assert (tool_use.name, tool_use.input) == ("get_weather", fake_provider.TOOL_INPUT)
    _, sent = last_gemini_request()
    assert sent["generationConfig"]["maxOutputTokens"] == 256
    answered = question + [
        {"role": "assistant", "content": [tool_use.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "18°C, cloudy"}]},
    ]
    second = ask(answered)
    assert second.content[0].text == fake_provider.FINAL_TEXT
    assert second.usage.input_tokens == 30 and second.usage.cache_read_input_tokens == 20
    assert gemini_gateway.balance(key)["total"] == 10 - 2 * 2
    entries = gemini_gateway.logs(key)
    assert [(e["status"], e["protocol"]) for e in entries] == [("ok", "messages")] * 2


@pytest.mark.parametrize("stream", [False, True])
def test_openai_responses_reach_a_gemini_model(gemini_gateway, stream):
    key = gemini_gateway.new_key(subscription=10)
    client_ = openai.OpenAI(base_url=f"{gemini_gateway.base}/v1", api_key=key, max_retries=0)
    tool = {"type": "function", "name": "get_weather", "parameters": OPENAI_WEATHER["function"]["parameters"]}
    if stream:
        with client_.responses.stream(model=EVERY_CLIENT_MODEL, input="Weather in Paris?", tools=[tool]) as events:
            response = events.get_final_response()
    else:
        response = client_.responses.create(model=EVERY_CLIENT_MODEL, input="Weather in Paris?", tools=[tool])
    [call] = [item for item in response.output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", fake_provider.TOOL_INPUT)
    assert gemini_gateway.balance(key)["total"] == 10 - 2
    [entry] = gemini_gateway.logs(key)
    assert (entry["status"], entry["protocol"]) == ("ok", "responses")
