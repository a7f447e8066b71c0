// Claude Code (`claude -p`, which speaks only Anthropic's messages API) against the example
// gateway, configured as its users point it at a gateway (`ANTHROPIC_BASE_URL`,
// `ANTHROPIC_API_KEY`), on a model whose provider speaks only chat completions: its messages
// calls are translated to chat completions and back, streamed. The fake provider's model runs
// Claude Code's `Bash` tool, then answers once the request carries the tool's result.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { createServer } from "node:http";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import { pieces, startGateway } from "./gateway.mjs";

const CLAUDE = new URL("./node_modules/.bin/claude", import.meta.url).pathname;
const MODEL = "chat-for-claude-code";
const PRICE = 2;
const COMMAND = "echo 'Hello from the gateway, 世界' > greeting.txt";
const FINAL_TEXT = "Wrote greeting.txt.";

/// A chat-completions provider. A request that offers `Bash` gets a call of it running COMMAND,
/// its arguments streamed in pieces; once the request carries the tool's result, FINAL_TEXT. A
/// request without tools (Claude Code's own small asks) gets a short text. Records each request.
function startFakeProvider() {
  const seen = [];
  const server = createServer((request, response) => {
    let body = "";
    request.on("data", (chunk) => (body += chunk));
    request.on("end", () => {
      const asked = JSON.parse(body || "{}");
      seen.push({ path: request.url, body: asked });
      const offersBash = (asked.tools ?? []).some((tool) => tool.function?.name === "Bash");
      const answered = (asked.messages ?? []).some((m) => m.role === "tool");
      const base = { id: "chatcmpl-fake", object: "chat.completion.chunk", created: 1732000000, model: "fake" };
      const chunk = (delta, finish = null) => ({ ...base, choices: [{ index: 0, delta, finish_reason: finish }] });
      const events = [];
      if (offersBash && !answered) {
        const call = { index: 0, id: "call_bash", type: "function", function: { name: "Bash", arguments: "" } };
        events.push(chunk({ role: "assistant", content: null, tool_calls: [call] }));
        const args = JSON.stringify({ command: COMMAND, description: "Write the greeting" });
        for (const piece of pieces(args, 7)) events.push(chunk({ tool_calls: [{ index: 0, function: { arguments: piece } }] }));
        events.push(chunk({}, "tool_calls"));
      } else {
        const text = offersBash ? FINAL_TEXT : "Greeting";
        events.push(chunk({ role: "assistant", content: "" }));
        for (const piece of pieces(text, 5)) events.push(chunk({ content: piece }));
        events.push(chunk({}, "stop"));
      }
      events.push({ ...base, choices: [], usage: { prompt_tokens: 1200, completion_tokens: 30, total_tokens: 1230, prompt_tokens_details: { cached_tokens: 1000 } } });
      if (asked.stream) {
        response.writeHead(200, { "content-type": "text/event-stream" });
        for (const event of events) response.write(`data: ${JSON.stringify(event)}\n\n`);
        response.end("data: [DONE]\n\n");
      } else {
        const text = offersBash ? FINAL_TEXT : "Greeting";
        response.writeHead(200, { "content-type": "application/json" });
        response.end(JSON.stringify({ ...base, object: "chat.completion", choices: [{ index: 0, message: { role: "assistant", content: text }, finish_reason: "stop" }], usage: events.at(-1).usage }));
      }
    });
  });
  return new Promise((resolve) => server.listen(0, "127.0.0.1", () => resolve({ server, seen })));
}

let gateway, fake, dir;

before(async () => {
  dir = mkdtempSync(join(tmpdir(), "mg-claude-code-"));
  fake = await startFakeProvider();
  writeFileSync(join(dir, "models.toml"), `streaming = true
[[upstreams]]
name = "chat-only"
kind = "openai"
base_url = "http://127.0.0.1:${fake.server.address().port}/v1"
api_key_env = "FAKE_PROVIDER_KEY"
[[models]]
name = "${MODEL}"
protocol = "chat_completions"
endpoints = ["chat_completions", "messages"]
price = ${PRICE}
upstream = "chat-only"
`);
  gateway = await startGateway({ MOCK_UPSTREAM: "0", GATEWAY_MODELS: join(dir, "models.toml"), FAKE_PROVIDER_KEY: "sk-fake" });
});

after(async () => {
  await gateway.stop();
  assert.match(gateway.audit(), /audit passed/);
  rmSync(gateway.dir, { recursive: true, force: true });
  fake.server.close();
  rmSync(dir, { recursive: true, force: true });
});

/// `claude -p prompt` against the gateway, in a fresh home and working directory, every model
/// it may use set to MODEL, its shell tool allowed. Run without blocking, so that the fake
/// provider in this process can answer.
function claude(key, prompt) {
  const home = mkdtempSync(join(dir, "home-"));
  const work = mkdtempSync(join(dir, "work-"));
  const args = ["-p", prompt, "--model", MODEL, "--allowedTools", "Bash", "--output-format", "text"];
  const child = spawn(CLAUDE, args, {
    cwd: work,
    env: {
      ...process.env,
      HOME: home,
      ANTHROPIC_BASE_URL: gateway.base,
      ANTHROPIC_API_KEY: key,
      ANTHROPIC_DEFAULT_HAIKU_MODEL: MODEL,
      ANTHROPIC_DEFAULT_SONNET_MODEL: MODEL,
      ANTHROPIC_DEFAULT_OPUS_MODEL: MODEL,
      ANTHROPIC_SMALL_FAST_MODEL: MODEL,
      CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC: "1",
      DISABLE_AUTOUPDATER: "1",
    },
    stdio: ["ignore", "pipe", "pipe"],
    timeout: 120_000,
  });
  let stdout = "";
  let stderr = "";
  child.stdout.setEncoding("utf8").on("data", (text) => (stdout += text));
  child.stderr.setEncoding("utf8").on("data", (text) => (stderr += text));
  return new Promise((resolve) => child.on("close", (status) => resolve({ status, stdout, stderr, work })));
}

test("Claude Code runs its shell tool on a chat-completions model, each call translated and charged once", async () => {
  const key = gateway.newKey(100);
  fake.seen.length = 0;
  const run = await claude(key, "Write a greeting to greeting.txt.");
  assert.equal(run.status, 0, `${run.stdout}\n${run.stderr}`);
  assert.equal(run.stdout.trim(), FINAL_TEXT);
  assert.equal(readFileSync(join(run.work, "greeting.txt"), "utf8"), "Hello from the gateway, 世界\n");
  // Every call reached the provider as chat completions; the turn's two carried Claude Code's
  // tools as function tools, and the second the shell's output as a tool message.
  assert.ok(fake.seen.every((asked) => asked.path === "/v1/chat/completions"));
  const turn = fake.seen.filter((asked) => (asked.body.tools ?? []).some((tool) => tool.function?.name === "Bash"));
  assert.equal(turn.length, 2, JSON.stringify(fake.seen.map((asked) => asked.body.messages?.length)));
  assert.ok(turn.every((asked) => asked.body.stream === true));
  const result = turn[1].body.messages.find((m) => m.role === "tool");
  assert.equal(result.tool_call_id, "call_bash");
  // Each call the gateway logged is a messages call, charged once.
  const calls = gateway.logs(key);
  assert.equal(calls.length, fake.seen.length);
  assert.ok(calls.every((c) => c.protocol === "messages" && c.status === "ok"), JSON.stringify(calls));
  assert.equal(gateway.balance(key).total, 100 - PRICE * calls.length);
});
