"""The official Python SDKs call the example gateway in mock mode, changing only base URL and key;
and, through a proxy that loses the first answer, retry with an Idempotency-Key uncharged.

The gateway binary is built by .ci/run (`cargo build --example gateway`); GATEWAY_BIN overrides
its path. Each test module run starts one gateway on a free port with a temporary SQLite file.
"""

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import anthropic
import fake_provider
import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
GATEWAY_BIN = os.environ.get("GATEWAY_BIN", str(ROOT / "target" / "debug" / "examples" / "gateway"))
MOCK_TEXT = "This is a demo reply from model-gateway's mock upstream; no model was called."
CHAT_MODEL, CHAT_PRICE = "gpt-4o-mini", 2
MESSAGES_MODEL, MESSAGES_PRICE = "claude-haiku-4-5", 3


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_gateway(tmp_path_factory, **settings):
    """Starts the example gateway with these extra environment variables; yields its handle and
    checks, once done, that it shut down cleanly, logged no key and that the audit passes."""
    db = tmp_path_factory.mktemp("gateway") / "gateway.db"
    log_path = db.parent / "gateway.log"
    env = {**os.environ, "DATABASE_URL": f"sqlite://{db}?mode=rwc", "MOCK_UPSTREAM": "1", **settings}
    env["GATEWAY_LISTEN"] = f"127.0.0.1:{free_port()}"

    def command(*args):
        done = subprocess.run([GATEWAY_BIN, *args], env=env, capture_output=True, text=True, check=True)
        return done.stdout

    log_file = open(log_path, "w")
    server = subprocess.Popen([GATEWAY_BIN, "serve"], env=env, stdout=subprocess.PIPE, stderr=log_file)
    host, port = env["GATEWAY_LISTEN"].split(":")
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start: {log_path.read_text()}")
            time.sleep(0.1)

    keys = []

    class Gateway:
        base = f"http://{env['GATEWAY_LISTEN']}"

        @staticmethod
        def new_key(subscription=0, topup=0):
            out = command("keys", "create", "--subscription", str(subscription), "--topup", str(topup))
            key = out.strip().splitlines()[-1]
            keys.append(key)
            return key

        @staticmethod
        def balance(key):
            return json.loads(command("balance", "--key", key))

        @staticmethod
        def logs(key):
            return json.loads(command("logs", "--key", key))

        @staticmethod
        def log():
            """What the server has logged so far."""
            return log_path.read_text()

        @staticmethod
        def access_lines(path, status):
            """The server's access-log lines so far for requests to `path` answered `status`."""
            return [
                line
                for line in log_path.read_text().splitlines()
                if "model_gateway::access" in line and f' path="{path}" status={status} ' in line
            ]

    yield Gateway
    # Ctrl-C shuts the server down gracefully: a clean exit that said where it listened.
    server.send_signal(signal.SIGINT)
    assert server.wait(timeout=10) == 0
    log_file.close()
    log = log_path.read_text()
    assert f"listening on http://{env['GATEWAY_LISTEN']}" in log
    assert "shut down" in log
    # No key, valid or not, ever reaches the server's log.
    for key in keys + ["sk-mg-wrong"]:
        assert key not in log
    audited = subprocess.run([GATEWAY_BIN, "audit"], env=env, capture_output=True, text=True)
    assert audited.returncode == 0, audited.stdout + audited.stderr
    assert "audit passed" in audited.stdout


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    yield from start_gateway(tmp_path_factory)


@pytest.fixture(scope="module")
def compatible_gateway(tmp_path_factory):
    """Refusals also in each protocol's own error object (GATEWAY_ERROR_BODY=compatible)."""
    yield from start_gateway(tmp_path_factory, GATEWAY_ERROR_BODY="compatible")


def detail(error):
    """The gateway's `detail`, as the SDK error exposes the parsed body."""
    body = error.body
    return body.get("detail") if isinstance(body, dict) else str(body)


def openai_client(gateway, key):
    return openai.OpenAI(base_url=f"{gateway.base}/v1", api_key=key, max_retries=0)


def anthropic_client(gateway, key):
    return anthropic.Anthropic(base_url=gateway.base, api_key=key, max_retries=0)


def test_openai_sdk_gets_a_chat_completion(gateway):
    key = gateway.new_key(subscription=10)
    reply = openai_client(gateway, key).chat.completions.create(
        model=CHAT_MODEL, messages=[{"role": "user", "content": "Hello"}]
    )
    assert reply.choices[0].message.content == MOCK_TEXT
    assert reply.choices[0].finish_reason == "stop"
    assert reply.model == CHAT_MODEL
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert gateway.balance(key) == {
        "subscription": 10 - CHAT_PRICE,
        "topup": 0,
        "total": 10 - CHAT_PRICE,
        "subscription_ends_at": None,
    }


def test_anthropic_sdk_gets_a_message(gateway):
    key = gateway.new_key(topup=10)
    reply = anthropic_client(gateway, key).messages.create(
        model=MESSAGES_MODEL, max_tokens=64, messages=[{"role": "user", "content": "Hello"}]
    )
    assert reply.content[0].type == "text"
    assert reply.content[0].text == MOCK_TEXT
    assert reply.stop_reason == "end_turn"
    assert reply.usage.output_tokens > 0
    assert gateway.balance(key)["total"] == 10 - MESSAGES_PRICE
    assert [entry["status"] for entry in gateway.logs(key)] == ["ok"]


def test_one_key_serves_both_sdks_from_one_pool(gateway):
    key = gateway.new_key(subscription=CHAT_PRICE, topup=MESSAGES_PRICE)
    openai_client(gateway, key).chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": "a"}])
    anthropic_client(gateway, key).messages.create(
        model=MESSAGES_MODEL, max_tokens=8, messages=[{"role": "user", "content": "b"}]
    )
    assert gateway.balance(key)["total"] == 0
    assert sorted(entry["protocol"] for entry in gateway.logs(key)) == ["chat_completions", "messages"]


def test_sdks_see_401_as_authentication_errors(gateway):
    with pytest.raises(openai.AuthenticationError) as raised:
        openai_client(gateway, "sk-mg-wrong").chat.completions.create(
            model=CHAT_MODEL, messages=[{"role": "user", "content": "x"}]
        )
    assert detail(raised.value) == "无效的 API Key"
    with pytest.raises(anthropic.AuthenticationError) as raised:
        anthropic_client(gateway, "sk-mg-wrong").messages.create(
            model=MESSAGES_MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}]
        )
    assert detail(raised.value) == "无效的 API Key"


def test_sdks_see_402_with_its_detail_and_nothing_is_charged(gateway):
    key = gateway.new_key(subscription=1)
    with pytest.raises(openai.APIStatusError) as raised:
        openai_client(gateway, key).chat.completions.create(
            model=CHAT_MODEL, messages=[{"role": "user", "content": "x"}]
        )
    assert raised.value.status_code == 402
    assert detail(raised.value) == "积分不足"
    with pytest.raises(anthropic.APIStatusError) as raised:
        anthropic_client(gateway, key).messages.create(
            model=MESSAGES_MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}]
        )
    assert raised.value.status_code == 402
    assert detail(raised.value) == "积分不足"
    assert gateway.balance(key)["total"] == 1
    assert gateway.logs(key) == []


def test_sdks_see_404_for_unknown_and_cross_protocol_models(gateway):
    key = gateway.new_key(subscription=100)
    for model in ["no-such-model", MESSAGES_MODEL]:
        with pytest.raises(openai.NotFoundError) as raised:
            openai_client(gateway, key).chat.completions.create(
                model=model, messages=[{"role": "user", "content": "x"}]
            )
        assert detail(raised.value) == "模型不存在"
    for model in ["no-such-model", CHAT_MODEL]:
        with pytest.raises(anthropic.NotFoundError) as raised:
            anthropic_client(gateway, key).messages.create(
                model=model, max_tokens=8, messages=[{"role": "user", "content": "x"}]
            )
        assert detail(raised.value) == "模型不存在"
    assert gateway.balance(key)["total"] == 100


def test_openai_sdk_errors_read_the_message_only_with_compatible_bodies(gateway, compatible_gateway):
    # Off (the specified body): the SDK finds no `error` object; `.body` is the whole answer.
    key = gateway.new_key(subscription=1)
    with pytest.raises(openai.APIStatusError) as off:
        openai_client(gateway, key).chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": "x"}])
    assert off.value.body == {"detail": "积分不足"}
    assert (off.value.code, off.value.type) == (None, None)
    # On: the SDK reads `error`: its message, type and code.
    key = compatible_gateway.new_key(subscription=1)
    with pytest.raises(openai.APIStatusError) as on:
        openai_client(compatible_gateway, key).chat.completions.create(
            model=CHAT_MODEL, messages=[{"role": "user", "content": "x"}]
        )
    assert on.value.status_code == 402
    assert on.value.body["message"] == "积分不足"
    assert (on.value.code, on.value.type) == ("insufficient_quota", "insufficient_quota")
    assert "积分不足" in str(on.value)
    with pytest.raises(openai.NotFoundError) as missing:
        openai_client(compatible_gateway, key).chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )
    assert (missing.value.body["message"], missing.value.code, missing.value.param) == (
        "模型不存在",
        "model_not_found",
        "model",
    )
    assert compatible_gateway.logs(key) == []


def test_anthropic_sdk_errors_keep_the_detail_and_gain_anthropics_error_type(gateway, compatible_gateway):
    key = compatible_gateway.new_key(subscription=1)
    with pytest.raises(anthropic.APIStatusError) as on:
        anthropic_client(compatible_gateway, key).messages.create(
            model=MESSAGES_MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}]
        )
    assert on.value.body["detail"] == "积分不足"
    assert on.value.body["error"] == {"type": "billing_error", "message": "积分不足"}
    key = gateway.new_key(subscription=1)
    with pytest.raises(anthropic.APIStatusError) as off:
        anthropic_client(gateway, key).messages.create(
            model=MESSAGES_MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}]
        )
    assert off.value.body == {"detail": "积分不足"}


def test_anthropic_sdk_errors_carry_the_request_id(gateway):
    with pytest.raises(anthropic.AuthenticationError) as raised:
        anthropic_client(gateway, "sk-mg-wrong").messages.create(
            model=MESSAGES_MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}]
        )
    request_id = raised.value.request_id
    assert request_id is not None and request_id.startswith("req_")
    # The operator finds that request in the access log by the id the client has.
    [line] = [line for line in gateway.access_lines("/v1/messages", 401) if f'request_id="{request_id}"' in line]
    assert 'error="invalid_api_key"' in line


def test_sdks_with_their_default_retries_ask_once_for_what_a_retry_cannot_change(gateway):
    poor = gateway.new_key(subscription=1)
    calls = [
        (lambda: openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="sk-mg-wrong").chat.completions.create(
            model=CHAT_MODEL, messages=[{"role": "user", "content": "x"}]), "/v1/chat/completions", 401),
        (lambda: openai.OpenAI(base_url=f"{gateway.base}/v1", api_key=poor).chat.completions.create(
            model=CHAT_MODEL, messages=[{"role": "user", "content": "x"}]), "/v1/chat/completions", 402),
        (lambda: anthropic.Anthropic(base_url=gateway.base, api_key="sk-mg-wrong").messages.create(
            model=MESSAGES_MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}]), "/v1/messages", 401),
        (lambda: anthropic.Anthropic(base_url=gateway.base, api_key=poor).messages.create(
            model=MESSAGES_MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}]), "/v1/messages", 402),
    ]
    for call, path, status in calls:
        before = len(gateway.access_lines(path, status))
        with pytest.raises((openai.APIStatusError, anthropic.APIStatusError)) as raised:
            call()
        assert raised.value.status_code == status
        assert raised.value.response.headers["x-should-retry"] == "false"
        assert len(gateway.access_lines(path, status)) - before == 1, f"{path} {status}: asked more than once"


def test_both_sdks_call_a_model_by_its_alias(gateway):
    key = gateway.new_key(subscription=10)
    reply = anthropic_client(gateway, key).messages.create(
        model="claude-haiku-4-5-20251001", max_tokens=8, messages=[{"role": "user", "content": "x"}]
    )
    assert reply.content[0].text == MOCK_TEXT
    [entry] = gateway.logs(key)
    assert (entry["model"], entry["requested_model"], entry["price"]) == (
        MESSAGES_MODEL,
        "claude-haiku-4-5-20251001",
        MESSAGES_PRICE,
    )
    retrieved = openai_client(gateway, key).models.retrieve("claude-haiku-4-5-20251001")
    assert retrieved.id == MESSAGES_MODEL
    assert retrieved.model_extra["aliases"] == ["claude-haiku-4-5-20251001"]


def test_openai_sdk_creates_embeddings_charged_per_call(gateway):
    key = gateway.new_key(subscription=10)
    client = openai_client(gateway, key)
    # The SDK asks for base64 and decodes it into floats.
    created = client.embeddings.create(model="text-embedding-3-small", input=["a cat", "a dog", "a cat"])
    assert [item.index for item in created.data] == [0, 1, 2]
    vectors = [item.embedding for item in created.data]
    assert all(len(vector) == 1536 for vector in vectors)
    assert abs(sum(x * x for x in vectors[0]) - 1.0) < 1e-4
    assert vectors[0] == vectors[2] and vectors[0] != vectors[1]
    floats = client.embeddings.create(model="text-embedding-3-small", input="a cat", encoding_format="float", dimensions=8)
    assert len(floats.data[0].embedding) == 8
    assert created.usage.prompt_tokens > 0
    assert gateway.balance(key)["total"] == 8
    assert [entry["protocol"] for entry in gateway.logs(key)] == ["embeddings", "embeddings"]
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model=CHAT_MODEL, input="x")


# --- Streaming (GATEWAY_STREAMING=1) -------------------------------------------------------


@pytest.fixture(scope="module")
def streaming_gateway(tmp_path_factory):
    yield from start_gateway(tmp_path_factory, GATEWAY_STREAMING="1")


@pytest.fixture(scope="module")
def provider_gateway(tmp_path_factory):
    """The gateway in front of a fake provider that streams tool use, streaming on."""
    provider, base = fake_provider.start()
    catalogue = tmp_path_factory.mktemp("catalogue") / "models.toml"
    catalogue.write_text(
        "streaming = true\n"
        f'[[upstreams]]\nname = "fake-openai"\nkind = "openai"\nbase_url = "{base}/v1"\napi_key_env = "FAKE_PROVIDER_KEY"\n'
        f'[[upstreams]]\nname = "fake-anthropic"\nkind = "anthropic"\nbase_url = "{base}"\napi_key_env = "FAKE_PROVIDER_KEY"\n'
        f'[[models]]\nname = "{CHAT_MODEL}"\nprotocol = "chat_completions"\nprice = {CHAT_PRICE}\nupstream = "fake-openai"\n'
        f'[[models]]\nname = "{MESSAGES_MODEL}"\nprotocol = "messages"\nprice = {MESSAGES_PRICE}\nupstream = "fake-anthropic"\n'
    )
    yield from start_gateway(
        tmp_path_factory, MOCK_UPSTREAM="0", GATEWAY_MODELS=str(catalogue), FAKE_PROVIDER_KEY="sk-fake"
    )
    provider.shutdown()


WEATHER_TOOL_OPENAI = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"location": {"type": "string"}}}},
}
WEATHER_TOOL_ANTHROPIC = {
    "name": "get_weather",
    "input_schema": {"type": "object", "properties": {"location": {"type": "string"}}},
}


def test_openai_sdk_streams_a_chat_completion_to_the_end(streaming_gateway):
    key = streaming_gateway.new_key(subscription=10)
    chunks = list(
        openai_client(streaming_gateway, key).chat.completions.create(
            model=CHAT_MODEL,
            messages=[{"role": "user", "content": "Hello"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == MOCK_TEXT
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
    assert chunks[-1].usage.completion_tokens == 16
    assert streaming_gateway.balance(key)["total"] == 10 - CHAT_PRICE
    [entry] = streaming_gateway.logs(key)
    assert (entry["status"], entry["output_tokens"]) == ("ok", 16)


def test_anthropic_sdk_streams_a_message_and_gets_the_final_message(streaming_gateway):
    key = streaming_gateway.new_key(topup=10)
    client = anthropic_client(streaming_gateway, key)
    with client.messages.stream(
        model=MESSAGES_MODEL, max_tokens=64, messages=[{"role": "user", "content": "Hello"}]
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == MOCK_TEXT
    assert len(pieces) > 1
    assert final.content[0].text == MOCK_TEXT
    assert final.stop_reason == "end_turn"
    assert final.usage.input_tokens > 0 and final.usage.output_tokens == 16
    assert streaming_gateway.balance(key)["total"] == 10 - MESSAGES_PRICE
    assert [(e["status"], e["input_tokens"]) for e in streaming_gateway.logs(key)] == [
        ("ok", final.usage.input_tokens)
    ]


def test_a_streamed_call_refused_before_it_starts_raises_the_sdks_error(streaming_gateway):
    key = streaming_gateway.new_key(subscription=1)
    with pytest.raises(openai.APIStatusError) as raised:
        openai_client(streaming_gateway, key).chat.completions.create(
            model=CHAT_MODEL, messages=[{"role": "user", "content": "x"}], stream=True
        )
    assert raised.value.status_code == 402
    assert detail(raised.value) == "积分不足"
    with pytest.raises(anthropic.APIStatusError) as raised:
        with anthropic_client(streaming_gateway, key).messages.stream(
            model=MESSAGES_MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}]
        ) as stream:
            stream.get_final_message()
    assert raised.value.status_code == 402
    assert streaming_gateway.logs(key) == []


def test_streamed_tool_use_arrives_intact_through_both_sdks(provider_gateway):
    key = provider_gateway.new_key(subscription=100)
    chunks = list(
        openai_client(provider_gateway, key).chat.completions.create(
            model=CHAT_MODEL,
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[WEATHER_TOOL_OPENAI],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert calls[0][0].function.name == "get_weather"
    arguments = "".join(call[0].function.arguments or "" for call in calls)
    assert json.loads(arguments) == fake_provider.TOOL_INPUT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

    client = anthropic_client(provider_gateway, key)
    with client.messages.stream(
        model=MESSAGES_MODEL,
        max_tokens=256,
        tools=[WEATHER_TOOL_ANTHROPIC],
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    ) as stream:
        final = stream.get_final_message()
    [tool_use] = final.content
    assert (tool_use.type, tool_use.name) == ("tool_use", "get_weather")
    assert tool_use.input == fake_provider.TOOL_INPUT
    assert final.stop_reason == "tool_use"

    entries = provider_gateway.logs(key)
    assert [e["status"] for e in entries] == ["ok", "ok"]
    assert [e["output_tokens"] for e in entries] == [20, 20]
    assert provider_gateway.balance(key)["total"] == 100 - CHAT_PRICE - MESSAGES_PRICE


# --- What key holders can ask (models, count_tokens) ---------------------------------------


def test_both_sdks_list_and_retrieve_models(gateway):
    key = gateway.new_key(subscription=10)
    models = openai_client(gateway, key).models.list()
    ids = sorted(model.id for model in models)
    assert CHAT_MODEL in ids and MESSAGES_MODEL in ids
    model = openai_client(gateway, key).models.retrieve(CHAT_MODEL)
    assert (model.id, model.object) == (CHAT_MODEL, "model")
    assert model.model_extra["price"] == CHAT_PRICE

    client = anthropic_client(gateway, key)
    # Auto-pagination one model per page walks every model, in order, once.
    walked = [model.id for model in client.models.list(limit=1)]
    assert walked == ids
    first_page = client.models.list(limit=1)
    assert len(first_page.data) == 1 and first_page.has_more
    retrieved = client.models.retrieve(MESSAGES_MODEL)
    assert (retrieved.id, retrieved.type) == (MESSAGES_MODEL, "model")
    with pytest.raises(anthropic.NotFoundError):
        client.models.retrieve("no-such-model")
    assert gateway.logs(key) == []
    assert gateway.balance(key)["total"] == 10


def test_the_anthropic_sdk_counts_tokens_for_free(gateway):
    key = gateway.new_key(subscription=10)
    counted = anthropic_client(gateway, key).messages.count_tokens(
        model=MESSAGES_MODEL, messages=[{"role": "user", "content": "Hello, how are you?"}]
    )
    assert counted.input_tokens > 0
    assert gateway.logs(key) == []
    assert gateway.balance(key)["total"] == 10


class DroppingProxy:
    """An HTTP proxy in front of the gateway that loses the first answer to each idempotency key
    (or, for a request without one, to each value of the test's `x-drop-once` header): it
    forwards the request, reads the gateway's whole answer, and closes the client's connection
    without sending it, as a network failure on the way back would. The SDK sees a connection
    error and retries; later requests are passed through."""

    def __init__(self, target):
        import http.client
        import http.server
        import threading

        self.dropped = {}  # idempotency key -> (status, headers, body) the client never got
        self.seen = []  # (idempotency key, path) of every request, in order
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                idem = self.headers.get("idempotency-key")
                proxy.seen.append((idem, self.path))
                host, port = target.removeprefix("http://").split(":")
                upstream = http.client.HTTPConnection(host, int(port), timeout=30)
                upstream.request("POST", self.path, body=body, headers=headers)
                answer = upstream.getresponse()
                answered = (answer.status, dict(answer.getheaders()), answer.read())
                upstream.close()
                drop = idem or self.headers.get("x-drop-once")
                if drop is not None and drop not in proxy.dropped:
                    proxy.dropped[drop] = answered
                    self.close_connection = True
                    return  # the answer is lost on its way back
                status, answer_headers, data = answered
                self.send_response(status)
                for name, value in answer_headers.items():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length", "date"):
                        self.send_header(name, value)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


@pytest.fixture(scope="module")
def dropping_proxy(gateway):
    proxy = DroppingProxy(gateway.base)
    yield proxy
    proxy.close()


def test_openai_sdk_retry_after_a_lost_reply_is_not_charged_again(gateway, dropping_proxy):
    key = gateway.new_key(topup=10)
    client = openai.OpenAI(base_url=f"{dropping_proxy.base}/v1", api_key=key, max_retries=2)
    raw = client.chat.completions.with_raw_response.create(
        model=CHAT_MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        extra_headers={"Idempotency-Key": "openai-lost-reply"},
    )
    reply = raw.parse()
    # The SDK sent the request twice with the same key; the first answer was lost.
    assert [s for s in dropping_proxy.seen if s[0] == "openai-lost-reply"] == [
        ("openai-lost-reply", "/v1/chat/completions")
    ] * 2
    status, _, lost = dropping_proxy.dropped["openai-lost-reply"]
    assert status == 200
    assert reply.id == json.loads(lost)["id"], "the same reply again, not a second call"
    assert reply.choices[0].message.content == MOCK_TEXT
    assert raw.headers["idempotent-replayed"] == "true"
    assert gateway.balance(key)["total"] == 10 - CHAT_PRICE
    assert [entry["status"] for entry in gateway.logs(key)] == ["ok"]


def test_anthropic_sdk_retry_after_a_lost_reply_is_not_charged_again(gateway, dropping_proxy):
    key = gateway.new_key(topup=10)
    client = anthropic.Anthropic(base_url=dropping_proxy.base, api_key=key, max_retries=2)
    raw = client.messages.with_raw_response.create(
        model=MESSAGES_MODEL,
        max_tokens=64,
        messages=[{"role": "user", "content": "Hello"}],
        extra_headers={"Idempotency-Key": "anthropic-lost-reply"},
    )
    message = raw.parse()
    assert [s for s in dropping_proxy.seen if s[0] == "anthropic-lost-reply"] == [
        ("anthropic-lost-reply", "/v1/messages")
    ] * 2
    status, _, lost = dropping_proxy.dropped["anthropic-lost-reply"]
    assert status == 200
    assert message.id == json.loads(lost)["id"], "the same reply again, not a second call"
    assert message.content[0].text == MOCK_TEXT
    assert raw.headers["idempotent-replayed"] == "true"
    assert gateway.balance(key)["total"] == 10 - MESSAGES_PRICE
    assert [entry["status"] for entry in gateway.logs(key)] == ["ok"]


def test_without_a_key_the_same_lost_reply_is_charged_twice(gateway, dropping_proxy):
    """What the key prevents: the same lost reply without one, and the SDK's retry is a second
    call, charged again."""
    key = gateway.new_key(topup=10)
    client = openai.OpenAI(base_url=f"{dropping_proxy.base}/v1", api_key=key, max_retries=2)
    raw = client.chat.completions.with_raw_response.create(
        model=CHAT_MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        extra_headers={"x-drop-once": "no-idempotency-key"},
    )
    status, _, lost = dropping_proxy.dropped["no-idempotency-key"]
    assert status == 200
    assert raw.parse().id != json.loads(lost)["id"], "a second call"
    assert "idempotent-replayed" not in raw.headers
    assert gateway.balance(key)["total"] == 10 - 2 * CHAT_PRICE
    assert [entry["status"] for entry in gateway.logs(key)] == ["ok", "ok"]
