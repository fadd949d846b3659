"""The deploytool.fleet modules as data (tests/support/fleet/module_cases.yaml): parameters -> the exact `deploytool`
calls, canned `--json` answers -> the module's result; and the gate's HTTP exchanges -> its verdict.

Each case runs the module's own file with the fleet test bed's ansible-core (.cache/fleet-ansible), as ansible runs
a module (its arguments in a file, the result as JSON on stdout). `deploytool` is a stand-in program that answers
the case's calls in order and fails any other, so the cases pin what each module asks of deploytool; the gate asks
a real HTTP server on 127.0.0.1 that answers as the case says and records what it was sent. The same modules on
real hosts against the real deploytool are tests/test_fleet_rollout.py's.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CASES = yaml.safe_load((REPO / "tests" / "support" / "fleet" / "module_cases.yaml").read_text())
PYTHON = REPO / ".cache" / "fleet-ansible" / "bin" / "python"

STUB = r'''#!/usr/bin/env python3
"""A stand-in deploytool: answers the calls in answers.json in order; any other call fails (exit 99)."""
import json, os, sys
here = os.path.dirname(os.path.abspath(__file__))
answers = json.load(open(os.path.join(here, "answers.json")))
with open(os.path.join(here, "calls.jsonl"), "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\n")
n = sum(1 for _ in open(os.path.join(here, "calls.jsonl"))) - 1
if n >= len(answers) or answers[n]["argv"] != sys.argv[1:]:
    sys.stderr.write("error: unexpected call %d: %r\n" % (n, sys.argv[1:]))
    sys.exit(99)
a = answers[n]
out = a.get("stdout", "")
sys.stdout.write(out if isinstance(out, str) else json.dumps(out))
sys.stderr.write(a.get("stderr", ""))
sys.exit(a.get("rc", 0))
'''


def _fill(obj: Any, subs: dict[str, str]) -> Any:
    """`obj` with {tmp}, {stub}, {port} replaced in every string."""
    if isinstance(obj, str):
        for k, v in subs.items():
            obj = obj.replace("{" + k + "}", v)
        return obj
    if isinstance(obj, list):
        return [_fill(x, subs) for x in obj]
    if isinstance(obj, dict):
        return {k: _fill(v, subs) for k, v in obj.items()}
    return obj


def _mismatches(want: Any, got: Any, where: str = "") -> list[str]:
    """Where `got` differs from `want`: mappings as subsets (a null wants the key absent or null; a key ending in ~
    wants a substring), everything else equal."""
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return [f"{where or '.'}: want a mapping, got {got!r}"]
        out = []
        for k, v in want.items():
            if k.endswith("~"):
                if v not in str(got.get(k[:-1], "")):
                    out.append(f"{where}.{k[:-1]}: {got.get(k[:-1])!r} does not contain {v!r}")
            elif v is None:
                if got.get(k) is not None:
                    out.append(f"{where}.{k}: want absent or null, got {got[k]!r}")
            elif k not in got:
                out.append(f"{where}.{k}: missing (want {v!r})")
            else:
                out += _mismatches(v, got[k], f"{where}.{k}")
        return out
    return [] if want == got else [f"{where or '.'}: want {want!r}, got {got!r}"]


@pytest.fixture(scope="module")
def collections_root(tmp_path_factory) -> Path:
    """A directory with ansible_collections/deploytool/fleet -> the checkout's collection (what PYTHONPATH needs)."""
    if not PYTHON.is_file():
        pytest.fail(f"{PYTHON} is missing: the fleet test bed's ansible-core is installed by `make setup`")
    root = tmp_path_factory.mktemp("collections")
    (root / "ansible_collections" / "deploytool").mkdir(parents=True)
    (root / "ansible_collections" / "deploytool" / "fleet").symlink_to(REPO / "ansible")
    return root


def run_module(root: Path, name: str, params: dict[str, Any], cwd: Path, *, check: bool = False,
               diff: bool = False) -> tuple[dict[str, Any], int]:
    """Run deploytool.fleet.NAME as ansible runs a module: its arguments in a file; (result, exit status)."""
    args = dict(params, _ansible_check_mode=check, _ansible_diff=diff, _ansible_tmpdir=str(cwd))
    argfile = cwd / "args.json"
    argfile.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONPATH": str(root),
           "HOME": str(cwd)}
    r = subprocess.run([str(PYTHON), "-m", f"ansible_collections.deploytool.fleet.plugins.modules.{name}",
                        str(argfile)], capture_output=True, text=True, timeout=60, cwd=cwd, env=env,
                       stdin=subprocess.DEVNULL)
    try:
        return json.loads(r.stdout), r.returncode
    except ValueError:
        raise AssertionError(f"module {name} printed no result (exit {r.returncode}):\n{r.stdout}\n{r.stderr}") \
            from None


def _make_files(d: Path, files: dict[str, str] | None) -> None:
    for rel, text in (files or {}).items():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


@pytest.mark.parametrize("case", CASES["modules"], ids=[c["name"] for c in CASES["modules"]])
def test_module_calls_deploytool_as_the_case_says_and_returns_its_result(case, tmp_path, collections_root):
    """The module makes exactly the case's deploytool calls and turns their answers into the case's result."""
    stub = tmp_path / "bin" / "deploytool"
    stub.parent.mkdir()
    stub.write_text(STUB)
    stub.chmod(0o755)
    subs = {"tmp": str(tmp_path), "stub": str(stub)}
    case = _fill(case, subs)
    (stub.parent / "answers.json").write_text(json.dumps(case["deploytool"]))
    _make_files(tmp_path, case.get("files"))
    params = {"deploytool": str(stub), "config": str(tmp_path / "deploytool.yaml"), **case["params"]}
    params = {k: v for k, v in params.items() if v is not None}
    result, rc = run_module(collections_root, case["module"], params, tmp_path, check=case.get("check", False),
                            diff=case.get("diff", False))
    log = stub.parent / "calls.jsonl"
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    assert calls == [a["argv"] for a in case["deploytool"]], json.dumps(result, indent=1)
    assert (rc != 0) == bool(case["result"].get("failed")), (rc, result)
    bad = _mismatches(case["result"], result)
    assert not bad, "\n".join(bad) + "\n" + json.dumps(result, indent=1)
    for rel, text in (case.get("files_after") or {}).items():
        p = tmp_path / rel
        assert (p.read_text() if p.exists() else None) == text, rel


class _Server:
    """An HTTP server on 127.0.0.1 answering every POST with the next canned answer (the last repeats)."""

    def __init__(self, answers: list[dict[str, Any]]) -> None:
        self.answers = answers
        self.requests: list[dict[str, Any]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                server.requests.append({"path": self.path, "authorization": self.headers.get("Authorization"),
                                        "body": json.loads(body or b"null")})
                a = server.answers[min(len(server.requests), len(server.answers)) - 1]
                time.sleep(a.get("delay", 0))
                data = a.get("body", "")
                raw = (data if isinstance(data, str) else json.dumps(data)).encode()
                try:
                    self.send_response(a.get("status", 200))
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(raw)))
                    self.end_headers()
                    self.wfile.write(raw)
                except OSError:
                    pass  # the gate gave up on this request (its request_timeout)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> _Server:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("case", CASES["gate"], ids=[c["name"] for c in CASES["gate"]])
def test_gate_asks_for_a_completion_and_judges_the_answer_as_the_case_says(case, tmp_path, collections_root):
    """The gate's request (path, key, model, one token at temperature 0) and its verdict on the server's answers."""
    with _Server(case["http"] or [{"status": 500}]) as srv:
        case = _fill(case, {"tmp": str(tmp_path), "port": str(srv.port)})
        _make_files(tmp_path, case.get("files"))
        t0 = time.monotonic()
        result, rc = run_module(collections_root, "gate", case["params"], tmp_path)
        seconds = time.monotonic() - t0
    assert (rc != 0) == bool(case["result"].get("failed")), (rc, result)
    bad = _mismatches(case["result"], result)
    assert not bad, "\n".join(bad) + "\n" + json.dumps(result, indent=1)
    if not case["http"]:
        assert srv.requests == [], srv.requests
    for i, want in enumerate(case.get("requests") or []):
        assert i < len(srv.requests), srv.requests
        bad = _mismatches(want, srv.requests[i], f"request {i}")
        assert not bad, "\n".join(bad)
    if result.get("reason") == "key-wrong":
        assert len(srv.requests) == 1 and seconds < 5, (srv.requests, seconds)  # at once, not after the timeout
    assert "s3cret" not in json.dumps({k: v for k, v in result.items() if k != "invocation"})
    assert "box-secret" not in json.dumps(result)


def test_the_gate_never_returns_the_key_it_sent(tmp_path, collections_root):
    """The key reaches the server, not the task's result (the module masks its api_key option in `invocation`)."""
    body = CASES["gate"][0]["http"][-1]["body"]
    with _Server([{"status": 200, "body": body}]) as srv:
        result, rc = run_module(collections_root, "gate", {"url": f"http://127.0.0.1:{srv.port}", "model": "demo",
                                                           "api_key": "k-very-secret-1"}, tmp_path)
    assert rc == 0 and srv.requests[0]["authorization"] == "Bearer k-very-secret-1", result
    assert "k-very-secret-1" not in json.dumps(result), result


def test_the_gate_task_reads_the_boxs_config_and_credential_over_the_connection(tmp_path, collections_root):
    """Through ansible (the action plugin): the box's config and root-only credential are read over the task's
    connection (slurp), the completion is asked from the controller, and the key shows in no output, even -vvv."""
    ansible = PYTHON.parent / "ansible"
    body = CASES["gate"][0]["http"][-1]["body"]
    with _Server([{"status": 200, "body": body}]) as srv:
        _make_files(tmp_path, _fill(CASES["gate"][5]["files"], {"tmp": str(tmp_path), "port": str(srv.port)}))
        (tmp_path / "env" / "api-key").chmod(0o600)
        env = {"PATH": f"{PYTHON.parent}:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(tmp_path),
               "ANSIBLE_COLLECTIONS_PATH": str(collections_root), "ANSIBLE_NOCOLOR": "1",
               "ANSIBLE_LOCALHOST_WARNING": "0", "ANSIBLE_INVENTORY_UNPARSED_WARNING": "0",
               "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp")}
        r = subprocess.run([str(ansible), "localhost", "-vvv", "-m", "deploytool.fleet.gate", "-a",
                            f"host=127.0.0.1 config={tmp_path}/deploytool.yaml"], capture_output=True, text=True,
                           timeout=120, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert [q["authorization"] for q in srv.requests] == ["Bearer box-secret"], srv.requests
    assert srv.requests[0]["body"]["model"] == "demo" and srv.requests[0]["path"] == "/v1/chat/completions"
    assert f"the box's credential {tmp_path}/env/api-key" in out and '"status": 200' in out, out
    assert "box-secret" not in out, out
