"""The official SDKs on Claude and Gemini where a cloud platform hosts them: the example gateway in
front of fakes of Amazon Bedrock and Google Vertex AI (`fake_cloud`: signatures recomputed with
botocore's signer, tokens issued for a JWT that verifies), with a tool round trip each way,
plain and streamed, on the Anthropic SDK and, through translation, the OpenAI SDK; and no
credential in the gateway's log.
"""

import json

import anthropic
import fake_cloud
import fake_provider
import pytest
from google import genai
from google.genai import types as genai_types
from test_sdks import anthropic_client, openai_client, start_gateway
from test_translation import OPENAI_WEATHER_TOOL, WEATHER_REPORT, WEATHER_TOOL, answer, question

PRICE = 3
MODELS = {"bedrock": "claude-on-bedrock", "vertex": "claude-on-vertex"}
GEMINI = "gemini-on-vertex"


@pytest.fixture(scope="module")
def cloud_gateway(tmp_path_factory):
    """The gateway with a Bedrock upstream, a Vertex upstream for each publisher, and a model on
    each, its AWS credentials and service account as an operator gives them."""
    _, base = fake_cloud.start()
    directory = tmp_path_factory.mktemp("cloud")
    key_file = fake_cloud.key_file(directory, base)
    catalogue = directory / "models.toml"
    endpoints = 'endpoints = ["messages", "chat_completions", "responses"]\n'
    catalogue.write_text(
        "streaming = true\n"
        f'[[upstreams]]\nname = "bedrock"\nkind = "bedrock"\nregion = "{fake_cloud.REGION}"\nbase_url = "{base}"\n'
        f'[[upstreams]]\nname = "vertex-claude"\nkind = "vertex"\npublisher = "anthropic"\n'
        f'project = "{fake_cloud.VERTEX_PROJECT}"\nregion = "{fake_cloud.VERTEX_REGION}"\nbase_url = "{base}"\n'
        f'[[upstreams]]\nname = "vertex-gemini"\nkind = "vertex"\npublisher = "google"\n'
        f'project = "{fake_cloud.VERTEX_PROJECT}"\nregion = "{fake_cloud.VERTEX_REGION}"\nbase_url = "{base}"\n'
        f'[[models]]\nname = "{MODELS["bedrock"]}"\nprotocol = "messages"\n{endpoints}price = {PRICE}\n'
        'max_output_tokens = 1024\n'
        'upstreams = [{ name = "bedrock", upstream_model = "anthropic.claude-sonnet-4-5-20250929-v1:0" }]\n'
        f'[[models]]\nname = "{MODELS["vertex"]}"\nprotocol = "messages"\n{endpoints}price = {PRICE}\n'
        'max_output_tokens = 1024\n'
        'upstreams = [{ name = "vertex-claude", upstream_model = "claude-sonnet-4-5@20250929" }]\n'
        f'[[models]]\nname = "{GEMINI}"\nprotocol = "gemini"\nprice = {PRICE}\n'
        'upstreams = [{ name = "vertex-gemini", upstream_model = "gemini-2.5-flash" }]\n'
    )
    yield from start_gateway(
        tmp_path_factory, MOCK_UPSTREAM="0", GATEWAY_MODELS=str(catalogue),
        AWS_ACCESS_KEY_ID=fake_cloud.AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY=fake_cloud.AWS_SECRET_ACCESS_KEY,
        AWS_SESSION_TOKEN=fake_cloud.AWS_SESSION_TOKEN, GOOGLE_APPLICATION_CREDENTIALS=str(key_file),
    )


def last_call(platform):
    path, body = fake_cloud.calls()[-1]
    assert path.startswith("/model/" if platform == "bedrock" else "/v1/projects/"), path
    return path, body


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
@pytest.mark.parametrize("platform", ["bedrock", "vertex"])
def test_anthropic_sdk_runs_a_tool_round_trip_on_claude_hosted_by(cloud_gateway, platform, stream):
    key = cloud_gateway.new_key(subscription=10)
    client = anthropic_client(cloud_gateway, key)
    model = MODELS[platform]

    def ask(messages):
        arguments = dict(model=model, max_tokens=256, tools=[WEATHER_TOOL], messages=messages)
        if not stream:
            return client.messages.create(**arguments)
        with client.messages.stream(**arguments) as events:
            return events.get_final_message()

    first = ask(question())
    [tool_use] = first.content
    assert (tool_use.type, tool_use.name, tool_use.input) == ("tool_use", "get_weather", fake_provider.TOOL_INPUT)
    assert first.stop_reason == "tool_use"
    path, sent = last_call(platform)
    verbs = {("bedrock", False): "/invoke", ("bedrock", True): "/invoke-with-response-stream",
             ("vertex", False): ":rawPredict", ("vertex", True): ":streamRawPredict"}
    assert path.endswith(verbs[(platform, stream)]), path
    assert sent["tools"] == [WEATHER_TOOL]

    second = ask(answer(tool_use))
    assert second.content[0].text == fake_provider.FINAL_TEXT
    assert (second.usage.input_tokens, second.usage.output_tokens) == (80, 10)
    _, sent = last_call(platform)
    assert sent["messages"][-1]["content"][0]["tool_use_id"] == tool_use.id
    entries = cloud_gateway.logs(key)
    assert [(e["protocol"], e["status"]) for e in entries] == [("messages", "ok")] * 2
    assert sorted(e["output_tokens"] for e in entries) == [10, 20]
    assert cloud_gateway.balance(key)["total"] == 10 - 2 * PRICE


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
@pytest.mark.parametrize("platform", ["bedrock", "vertex"])
def test_openai_sdk_runs_a_tool_round_trip_on_claude_hosted_by(cloud_gateway, platform, stream):
    key = cloud_gateway.new_key(subscription=10)
    client = openai_client(cloud_gateway, key)
    model = MODELS[platform]
    asked = [{"role": "user", "content": "Weather in Paris?"}]

    def ask(messages):
        arguments = dict(model=model, messages=messages, tools=[OPENAI_WEATHER_TOOL])
        if not stream:
            return client.chat.completions.create(**arguments).choices[0]
        with client.chat.completions.stream(**arguments) as events:
            return events.get_final_completion().choices[0]

    first = ask(asked)
    assert first.finish_reason == "tool_calls"
    [call] = first.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", fake_provider.TOOL_INPUT)
    _, sent = last_call(platform)
    assert sent["tools"][0]["input_schema"] == OPENAI_WEATHER_TOOL["function"]["parameters"]

    answered = asked + [first.message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id, "content": WEATHER_REPORT}]
    second = ask(answered)
    assert second.message.content == fake_provider.FINAL_TEXT
    entries = cloud_gateway.logs(key)
    assert [(e["protocol"], e["status"]) for e in entries] == [("chat_completions", "ok")] * 2
    assert cloud_gateway.balance(key)["total"] == 10 - 2 * PRICE


@pytest.mark.parametrize("stream", [False, True], ids=["generate", "stream"])
def test_google_genai_sdk_reaches_gemini_on_vertex(cloud_gateway, stream):
    key = cloud_gateway.new_key(subscription=10)
    client = genai.Client(api_key=key, http_options=genai_types.HttpOptions(base_url=cloud_gateway.base))
    if stream:
        chunks = list(client.models.generate_content_stream(model=GEMINI, contents="Hello"))
        parts = [part for chunk in chunks for part in chunk.candidates[0].content.parts]
        assert [part.function_call.name for part in parts] == ["get_weather"]
        assert fake_cloud.calls()[-1][0].endswith(":streamGenerateContent?alt=sse")
    reply = client.models.generate_content(model=GEMINI, contents="Hello")
    [part] = reply.candidates[0].content.parts
    assert part.function_call.name == "get_weather"
    path, _ = fake_cloud.calls()[-1]
    assert path.endswith("/publishers/google/models/gemini-2.5-flash:generateContent"), path
    assert cloud_gateway.balance(key)["total"] == 10 - (2 if stream else 1) * PRICE


def test_no_credential_reaches_the_gateways_log(cloud_gateway):
    # Every platform called at least once by the tests before; make sure of it here too.
    key = cloud_gateway.new_key(subscription=10)
    for model in MODELS.values():
        anthropic_client(cloud_gateway, key).messages.create(model=model, max_tokens=16, messages=question())
    assert fake_cloud.refused() == []
    tokens = fake_cloud.tokens()
    publishers = {path.split("/publishers/")[1].split("/")[0] for path, _ in fake_cloud.calls() if "/publishers/" in path}
    vertex_calls = sum("/publishers/" in path for path, _ in fake_cloud.calls())
    # A token per Vertex upstream (one per publisher here), fetched once and shared by its calls.
    assert len(tokens) == len(publishers) < vertex_calls, (tokens, vertex_calls)
    log = cloud_gateway.log()
    secrets = [fake_cloud.AWS_SECRET_ACCESS_KEY, fake_cloud.AWS_SESSION_TOKEN, *tokens]
    secrets += [line for line in fake_cloud.VERTEX_PRIVATE_KEY.splitlines() if not line.startswith("-----")]
    for secret in secrets:
        assert secret not in log
    with pytest.raises(anthropic.NotFoundError):
        anthropic_client(cloud_gateway, key).messages.create(model=GEMINI, max_tokens=16, messages=question())
