"""A client of the public port, as the issue that asked for the held port measured one: an application with a sane
timeout, GET /v1/models every 50 ms and a 4-token chat completion every 0.5 s, each on its own connection, every
outcome kept (tests/test_held_port_e2e.py, and the failover and liveness e2e tests run it through their
operations)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from deploy_tool import config

MODEL = "qwen38-27b-ud"


@dataclass
class Seen:
    kind: str
    started: float
    seconds: float
    status: int | None  # None: no HTTP answer at all (refused, reset, timed out)
    error: str = ""


@dataclass
class ClientLoop:
    """Requests to the public port from a thread, each with its own connection (as a client library that does
    not pool would); every outcome kept."""
    port: int
    timeout: float
    models_every: float = 0.05
    chat_every: float = 0.5
    seen: list[Seen] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def _one(self, kind: str) -> None:
        url = f"http://127.0.0.1:{self.port}"
        if kind == "models":
            req = urllib.request.Request(f"{url}/v1/models")
        else:
            body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                               "temperature": 0}).encode()
            req = urllib.request.Request(f"{url}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                data = json.loads(r.read())
                ok = (MODEL in json.dumps(data["data"]) if kind == "models"
                      else bool(data["choices"][0]["message"]["content"] is not None))
                self.seen.append(Seen(kind, t0, time.monotonic() - t0, r.status if ok else -1))
        except urllib.error.HTTPError as exc:
            self.seen.append(Seen(kind, t0, time.monotonic() - t0, exc.code, exc.read()[:300].decode("replace")))
        except (OSError, ValueError, KeyError, IndexError) as exc:
            self.seen.append(Seen(kind, t0, time.monotonic() - t0, None, f"{type(exc).__name__}: {exc}"))

    def _run(self, kind: str, every: float) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            self._one(kind)
            self._stop.wait(max(0.0, every - (time.monotonic() - t)))

    def start(self) -> ClientLoop:
        self._threads = [threading.Thread(target=self._run, args=("models", self.models_every), daemon=True),
                         threading.Thread(target=self._run, args=("chat", self.chat_every), daemon=True)]
        for t in self._threads:
            t.start()
        time.sleep(1.0)  # a second of requests before the operation: the control
        return self

    def stop(self) -> None:
        """A second more of requests, then the loop ends once its requests in flight are answered."""
        if self._stop.is_set():
            return
        time.sleep(1.0)
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout + 5)

    def __enter__(self) -> ClientLoop:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def failed(self) -> list[Seen]:
        return [s for s in self.seen if s.status != 200]

    def summary(self) -> str:
        longest = max((s.seconds for s in self.seen), default=0.0)
        return (f"{len(self.seen)} requests, {len(self.failed)} failed, longest {longest:.2f} s; failures: "
                + "; ".join(f"{s.kind} {s.status} {s.error[:120]}" for s in self.failed[:5]))


def _loop(cfg_path: Path) -> ClientLoop:
    cfg = config.load(cfg_path)
    return ClientLoop(cfg.serve.port, timeout=cfg.hold_timeout_s + 10)


def client_loop(cfg_path: Path, *, models_every: float = 0.05, chat_every: float = 0.5) -> ClientLoop:
    """A loop on the config's public port; its timeout is past the hold bound (the front answers 503 by then)."""
    cfg = config.load(cfg_path)
    return ClientLoop(cfg.serve.port, timeout=cfg.hold_timeout_s + 10, models_every=models_every,
                      chat_every=chat_every)
