"""Run a command in a network namespace of its own with only loopback up (``unshare -n``).

Mooncake's master and store clients listen on every interface whatever they are told, so every
Mooncake process, and every process that talks to one, runs inside such a namespace (as root):
nothing in it can reach or be reached from the machine's real interfaces.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time


def netns_available() -> str | None:
    """None when ``unshare -n`` works here, else why not."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare or ip (util-linux, iproute2) not installed"
    r = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"unshare -n failed (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}"
    return None


def mooncake_available() -> str | None:
    try:
        import mooncake.store  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"mooncake not importable: {exc}"
    return None


def run_in_netns(argv: list[str], *, env=None, timeout: float = 900, cwd=None) -> subprocess.CompletedProcess:
    """Run ``argv`` in a fresh loopback-only network namespace; returns the completed process."""
    script = 'ip link set lo up && exec "$@"'
    return subprocess.run(["unshare", "-n", "bash", "-c", script, "netns", *argv], env=env, cwd=cwd,
                          timeout=timeout, capture_output=True, text=True)  # fmt: skip


def start_master(port: int, log_path, *, lease_ms: int = 10_000) -> subprocess.Popen:
    """``mooncake_master`` on 127.0.0.1:``port`` (call inside the namespace). Waits until it answers."""
    import socket

    exe = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    if not os.path.exists(exe):
        exe = shutil.which("mooncake_master") or exe
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--rpc_address", "127.0.0.1", "--enable_http_metadata_server=false",
         "--metrics_port", str(port + 1), "--default_kv_lease_ttl", str(lease_ms)],
        stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    end = time.monotonic() + 30
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {proc.returncode}; see {log_path}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("mooncake_master did not start listening within 30 s")


def time_client_start(start, rep: dict, error_key: str, time_key: str, watchdog_s: float) -> None:
    """A master scenario's timed store-client start: ``start()`` under a faulthandler watchdog (it
    needs no GIL, which a stalled Mooncake setup holds) that ends the process after ``watchdog_s``;
    the error it ended with (None: it started) in ``rep[error_key]``, its seconds in ``rep[time_key]``."""
    import faulthandler

    faulthandler.dump_traceback_later(watchdog_s, exit=True)
    t0 = time.monotonic()
    try:
        start()
        rep[error_key] = None
    except Exception as exc:  # noqa: BLE001
        rep[error_key] = f"{type(exc).__name__}: {exc}"
    rep[time_key] = round(time.monotonic() - t0, 2)
    faulthandler.cancel_dump_traceback_later()


def release_master(master: subprocess.Popen) -> None:
    """End a scenario's master, stopped (SIGSTOP) or not."""
    import signal

    os.kill(master.pid, signal.SIGCONT)
    master.kill()
    master.wait(10)


def run_master_scenario(module: str, out) -> tuple[subprocess.CompletedProcess, dict]:
    """Run a master scenario (``python -m module out``) in a loopback-only namespace; its JSON
    report (empty if it wrote none). Cut off, it leaves its stopped master behind: killed here."""
    import json
    import signal

    r = run_in_netns([sys.executable, "-m", module, str(out)], timeout=300)
    rep = json.loads(out.read_text()) if out.exists() else {}
    if r.returncode != 0 and rep.get("master_pid"):
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(rep["master_pid"], sig)
            except ProcessLookupError:
                pass
    return r, rep
