// OpenAI's coding-agent CLI (`codex exec`, which speaks only the Responses API) against the
// example gateway, configured as its users configure a provider: a base URL, a key variable and
// `wire_api = "responses"`. In mock mode, and in front of a fake chat-completions provider
// reached by translation (`responses = "translate"`), whose model edits a file with Codex's
// `apply_patch`. Under the names of its own models (`gpt-5.5`, ...) Codex sends `apply_patch`
// as a custom tool (free-form input under a Lark grammar), which translates to a chat
// completions custom tool. Codex's built-in web search, which translates to nothing, and its
// namespaced multi-agent tools are switched off, except in the runs with the minimal provider
// config, where the gateway drops web search (named in `x-gateway-dropped-tools`) and offers
// the namespaced tools under flat names (one of them run through a translated model): those run a shell
// command (`exec_command`, a function tool under a model name Codex does not know) on a
// translated chat model and on a model whose provider speaks only Anthropic's messages.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { createServer } from "node:http";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import { MOCK_TEXT, pieces, startGateway } from "./gateway.mjs";

const CODEX = new URL("./node_modules/.bin/codex", import.meta.url).pathname;
// One of the CLI's own model names: with it, `apply_patch` is a custom tool.
const AGENT_MODEL = "gpt-5.5";
const PRICE = 2;
const PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+Hello from the gateway, 世界\n*** End Patch\n";
const FINAL_TEXT = "Added hello.txt.";
// The shell command the fake models run with Codex's `exec_command`.
const SHELL_COMMAND = "echo 'Hello from the agent, 世界' > greeting.txt";

/// A chat-completions provider whose model calls the custom tool `apply_patch` with PATCH, its
/// input streamed in pieces, then, once the request carries the tool's output, answers
/// FINAL_TEXT. Records each request.
function startFakeProvider() {
  const seen = [];
  const server = createServer((request, response) => {
    let body = "";
    request.on("data", (chunk) => (body += chunk));
    request.on("end", () => {
      const asked = JSON.parse(body || "{}");
      seen.push(asked);
      const answered = (asked.messages ?? []).some((m) => m.role === "tool");
      const base = { id: "chatcmpl-fake", object: "chat.completion.chunk", created: 1732000000, model: AGENT_MODEL };
      const chunk = (delta, finish = null) => ({ ...base, choices: [{ index: 0, delta, finish_reason: finish }] });
      const events = [];
      if (answered) {
        events.push(chunk({ role: "assistant", content: "" }));
        for (const piece of pieces(FINAL_TEXT, 5)) events.push(chunk({ content: piece }));
        events.push(chunk({}, "stop"));
      } else if (JSON.stringify(asked.messages ?? []).includes("Close an agent")) {
        // One of Codex's namespaced multi-agent tools, under the flat name it was offered by.
        const call = { index: 0, id: "call_ns", type: "function", function: { name: "multi_agent_v1__close_agent", arguments: JSON.stringify({ target: "nobody" }) } };
        events.push(chunk({ role: "assistant", content: null, tool_calls: [call] }));
        events.push(chunk({}, "tool_calls"));
      } else if ((asked.tools ?? []).some((tool) => tool.type === "custom")) {
        events.push(chunk({ role: "assistant", content: null, tool_calls: [{ index: 0, id: "call_patch", type: "custom", custom: { name: "apply_patch", input: "" } }] }));
        for (const piece of pieces(PATCH, 9)) events.push(chunk({ tool_calls: [{ index: 0, custom: { input: piece } }] }));
        events.push(chunk({}, "tool_calls"));
      } else {
        // A model Codex does not know gets its shell as a function tool.
        events.push(chunk({ role: "assistant", content: null, tool_calls: [{ index: 0, id: "call_shell", type: "function", function: { name: "exec_command", arguments: "" } }] }));
        for (const piece of pieces(JSON.stringify({ cmd: SHELL_COMMAND }), 9)) events.push(chunk({ tool_calls: [{ index: 0, function: { arguments: piece } }] }));
        events.push(chunk({}, "tool_calls"));
      }
      events.push({ ...base, choices: [], usage: { prompt_tokens: 900, completion_tokens: 30, total_tokens: 930 } });
      response.writeHead(200, { "content-type": "text/event-stream" });
      for (const event of events) response.write(`data: ${JSON.stringify(event)}\n\n`);
      response.end("data: [DONE]\n\n");
    });
  });
  return new Promise((resolve) => server.listen(0, "127.0.0.1", () => resolve({ server, seen })));
}

/// An Anthropic provider (messages only) whose model runs Codex's `exec_command` with
/// SHELL_COMMAND, its input streamed in pieces, then, once the request carries the tool's
/// result, answers FINAL_TEXT. Records each request.
function startFakeAnthropic() {
  const seen = [];
  const server = createServer((request, response) => {
    let body = "";
    request.on("data", (chunk) => (body += chunk));
    request.on("end", () => {
      const asked = JSON.parse(body || "{}");
      seen.push({ path: request.url, body: asked });
      const answered = (asked.messages ?? []).some(
        (m) => Array.isArray(m.content) && m.content.some((block) => block.type === "tool_result"),
      );
      const events = [["message_start", { type: "message_start", message: { id: "msg_fake", type: "message", role: "assistant", model: "claude", content: [], stop_reason: null, stop_sequence: null, usage: { input_tokens: 900, cache_read_input_tokens: 100, output_tokens: 1 } } }]];
      let stop;
      if (answered) {
        events.push(["content_block_start", { type: "content_block_start", index: 0, content_block: { type: "text", text: "" } }]);
        for (const piece of pieces(FINAL_TEXT, 5)) events.push(["content_block_delta", { type: "content_block_delta", index: 0, delta: { type: "text_delta", text: piece } }]);
        stop = "end_turn";
      } else {
        events.push(["content_block_start", { type: "content_block_start", index: 0, content_block: { type: "tool_use", id: "toolu_shell", name: "exec_command", input: {} } }]);
        for (const piece of pieces(JSON.stringify({ cmd: SHELL_COMMAND }), 9)) events.push(["content_block_delta", { type: "content_block_delta", index: 0, delta: { type: "input_json_delta", partial_json: piece } }]);
        stop = "tool_use";
      }
      events.push(["content_block_stop", { type: "content_block_stop", index: 0 }]);
      events.push(["message_delta", { type: "message_delta", delta: { stop_reason: stop, stop_sequence: null }, usage: { output_tokens: 30 } }]);
      events.push(["message_stop", { type: "message_stop" }]);
      response.writeHead(200, { "content-type": "text/event-stream" });
      for (const [name, data] of events) response.write(`event: ${name}\ndata: ${JSON.stringify(data)}\n\n`);
      response.end();
    });
  });
  return new Promise((resolve) => server.listen(0, "127.0.0.1", () => resolve({ server, seen })));
}

const CLAUDE_MODEL = "claude-for-codex";
// A chat model Codex does not know: its shell is a function tool, `exec_command`.
const CHAT_MODEL = "chat-for-codex";
let mock, translated, fake, dir, anthropicFake, onClaude;

before(async () => {
  dir = mkdtempSync(join(tmpdir(), "mg-codex-"));
  fake = await startFakeProvider();
  // The agent's model beside the demo's, in mock mode and on the fake provider.
  const catalogue = (baseUrl) => `streaming = true
[[upstreams]]
name = "agents"
kind = "openai"
base_url = "${baseUrl}"
api_key_env = "FAKE_PROVIDER_KEY"
responses = "translate"
[[models]]
name = "gpt-4o-mini"
protocol = "chat_completions"
price = ${PRICE}
upstream = "agents"
[[models]]
name = "${AGENT_MODEL}"
protocol = "chat_completions"
price = ${PRICE}
upstream = "agents"
[[models]]
name = "${CHAT_MODEL}"
protocol = "chat_completions"
price = ${PRICE}
upstream = "agents"
`;
  writeFileSync(join(dir, "mock.toml"), catalogue("http://127.0.0.1:9/v1"));
  writeFileSync(join(dir, "fake.toml"), catalogue(`http://127.0.0.1:${fake.server.address().port}/v1`));
  mock = await startGateway({ GATEWAY_MODELS: join(dir, "mock.toml"), FAKE_PROVIDER_KEY: "sk-fake" });
  anthropicFake = await startFakeAnthropic();
  writeFileSync(join(dir, "claude.toml"), `streaming = true
[[upstreams]]
name = "messages-only"
kind = "anthropic"
base_url = "http://127.0.0.1:${anthropicFake.server.address().port}"
api_key_env = "FAKE_PROVIDER_KEY"
[[models]]
name = "${CLAUDE_MODEL}"
protocol = "messages"
endpoints = ["messages", "responses"]
price = ${PRICE}
max_output_tokens = 4096
upstream = "messages-only"
`);
  onClaude = await startGateway({ MOCK_UPSTREAM: "0", GATEWAY_MODELS: join(dir, "claude.toml"), FAKE_PROVIDER_KEY: "sk-fake" });
  translated = await startGateway({ MOCK_UPSTREAM: "0", GATEWAY_MODELS: join(dir, "fake.toml"), FAKE_PROVIDER_KEY: "sk-fake" });
});

after(async () => {
  for (const gateway of [mock, translated, onClaude]) {
    await gateway.stop();
    assert.match(gateway.audit(), /audit passed/);
    rmSync(gateway.dir, { recursive: true, force: true });
  }
  fake.server.close();
  anthropicFake.server.close();
  rmSync(dir, { recursive: true, force: true });
});

/// `codex exec` with `prompt` against `gateway`, in a fresh home and working directory, the
/// sandbox off (the working directory is a temporary one) so that `apply_patch` writes there.
/// Run without blocking, so that the fake provider in this process can answer.
/// With `minimal`, the provider configured with the least a user writes (no switches for web
/// search or the multi-agent tools, which the gateway then drops and names).
function codex(gateway, key, model, prompt, { minimal = false } = {}) {
  const home = mkdtempSync(join(dir, "home-"));
  const work = mkdtempSync(join(dir, "work-"));
  const settings = [
    "model_provider=mg",
    'model_providers.mg.name="model-gateway"',
    `model_providers.mg.base_url="${gateway.base}/v1"`,
    'model_providers.mg.env_key="MODEL_GATEWAY_KEY"',
    'model_providers.mg.wire_api="responses"',
    `model=${model}`,
  ];
  if (!minimal) settings.push("web_search=disabled");
  const args = ["exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", "-C", work];
  if (!minimal) args.push("--disable", "multi_agent");
  for (const setting of settings) args.push("-c", setting);
  args.push(prompt);
  const child = spawn(CODEX, args, {
    env: { ...process.env, CODEX_HOME: home, MODEL_GATEWAY_KEY: key },
    stdio: ["ignore", "pipe", "pipe"],
    timeout: 120_000,
  });
  let stdout = "";
  let stderr = "";
  child.stdout.setEncoding("utf8").on("data", (text) => (stdout += text));
  child.stderr.setEncoding("utf8").on("data", (text) => (stderr += text));
  return new Promise((resolve) => child.on("close", (status) => resolve({ status, stdout, stderr, work })));
}

for (const model of ["gpt-4o-mini", AGENT_MODEL]) {
  test(`the coding-agent CLI runs a turn through the Responses API as ${model}, charged once`, async () => {
    const key = mock.newKey(10);
    const run = await codex(mock, key, model, "Say hello.");
    assert.equal(run.status, 0, run.stderr);
    assert.equal(run.stdout.trim(), MOCK_TEXT);
    const calls = mock.logs(key);
    assert.deepEqual(calls.map((c) => [c.protocol, c.status]), [["responses", "ok"]]);
    assert.equal(mock.balance(key).total, 10 - PRICE);
  });
}

test("the coding-agent CLI with the minimal provider config runs a turn, its built-in tools dropped", async () => {
  const key = mock.newKey(10);
  const run = await codex(mock, key, AGENT_MODEL, "Say hello.", { minimal: true });
  assert.equal(run.status, 0, run.stderr);
  assert.equal(run.stdout.trim(), MOCK_TEXT);
  assert.deepEqual(mock.logs(key).map((c) => [c.protocol, c.status]), [["responses", "ok"]]);
  assert.equal(mock.balance(key).total, 10 - PRICE);
});

test("the coding-agent CLI edits a file with its custom apply_patch tool through a translated upstream", async () => {
  const key = translated.newKey(10);
  fake.seen.length = 0;
  const run = await codex(translated, key, AGENT_MODEL, "Add hello.txt.");
  assert.equal(run.status, 0, run.stderr);
  assert.equal(run.stdout.trim(), FINAL_TEXT);
  assert.equal(readFileSync(join(run.work, "hello.txt"), "utf8"), "Hello from the gateway, 世界\n");
  // The provider was offered apply_patch as a chat-completions custom tool with its grammar,
  // and got the call and its output back as a tool call and a tool message.
  assert.equal(fake.seen.length, 2);
  const offered = fake.seen[0].tools.find((tool) => tool.type === "custom");
  assert.equal(offered.custom.name, "apply_patch");
  assert.equal(offered.custom.format.type, "grammar");
  assert.equal(offered.custom.format.grammar.syntax, "lark");
  assert.match(offered.custom.format.grammar.definition, /begin_patch/);
  const messages = fake.seen[1].messages;
  const call = messages.find((m) => m.role === "assistant" && m.tool_calls)?.tool_calls[0];
  assert.deepEqual(call, { id: "call_patch", type: "custom", custom: { name: "apply_patch", input: PATCH } });
  const output = messages.find((m) => m.role === "tool");
  assert.equal(output.tool_call_id, "call_patch");
  assert.match(output.content, /hello\.txt/);
  // Two calls, each charged once.
  const calls = translated.logs(key);
  assert.deepEqual(calls.map((c) => [c.protocol, c.status]), [["responses", "ok"], ["responses", "ok"]]);
  assert.equal(translated.balance(key).total, 10 - 2 * PRICE);
});

test("the coding-agent CLI reports the gateway's refusal and nothing is charged", async () => {
  const key = mock.newKey(1);
  const run = await codex(mock, key, "gpt-4o-mini", "Say hello.");
  assert.notEqual(run.status, 0);
  assert.match(run.stderr, /积分不足/);
  assert.deepEqual(mock.logs(key), []);
});

test("the coding-agent CLI with the minimal provider config runs a shell command on an Anthropic model, translated", async () => {
  const key = onClaude.newKey(10);
  anthropicFake.seen.length = 0;
  const run = await codex(onClaude, key, CLAUDE_MODEL, "Write greeting.txt.", { minimal: true });
  assert.equal(run.status, 0, run.stderr);
  assert.equal(run.stdout.trim(), FINAL_TEXT);
  assert.equal(readFileSync(join(run.work, "greeting.txt"), "utf8"), "Hello from the agent, 世界\n");
  // The provider was asked Anthropic's messages, with Codex's function tools (its web search and
  // its namespace of tools left out), and got the command's output back as a tool result.
  assert.equal(anthropicFake.seen.length, 2);
  assert.ok(anthropicFake.seen.every((asked) => asked.path === "/v1/messages" && asked.body.stream === true));
  const tools = anthropicFake.seen[0].body.tools.map((tool) => tool.name);
  assert.ok(tools.includes("exec_command"), tools.join(", "));
  const result = anthropicFake.seen[1].body.messages.at(-1).content.find((block) => block.type === "tool_result");
  assert.equal(result.tool_use_id, "toolu_shell");
  const calls = onClaude.logs(key);
  assert.deepEqual(calls.map((c) => [c.protocol, c.status]), [["responses", "ok"], ["responses", "ok"]]);
  assert.equal(onClaude.balance(key).total, 10 - 2 * PRICE);
});

test("the coding-agent CLI with the minimal provider config runs a shell command on a translated chat model", async () => {
  const key = translated.newKey(10);
  fake.seen.length = 0;
  const run = await codex(translated, key, CHAT_MODEL, "Write greeting.txt.", { minimal: true });
  assert.equal(run.status, 0, run.stderr);
  assert.equal(run.stdout.trim(), FINAL_TEXT);
  assert.equal(readFileSync(join(run.work, "greeting.txt"), "utf8"), "Hello from the agent, 世界\n");
  assert.equal(fake.seen.length, 2);
  const output = fake.seen[1].messages.find((m) => m.role === "tool");
  assert.equal(output.tool_call_id, "call_shell");
  assert.deepEqual(translated.logs(key).map((c) => [c.protocol, c.status]), [["responses", "ok"], ["responses", "ok"]]);
  assert.equal(translated.balance(key).total, 10 - 2 * PRICE);
});

test("the coding-agent CLI runs one of its namespaced tools through a translated chat model", async () => {
  const key = translated.newKey(10);
  fake.seen.length = 0;
  const run = await codex(translated, key, CHAT_MODEL, "Close an agent.", { minimal: true });
  assert.equal(run.status, 0, run.stderr);
  // Offered flat, called flat, the call came back to Codex in its namespace: Codex ran the tool
  // (which found no such agent) rather than answering "unsupported call".
  const offered = fake.seen[0].tools.map((tool) => tool.function?.name);
  assert.ok(offered.includes("multi_agent_v1__close_agent"), offered.join(", "));
  const output = fake.seen[1].messages.find((m) => m.role === "tool");
  assert.equal(output.tool_call_id, "call_ns");
  assert.doesNotMatch(output.content, /unsupported call/);
  assert.match(output.content, /nobody/);
  const call = fake.seen[1].messages.find((m) => m.role === "assistant" && m.tool_calls)?.tool_calls[0];
  assert.equal(call.function.name, "multi_agent_v1__close_agent", "the call went back flat");
  assert.equal(translated.balance(key).total, 10 - 2 * PRICE);
});
