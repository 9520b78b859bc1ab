"""Start, wait for, and stop SGLang server processes on CPU (used by ``serve``, tests and benches).

No sglang import here: the server runs in a child process from the same interpreter.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field


# Ports we hand out lie under the kernel's ephemeral range and under SGLang's own pick for its
# torch.distributed port (22000-29999, ``get_free_port_below_ephemeral``). A port from bind(0)
# lies in the ephemeral range, where any process's outgoing connection or gloo listener can take
# it in the seconds before an SGLang server binds it (after its model loads): CI saw a TP=2
# server lose its HTTP port that way (stop 45).
PORT_LOW, PORT_HIGH = 12000, 21999
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as sk:  # (loopback only: every server here binds 127.0.0.1)
        try:
            sk.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A free TCP port that no kernel-chosen (ephemeral) port can take before its user binds it,
    and that this process has not handed out before."""
    high = min(PORT_HIGH, _ephemeral_low() - 1)
    if high - PORT_LOW >= 256:
        for port in random.sample(range(PORT_LOW, high + 1), 128):
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
    with socket.socket() as sk:  # (a machine whose ephemeral range starts low)
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


class RedisMissing(RuntimeError):
    pass


def start_redis(port: int, log=subprocess.DEVNULL, timeout_s: float = 10.0) -> subprocess.Popen:
    """A throwaway ``redis-server`` on 127.0.0.1:``port`` (no persistence), returned once it
    accepts connections; ``RedisMissing`` when it is not installed (tests skip on it). One helper
    for the tests and the benchmarks, which each started their own."""
    import shutil

    exe = shutil.which("redis-server")
    if exe is None:
        raise RedisMissing("redis-server is not installed (apt-get install -y redis-server)")
    p = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                         stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and p.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return p
        except OSError:
            time.sleep(0.05)
    p.kill()
    p.wait(timeout=10)
    raise RuntimeError(f"redis-server did not start on 127.0.0.1:{port}")


def cpu_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    # nothing downloads at run time: a mistyped local path must not become a hub download
    env.setdefault("HF_HUB_OFFLINE", "1")
    if extra:
        env.update(extra)
    return env


def add_threads_option(ap) -> None:
    """``--threads N`` for benchmarks that start servers: OMP threads per server."""
    ap.add_argument("--threads", type=int, default=None,
                    help="OMP threads per server (default: torch's, one per core). 1 keeps TTFTs meaningful on a "
                         "machine shared with other work (e.g. several servers on few cores): SGLang's CPU ops "
                         "wait on all their threads at every op, so contention makes TTFTs 5-10x longer")  # fmt: skip


def use_server_threads(threads: int | None) -> None:
    """Servers started from now on get ``threads`` OMP threads (``cpu_env`` copies the environment)."""
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)


CGROUP_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified", "/sys/fs/cgroup/cpu")
# What SGLang logs once its warmup request has run (http_server.py ``_wait_and_warmup``; the
# servers run with --log-level info), and how long ``Server.wait_ready`` waits for it after the
# routes answer (a server started at another log level never logs it: returned after this long).
READY_LINE = b"The server is fired up and ready to roll!"
WARMUP_WAIT_S = 60.0


def cpu_quota_group(name: str, cores: float) -> str:
    """A cgroup named ``name`` whose processes together get at most ``cores`` CPUs (CFS quota):
    servers started in it (``ServerSpec.cgroup``) each have fixed compute, as on a fleet where each
    server has its own accelerator, instead of taking what the others leave idle on a shared host.
    cgroup v2 (a root whose ``cgroup.subtree_control`` enables ``cpu``) or v1 (the ``cpu``
    hierarchy); ``RuntimeError`` saying why when neither is writable (not root, no cgroup fs)."""
    if not cores > 0:
        raise ValueError(f"cores must be > 0, got {cores}")
    period = 100_000
    quota = max(1000, int(cores * period))
    errors = []
    for root in CGROUP_ROOTS:
        v2 = os.path.exists(os.path.join(root, "cgroup.subtree_control"))
        if v2:
            try:
                with open(os.path.join(root, "cgroup.subtree_control")) as f:
                    enabled = f.read().split()
            except OSError as exc:
                errors.append(f"{root}: {exc.strerror}")
                continue
            if "cpu" not in enabled:
                errors.append(f"{root}: cgroup v2 without the cpu controller enabled for children")
                continue
        elif not os.path.exists(os.path.join(root, "cpu.cfs_quota_us")):
            continue
        path = os.path.join(root, name)
        try:
            os.makedirs(path, exist_ok=True)
            if v2:
                with open(os.path.join(path, "cpu.max"), "w") as f:
                    f.write(f"{quota} {period}")
            else:
                with open(os.path.join(path, "cpu.cfs_period_us"), "w") as f:
                    f.write(str(period))
                with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
                    f.write(str(quota))
            return path
        except OSError as exc:
            errors.append(f"{path}: {exc.strerror}")
    raise RuntimeError("no writable cgroup with a CPU quota here (" + ("; ".join(errors) or "no cgroup fs") + ")")


def cgroup_joiner(path: str):
    """A ``preexec_fn`` that moves the child into cgroup ``path`` before it execs (every process it
    starts then inherits the group)."""
    procs = os.path.join(path, "cgroup.procs")

    def join() -> None:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    return join


def remove_cgroup(path: str) -> None:
    """Remove a group made by ``cpu_quota_group`` once its processes have exited (best effort)."""
    for _ in range(50):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:  # still has processes (exiting): retry briefly
            time.sleep(0.1)


class ServerStartError(RuntimeError):
    pass


class PortTaken(ServerStartError):
    """Another process bound the server's port before it did."""


@dataclass
class ServerSpec:
    model_path: str
    port: int = 0
    host: str = "127.0.0.1"
    backend: str | None = "tiered"  # None: SGLang's default cache
    disable_radix_cache: bool = False
    page_size: int = 16
    max_total_tokens: int = 32768
    tp: int = 1
    dtype: str | None = None
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    python: str | None = None  # interpreter (default: this one)
    cwd: str | None = None  # working directory of the server process
    cgroup: str | None = None  # a cgroup directory the server joins before it starts (``cpu_quota_group``)

    def argv(self) -> list[str]:
        args = [
            self.python or sys.executable, "-m", "sglang.launch_server",
            "--model-path", self.model_path,
            "--device", "cpu",
            "--attention-backend", "torch_native",
            "--host", self.host,
            "--port", str(self.port),
            "--page-size", str(self.page_size),
            "--max-total-tokens", str(self.max_total_tokens),
            "--sleep-on-idle",
            "--log-level", "info",
        ]  # fmt: skip
        if self.backend:
            args += ["--radix-cache-backend", self.backend]
        if self.disable_radix_cache:
            args.append("--disable-radix-cache")
        if self.tp != 1:
            args += ["--tp", str(self.tp)]
        if self.dtype:
            args += ["--dtype", self.dtype]
        return args + list(self.extra_args)


class Server:
    """A running ``sglang.launch_server`` child with its log in a file."""

    def __init__(self, spec: ServerSpec, log_path: pathlib.Path):
        self._own_port = not spec.port  # (ours to change when another process took it)
        if not spec.port:
            spec.port = free_port()
        self.spec = spec
        self.log_path = pathlib.Path(log_path)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.port}"

    def start(self, timeout_s: float = 240.0) -> "Server":
        for attempt in range(3):
            try:
                return self._start(timeout_s)
            except PortTaken:
                if not self._own_port or attempt == 2:
                    raise
                self.spec.port = free_port()
        raise AssertionError("unreachable")

    def _start(self, timeout_s: float) -> "Server":
        # SGLang binds its port only after the model loaded: whatever answers there before is
        # another process, which wait_ready would take for this server (review, session 23)
        with socket.socket(socket.AF_INET6 if ":" in self.spec.host else socket.AF_INET) as sk:
            sk.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as SGLang's server: TIME_WAIT is free)
            try:
                sk.bind((self.spec.host, self.spec.port))
            except OSError as exc:
                raise PortTaken(f"port {self.spec.port} on {self.spec.host} is in use ({exc.strerror})") from None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = cpu_env(self.spec.env)
        if self.spec.tp > 1:
            env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(self.spec.tp)))
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.spec.argv(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            cwd=self.spec.cwd, preexec_fn=cgroup_joiner(self.spec.cgroup) if self.spec.cgroup else None,
        )
        log.close()
        try:
            self.wait_ready(timeout_s)
        except BaseException:  # (Ctrl-C, SIGTERM, not ready): the child is in its own session
            self.stop()
            raise
        return self

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def _api_key(self) -> str | None:
        args = self.spec.extra_args
        for flag in ("--api-key", "--admin-api-key"):  # /model_info is a NORMAL endpoint
            if flag in args and args.index(flag) + 1 < len(args):
                return args[args.index(flag) + 1]
        return None

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"server exited with code {self.proc.returncode} before it was ready; "
                    f"log {self.log_path} ends:\n{self.log_tail()}"
                )
            req = urllib.request.Request(self.url + "/model_info")
            key = self._api_key()
            if key:
                req.add_header("Authorization", f"Bearer {key}")
            try:
                with urllib.request.urlopen(req, timeout=2) as r:
                    if r.status == 200:
                        if self._logs_ready_line():
                            self._wait_warmed(min(deadline, time.monotonic() + WARMUP_WAIT_S))
                        if self.proc.poll() is not None:  # (a failed warmup: SGLang kills itself)
                            raise ServerStartError(
                                f"server exited with code {self.proc.returncode} during its warmup; "
                                f"log {self.log_path} ends:\n{self.log_tail()}"
                            )
                        return
            except (urllib.error.URLError, OSError):
                pass
            if self._bind_failed():  # (uvicorn logs it, then hangs in shutdown: do not wait it out)
                self.stop()
                raise PortTaken(f"the server could not bind {self.url}; log {self.log_path} ends:\n{self.log_tail()}")
            time.sleep(0.5)
        self.stop()
        raise ServerStartError(
            f"server not ready after {timeout_s:.0f}s; log {self.log_path} ends:\n{self.log_tail()}"
        )

    def _logs_ready_line(self) -> bool:
        """Whether SGLang logs READY_LINE: at info (ServerSpec's) or debug, not at a level above it
        a caller's ``--log-level`` set (the last one given wins; review, session 43: such a server
        waited WARMUP_WAIT_S more at every start)."""
        level = "info"
        args = self.spec.argv()
        for i, a in enumerate(args):
            if a == "--log-level" and i + 1 < len(args):
                level = args[i + 1]
            elif a.startswith("--log-level="):
                level = a.split("=", 1)[1]
        return level.lower() in ("info", "debug")

    def _wait_warmed(self, until: float) -> None:
        """Wait (until ``until``) for SGLang's warmup request to end: its routes answer before
        it has run (``_wait_and_warmup`` sends one generate request after the port is bound,
        then logs READY_LINE). A test's first call could meet it running: a ``/flush_cache``
        refused with "pending requests" (CI, session 43, on a loaded machine), a tenant's stats
        counting one request more. A server whose warmup never ends is returned as before."""
        while time.monotonic() < until and self.proc.poll() is None:
            try:
                with open(self.log_path, "rb") as f:
                    if READY_LINE in f.read():
                        return
            except OSError:
                return
            time.sleep(0.2)

    def _bind_failed(self) -> bool:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 16384))
                return b"error while attempting to bind on address" in f.read()
        except OSError:
            return False

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=timeout_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)

    def __enter__(self) -> "Server":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- small HTTP client -------------------------------------------------------------------
    def request(self, method: str, path: str, payload=None, timeout: float = 120.0, headers=None,
                raw: bytes | None = None):  # fmt: skip
        data = raw if raw is not None else (None if payload is None else json.dumps(payload).encode())
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        for k, v in (headers or {}).items():
            req.add_header(k, v)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                body = r.read()
                try:
                    return r.status, (json.loads(body) if body else None)
                except ValueError:
                    return r.status, body.decode(errors="replace")
        except urllib.error.HTTPError as e:
            body = e.read()
            try:
                return e.code, json.loads(body)
            except ValueError:
                return e.code, body.decode(errors="replace")

    def generate(self, payload: dict, timeout: float = 120.0) -> dict:
        status, body = self.request("POST", "/generate", payload, timeout=timeout)
        if status != 200:
            raise RuntimeError(f"/generate returned {status}: {body}")
        return body
