"""A fake LLM provider that calls a tool in each protocol's format, for the SDK tests.

It answers `POST /v1/chat/completions` (OpenAI), `POST /v1/responses` (OpenAI's Responses API),
`POST /v1/messages` (Anthropic) and `POST /v1beta/models/{model}:generateContent`,
`:streamGenerateContent?alt=sse` and `:countTokens` (Google's Gemini API), each only in its own format (a gateway that reaches one of them
for another protocol's client translates). The model calls `get_weather` with TOOL_INPUT, its arguments cut
into several deltas when streamed, as the providers send them; once the request carries the tool's
result (a `tool` message, a `tool_result` block, or a `function_call_output` item), it answers
FINAL_TEXT instead. A chat
request that offers a custom tool (free-form input) gets a call of that tool with PATCH instead.
A request without `stream: true` gets a complete JSON reply.
"""

import itertools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOOL_INPUT = {"location": "Paris, France", "unit": "celsius"}
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+Hello, 世界\n*** End Patch\n"
FINAL_TEXT = "It is 18°C and cloudy in Paris."
CREATED = 1732000000


def _argument_pieces():
    text = json.dumps(TOOL_INPUT)
    return [text[i : i + 7] for i in range(0, len(text), 7)]


def _custom_tool(request):
    """The name of the first custom tool the chat request offers, if any."""
    tools = request.get("tools") or []
    return next((t["custom"]["name"] for t in tools if isinstance(t, dict) and t.get("type") == "custom"), None)


def chat_events(custom_tool=None):
    base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1732000000, "model": "gpt-4o-mini"}

    def chunk(delta, finish=None):
        return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    if custom_tool:
        # A custom tool's call, as chat completions writes one in a reply, in pieces.
        call = {"index": 0, "id": "call_custom", "type": "custom", "custom": {"name": custom_tool, "input": ""}}
        pieces = [PATCH[i : i + 8] for i in range(0, len(PATCH), 8)]
        deltas = [{"tool_calls": [{"index": 0, "custom": {"input": piece}}]} for piece in pieces]
    else:
        call = {"index": 0, "id": "call_fake", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
        deltas = [{"tool_calls": [{"index": 0, "function": {"arguments": piece}}]} for piece in _argument_pieces()]
    events = [chunk({"role": "assistant", "content": None, "tool_calls": [call]})]
    events += [chunk(delta) for delta in deltas]
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


def _text_pieces():
    return [FINAL_TEXT[i : i + 9] for i in range(0, len(FINAL_TEXT), 9)]


def chat_text_events():
    base = {"id": "chatcmpl-fake2", "object": "chat.completion.chunk", "created": CREATED, "model": "gpt-4o-mini"}
    events = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    for piece in _text_pieces():
        events.append({**base, "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
    events.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    events.append({**base, "choices": [], "usage": {"prompt_tokens": 80, "completion_tokens": 10, "total_tokens": 90}})
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def chat_reply(answered, custom_tool=None):
    if answered:
        message = {"role": "assistant", "content": FINAL_TEXT}
        finish, usage = "stop", {"prompt_tokens": 80, "completion_tokens": 10, "total_tokens": 90}
    else:
        call = {"id": "call_fake", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps(TOOL_INPUT)}}
        if custom_tool:
            call = {"id": "call_custom", "type": "custom", "custom": {"name": custom_tool, "input": PATCH}}
        message = {"role": "assistant", "content": None, "tool_calls": [call]}
        finish, usage = "tool_calls", {"prompt_tokens": 50, "completion_tokens": 20, "total_tokens": 70}
    return {"id": "chatcmpl-fake", "object": "chat.completion", "created": CREATED, "model": "gpt-4o-mini",
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}], "usage": usage}


_response_ids = itertools.count(1)


def _response(status, output, usage, id="resp_fake"):
    return {"id": id, "object": "response", "created_at": CREATED, "status": status, "error": None,
            "incomplete_details": None, "instructions": None, "max_output_tokens": None, "metadata": {},
            "model": "gpt-4o-mini", "output": output, "parallel_tool_calls": True, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False, "temperature": 1.0,
            "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [], "top_p": 1.0,
            "truncation": "disabled", "usage": usage, "user": None}


def _response_usage(input_tokens, output_tokens):
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def _call_item(status, arguments):
    return {"id": "fc_fake", "type": "function_call", "status": status, "call_id": "call_fake",
            "name": "get_weather", "arguments": arguments}


def _message_item(status, text):
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {"id": "msg_fake", "type": "message", "status": status, "role": "assistant", "content": content}


def responses_reply(answered, id=None):
    """A response, with a new id unless given one (a provider never gives two the same)."""
    id = id or f"resp_fake_{next(_response_ids)}"
    if answered:
        return _response("completed", [_message_item("completed", FINAL_TEXT)], _response_usage(80, 10), id)
    return _response("completed", [_call_item("completed", json.dumps(TOOL_INPUT))], _response_usage(50, 20), id)


def responses_events(answered):
    final = responses_reply(answered)
    id = final["id"]
    events = [("response.created", {"response": _response("in_progress", [], None, id)}),
              ("response.in_progress", {"response": _response("in_progress", [], None, id)})]
    if answered:
        part = {"type": "output_text", "text": "", "annotations": []}
        events += [("response.output_item.added", {"output_index": 0, "item": _message_item("in_progress", "")}),
                   ("response.content_part.added", {"item_id": "msg_fake", "output_index": 0, "content_index": 0, "part": part})]
        for piece in _text_pieces():
            events.append(("response.output_text.delta", {"item_id": "msg_fake", "output_index": 0, "content_index": 0, "delta": piece}))
        done = {**part, "text": FINAL_TEXT}
        events += [("response.output_text.done", {"item_id": "msg_fake", "output_index": 0, "content_index": 0, "text": FINAL_TEXT}),
                   ("response.content_part.done", {"item_id": "msg_fake", "output_index": 0, "content_index": 0, "part": done}),
                   ("response.output_item.done", {"output_index": 0, "item": _message_item("completed", FINAL_TEXT)})]
    else:
        events.append(("response.output_item.added", {"output_index": 0, "item": _call_item("in_progress", "")}))
        for piece in _argument_pieces():
            events.append(("response.function_call_arguments.delta", {"item_id": "fc_fake", "output_index": 0, "delta": piece}))
        arguments = json.dumps(TOOL_INPUT)
        events += [("response.function_call_arguments.done", {"item_id": "fc_fake", "output_index": 0, "arguments": arguments}),
                   ("response.output_item.done", {"output_index": 0, "item": _call_item("completed", arguments)})]
    events.append(("response.completed", {"response": final}))
    return "".join(
        f"event: {name}\ndata: {json.dumps({'type': name, 'sequence_number': n, **data})}\n\n"
        for n, (name, data) in enumerate(events)
    )


def messages_reply(answered):
    """A complete message: the tool call, or once answered FINAL_TEXT."""
    if answered:
        content, stop, usage = [{"type": "text", "text": FINAL_TEXT}], "end_turn", {"input_tokens": 80, "output_tokens": 10}
    else:
        content = [{"type": "tool_use", "id": "toolu_fake", "name": "get_weather", "input": TOOL_INPUT}]
        stop, usage = "tool_use", {"input_tokens": 50, "output_tokens": 20}
    return {"id": "msg_fake", "type": "message", "role": "assistant", "model": "claude-haiku-4-5",
            "content": content, "stop_reason": stop, "stop_sequence": None, "usage": usage}


def messages_text_events():
    events = [
        ("message_start", {"type": "message_start", "message": {
            "id": "msg_fake2", "type": "message", "role": "assistant", "model": "claude-haiku-4-5",
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 80, "output_tokens": 1}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
    ]
    for piece in _text_pieces():
        events.append(("content_block_delta", {"type": "content_block_delta", "index": 0,
                                               "delta": {"type": "text_delta", "text": piece}}))
    events += [
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                           "usage": {"output_tokens": 10}}),
        ("message_stop", {"type": "message_stop"}),
    ]
    return "".join(f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events)


# What the fake Gemini reports: 20 of the 50 prompt tokens read from a cache, 5 thinking tokens
# beside the 10 of the candidates.
GEMINI_USAGE = {"promptTokenCount": 50, "cachedContentTokenCount": 20, "candidatesTokenCount": 10,
                "thoughtsTokenCount": 5, "totalTokenCount": 65}


def _gemini_response(parts, finish=None, usage=None):
    candidate = {"content": {"role": "model", "parts": parts}, "index": 0}
    if finish:
        candidate["finishReason"] = finish
    reply = {"candidates": [candidate], "modelVersion": "gemini-fake", "responseId": "fake-gemini"}
    if usage:
        reply["usageMetadata"] = usage
    return reply


def gemini_reply(answered):
    """A complete `GenerateContentResponse`: the function call, or once answered FINAL_TEXT."""
    if answered:
        return _gemini_response([{"text": FINAL_TEXT}], "STOP", GEMINI_USAGE)
    call = {"functionCall": {"name": "get_weather", "args": TOOL_INPUT}}
    return _gemini_response([call], "STOP", GEMINI_USAGE)


def gemini_events(answered):
    """Google's server-sent events: whole responses, the last with its finish reason and usage
    (each carries the prompt's count, as Google's do)."""
    running = {"promptTokenCount": 50}
    if answered:
        pieces = _text_pieces()
        chunks = [_gemini_response([{"text": piece}], usage=running) for piece in pieces[:-1]]
        chunks.append(_gemini_response([{"text": pieces[-1]}], "STOP", GEMINI_USAGE))
    else:
        call = {"functionCall": {"name": "get_weather", "args": TOOL_INPUT}}
        chunks = [_gemini_response([call], "STOP", GEMINI_USAGE)]
    return "".join(f"data: {json.dumps(c)}\r\n\r\n" for c in chunks)


def _gemini_answered(request):
    """Whether the Gemini request carries a function's response."""
    return any(
        isinstance(part, dict) and "functionResponse" in part
        for content in request.get("contents") or []
        for part in content.get("parts") or []
    )


def _answered(request):
    """Whether the request carries the tool's result (a `tool` message, a `tool_result` block, or
    a `function_call_output` item)."""
    if isinstance(request.get("messages"), list):
        def has_result(m):
            content = m.get("content")
            blocks = content if isinstance(content, list) else []
            return m.get("role") == "tool" or any(
                isinstance(b, dict) and b.get("type") == "tool_result" for b in blocks)
        return any(isinstance(m, dict) and has_result(m) for m in request["messages"])
    items = request.get("input")
    return isinstance(items, list) and any(
        isinstance(i, dict) and i.get("type") == "function_call_output" for i in items
    )


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Every request's path and body, in order, for the tests to look at.
    seen = []
    # The key each Gemini request was sent with.
    gemini_keys = []

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        _Handler.seen.append((self.path, request))
        if self.path.startswith("/v1beta/models/"):
            _Handler.gemini_keys.append(self.headers.get("x-goog-api-key"))
            return self._gemini(request)
        answered = _answered(request)
        stream = request.get("stream") is True
        if self.path.endswith("/chat/completions"):
            custom_tool = _custom_tool(request)
            if not stream:
                return self._json(chat_reply(answered, custom_tool))
            body = chat_text_events() if answered else chat_events(custom_tool)
        elif self.path.endswith("/responses"):
            if not stream:
                return self._json(responses_reply(answered))
            body = responses_events(answered)
        else:
            if not stream:
                return self._json(messages_reply(answered))
            body = messages_text_events() if answered else messages_events()
        self._events(body.split("\n\n")[:-1], "\n\n")

    def _events(self, events, end):
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("connection", "close")
        self.end_headers()
        # One event per write, as a provider sends them.
        for event in events:
            self.wfile.write((event + end).encode())
            self.wfile.flush()
        self.close_connection = True

    def _gemini(self, request):
        verb = self.path.split("?")[0].rsplit(":", 1)[-1]
        if verb == "countTokens":
            return self._json({"totalTokens": 42})
        answered = _gemini_answered(request)
        if verb == "generateContent":
            return self._json(gemini_reply(answered))
        assert verb == "streamGenerateContent" and self.path.endswith("?alt=sse"), self.path
        self._events(gemini_events(answered).split("\r\n\r\n")[:-1], "\r\n\r\n")

    def do_GET(self):
        # A stored response, as a native Responses provider keeps it.
        _Handler.seen.append((self.path, None))
        if self.path.startswith("/v1/responses/"):
            return self._json(responses_reply(True, id=self.path.rsplit("/", 1)[-1]))
        self.send_response(404)
        self.send_header("content-length", "0")
        self.end_headers()

    def _json(self, reply, status=200):
        body = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.send_header("connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def log_message(self, *args):
        pass


def seen():
    """The (path, body) of every request received so far."""
    return list(_Handler.seen)


def start():
    """Starts the provider on a free port; returns (server, base URL)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def gemini_keys():
    """The `x-goog-api-key` of every Gemini request received so far."""
    return list(_Handler.gemini_keys)
