// The Vercel AI SDK's default OpenAI provider (`createOpenAI({ baseURL })(model)`, which calls
// the Responses API) against the example gateway: `generateText` and `streamText` with a tool
// that the model calls, in mock mode and in front of a fake provider reached natively
// (`responses = "native"`) and by translation to chat completions (`responses = "translate"`).

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { createServer } from "node:http";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, streamText, stepCountIs, tool } from "ai";
import { z } from "zod";

import { MOCK_TEXT, pieces, startGateway } from "./gateway.mjs";

const MODEL = "gpt-4o-mini";
const PRICE = 2;
const TOOL_INPUT = { location: "Paris, France", unit: "celsius" };
const FINAL_TEXT = "It is 18°C and cloudy in Paris.";
const THOUGHT = "The tool said 18°C, cloudy.";
const CREATED = 1732000000;

/// A provider of chat completions and of the Responses API whose model calls `get_weather` with
/// TOOL_INPUT, then, once the request carries the tool's result, answers FINAL_TEXT (on chat
/// completions with its reasoning before it, `reasoning_content`); streamed or complete as
/// asked. Records each request.
function startFakeProvider() {
  const seen = [];
  const usage = (answered) => (answered ? [80, 10] : [50, 20]);
  const chat = (answered, stream) => {
    const [prompt, completion] = usage(answered);
    const totals = { prompt_tokens: prompt, completion_tokens: completion, total_tokens: prompt + completion };
    const base = { id: "chatcmpl-fake", created: CREATED, model: MODEL };
    if (!stream) {
      // A reasoning model's answer carries its reasoning, as such servers send it.
      const message = answered
        ? { role: "assistant", content: FINAL_TEXT, reasoning_content: THOUGHT }
        : { role: "assistant", content: null, tool_calls: [{ id: "call_fake", type: "function", function: { name: "get_weather", arguments: JSON.stringify(TOOL_INPUT) } }] };
      const finish = answered ? "stop" : "tool_calls";
      return { ...base, object: "chat.completion", choices: [{ index: 0, message, finish_reason: finish }], usage: totals };
    }
    const chunk = (delta, finish = null) => ({ ...base, object: "chat.completion.chunk", choices: [{ index: 0, delta, finish_reason: finish }] });
    const events = [];
    if (answered) {
      events.push(chunk({ role: "assistant", content: "" }));
      for (const piece of pieces(THOUGHT, 11)) events.push(chunk({ reasoning_content: piece }));
      for (const piece of pieces(FINAL_TEXT, 9)) events.push(chunk({ content: piece }));
      events.push(chunk({}, "stop"));
    } else {
      events.push(chunk({ role: "assistant", content: null, tool_calls: [{ index: 0, id: "call_fake", type: "function", function: { name: "get_weather", arguments: "" } }] }));
      for (const piece of pieces(JSON.stringify(TOOL_INPUT), 7)) events.push(chunk({ tool_calls: [{ index: 0, function: { arguments: piece } }] }));
      events.push(chunk({}, "tool_calls"));
    }
    events.push({ ...base, object: "chat.completion.chunk", choices: [], usage: totals });
    return events.map((e) => `data: ${JSON.stringify(e)}\n\n`).concat(["data: [DONE]\n\n"]);
  };
  const responses = (answered, stream) => {
    const [input, output] = usage(answered);
    const arguments_ = JSON.stringify(TOOL_INPUT);
    const item = answered
      ? { id: "msg_fake", type: "message", status: "completed", role: "assistant", content: [{ type: "output_text", text: FINAL_TEXT, annotations: [] }] }
      : { id: "fc_fake", type: "function_call", status: "completed", call_id: "call_fake", name: "get_weather", arguments: arguments_ };
    const response = (status, items, usage) => ({
      id: "resp_fake", object: "response", created_at: CREATED, status, error: null, incomplete_details: null,
      model: MODEL, output: items, usage, tools: [], tool_choice: "auto", parallel_tool_calls: true,
    });
    const finalUsage = {
      input_tokens: input, input_tokens_details: { cached_tokens: 0 }, output_tokens: output,
      output_tokens_details: { reasoning_tokens: 0 }, total_tokens: input + output,
    };
    if (!stream) return response("completed", [item], finalUsage);
    const events = [
      ["response.created", { response: response("in_progress", [], null) }],
      ["response.in_progress", { response: response("in_progress", [], null) }],
    ];
    if (answered) {
      const part = { type: "output_text", text: "", annotations: [] };
      events.push(["response.output_item.added", { output_index: 0, item: { ...item, status: "in_progress", content: [] } }]);
      events.push(["response.content_part.added", { item_id: "msg_fake", output_index: 0, content_index: 0, part }]);
      for (const delta of pieces(FINAL_TEXT, 9)) events.push(["response.output_text.delta", { item_id: "msg_fake", output_index: 0, content_index: 0, delta }]);
      events.push(["response.output_text.done", { item_id: "msg_fake", output_index: 0, content_index: 0, text: FINAL_TEXT }]);
      events.push(["response.content_part.done", { item_id: "msg_fake", output_index: 0, content_index: 0, part: { ...part, text: FINAL_TEXT } }]);
    } else {
      events.push(["response.output_item.added", { output_index: 0, item: { ...item, status: "in_progress", arguments: "" } }]);
      for (const delta of pieces(arguments_, 7)) events.push(["response.function_call_arguments.delta", { item_id: "fc_fake", output_index: 0, delta }]);
      events.push(["response.function_call_arguments.done", { item_id: "fc_fake", output_index: 0, arguments: arguments_ }]);
    }
    events.push(["response.output_item.done", { output_index: 0, item }]);
    events.push(["response.completed", { response: response("completed", [item], finalUsage) }]);
    return events.map(([type, data], n) => `event: ${type}\ndata: ${JSON.stringify({ type, sequence_number: n, ...data })}\n\n`);
  };
  const server = createServer((request, response) => {
    let body = "";
    request.on("data", (chunk) => (body += chunk));
    request.on("end", () => {
      const asked = JSON.parse(body || "{}");
      seen.push({ path: request.url, body: asked });
      const answered = Array.isArray(asked.messages)
        ? asked.messages.some((m) => m.role === "tool")
        : Array.isArray(asked.input) && asked.input.some((i) => i.type === "function_call_output");
      const reply = request.url.endsWith("/responses") ? responses(answered, asked.stream) : chat(answered, asked.stream);
      if (!asked.stream) {
        response.writeHead(200, { "content-type": "application/json" });
        response.end(JSON.stringify(reply));
        return;
      }
      response.writeHead(200, { "content-type": "text/event-stream" });
      for (const event of reply) response.write(event);
      response.end();
    });
  });
  return new Promise((resolve) => server.listen(0, "127.0.0.1", () => resolve({ server, seen })));
}

let mock, fake, catalogueDir;
const upstreams = {};

before(async () => {
  mock = await startGateway({});
  fake = await startFakeProvider();
  catalogueDir = mkdtempSync(join(tmpdir(), "mg-node-ai-"));
  for (const responses of ["native", "translate"]) {
    const catalogue = join(catalogueDir, `${responses}.toml`);
    writeFileSync(
      catalogue,
      `streaming = true
[[upstreams]]
name = "fake"
kind = "openai"
base_url = "http://127.0.0.1:${fake.server.address().port}/v1"
api_key_env = "FAKE_PROVIDER_KEY"
responses = "${responses}"
[[models]]
name = "${MODEL}"
protocol = "chat_completions"
price = ${PRICE}
upstream = "fake"
`,
    );
    upstreams[responses] = await startGateway({ MOCK_UPSTREAM: "0", GATEWAY_MODELS: catalogue, FAKE_PROVIDER_KEY: "sk-fake" });
  }
});

after(async () => {
  for (const gateway of [mock, ...Object.values(upstreams)]) {
    await gateway.stop();
    assert.match(gateway.audit(), /audit passed/);
    rmSync(gateway.dir, { recursive: true, force: true });
  }
  fake.server.close();
  rmSync(catalogueDir, { recursive: true, force: true });
});

function model(gateway, key) {
  return createOpenAI({ baseURL: `${gateway.base}/v1`, apiKey: key })(MODEL);
}

function weatherTool(calls) {
  return tool({
    description: "The current weather at a location",
    inputSchema: z.object({ location: z.string(), unit: z.string() }),
    execute: async (input) => {
      calls.push(input);
      return "18°C, cloudy";
    },
  });
}

/// The provider got the tool's result: as a Responses item natively, as a tool message when
/// translated.
function assertTheToolResultReached(responses, stream) {
  const [last] = fake.seen.filter((r) => r.path.endsWith(responses === "native" ? "/v1/responses" : "/v1/chat/completions")).slice(-1);
  if (responses === "native") {
    assert.equal(last.body.input.at(-1).type, "function_call_output");
  } else {
    assert.equal(last.body.messages.at(-1).role, "tool");
    assert.equal(last.body.messages.at(-1).tool_call_id, "call_fake");
  }
  assert.equal(Boolean(last.body.stream), stream);
}

test("generateText and streamText get the mock text through the Responses API", async () => {
  const key = mock.newKey(10);
  const generated = await generateText({ model: model(mock, key), prompt: "Hello" });
  assert.equal(generated.text, MOCK_TEXT);
  assert.equal(generated.usage.outputTokens, 16);
  const streamed = streamText({ model: model(mock, key), prompt: "Hello" });
  const deltas = [];
  for await (const delta of streamed.textStream) deltas.push(delta);
  assert.equal(deltas.join(""), MOCK_TEXT);
  assert.ok(deltas.length > 1);
  assert.deepEqual(mock.logs(key).map((e) => [e.protocol, e.status]), [["responses", "ok"], ["responses", "ok"]]);
  assert.equal(mock.balance(key).total, 10 - 2 * PRICE);
});

for (const responses of ["native", "translate"]) {
  test(`generateText runs a tool round trip (${responses})`, async () => {
    const gateway = upstreams[responses];
    const key = gateway.newKey(10);
    const calls = [];
    const result = await generateText({
      model: model(gateway, key),
      prompt: "What is the weather in Paris?",
      tools: { get_weather: weatherTool(calls) },
      stopWhen: stepCountIs(3),
    });
    assert.deepEqual(calls, [TOOL_INPUT]);
    assert.equal(result.text, FINAL_TEXT);
    assert.equal(result.steps.length, 2);
    assertTheToolResultReached(responses, false);
    assert.deepEqual(gateway.logs(key).map((e) => [e.protocol, e.status, e.output_tokens]).sort(), [["responses", "ok", 10], ["responses", "ok", 20]]);
    assert.equal(gateway.balance(key).total, 10 - 2 * PRICE);
  });

  test(`streamText runs a tool round trip (${responses})`, async () => {
    const gateway = upstreams[responses];
    const key = gateway.newKey(10);
    const calls = [];
    const result = streamText({
      model: model(gateway, key),
      prompt: "What is the weather in Paris?",
      tools: { get_weather: weatherTool(calls) },
      stopWhen: stepCountIs(3),
    });
    const deltas = [];
    for await (const delta of result.textStream) deltas.push(delta);
    assert.equal(deltas.join(""), FINAL_TEXT);
    assert.ok(deltas.length > 1);
    assert.deepEqual(calls, [TOOL_INPUT]);
    assertTheToolResultReached(responses, true);
    assert.deepEqual(gateway.logs(key).map((e) => e.status), ["ok", "ok"]);
    assert.equal(gateway.balance(key).total, 10 - 2 * PRICE);
  });
}
