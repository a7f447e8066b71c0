"""Fake Amazon Bedrock and Google Vertex AI runtimes for the SDK tests, checking what the real ones
check, and answering as `fake_provider` does (a tool call, then FINAL_TEXT once the request
carries the tool's result).

- Bedrock (`POST /model/{id}/invoke` and `/invoke-with-response-stream`): each request's AWS
  Signature Version 4 is recomputed with botocore's own signer from the shared test credentials,
  and a bad one refused with 403; a body Bedrock would refuse (a `model` or `stream` field, the
  wrong `anthropic_version`) is refused with 400; streams are AWS event-stream frames (CRC-32 over
  the prelude and the whole frame) whose `chunk` events carry Anthropic's events as base64.
- Vertex AI: `POST /token` takes the JWT bearer grant only for a JWT whose RS256 signature
  verifies with the test service account's public key, and issues tokens; the publishers' paths
  (`anthropic` `:rawPredict`/`:streamRawPredict`, `google` `:generateContent`/
  `:streamGenerateContent?alt=sse`) refuse a token it did not issue or that expired.
"""

import base64
import json
import pathlib
import struct
import threading
import time
import zlib
from http.server import ThreadingHTTPServer

import jwt
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

import fake_provider

AWS_ACCESS_KEY_ID = "AKIAFAKEGATEWAYTEST1"
AWS_SECRET_ACCESS_KEY = "fAkE/sEcReT+kEy/oNlY/fOr/tEsTs/0123456789"
AWS_SESSION_TOKEN = "FwoGZXIvYXdzEFAKEsessionTOKENforTESTSonly"
REGION = "us-east-1"

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "fixtures"
VERTEX_PRIVATE_KEY = (FIXTURES / "vertex-test-key.pem").read_text()
VERTEX_PUBLIC_KEY = (FIXTURES / "vertex-test-key.pub.pem").read_text()
VERTEX_ACCOUNT = "gateway-test@fake-project.iam.gserviceaccount.com"
VERTEX_PROJECT, VERTEX_REGION = "fake-project", "us-east5"
TOKEN_LIFETIME = 3600


def frame(headers, payload):
    """One event-stream frame: its lengths, the prelude's CRC, string headers, the payload, and
    the CRC of everything before it."""
    encoded = b"".join(
        bytes([len(name)]) + name.encode() + b"\x07" + struct.pack(">H", len(value)) + value.encode()
        for name, value in headers
    )
    prelude = struct.pack(">II", 12 + len(encoded) + len(payload) + 4, len(encoded))
    message = prelude + struct.pack(">I", zlib.crc32(prelude)) + encoded + payload
    return message + struct.pack(">I", zlib.crc32(message))


def chunk_frames(sse):
    """Anthropic's server-sent events as Bedrock's `chunk` frames."""
    frames = []
    for event in sse.split("\n\n")[:-1]:
        data = next(line[len("data: "):] for line in event.split("\n") if line.startswith("data: "))
        payload = json.dumps({"bytes": base64.b64encode(data.encode()).decode(), "p": "abcdef"}).encode()
        headers = [(":event-type", "chunk"), (":content-type", "application/json"), (":message-type", "event")]
        frames.append(frame(headers, payload))
    return frames


def signature_problem(method, url, headers, body):
    """Why the request's signature is not good, recomputed with botocore's SigV4 signer; `None`
    when it is."""
    authorization = headers.get("authorization", "")
    if not authorization.startswith("AWS4-HMAC-SHA256 "):
        return "Missing Authentication Token"
    fields = dict(part.split("=", 1) for part in authorization[len("AWS4-HMAC-SHA256 "):].split(", "))
    key_id, date, region, service, _ = fields["Credential"].split("/")
    if key_id != AWS_ACCESS_KEY_ID or (region, service) != (REGION, "bedrock"):
        return "The security token included in the request is invalid."
    signed = fields["SignedHeaders"].split(";")
    request = AWSRequest(method=method, url=url, data=body, headers={name: headers[name] for name in signed})
    request.context["timestamp"] = headers["x-amz-date"]
    signer = SigV4Auth(Credentials(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN), "bedrock", REGION)
    expected = signer.signature(signer.string_to_sign(request, signer.canonical_request(request)), request)
    if expected != fields["Signature"]:
        return "The request signature we calculated does not match the signature you provided."
    return None


class _Cloud(fake_provider._Handler):
    calls = []
    refused = []
    tokens = {}

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        headers = {name.lower(): value for name, value in self.headers.items()}
        if self.path == "/token":
            return self._token(body)
        if self.path.startswith("/model/"):
            return self._bedrock(headers, body)
        return self._vertex(headers, body)

    def _bedrock(self, headers, body):
        problem = signature_problem("POST", f"http://{headers['host']}{self.path}", headers, body)
        if problem:
            _Cloud.refused.append(self.path)
            return self._json({"message": problem}, 403)
        request = json.loads(body)
        if "model" in request or "stream" in request or request.get("anthropic_version") != "bedrock-2023-05-31":
            return self._json({"message": "Malformed input request"}, 400)
        _Cloud.calls.append((self.path, request))
        answered = fake_provider._answered(request)
        if self.path.endswith("/invoke"):
            return self._json(fake_provider.messages_reply(answered))
        sse = fake_provider.messages_text_events() if answered else fake_provider.messages_events()
        self._stream("application/vnd.amazon.eventstream", chunk_frames(sse))

    def _token(self, body):
        form = dict(pair.split("=", 1) for pair in body.decode().split("&"))
        try:
            jwt.decode(
                form["assertion"], VERTEX_PUBLIC_KEY, algorithms=["RS256"], issuer=VERTEX_ACCOUNT,
                audience=f"http://{self.headers['host']}/token",
            )
        except jwt.PyJWTError as error:
            _Cloud.refused.append("/token")
            return self._json({"error": "invalid_grant", "error_description": str(error)}, 400)
        token = f"ya29.fake-{len(_Cloud.tokens)}-{time.time_ns()}"
        _Cloud.tokens[token] = time.monotonic() + TOKEN_LIFETIME
        self._json({"access_token": token, "expires_in": TOKEN_LIFETIME, "token_type": "Bearer"})

    def _vertex(self, headers, body):
        token = headers.get("authorization", "").removeprefix("Bearer ")
        if _Cloud.tokens.get(token, 0) < time.monotonic():
            _Cloud.refused.append(self.path)
            return self._json({"error": {"code": 401, "message": "Request had invalid authentication credentials.",
                                         "status": "UNAUTHENTICATED"}}, 401)
        prefix = f"/v1/projects/{VERTEX_PROJECT}/locations/{VERTEX_REGION}/publishers/"
        assert self.path.startswith(prefix), self.path
        publisher, model = self.path[len(prefix):].split("/models/")
        verb = model.split("?")[0].rsplit(":", 1)[1]
        request = json.loads(body)
        _Cloud.calls.append((self.path, request))
        if publisher == "anthropic":
            if "model" in request or request.get("anthropic_version") != "vertex-2023-10-16":
                return self._json({"error": {"code": 400, "message": "bad body", "status": "INVALID_ARGUMENT"}}, 400)
            answered = fake_provider._answered(request)
            if verb == "rawPredict":
                return self._json(fake_provider.messages_reply(answered))
            assert verb == "streamRawPredict" and request.get("stream") is True
            sse = fake_provider.messages_text_events() if answered else fake_provider.messages_events()
            return self._stream("text/event-stream", [event + "\n\n" for event in sse.split("\n\n")[:-1]])
        answered = fake_provider._gemini_answered(request)
        if verb == "generateContent":
            return self._json(fake_provider.gemini_reply(answered))
        assert verb == "streamGenerateContent" and self.path.endswith("?alt=sse"), self.path
        events = fake_provider.gemini_events(answered).split("\r\n\r\n")[:-1]
        self._stream("text/event-stream", [event + "\r\n\r\n" for event in events])

    def _stream(self, content_type, chunks):
        self.send_response(200)
        self.send_header("content-type", content_type)
        self.send_header("connection", "close")
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(chunk if isinstance(chunk, bytes) else chunk.encode())
            self.wfile.flush()
        self.close_connection = True


def start():
    """Starts both fakes on one free port; returns (server, base URL)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Cloud)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def key_file(directory, base):
    """The test service account's key file, its token URI this fake's."""
    path = directory / "service-account.json"
    path.write_text(json.dumps({
        "type": "service_account", "project_id": VERTEX_PROJECT, "private_key_id": "0123456789abcdef",
        "private_key": VERTEX_PRIVATE_KEY, "client_email": VERTEX_ACCOUNT, "token_uri": f"{base}/token",
    }))
    return path


def calls():
    """The (path, body) of every call whose credentials were good."""
    return list(_Cloud.calls)


def refused():
    """The paths of the requests refused for their credentials."""
    return list(_Cloud.refused)


def tokens():
    """The access tokens issued."""
    return list(_Cloud.tokens)
