"""A fake LLM provider that streams tool use in each protocol's event format, for the SDK tests.

It answers `POST /v1/chat/completions` (OpenAI) and `POST /v1/messages` (Anthropic) with a
server-sent event stream in which the model calls `get_weather` with TOOL_INPUT, its arguments
cut into several deltas, as the providers send them.
"""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOOL_INPUT = {"location": "Paris, France", "unit": "celsius"}


def _argument_pieces():
    text = json.dumps(TOOL_INPUT)
    return [text[i : i + 7] for i in range(0, len(text), 7)]


def chat_events():
    base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1732000000, "model": "gpt-4o-mini"}

    def chunk(delta, finish=None):
        return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    call = {"index": 0, "id": "call_fake", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    events = [chunk({"role": "assistant", "content": None, "tool_calls": [call]})]
    for piece in _argument_pieces():
        events.append(chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}))
    events.append(chunk({}, "tool_calls"))
    usage = {"prompt_tokens": 50, "completion_tokens": 20, "total_tokens": 70}
    events.append({**base, "choices": [], "usage": usage})
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def messages_events():
    events = [
        ("message_start", {"type": "message_start", "message": {
            "id": "msg_fake", "type": "message", "role": "assistant", "model": "claude-haiku-4-5",
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 50, "output_tokens": 1}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {
            "type": "tool_use", "id": "toolu_fake", "name": "get_weather", "input": {}}}),
        ("ping", {"type": "ping"}),
    ]
    for piece in _argument_pieces():
        events.append(("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
            "type": "input_json_delta", "partial_json": piece}}))
    events += [
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                           "usage": {"output_tokens": 20}}),
        ("message_stop", {"type": "message_stop"}),
    ]
    return "".join(f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body = chat_events() if self.path.endswith("/chat/completions") else messages_events()
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("connection", "close")
        self.end_headers()
        # One event per write, as a provider sends them.
        for event in body.split("\n\n")[:-1]:
            self.wfile.write((event + "\n\n").encode())
            self.wfile.flush()
        self.close_connection = True

    def log_message(self, *args):
        pass


def start():
    """Starts the provider on a free port; returns (server, base URL)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
