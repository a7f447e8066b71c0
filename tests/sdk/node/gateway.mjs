// The example gateway as the Node tests start it: a temporary SQLite file, streaming on, mock
// mode unless the environment given says otherwise.

import { spawn, execFileSync } from "node:child_process";
import { mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import net from "node:net";

const GATEWAY_BIN = process.env.GATEWAY_BIN ?? new URL("../../../target/debug/examples/gateway", import.meta.url).pathname;
export const MOCK_TEXT = "This is a demo reply from model-gateway's mock upstream; no model was called.";

/// `text` cut into pieces of `size` characters, as a provider streams it.
export function pieces(text, size) {
  const out = [];
  for (let i = 0; i < text.length; i += size) out.push(text.slice(i, i + size));
  return out;
}

function freePort() {
  return new Promise((resolve) => {
    const server = net.createServer().listen(0, "127.0.0.1", () => {
      const { port } = server.address();
      server.close(() => resolve(port));
    });
  });
}

export async function startGateway(env) {
  const dir = mkdtempSync(join(tmpdir(), "mg-node-"));
  const listen = `127.0.0.1:${await freePort()}`;
  const fullEnv = {
    ...process.env,
    DATABASE_URL: `sqlite://${join(dir, "gateway.db")}?mode=rwc`,
    MOCK_UPSTREAM: "1",
    GATEWAY_STREAMING: "1",
    GATEWAY_LISTEN: listen,
    ...env,
  };
  const server = spawn(GATEWAY_BIN, ["serve"], { env: fullEnv, stdio: ["ignore", "ignore", "pipe"] });
  let log = "";
  server.stderr.on("data", (chunk) => (log += chunk));
  const deadline = Date.now() + 30_000;
  for (;;) {
    const up = await new Promise((resolve) => {
      const socket = net.connect({ host: "127.0.0.1", port: Number(listen.split(":")[1]) });
      socket.on("connect", () => (socket.destroy(), resolve(true)));
      socket.on("error", () => resolve(false));
    });
    if (up) break;
    if (Date.now() > deadline || server.exitCode !== null) throw new Error(`gateway did not start: ${log}`);
    await new Promise((r) => setTimeout(r, 100));
  }
  const command = (...args) => execFileSync(GATEWAY_BIN, args, { env: fullEnv, encoding: "utf8" });
  return {
    dir,
    base: `http://${listen}`,
    newKey: (subscription) => command("keys", "create", "--subscription", String(subscription)).trim().split("\n").pop(),
    balance: (key) => JSON.parse(command("balance", "--key", key)),
    logs: (key) => JSON.parse(command("logs", "--key", key)),
    stop: () => new Promise((resolve) => (server.on("exit", resolve), server.kill("SIGINT"))),
    // The access-log lines so far of requests to `path` answered `status`.
    accessLines: (path, status) =>
      log.split("\n").filter((line) => line.includes("model_gateway::access") && line.includes(` path="${path}" status=${status} `)),
    audit: () => command("audit"),
  };
}

