// OpenAI's coding-agent CLI (`codex exec`, which speaks only the Responses API) against the
// example gateway in mock mode, configured as its users configure a provider: a base URL, a key
// variable and `wire_api = "responses"`. The demo catalogue's upstreams translate, so Codex's
// built-in web search and its namespaced multi-agent tools, which translate to nothing, are
// switched off, as the README tells Codex users to do.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import { MOCK_TEXT, startGateway } from "./gateway.mjs";

const CODEX = new URL("./node_modules/.bin/codex", import.meta.url).pathname;

let gateway, home;

before(async () => {
  gateway = await startGateway({});
  home = mkdtempSync(join(tmpdir(), "mg-codex-"));
});

after(async () => {
  await gateway.stop();
  assert.match(gateway.audit(), /audit passed/);
  rmSync(gateway.dir, { recursive: true, force: true });
  rmSync(home, { recursive: true, force: true });
});

function codex(key, prompt) {
  const settings = [
    "model_provider=mg",
    'model_providers.mg.name="model-gateway"',
    `model_providers.mg.base_url="${gateway.base}/v1"`,
    'model_providers.mg.env_key="MODEL_GATEWAY_KEY"',
    'model_providers.mg.wire_api="responses"',
    "model=gpt-4o-mini",
    "web_search=disabled",
  ];
  const args = ["exec", "--skip-git-repo-check", "--disable", "multi_agent"];
  for (const setting of settings) args.push("-c", setting);
  args.push(prompt);
  return spawnSync(CODEX, args, {
    env: { ...process.env, CODEX_HOME: home, MODEL_GATEWAY_KEY: key },
    input: "",
    encoding: "utf8",
    timeout: 120_000,
  });
}

test("the coding-agent CLI runs a turn through the Responses API, charged once", () => {
  const key = gateway.newKey(10);
  const run = codex(key, "Say hello.");
  assert.equal(run.status, 0, run.stderr);
  assert.equal(run.stdout.trim(), MOCK_TEXT);
  const calls = gateway.logs(key);
  assert.deepEqual(calls.map((c) => [c.protocol, c.status]), [["responses", "ok"]]);
  assert.equal(gateway.balance(key).total, 10 - 2);
});

test("the coding-agent CLI reports the gateway's refusal and nothing is charged", () => {
  const key = gateway.newKey(1);
  const run = codex(key, "Say hello.");
  assert.notEqual(run.status, 0);
  assert.match(run.stderr, /积分不足/);
  assert.deepEqual(gateway.logs(key), []);
});
