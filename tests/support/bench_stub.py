"""A stand-in chat server (stdlib http.server in a thread) for the faults real servers do not show on demand.

It streams OpenAI-style chat completion chunks, one word per chunk at a fixed pace, and can misbehave:

* `stall_requests`: request numbers (1-based) that stop after `stall_after` pieces and then send nothing
  until the server is closed (a server stuck mid-stream);
* `usage=False`: no `usage` in the stream (some servers and proxies drop it);
* a prompt holding the needle sentence is answered with the code it hides (to check the recall logic).

    with stub_server(stall_requests={1}) as s:
        ...s.base_url...
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "stub-model"


@dataclass
class StubConfig:
    model: str = MODEL
    token_delay: float = 0.004  # seconds between pieces (about 250 pieces/s)
    usage: bool = True
    stall_requests: set[int] = field(default_factory=set)
    stall_after: int = 3
    requests: int = 0
    bodies: list[dict] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the connection closes after each response: the stream ends with it
    cfg: StubConfig

    def log_message(self, *args: object) -> None:  # keep test output quiet
        pass

    def _send(self, obj: object) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()

    def do_POST(self) -> None:  # noqa: N802
        cfg = self.cfg
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
        with cfg.lock:
            cfg.requests += 1
            n_req = cfg.requests
            cfg.bodies.append(body)
        if body.get("model") != cfg.model:
            self.send_response(404)
            self.end_headers()
            self.wfile.write(json.dumps({"error": {"message": f"model {body.get('model')} not found"}}).encode())
            return
        prompt = " ".join(m.get("content", "") for m in body.get("messages", []))
        n_prompt = len(prompt.split())
        max_tokens = int(body.get("max_tokens") or 16)
        words = (["MAPLE-4416"] if "MAPLE-4416" in prompt else []) + [f"w{i}" for i in range(max_tokens)]
        words = words[:max_tokens]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        base = {"id": f"stub-{n_req}", "object": "chat.completion.chunk", "model": cfg.model}
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self._send({**base, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            for i, w in enumerate(words):
                if n_req in cfg.stall_requests and i == cfg.stall_after:
                    cfg.release.wait(60)  # stuck mid-stream until the test ends
                    return
                time.sleep(cfg.token_delay)
                self._send({**base, "choices": [{"index": 0, "delta": {"content": w + " "}}]})
            self._send({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
            if cfg.usage:
                self._send({**base, "choices": [], "usage": {
                    "prompt_tokens": n_prompt, "completion_tokens": len(words),
                    "total_tokens": n_prompt + len(words), "prompt_tokens_details": {"cached_tokens": 0}}})
            self.wfile.write(b"data: [DONE]\n\n")


@dataclass
class Stub:
    server: ThreadingHTTPServer
    cfg: StubConfig

    @property
    def base_url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])


@contextlib.contextmanager
def stub_server(**kw: object) -> Iterator[Stub]:
    """Run the stub on 127.0.0.1 (a free port) for the block; stalled handlers are released at the end."""
    cfg = StubConfig(**kw)  # type: ignore[arg-type]
    handler = type("Handler", (_Handler,), {"cfg": cfg})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="bench-stub", daemon=True)
    thread.start()
    try:
        yield Stub(server, cfg)
    finally:
        cfg.release.set()
        server.shutdown()
        server.server_close()
        thread.join(5)
