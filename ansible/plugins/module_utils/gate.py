# -*- coding: utf-8 -*-
# Copyright: deploytool maintainers; MIT License (see LICENSE)
"""The fleet's gate (deploytool.fleet.gate): one real chat completion seen from where the gate runs.

A server that answers `GET /v1/models` may still be unable to generate (a hung engine keeps its HTTP front end
answering), so the gate asks for one token (temperature 0) from the model the box serves, with the API key the box
was given, until an answer comes or the time is up:

    inputs(params, read_box, read_here)   what to ask, of which URL, with which key (and where the key came from):
                                          the task's options first, else the box's config (serve.model_name,
                                          serve.port, serve.api_key_file) and the box's own credential
                                          (paths.env_dir/api-key, the root-only copy the units load)
    wait(inputs, ...)                     the completion, retried until `timeout`; a 401/403 stops at once: the
                                          gate's key is wrong (or missing), which says nothing of the box's health

Both run on the controller in the action plugin (read_box reads the host's files over the connection) and wherever
the module itself runs. Standard library and ansible's module_utils only.
"""

from __future__ import annotations

import json
import os
import posixpath
import socket
import time
from urllib.error import HTTPError, URLError

DEFAULT_CONFIG = "/etc/deploytool/deploytool.yaml"
DEFAULT_ENV_DIR = "/etc/deploytool/env"
DEFAULT_PORT = 8082
DEFAULT_MODEL = "model"
CREDENTIAL = "api-key"  # deploytool's root-only copy of serve.api_key_file's key, in paths.env_dir
PROMPT = "Say hello."
_V1_SUFFIXES = ("/v1/chat/completions", "/v1/models", "/v1")

# the module's options (modules/gate.py documents them; the action plugin validates its task's args with it)
ARGUMENT_SPEC = dict(
    host=dict(type="str"),
    port=dict(type="int"),
    url=dict(type="str"),
    model=dict(type="str"),
    api_key=dict(type="str", no_log=True),
    api_key_file=dict(type="path"),
    config=dict(type="path", default=DEFAULT_CONFIG),
    timeout=dict(type="float", default=60.0),
    interval=dict(type="float", default=0.5),
    request_timeout=dict(type="float", default=10.0),
    max_tokens=dict(type="int", default=1, no_log=False),  # a count, not a secret
)


class GateError(Exception):
    """The gate cannot be asked (an input is missing or unreadable); `reason` is a stable slug."""

    def __init__(self, message, reason="bad-input"):
        Exception.__init__(self, message)
        self.reason = reason


def base_url(url):
    """The server's base URL: a trailing /v1/models (what deploytool_gate_url named before the gate asked for a
    completion), /v1/chat/completions or /v1 is dropped."""
    u = str(url).rstrip("/")
    for suffix in _V1_SUFFIXES:
        if u.endswith(suffix):
            return u[: -len(suffix)]
    return u


def _host_in_url(host):
    return "[%s]" % host if ":" in host and not host.startswith("[") else host


def serve_of(config_text, config_path):
    """(model_name, port, api key configured?, credential path) from the box's deploytool.yaml text."""
    try:
        import yaml  # pylint: disable=import-outside-toplevel  # the controller has it (ansible-core needs it)
    except ImportError:
        raise GateError("cannot read %s here (no PyYAML): give the gate its model (and port, key)" % config_path)
    try:
        doc = yaml.safe_load(config_text) or {}
    except yaml.YAMLError as exc:
        raise GateError("the box's config %s is not YAML: %s" % (config_path, exc))
    if not isinstance(doc, dict):
        raise GateError("the box's config %s is not a mapping" % config_path)
    serve = doc.get("serve") or {}
    paths = doc.get("paths") or {}
    if not isinstance(serve, dict) or not isinstance(paths, dict):
        raise GateError("the box's config %s: serve and paths must be mappings" % config_path)
    env_dir = str(paths.get("env_dir") or DEFAULT_ENV_DIR)
    if not env_dir.startswith("/"):
        # deploytool resolves a relative path against the config's directory
        env_dir = posixpath.normpath(posixpath.join(posixpath.dirname(config_path), env_dir))
    return (str(serve.get("model_name") or DEFAULT_MODEL), serve.get("port") or DEFAULT_PORT,
            bool(serve.get("api_key_file")), posixpath.join(env_dir, CREDENTIAL))


def _key_text(data, where):
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data)
    key = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not key:
        raise GateError("the gate's key file %s is empty" % where, "key-missing")
    return key


def inputs(params, read_box, read_here):
    """What the gate asks: dict(url, model, api_key, key_source, config_read).

    params: url, host, port, model, api_key, api_key_file, config (the box's config path). read_box(path) -> bytes
    of a file on the box, or None when it is not there or cannot be read; read_here(path) the same for a file where
    the gate runs (api_key_file)."""
    model, port = params.get("model"), params.get("port")
    api_key, api_key_file = params.get("api_key"), params.get("api_key_file")
    config = params.get("config") or DEFAULT_CONFIG
    key, source = None, "none"
    if api_key:
        key, source = str(api_key).strip(), "the api_key option"
    elif api_key_file:
        data = read_here(api_key_file)
        if data is None:
            raise GateError("the gate's key file %s cannot be read" % api_key_file, "key-missing")
        key, source = _key_text(data, api_key_file), "the api_key_file %s" % api_key_file
    need_config = not model or (port is None and not params.get("url")) or key is None
    config_read = False
    if need_config:
        text = read_box(config)
        if text is None:
            if not model:
                raise GateError("the box's config %s cannot be read, and the gate was given no model: pass the "
                                "model (deploytool_model_name)" % config)
        else:
            config_read = True
            c_model, c_port, keyed, credential = serve_of(text, config)
            model = model or c_model
            port = c_port if port is None else port
            if key is None and keyed:
                data = read_box(credential)
                if data is None:
                    raise GateError("the box's config has serve.api_key_file, but its credential %s cannot be read "
                                    "(it is root-only: connect as root or become), nor was the gate given a key "
                                    "(api_key, api_key_file)" % credential, "key-missing")
                key, source = _key_text(data, credential), "the box's credential %s" % credential
    if params.get("url"):
        base = base_url(params["url"])
    elif params.get("host"):
        base = "http://%s:%s" % (_host_in_url(str(params["host"])), port if port is not None else DEFAULT_PORT)
    else:
        raise GateError("the gate needs the box's address: host or url")
    return dict(url=base + "/v1/chat/completions", model=str(model), api_key=key, key_source=source,
                config_read=config_read)


def request_of(gate, max_tokens=1, prompt=PROMPT):
    """(headers, body) of the one-token completion."""
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if gate.get("api_key"):
        headers["Authorization"] = "Bearer %s" % gate["api_key"]
    body = {"model": gate["model"], "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens, "stream": False}
    return headers, json.dumps(body).encode("utf-8")


def send(url, headers, body, timeout):
    """POST once: (status, text); status None with the reason when nothing answered (refused, reset, timed out)."""
    from ansible.module_utils.urls import open_url  # pylint: disable=import-outside-toplevel

    try:
        resp = open_url(url, data=body, headers=headers, method="POST", timeout=timeout, use_proxy=False,
                        follow_redirects="none")
        return resp.getcode(), resp.read().decode("utf-8", "replace")
    except HTTPError as exc:
        try:
            text = exc.read().decode("utf-8", "replace")
        except Exception:  # pylint: disable=broad-exception-caught  # the body of an error is only for the message
            text = ""
        return exc.code, text
    except URLError as exc:
        return None, "no answer: %s" % (exc.reason,)
    except (socket.timeout, TimeoutError):
        return None, "no answer in %.0f s" % timeout
    except (OSError, ValueError) as exc:  # reset, closed mid-answer (http.client.RemoteDisconnected is an OSError)
        return None, "no answer: %s" % (exc,)


def judge(gate, status, text):
    """One answer: ("ok", completion dict), ("key", message) or ("retry", message)."""
    url = gate["url"]
    if status in (401, 403):
        if gate.get("api_key"):
            why = "it refused the key from %s" % gate["key_source"]
        else:
            why = ("the server wants an API key and the gate sent none (give it one: deploytool_api_key or "
                   "deploytool_api_key_file, or let it read the box's credential)")
        return "key", "the gate's key is wrong: %s answered HTTP %d: %s (%s)" % (url, status, text.strip()[:300], why)
    if status is None:
        return "retry", text
    if status != 200:
        return "retry", "HTTP %d: %s" % (status, text.strip()[:300])
    try:
        payload = json.loads(text)
        choice = payload["choices"][0]
        content = choice["message"].get("content")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return "retry", "HTTP 200 but not a chat completion: %s" % text.strip()[:300]
    served = payload.get("model")
    if isinstance(served, str) and served and served != gate["model"]:
        return "retry", "HTTP 200 from another model: %r (asked for %r)" % (served, gate["model"])
    if not isinstance(content, str):
        return "retry", "HTTP 200 but the completion has no text: %s" % text.strip()[:300]
    return "ok", dict(content=content, usage=payload.get("usage"), finish_reason=choice.get("finish_reason"),
                      served_model=served)


def wait(gate, timeout=60.0, interval=0.5, request_timeout=10.0, max_tokens=1, clock=time.monotonic,
         sleep=time.sleep, post=send):
    """Ask until a completion comes (ok), the key is refused, or `timeout` seconds have passed. A result dict:
    ok, reason (None, key-wrong, unhealthy), msg, url, model, status, attempts, seconds, key_source and, when ok,
    content, usage."""
    headers, body = request_of(gate, max_tokens=max_tokens)
    t0 = clock()
    deadline = t0 + float(timeout)
    attempts, last, status = 0, "", None
    res = dict(url=gate["url"], model=gate["model"], key_source=gate["key_source"])
    while True:
        attempts += 1
        left = deadline - clock()
        status, text = post(gate["url"], headers, body, max(0.1, min(float(request_timeout), left)))
        verdict, info = judge(gate, status, text)
        seconds = round(clock() - t0, 3)
        if verdict == "ok":
            res.update(ok=True, reason=None, status=status, attempts=attempts, seconds=seconds,
                       msg="%s answered a %d-token completion of %s in %.1f s" % (
                           gate["url"], max_tokens, gate["model"], seconds), **info)
            return res
        if verdict == "key":
            res.update(ok=False, reason="key-wrong", status=status, attempts=attempts, seconds=seconds, msg=info)
            return res
        last = info
        if clock() + float(interval) >= deadline:
            res.update(ok=False, reason="unhealthy", status=status, attempts=attempts, seconds=seconds,
                       last_error=last,
                       msg="unhealthy: %s gave no completion of %s in %.0f s (%d attempts; last: %s)" % (
                           gate["url"], gate["model"], float(timeout), attempts, last))
            return res
        sleep(float(interval))


def read_file(path):
    """A file's bytes where this runs, or None."""
    try:
        with open(os.path.expanduser(path), "rb") as f:
            return f.read()
    except (OSError, TypeError):
        return None
