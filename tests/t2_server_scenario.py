"""Two CPU SGLang servers with T2 on one Mooncake master, plus a no-cache reference server, all in
a loopback-only network namespace (run by tests/test_t2.py). Writes a JSON report to argv[1];
argv[2] is the tiny model's path, argv[3] the log directory.

1. Server A serves tenant acme's prompts (more than A's device pool + T1 hold), then flushes its
   device tree: A's T1 victims go to T2.
2. Server B serves the same prompts as acme: T2 hits on prefixes only A computed; greedy outputs
   identical to the reference.
3. B serves the same prompts as tenant globex: zero cached tokens.
4. The master is killed; B serves new and old prompts: every request succeeds, outputs identical.
"""

from __future__ import annotations

import json
import pathlib
import sys
import threading
import time

from sglang_tiered.dev.server import Server, ServerSpec
from tests.netns import start_master
from tests.test_e2e_server import make_prompt

PORT = 50071
PORT_A = 61071  # the three servers' HTTP ports: above the ephemeral range (alone in their network namespace)


def gen(server, prompt, tenant=None, n=6):
    headers = {"x-tenant-id": tenant} if tenant else None
    status, body = server.request("POST", "/generate", {"text": prompt, "sampling_params": {
        "temperature": 0, "max_new_tokens": n}}, headers=headers, timeout=300)  # fmt: skip
    return status, body


def t2_stats(server) -> dict:
    return server.request("GET", "/cache/stats")[1]["t2"]


def main(out: str, model: str, log_dir: str) -> None:
    logs = pathlib.Path(log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    # a read must end within half the lease: timeout_ms < lease_ms / 2 (parse_t2_url refuses the rest)
    master = start_master(PORT, logs / "t2-master.log", lease_ms=12_000)
    # timeout_ms: generous, as on a loaded CI machine (three CPU servers on two cores) a call that
    # missed a 1 s deadline opened the breaker and B fetched nothing (CI, once); the master-down
    # phase checks that requests still succeed, not how fast
    url = f"mooncake://127.0.0.1:{PORT}?segment_mb=256&buffer_mb=32&mode=on&timeout_ms=5000&lease_ms=12000"
    env = {"SGLANG_TIERED_HOST": "on", "SGLANG_TIERED_HOST_RATIO": "1", "SGLANG_TIERED_T2": url,
           "SGLANG_TIERED_TENANT_HEADER": "x-tenant-id", "SGLANG_TIERED_DEBUG": "1"}  # fmt: skip
    common = dict(model_path=model, max_total_tokens=2048, dtype="float32")
    # Fixed ports above the ephemeral range: the Mooncake clients inside the servers open listening
    # ports of their own while the servers start, so a port picked as free beforehand could be
    # taken by the time the HTTP server binds (seen once in CI: "address already in use", and the
    # server then hung instead of exiting).
    servers = {
        "a": Server(ServerSpec(env=env, port=PORT_A, **common), logs / "t2-a.log"),
        "b": Server(ServerSpec(env=env, port=PORT_A + 1, **common), logs / "t2-b.log"),
        "ref": Server(ServerSpec(backend=None, disable_radix_cache=True, port=PORT_A + 2, **common), logs / "t2-ref.log"),
    }
    report: dict = {"ok": False}
    errors: list = []

    def start(s):
        try:
            s.start(timeout_s=600)
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))

    threads = [threading.Thread(target=start, args=(s,)) for s in servers.values()]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError(f"server start failed: {errors}")
        a, b, ref = servers["a"], servers["b"], servers["ref"]
        prompts = [make_prompt(900 + i, 300) for i in range(14)]  # ~14 x 380 tokens > 2 x 2,048
        want = {p: gen(ref, p)[1]["output_ids"] for p in prompts}
        got_a = [gen(a, p, "acme")[1] for p in prompts]
        report["a_outputs_equal"] = all(g["output_ids"] == want[p] for p, g in zip(prompts, got_a))
        assert a.request("POST", "/flush_cache?timeout=30")[0] == 200  # device -> T1 -> victims to T2
        end = time.monotonic() + 60
        while time.monotonic() < end and t2_stats(a)["queue_depth_pages"]:
            time.sleep(0.2)
        report["a_t2"] = t2_stats(a)
        got_b = [gen(b, p, "acme")[1] for p in prompts]
        report["b_cached_tokens"] = sum(g["meta_info"]["cached_tokens"] for g in got_b)
        report["b_prompt_tokens"] = sum(g["meta_info"]["prompt_tokens"] for g in got_b)
        report["b_outputs_equal"] = all(g["output_ids"] == want[p] for p, g in zip(prompts, got_b))
        report["b_t2"] = t2_stats(b)
        got_g = [gen(b, p, "globex")[1] for p in prompts]
        report["globex_cached_tokens"] = sum(g["meta_info"]["cached_tokens"] for g in got_g)
        report["globex_outputs_equal"] = all(g["output_ids"] == want[p] for p, g in zip(prompts, got_g))
        master.kill()
        master.wait()
        fresh = [make_prompt(950 + i, 300) for i in range(4)]
        want.update({p: gen(ref, p)[1]["output_ids"] for p in fresh})
        statuses, equal = [], []
        t0 = time.perf_counter()
        for p in fresh + prompts[:6]:
            st, body = gen(b, p, "acme")
            statuses.append(st)
            equal.append(st == 200 and body["output_ids"] == want[p])
        report["down_seconds"] = time.perf_counter() - t0
        report["down_statuses"] = statuses
        report["down_outputs_equal"] = all(equal)
        report["b_t2_down"] = t2_stats(b)
        report["ok"] = True
    finally:
        for s in servers.values():
            try:
                s.stop()
            except Exception:  # noqa: BLE001
                pass
        if master.poll() is None:
            master.kill()
        pathlib.Path(out).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main(*sys.argv[1:4])
