"""Test doubles for the evaluation harness: a real HTTP OpenAI-compatible server on
127.0.0.1 (random free port) whose answers come from a Python function, plus small data
helpers. Used in-process by the tests and as a stand-in SGLang server by
evals_fake_sglang.py."""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable


def completion(content: str | None, finish_reason: str | None = "stop",
               reasoning: str | None = None, model: str = "fake-model") -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "message": msg, "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30},
    }


def error_body(message: str, code: int = 400) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": "BadRequestError", "code": code}


# A responder gets the parsed request body and returns one of:
#   dict                         -> 200 with that JSON
#   (status:int, dict)           -> that status with that JSON
#   ("raw", status, bytes)       -> raw bytes with content-type application/json
#   "close"                      -> drop the connection without answering
Responder = Callable[[dict[str, Any]], Any]


class FakeOpenAIServer:
    def __init__(self, responder: Responder, model: str = "fake-model", delay: float = 0.0,
                 host: str = "127.0.0.1", port: int = 0, health_status: int = 200,
                 server_info: dict[str, Any] | None = None):
        self.responder = responder
        self.server_info = server_info  # GET /server_info (SGLang's), 404 when None
        self.model = model
        self.delay = delay
        self.health_status = health_status
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.connections: set = set()
        self.stopped = False
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def setup(self):
                super().setup()
                with outer.lock:
                    outer.connections.add(self.connection)

            def finish(self):
                with outer.lock:
                    outer.connections.discard(self.connection)
                try:
                    super().finish()
                except OSError:
                    pass

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path in ("/health", "/health_generate"):
                    self._send(outer.health_status, b"{}")
                elif self.path.rstrip("/") == "/v1/models":
                    data = {"object": "list", "data": [{"id": outer.model, "object": "model",
                                                        "created": 0, "owned_by": "fake"}]}
                    self._send(200, json.dumps(data).encode())
                elif self.path == "/server_info" and outer.server_info is not None:
                    self._send(200, json.dumps(outer.server_info).encode())
                else:
                    self._send(404, json.dumps(error_body("not found", 404)).encode())

            def do_POST(self):
                if outer.stopped:
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                if self.path.rstrip("/") != "/v1/chat/completions":
                    self._send(404, json.dumps(error_body("not found", 404)).encode())
                    return
                body = json.loads(raw)
                with outer.lock:
                    outer.requests.append(body)
                if outer.delay:
                    time.sleep(outer.delay)
                out = outer.responder(body)
                if out == "close":
                    self.close_connection = True
                    try:
                        self.connection.shutdown(2)
                    except OSError:
                        pass
                    return
                if isinstance(out, tuple) and out[0] == "raw":
                    self._send(out[1], out[2])
                elif isinstance(out, tuple):
                    self._send(out[0], json.dumps(out[1]).encode())
                else:
                    self._send(200, json.dumps(out).encode())

        class QuietServer(ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # client went away: fine
                pass

        self.httpd = QuietServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "FakeOpenAIServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stop like a dying server: no new connections, open keep-alive ones are cut."""
        self.stopped = True
        self.httpd.shutdown()
        self.httpd.server_close()
        with self.lock:
            conns = list(self.connections)
        for c in conns:
            try:
                c.shutdown(2)
            except OSError:
                pass

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def user_texts(self) -> list[str]:
        with self.lock:
            return [r["messages"][-1]["content"] for r in self.requests]


# ----------------------------------------------------------------------------- data


def gpqa_rows(n: int) -> list[dict[str, str]]:
    """n made-up GPQA questions; the correct option text contains RIGHT."""
    return [
        {
            "Record ID": f"rec{i:03d}",
            "Question": f"Question number {i}: which option is right?",
            "Correct Answer": f"RIGHT option {i}",
            "Incorrect Answer 1": f"wrong one {i}",
            "Incorrect Answer 2": f"wrong two {i}",
            "Incorrect Answer 3": f"wrong three {i}",
        }
        for i in range(n)
    ]


def write_jsonl(path, rows) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")


def options(prompt: str) -> dict[str, str]:
    return dict(re.findall(r"^([A-D])\) (.*)$", prompt, re.M))


def right_letter(prompt: str) -> str:
    return next(k for k, v in options(prompt).items() if v.startswith("RIGHT"))


def stable_bucket(text: str, k: int) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest(), 16) % k


def gpqa_responder(body: dict[str, Any]) -> dict[str, Any]:
    """Deterministic thinking-model answers: right for 2 of 3 prompts (by a hash of the
    prompt), otherwise a wrong letter; the formats vary."""
    prompt = body["messages"][-1]["content"]
    good = right_letter(prompt)
    bucket = stable_bucket(prompt, 6)
    wrong = next(c for c in "ABCD" if c != good)
    if bucket == 0:
        return completion(f"<think>hmm, maybe {good}</think>\nAnswer: {wrong}")
    if bucket == 1:
        return completion(f"<think>long reasoning</think>\n**Answer:** {good}")
    if bucket == 2:
        return completion(f"reasoning without open tag</think>The answer is \\boxed{{{good}}}.")
    if bucket == 3:
        return completion("<think>still thinking about " + good, finish_reason="length")
    if bucket == 4:
        return completion(f"Answer:\n{good}", reasoning="the reasoning went elsewhere")
    return completion(f"<think>x</think>After all that, ({good})")
