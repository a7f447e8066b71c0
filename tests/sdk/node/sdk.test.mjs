// The official Node SDKs (`openai`, `@anthropic-ai/sdk`) against the example gateway with
// streaming on: in mock mode, and in front of a fake provider that streams tool use. Changing
// only the base URL and the key. Run by .ci/run: `npm ci && npm test` in this folder, with
// GATEWAY_BIN naming the built example gateway.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { createServer } from "node:http";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import OpenAI from "openai";
import Anthropic from "@anthropic-ai/sdk";

import { MOCK_TEXT, startGateway } from "./gateway.mjs";

const TOOL_INPUT = { location: "Paris, France", unit: "celsius" };
const ANSWER = "It is 18°C and cloudy in Paris.";

/// A provider that streams a call of `get_weather` with TOOL_INPUT, its arguments in pieces.
function startFakeProvider() {
  const text = JSON.stringify(TOOL_INPUT);
  const pieces = [];
  for (let i = 0; i < text.length; i += 7) pieces.push(text.slice(i, i + 7));
  const chat = () => {
    const base = { id: "chatcmpl-fake", object: "chat.completion.chunk", created: 1732000000, model: "gpt-4o-mini" };
    const chunk = (delta, finish = null) => ({ ...base, choices: [{ index: 0, delta, logprobs: null, finish_reason: finish }] });
    const call = { index: 0, id: "call_fake", type: "function", function: { name: "get_weather", arguments: "" } };
    const events = [chunk({ role: "assistant", content: null, tool_calls: [call] })];
    for (const piece of pieces) events.push(chunk({ tool_calls: [{ index: 0, function: { arguments: piece } }] }));
    events.push(chunk({}, "tool_calls"));
    return events.map((e) => `data: ${JSON.stringify(e)}\n\n`).concat(["data: [DONE]\n\n"]);
  };
  const messages = () => {
    const events = [
      ["message_start", { type: "message_start", message: { id: "msg_fake", type: "message", role: "assistant", model: "claude-haiku-4-5", content: [], stop_reason: null, stop_sequence: null, usage: { input_tokens: 50, output_tokens: 1 } } }],
      ["content_block_start", { type: "content_block_start", index: 0, content_block: { type: "tool_use", id: "toolu_fake", name: "get_weather", input: {} } }],
      ...pieces.map((p) => ["content_block_delta", { type: "content_block_delta", index: 0, delta: { type: "input_json_delta", partial_json: p } }]),
      ["content_block_stop", { type: "content_block_stop", index: 0 }],
      ["message_delta", { type: "message_delta", delta: { stop_reason: "tool_use", stop_sequence: null }, usage: { output_tokens: 20 } }],
      ["message_stop", { type: "message_stop" }],
    ];
    return events.map(([name, data]) => `event: ${name}\ndata: ${JSON.stringify(data)}\n\n`);
  };
  // Once the request carries the tool's result, the chat model answers ANSWER.
  const answer = (stream) => {
    const base = { id: "chatcmpl-fake2", object: "chat.completion.chunk", created: 1732000000, model: "m" };
    const usage = { prompt_tokens: 80, completion_tokens: 10, total_tokens: 90 };
    if (!stream) {
      const message = { role: "assistant", content: ANSWER };
      return [JSON.stringify({ ...base, object: "chat.completion", choices: [{ index: 0, message, finish_reason: "stop" }], usage })];
    }
    const chunk = (delta, finish = null) => ({ ...base, choices: [{ index: 0, delta, finish_reason: finish }] });
    const events = [chunk({ role: "assistant", content: "" }), chunk({ content: ANSWER.slice(0, 7) }), chunk({ content: ANSWER.slice(7) }), chunk({}, "stop"), { ...base, choices: [], usage }];
    return events.map((e) => `data: ${JSON.stringify(e)}\n\n`).concat(["data: [DONE]\n\n"]);
  };
  const server = createServer((request, response) => {
    let body = "";
    request.on("data", (chunk) => (body += chunk));
    request.on("end", () => {
      const asked = JSON.parse(body || "{}");
      const isChat = request.url.endsWith("/chat/completions");
      const answered = (asked.messages ?? []).some((m) => m.role === "tool");
      if (isChat && !asked.stream) {
        const events = answered ? answer(false) : null;
        const call = { id: "call_fake", type: "function", function: { name: "get_weather", arguments: text } };
        const reply = events?.[0] ?? JSON.stringify({ id: "chatcmpl-fake", object: "chat.completion", created: 1, model: "m", choices: [{ index: 0, message: { role: "assistant", content: null, tool_calls: [call] }, finish_reason: "tool_calls" }], usage: { prompt_tokens: 50, completion_tokens: 20, total_tokens: 70 } });
        response.writeHead(200, { "content-type": "application/json" });
        return response.end(reply);
      }
      const answeredMessages = (asked.messages ?? []).some(
        (m) => Array.isArray(m.content) && m.content.some((block) => block.type === "tool_result"),
      );
      if (!isChat && answeredMessages) {
        // The Anthropic model's answer once the request carries the tool's result.
        const usage = { input_tokens: 80, output_tokens: 10 };
        if (!asked.stream) {
          response.writeHead(200, { "content-type": "application/json" });
          return response.end(JSON.stringify({ id: "msg_fake2", type: "message", role: "assistant", model: "m", content: [{ type: "text", text: ANSWER }], stop_reason: "end_turn", stop_sequence: null, usage }));
        }
        const events = [
          ["message_start", { type: "message_start", message: { id: "msg_fake2", type: "message", role: "assistant", model: "m", content: [], stop_reason: null, stop_sequence: null, usage: { input_tokens: 80, output_tokens: 1 } } }],
          ["content_block_start", { type: "content_block_start", index: 0, content_block: { type: "text", text: "" } }],
          ["content_block_delta", { type: "content_block_delta", index: 0, delta: { type: "text_delta", text: ANSWER.slice(0, 7) } }],
          ["content_block_delta", { type: "content_block_delta", index: 0, delta: { type: "text_delta", text: ANSWER.slice(7) } }],
          ["content_block_stop", { type: "content_block_stop", index: 0 }],
          ["message_delta", { type: "message_delta", delta: { stop_reason: "end_turn", stop_sequence: null }, usage: { output_tokens: 10 } }],
          ["message_stop", { type: "message_stop" }],
        ];
        response.writeHead(200, { "content-type": "text/event-stream" });
        for (const [name, data] of events) response.write(`event: ${name}\ndata: ${JSON.stringify(data)}\n\n`);
        return response.end();
      }
      if (!isChat && !asked.stream) {
        const toolUse = { type: "tool_use", id: "toolu_fake", name: "get_weather", input: TOOL_INPUT };
        response.writeHead(200, { "content-type": "application/json" });
        return response.end(JSON.stringify({ id: "msg_fake", type: "message", role: "assistant", model: "m", content: [toolUse], stop_reason: "tool_use", stop_sequence: null, usage: { input_tokens: 50, output_tokens: 20 } }));
      }
      response.writeHead(200, { "content-type": "text/event-stream" });
      const events = isChat ? (answered ? answer(true) : chat()) : messages();
      for (const event of events) response.write(event);
      response.end();
    });
  });
  return new Promise((resolve) => server.listen(0, "127.0.0.1", () => resolve(server)));
}

let mock, compat, provider, fake, catalogueDir;

before(async () => {
  mock = await startGateway({});
  compat = await startGateway({ GATEWAY_ERROR_BODY: "compatible" });
  fake = await startFakeProvider();
  const base = `http://127.0.0.1:${fake.address().port}`;
  catalogueDir = mkdtempSync(join(tmpdir(), "mg-node-cat-"));
  const catalogue = join(catalogueDir, "models.toml");
  writeFileSync(
    catalogue,
    `streaming = true
[[upstreams]]
name = "fake-openai"
kind = "openai"
base_url = "${base}/v1"
api_key_env = "FAKE_PROVIDER_KEY"
[[upstreams]]
name = "fake-anthropic"
kind = "anthropic"
base_url = "${base}"
api_key_env = "FAKE_PROVIDER_KEY"
[[models]]
name = "gpt-4o-mini"
protocol = "chat_completions"
price = 2
upstream = "fake-openai"
[[models]]
name = "claude-haiku-4-5"
protocol = "messages"
price = 3
upstream = "fake-anthropic"
[[models]]
name = "claude-on-openai-clients"
protocol = "messages"
endpoints = ["messages", "chat_completions", "responses"]
price = 3
max_output_tokens = 1024
upstream = "fake-anthropic"
[[models]]
name = "chat-on-messages"
protocol = "chat_completions"
endpoints = ["chat_completions", "messages"]
price = 2
upstream = "fake-openai"
`,
  );
  provider = await startGateway({ MOCK_UPSTREAM: "0", GATEWAY_MODELS: catalogue, FAKE_PROVIDER_KEY: "sk-fake" });
});

after(async () => {
  for (const gateway of [mock, compat, provider]) {
    await gateway.stop();
    assert.match(gateway.audit(), /audit passed/);
  }
  fake.close();
  for (const dir of [mock.dir, compat.dir, provider.dir, catalogueDir]) {
    rmSync(dir, { recursive: true, force: true });
  }
});

const openai = (gateway, key) => new OpenAI({ baseURL: `${gateway.base}/v1`, apiKey: key, maxRetries: 0 });
const anthropic = (gateway, key) => new Anthropic({ baseURL: gateway.base, apiKey: key, maxRetries: 0 });

test("openai streams a chat completion to the end and it is billed once", async () => {
  const key = mock.newKey(10);
  const stream = await openai(mock, key).chat.completions.create({
    model: "gpt-4o-mini",
    messages: [{ role: "user", content: "Hello" }],
    stream: true,
    stream_options: { include_usage: true },
  });
  let text = "";
  let usage;
  for await (const chunk of stream) {
    text += chunk.choices[0]?.delta?.content ?? "";
    usage = chunk.usage ?? usage;
  }
  assert.equal(text, MOCK_TEXT);
  assert.equal(usage.completion_tokens, 16);
  assert.equal(mock.balance(key).total, 8);
  assert.deepEqual(mock.logs(key).map((e) => e.status), ["ok"]);
});

test("anthropic streams a message and gives the final message", async () => {
  const key = mock.newKey(10);
  const stream = anthropic(mock, key).messages.stream({
    model: "claude-haiku-4-5",
    max_tokens: 64,
    messages: [{ role: "user", content: "Hello" }],
  });
  const pieces = [];
  stream.on("text", (piece) => pieces.push(piece));
  const final = await stream.finalMessage();
  assert.equal(pieces.join(""), MOCK_TEXT);
  assert.ok(pieces.length > 1);
  assert.equal(final.content[0].text, MOCK_TEXT);
  assert.equal(final.usage.output_tokens, 16);
  assert.equal(mock.balance(key).total, 7);
});

test("a streamed call refused before it starts is the SDK's error with the detail", async () => {
  const key = mock.newKey(1);
  await assert.rejects(
    openai(mock, key).chat.completions.create({ model: "gpt-4o-mini", messages: [{ role: "user", content: "x" }], stream: true }),
    // The OpenAI Node SDK reads only an `error` member of an error body, so the contract's
    // `{"detail"}` is not on the error object (the Python SDKs expose it as `.body`).
    (error) => error instanceof OpenAI.APIError && error.status === 402,
  );
  await assert.rejects(
    anthropic(mock, "sk-mg-wrong").messages.stream({ model: "claude-haiku-4-5", max_tokens: 8, messages: [{ role: "user", content: "x" }] }).finalMessage(),
    (error) => error instanceof Anthropic.AuthenticationError && error.status === 401,
  );
  assert.deepEqual(mock.logs(key), []);
});

test("streamed tool use arrives intact through both SDKs", async () => {
  const key = provider.newKey(100);
  const stream = await openai(provider, key).chat.completions.create({
    model: "gpt-4o-mini",
    messages: [{ role: "user", content: "Weather in Paris?" }],
    tools: [{ type: "function", function: { name: "get_weather", parameters: { type: "object" } } }],
    stream: true,
  });
  let name = "";
  let args = "";
  for await (const chunk of stream) {
    for (const call of chunk.choices[0]?.delta?.tool_calls ?? []) {
      name += call.function?.name ?? "";
      args += call.function?.arguments ?? "";
    }
  }
  assert.equal(name, "get_weather");
  assert.deepEqual(JSON.parse(args), TOOL_INPUT);

  const final = await anthropic(provider, key)
    .messages.stream({
      model: "claude-haiku-4-5",
      max_tokens: 256,
      tools: [{ name: "get_weather", input_schema: { type: "object" } }],
      messages: [{ role: "user", content: "Weather in Paris?" }],
    })
    .finalMessage();
  assert.equal(final.content[0].type, "tool_use");
  assert.deepEqual(final.content[0].input, TOOL_INPUT);
  assert.equal(final.stop_reason, "tool_use");
  assert.deepEqual(provider.logs(key).map((e) => e.status), ["ok", "ok"]);
  assert.equal(provider.balance(key).total, 95);
});

for (const how of ["create", "stream"]) {
  test(`the Anthropic SDK's messages.${how} runs a tool round trip on a chat-completions model, translated`, async () => {
    const key = provider.newKey(100);
    const client = anthropic(provider, key);
    const tools = [{ name: "get_weather", input_schema: { type: "object" } }];
    const ask = (messages) => {
      const request = { model: "chat-on-messages", max_tokens: 256, tools, messages };
      return how === "create" ? client.messages.create(request) : client.messages.stream(request).finalMessage();
    };
    const question = [{ role: "user", content: "Weather in Paris?" }];
    const first = await ask(question);
    const [toolUse] = first.content;
    assert.deepEqual([toolUse.type, toolUse.name, toolUse.input], ["tool_use", "get_weather", TOOL_INPUT]);
    assert.equal(first.stop_reason, "tool_use");
    const second = await ask([
      ...question,
      { role: "assistant", content: first.content },
      { role: "user", content: [{ type: "tool_result", tool_use_id: toolUse.id, content: "18°C, cloudy" }] },
    ]);
    assert.equal(second.content[0].text, ANSWER);
    assert.equal(second.stop_reason, "end_turn");
    assert.deepEqual([second.usage.input_tokens, second.usage.output_tokens], [80, 10]);
    assert.deepEqual(provider.logs(key).map((e) => [e.protocol, e.status]), [["messages", "ok"], ["messages", "ok"]]);
    assert.equal(provider.balance(key).total, 96);
  });
}

for (const how of ["create", "stream"]) {
  test(`the OpenAI SDK's chat completions (${how}) run a tool round trip on an Anthropic model, translated`, async () => {
    const key = provider.newKey(100);
    const client = openai(provider, key);
    const tools = [{ type: "function", function: { name: "get_weather", parameters: { type: "object" } } }];
    const ask = async (messages) => {
      const request = { model: "claude-on-openai-clients", messages, tools };
      if (how === "create") return (await client.chat.completions.create(request)).choices[0];
      return (await client.chat.completions.stream(request).finalChatCompletion()).choices[0];
    };
    const question = [{ role: "user", content: "Weather in Paris?" }];
    const first = await ask(question);
    assert.equal(first.finish_reason, "tool_calls");
    const [call] = first.message.tool_calls;
    assert.deepEqual([call.function.name, JSON.parse(call.function.arguments)], ["get_weather", TOOL_INPUT]);
    const second = await ask([...question, first.message, { role: "tool", tool_call_id: call.id, content: "18°C, cloudy" }]);
    assert.equal(second.message.content, ANSWER);
    assert.deepEqual(provider.logs(key).map((e) => [e.protocol, e.status]), [["chat_completions", "ok"], ["chat_completions", "ok"]]);
    assert.equal(provider.balance(key).total, 94);
  });

  test(`the OpenAI SDK's responses (${how}) run a tool round trip on an Anthropic model, translated`, async () => {
    const key = provider.newKey(100);
    const client = openai(provider, key);
    const tools = [{ type: "function", name: "get_weather", parameters: { type: "object" } }];
    const ask = async (input) => {
      const request = { model: "claude-on-openai-clients", input, tools };
      if (how === "create") return client.responses.create(request);
      return client.responses.stream(request).finalResponse();
    };
    const question = [{ role: "user", content: "Weather in Paris?" }];
    const first = await ask(question);
    const call = first.output.find((item) => item.type === "function_call");
    assert.deepEqual([call.name, JSON.parse(call.arguments)], ["get_weather", TOOL_INPUT]);
    const second = await ask([...question, call, { type: "function_call_output", call_id: call.call_id, output: "18°C, cloudy" }]);
    assert.equal(second.output_text, ANSWER);
    assert.deepEqual(provider.logs(key).map((e) => [e.protocol, e.status]), [["responses", "ok"], ["responses", "ok"]]);
    assert.equal(provider.balance(key).total, 94);
  });
}

test("both SDKs list and retrieve models", async () => {
  const key = mock.newKey(10);
  const ids = [];
  for await (const model of openai(mock, key).models.list()) ids.push(model.id);
  assert.ok(ids.includes("gpt-4o-mini") && ids.includes("claude-haiku-4-5"));
  const one = await openai(mock, key).models.retrieve("gpt-4o-mini");
  assert.equal(one.id, "gpt-4o-mini");

  const walked = [];
  for await (const model of anthropic(mock, key).models.list({ limit: 1 })) walked.push(model.id);
  assert.deepEqual(walked, [...ids].sort());
  const info = await anthropic(mock, key).models.retrieve("claude-haiku-4-5");
  assert.equal(info.type, "model");
  assert.deepEqual(mock.logs(key), []);
});

const chatOnce = (client) => client.chat.completions.create({ model: "gpt-4o-mini", messages: [{ role: "user", content: "x" }] });
const messageOnce = (client) => client.messages.create({ model: "claude-haiku-4-5", max_tokens: 8, messages: [{ role: "user", content: "x" }] });

test("the OpenAI SDK's error shows the gateway's text only with compatible error bodies", async () => {
  // Off (the specified {"detail"} body): the SDK finds no `error` object to read.
  await assert.rejects(chatOnce(openai(mock, mock.newKey(1))), (error) => {
    assert.equal(error.status, 402);
    assert.equal(error.message, "402 status code (no body)");
    assert.ok(!error.message.includes("积分不足"));
    return true;
  });
  await assert.rejects(chatOnce(openai(compat, compat.newKey(1))), (error) => {
    assert.equal(error.message, "402 积分不足");
    assert.equal(error.code, "insufficient_quota");
    assert.equal(error.type, "insufficient_quota");
    return true;
  });
  await assert.rejects(chatOnce(openai(compat, "sk-mg-wrong")), (error) => {
    assert.ok(error instanceof OpenAI.AuthenticationError);
    assert.equal(error.message, "401 无效的 API Key");
    return true;
  });
});

test("the Anthropic SDK's errors carry the gateway's text and the request id", async () => {
  for (const gateway of [mock, compat]) {
    await assert.rejects(messageOnce(anthropic(gateway, gateway.newKey(1))), (error) => {
      assert.equal(error.status, 402);
      assert.ok(error.message.includes("积分不足"), error.message);
      assert.match(error.requestID, /^req_[0-9a-f]{32}$/);
      return true;
    });
  }
  await assert.rejects(messageOnce(anthropic(compat, compat.newKey(1))), (error) => {
    assert.equal(error.error.error.type, "billing_error");
    return true;
  });
});

test("both SDKs with their default retries ask once for what a retry cannot change", async () => {
  const poor = mock.newKey(1);
  const defaults = {
    openai: (key) => new OpenAI({ baseURL: `${mock.base}/v1`, apiKey: key }),
    anthropic: (key) => new Anthropic({ baseURL: mock.base, apiKey: key }),
  };
  const cases = [
    [() => chatOnce(defaults.openai("sk-mg-wrong")), "/v1/chat/completions", 401],
    [() => chatOnce(defaults.openai(poor)), "/v1/chat/completions", 402],
    [() => messageOnce(defaults.anthropic("sk-mg-wrong")), "/v1/messages", 401],
    [() => messageOnce(defaults.anthropic(poor)), "/v1/messages", 402],
  ];
  for (const [call, path, status] of cases) {
    const before = mock.accessLines(path, status).length;
    await assert.rejects(call(), (error) => error.status === status && error.headers.get("x-should-retry") === "false");
    // The access line is written as the answer leaves; give the pipe a moment.
    await new Promise((r) => setTimeout(r, 200));
    assert.equal(mock.accessLines(path, status).length - before, 1, `${path} ${status}`);
  }
});

test("the OpenAI SDK creates embeddings, charged per call", async () => {
  const key = mock.newKey(10);
  const created = await openai(mock, key).embeddings.create({ model: "text-embedding-3-small", input: ["a cat", "a dog"] });
  assert.deepEqual(created.data.map((item) => item.index), [0, 1]);
  assert.equal(created.data[0].embedding.length, 1536);
  assert.notDeepEqual(created.data[0].embedding, created.data[1].embedding);
  const again = await openai(mock, key).embeddings.create({ model: "text-embedding-3-small", input: "a cat" });
  assert.deepEqual(again.data[0].embedding, created.data[0].embedding);
  assert.equal(mock.balance(key).total, 8);
  assert.deepEqual(mock.logs(key).map((e) => e.protocol), ["embeddings", "embeddings"]);
});
