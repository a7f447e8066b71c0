// Google's clients on the gateway's Gemini API, changing only base URL and key: the Node SDK
// (`@google/genai`: `generateContent`, `generateContentStream`) against the mock, and the Gemini
// CLI (`gemini -p`, pointed at the gateway as its docs say: `GOOGLE_GEMINI_BASE_URL`,
// `GEMINI_API_KEY`, the API-key auth chosen in its settings) completing a turn that runs its
// `write_file` tool, on a Gemini model whose fake provider speaks only the Gemini API and on a
// chat-completions model whose fake provider speaks only chat completions (translated).

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { createServer } from "node:http";
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { GoogleGenAI } from "@google/genai";

import { MOCK_TEXT, pieces, startGateway } from "./gateway.mjs";

const GEMINI = new URL("./node_modules/.bin/gemini", import.meta.url).pathname;
const MOCK_MODEL = "gemini-3.5-flash-lite";
const MOCK_PRICE = 1;
const MODEL = "gemini-for-cli";
const PRICE = 2;
const GREETING = "Hello from the gateway, 世界\n";
const FINAL_TEXT = "Wrote greeting.txt.";

let mock;

before(async () => {
  mock = await startGateway({});
});

after(async () => {
  await mock?.stop();
});

test("@google/genai generateContent gets the mock's reply, charged once", async () => {
  const key = mock.newKey(10);
  const ai = new GoogleGenAI({ apiKey: key, httpOptions: { baseUrl: mock.base } });
  const reply = await ai.models.generateContent({ model: MOCK_MODEL, contents: "Hello" });
  assert.equal(reply.text, MOCK_TEXT);
  assert.equal(reply.usageMetadata.candidatesTokenCount, 16);
  assert.equal(mock.balance(key).total, 10 - MOCK_PRICE);
  const [entry] = mock.logs(key);
  assert.deepEqual([entry.protocol, entry.model, entry.status], ["gemini", MOCK_MODEL, "ok"]);
});

test("@google/genai generateContentStream reads several chunks, charged once", async () => {
  const key = mock.newKey(10);
  const ai = new GoogleGenAI({ apiKey: key, httpOptions: { baseUrl: mock.base } });
  const chunks = [];
  for await (const chunk of await ai.models.generateContentStream({ model: MOCK_MODEL, contents: "Hello" })) {
    chunks.push(chunk);
  }
  assert.ok(chunks.length > 1, `${chunks.length} chunks`);
  assert.equal(chunks.map((chunk) => chunk.text).join(""), MOCK_TEXT);
  assert.equal(chunks.at(-1).candidates[0].finishReason, "STOP");
  assert.equal(mock.balance(key).total, 10 - MOCK_PRICE);
  assert.deepEqual(mock.logs(key).map((entry) => entry.status), ["ok"]);
});

test("@google/genai reads a refusal's text from Google's error object", async () => {
  const key = mock.newKey(0);
  const ai = new GoogleGenAI({ apiKey: key, httpOptions: { baseUrl: mock.base } });
  await assert.rejects(ai.models.generateContent({ model: MOCK_MODEL, contents: "Hello" }), (error) => {
    assert.equal(error.status, 402);
    assert.match(error.message, /积分不足/);
    return true;
  });
});

/// A Gemini provider. A request that offers `write_file` gets a call of it writing GREETING to
/// `greeting.txt` in `dir`; once the request carries the tool's response, FINAL_TEXT. A request
/// without tools (the CLI's own small asks) gets a short text. Streams as Google does (whole
/// responses as server-sent events, `\r\n` line ends). Records each request.
function startFakeGemini(dir) {
  const seen = [];
  const server = createServer((request, response) => {
    let body = "";
    request.on("data", (chunk) => (body += chunk));
    request.on("end", () => {
      const asked = JSON.parse(body || "{}");
      seen.push({ path: request.url, key: request.headers["x-goog-api-key"], body: asked });
      const declared = (asked.tools ?? []).flatMap((tool) => tool.functionDeclarations ?? []);
      const offersWrite = declared.some((fn) => fn.name === "write_file");
      const answered = (asked.contents ?? []).some((content) => (content.parts ?? []).some((part) => part.functionResponse));
      const usage = { promptTokenCount: 1200, cachedContentTokenCount: 1000, candidatesTokenCount: 30, totalTokenCount: 1230 };
      const chunk = (parts, finish) => ({
        candidates: [{ content: { role: "model", parts }, index: 0, ...(finish ? { finishReason: finish } : {}) }],
        usageMetadata: finish ? usage : { promptTokenCount: 1200 },
        modelVersion: "gemini-fake",
      });
      let chunks;
      if (offersWrite && !answered) {
        const args = { file_path: join(dir, "greeting.txt"), content: GREETING };
        chunks = [chunk([{ functionCall: { name: "write_file", args } }], "STOP")];
      } else {
        const text = offersWrite ? FINAL_TEXT : "Greeting";
        const parts = pieces(text, 5);
        chunks = parts.map((piece, i) => chunk([{ text: piece }], i === parts.length - 1 ? "STOP" : null));
      }
      if (request.url.includes(":streamGenerateContent")) {
        response.writeHead(200, { "content-type": "text/event-stream" });
        for (const event of chunks) response.write(`data: ${JSON.stringify(event)}\r\n\r\n`);
        response.end();
      } else if (request.url.includes(":countTokens")) {
        response.writeHead(200, { "content-type": "application/json" });
        response.end(JSON.stringify({ totalTokens: 1200 }));
      } else {
        const parts = chunks.flatMap((c) => c.candidates[0].content.parts);
        response.writeHead(200, { "content-type": "application/json" });
        response.end(JSON.stringify({ ...chunk(parts, "STOP") }));
      }
    });
  });
  return new Promise((resolve) =>
    server.listen(0, "127.0.0.1", () => resolve({ server, seen, base: `http://127.0.0.1:${server.address().port}` })),
  );
}

/// A chat-completions provider playing the same model as `startFakeGemini`, in its own format.
function startFakeChat(dir) {
  const seen = [];
  const server = createServer((request, response) => {
    let body = "";
    request.on("data", (chunk) => (body += chunk));
    request.on("end", () => {
      const asked = JSON.parse(body || "{}");
      seen.push({ path: request.url, key: request.headers.authorization, body: asked });
      const offersWrite = (asked.tools ?? []).some((tool) => tool.function?.name === "write_file");
      const answered = (asked.messages ?? []).some((m) => m.role === "tool");
      const base = { id: "chatcmpl-fake", object: "chat.completion.chunk", created: 1732000000, model: "fake" };
      const chunk = (delta, finish = null) => ({ ...base, choices: [{ index: 0, delta, finish_reason: finish }] });
      const usage = { prompt_tokens: 1200, completion_tokens: 30, total_tokens: 1230 };
      const events = [];
      let message;
      if (offersWrite && !answered) {
        const args = JSON.stringify({ file_path: join(dir, "greeting.txt"), content: GREETING });
        const call = { index: 0, id: "call_write", type: "function", function: { name: "write_file", arguments: "" } };
        events.push(chunk({ role: "assistant", content: null, tool_calls: [call] }));
        for (const piece of pieces(args, 9)) events.push(chunk({ tool_calls: [{ index: 0, function: { arguments: piece } }] }));
        events.push(chunk({}, "tool_calls"));
        message = { role: "assistant", content: null, tool_calls: [{ id: "call_write", type: "function", function: { name: "write_file", arguments: args } }] };
      } else {
        const text = offersWrite ? FINAL_TEXT : "Greeting";
        events.push(chunk({ role: "assistant", content: "" }));
        for (const piece of pieces(text, 5)) events.push(chunk({ content: piece }));
        events.push(chunk({}, "stop"));
        message = { role: "assistant", content: text };
      }
      events.push({ ...base, choices: [], usage });
      if (asked.stream) {
        response.writeHead(200, { "content-type": "text/event-stream" });
        for (const event of events) response.write(`data: ${JSON.stringify(event)}\n\n`);
        response.end("data: [DONE]\n\n");
      } else {
        response.writeHead(200, { "content-type": "application/json" });
        const finish = message.tool_calls ? "tool_calls" : "stop";
        response.end(JSON.stringify({ ...base, object: "chat.completion", choices: [{ index: 0, message, finish_reason: finish }], usage }));
      }
    });
  });
  return new Promise((resolve) =>
    server.listen(0, "127.0.0.1", () => resolve({ server, seen, base: `http://127.0.0.1:${server.address().port}` })),
  );
}

/// The Gemini CLI writing its greeting through the gateway to a provider started by `start`,
/// which `upstream` (a catalogue upstream entry's body) and `endpoints` reach; each call charged.
async function cliTurn(start, upstream, endpoints) {
  const dir = mkdtempSync(join(tmpdir(), "mg-gemini-cli-"));
  const work = join(dir, "work");
  const home = join(dir, "home");
  mkdirSync(work);
  mkdirSync(join(home, ".gemini"), { recursive: true });
  // The API-key auth, chosen as the CLI's settings choose it.
  writeFileSync(join(home, ".gemini", "settings.json"), JSON.stringify({ security: { auth: { selectedType: "gemini-api-key" } } }));
  const provider = await start(work);
  const catalogue = join(dir, "models.toml");
  writeFileSync(
    catalogue,
    `streaming = true
[[upstreams]]
name = "provider"
${upstream(provider.base)}
api_key_env = "FAKE_PROVIDER_KEY"
[[models]]
name = "${MODEL}"
${endpoints}
price = ${PRICE}
upstreams = [{ name = "provider", upstream_model = "gemini-2.5-flash" }]
`,
  );
  const gateway = await startGateway({ MOCK_UPSTREAM: "0", GATEWAY_MODELS: catalogue, FAKE_PROVIDER_KEY: "sk-fake-provider" });
  try {
    const key = gateway.newKey(100);
    const run = spawn(GEMINI, ["-p", "Write a greeting to greeting.txt", "-m", MODEL, "--approval-mode", "yolo"], {
      cwd: work,
      env: {
        ...process.env,
        HOME: home,
        GOOGLE_GEMINI_BASE_URL: gateway.base,
        GEMINI_API_KEY: key,
        GEMINI_CLI_TRUST_WORKSPACE: "true",
      },
      stdio: ["ignore", "pipe", "pipe"],
    });
    let out = "";
    let err = "";
    run.stdout.on("data", (chunk) => (out += chunk));
    run.stderr.on("data", (chunk) => (err += chunk));
    const code = await new Promise((resolve) => run.on("exit", resolve));
    assert.equal(code, 0, `gemini exited ${code}: ${out}\n${err}`);
    assert.match(out, new RegExp(FINAL_TEXT.replace(".", "\\.")));
    assert.equal(readFileSync(join(work, "greeting.txt"), "utf8"), GREETING);
    // Each call the CLI made was charged once.
    const entries = gateway.logs(key);
    assert.ok(entries.length >= 2, JSON.stringify(entries));
    assert.ok(entries.every((entry) => entry.status === "ok" && entry.protocol === "gemini"));
    assert.equal(gateway.balance(key).total, 100 - PRICE * entries.length);
    assert.match(gateway.audit(), /audit passed/);
    return provider.seen;
  } finally {
    await gateway.stop();
    provider.server.close();
    rmSync(dir, { recursive: true, force: true });
  }
}

test("the Gemini CLI completes a turn that runs a tool on a Gemini model", async () => {
  const seen = await cliTurn(startFakeGemini, (base) => `kind = "gemini"\nbase_url = "${base}"`, 'protocol = "gemini"');
  // The tool's response went back to the provider, on the channel's model, with its own key.
  const calls = seen.filter((request) => request.path.includes("GenerateContent"));
  assert.ok(calls.some((request) => (request.body.contents ?? []).some((c) => (c.parts ?? []).some((p) => p.functionResponse))));
  assert.ok(calls.every((request) => request.path.startsWith("/v1beta/models/gemini-2.5-flash:")));
  assert.ok(seen.every((request) => request.key === "sk-fake-provider"));
});

test("the Gemini CLI completes a turn that runs a tool on a chat-completions model", async () => {
  const seen = await cliTurn(
    startFakeChat,
    (base) => `kind = "openai"\nbase_url = "${base}/v1"`,
    'protocol = "chat_completions"\nendpoints = ["chat_completions", "gemini"]',
  );
  // Asked in chat completions: the tool's result as a tool message answering the call.
  assert.ok(seen.every((request) => request.path === "/v1/chat/completions" && request.body.model === "gemini-2.5-flash"));
  const answered = seen.find((request) => request.body.messages.some((m) => m.role === "tool"));
  assert.ok(answered, JSON.stringify(seen.map((r) => r.body.messages)));
  const tool = answered.body.messages.find((m) => m.role === "tool");
  assert.equal(tool.tool_call_id, "call_write");
  assert.ok(seen.every((request) => request.key === "Bearer sk-fake-provider"));
});
