"""``sglang-tiered`` command line: build-model, serve, plan, route."""

from __future__ import annotations

import argparse
import math
import pathlib
import re
import signal
import sys
import time


# Argument types (review, session 18: bad values were tracebacks, or nonsense with exit 0)
def _whole(lo: int, hi: int | None = None):
    def parse(v: str) -> int:
        try:
            x = int(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{v!r} is not a whole number") from None
        if x < lo or (hi is not None and x > hi):
            raise argparse.ArgumentTypeError(f"{v} is not in [{lo}, {hi}]" if hi is not None else f"{v} is below {lo}")
        return x

    return parse


def _number(lo: float, *, above: bool = False, hi: float | None = None):
    """A finite number >= lo (> lo with ``above``), and <= hi when given."""

    def parse(v: str) -> float:
        try:
            x = float(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{v!r} is not a number") from None
        if not math.isfinite(x) or x < lo or (above and x == lo):
            raise argparse.ArgumentTypeError(f"{v} must be a finite number {'>' if above else '>='} {lo:g}")
        if hi is not None and x > hi:
            raise argparse.ArgumentTypeError(f"{v} must be at most {hi:g}")
        return x

    return parse


def _tier(v: str) -> tuple[str, float]:
    name, sep, gbps = v.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{v!r}: expected NAME=GB/s")
    return name, _number(0.0, above=True)(gbps)


def _redis_url(v: str) -> str:
    if not re.fullmatch(r"rediss?://[A-Za-z0-9_.\[\]:@%-]+(/[0-9]{1,2})?", v):
        raise argparse.ArgumentTypeError(f"{v!r}: expected redis://HOST:PORT[/DB]")
    return v


def _worker_url(v: str) -> str:
    """A worker's base URL, ``http(s)://HOST:PORT`` (a trailing ``/`` dropped): before, ``ftp://x``
    or ``notaurl`` started a router whose every request was a 502 (a helper's hunt, session 32)."""
    from urllib.parse import urlsplit

    u = urlsplit(v.strip())
    try:
        port = u.port  # (a port that is not a number, or past 65535, raises)
    except ValueError:
        port = 0
    if (u.scheme.lower() not in ("http", "https") or not u.hostname or port == 0 or u.path not in ("", "/")
            or u.query or u.fragment):
        raise argparse.ArgumentTypeError(f"{v!r}: expected a worker's base URL, http://HOST:PORT")
    return v.strip().rstrip("/")


def _header_name(v: str) -> str:
    from sglang_tiered.config import HEADER_NAME, RESERVED_HEADERS

    if not HEADER_NAME.fullmatch(v):  # (as SGLANG_TIERED_TENANT_HEADER on the servers)
        raise argparse.ArgumentTypeError(f"{v!r}: a header name is 1-64 letters, digits and '-'")
    if v.lower() in RESERVED_HEADERS:
        raise argparse.ArgumentTypeError(f"{v!r}: a standard HTTP header, not a tenant's name")
    return v


def _model_dir(v: str) -> str:
    import os

    if not os.path.isdir(v) or not os.path.isfile(os.path.join(v, "config.json")):
        raise argparse.ArgumentTypeError(f"{v!r}: expected a local model folder (with its config.json and tokenizer)")
    return v


_PORT = _whole(1, 65535)
_MAX_MB = float(1 << 20)  # a request body limit in MiB: 1 TiB
_POSITIVE = _whole(1)


def _cmd_build_model(args: argparse.Namespace) -> int:
    from sglang_tiered.dev.tiny_model import TinyModelSpec, build_model

    spec = TinyModelSpec(num_layers=args.layers, max_position_embeddings=args.context, dtype=args.dtype)
    print(build_model(spec))
    return 0


def default_max_total_tokens() -> int:
    # The tiny model's KV is 4 layers x 2 x 4 heads x 32 dims x 2 bytes = 2 KiB/token, so this pool
    # is 64 MiB; without the flag SGLang sizes the pool to host RAM (15 GB on a 24 GB machine).
    return 32768


def _cmd_serve(args: argparse.Namespace) -> int:
    from sglang_tiered.dev.server import Server, ServerSpec

    model = args.model  # (make serve passes MODEL=... as --model)
    if model and not pathlib.Path(model).exists():
        raise ValueError(f"--model {model}: no such folder or file (a local model path; nothing is downloaded)")
    if not model:
        from sglang_tiered.dev.tiny_model import build_model

        model = str(build_model())
    spec = ServerSpec(
        model_path=model,
        port=args.port,
        host=args.host,
        page_size=args.page_size,
        max_total_tokens=args.max_total_tokens,
        tp=args.tp,
        extra_args=args.sglang_args,
    )
    log = pathlib.Path(args.log or "logs/serve.log")
    server = Server(spec, log)
    print(f"starting: {' '.join(spec.argv())}\n(log: {log})", flush=True)

    def on_term(*_):
        raise KeyboardInterrupt

    # before start(): a SIGTERM or Ctrl-C while the model loads stops the child too (it runs in its
    # own session; review, session 23: it was left running under init)
    signal.signal(signal.SIGTERM, on_term)
    try:
        server.start(timeout_s=args.start_timeout)
    except KeyboardInterrupt:
        return 130
    print(
        f"\nsglang-tiered is serving {model} at {server.url}  (cache backend: tiered)\n"
        "try:\n"
        f"  curl -s {server.url}/generate -H 'Content-Type: application/json' \\\n"
        "    -d '{\"text\": \"def hello(world):\", \"sampling_params\": "
        "{\"temperature\": 0, \"max_new_tokens\": 16}}'\n"
        "Ctrl-C stops it.",
        flush=True,
    )
    stopped = False
    try:
        while server.proc.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        stopped = True  # Ctrl-C / SIGTERM: SGLang's launcher then ends itself with SIGKILL (-9)
    finally:
        server.stop()
    if stopped or server.proc.returncode in (0, -15, None):
        return 0
    return server.proc.returncode if server.proc.returncode > 0 else 128 - server.proc.returncode


def _cmd_plan(args: argparse.Namespace) -> int:
    import json

    from sglang_tiered.core.planner import GPU_BF16_DENSE_FLOPS, ModelShape, load_config_json, plan

    cfg = load_config_json(args.model_config)
    params = args.params_b * 1e9 if args.params_b else None
    try:
        shape = ModelShape.from_config(cfg, params)
    except KeyError as exc:
        raise ValueError(f"{args.model_config} lacks {exc} (not a transformer config.json?)") from None
    flops = args.flops if args.flops else GPU_BF16_DENSE_FLOPS[args.gpu]
    tiers = dict(args.tier) if args.tier else None
    out = plan(shape, flops_per_gpu=flops, tp=args.tp, kv_dtype=args.kv_dtype, tiers=tiers, tokens=args.tokens)
    if args.json:
        print(json.dumps({"model": shape.__dict__, "flops_per_gpu": flops, "tp": args.tp, **out}, indent=2))
        return 0
    print(f"model: {shape.layers} layers, {shape.kv_heads} KV heads x {shape.head_dim}, "
          f"{shape.params / 1e9:.1f} B params; GPU {flops / 1e12:.1f} TFLOP/s x TP{args.tp}; KV {args.kv_dtype}")
    print(f"KV bytes per token          {out['kv_bytes_per_token']:>12,d}  ({out['kv_kib_per_token']:.0f} KiB)")
    print(f"recompute time per token    {out['recompute_us_per_token']:>12.1f}  us")
    print(f"break-even tier bandwidth   {out['break_even_gbps']:>12.1f}  GB/s")
    print(f"\nreading {out['tokens']} tokens instead of recomputing them:")
    print(f"{'tier':<16}{'GB/s':>8}{'read ms':>10}{'recompute ms':>14}  latency  GPU-cost")
    for t in out["tiers"]:
        print(f"{t['name']:<16}{t['bandwidth_gbps']:>8.1f}{t['read_ms']:>10.1f}{t['recompute_ms']:>14.1f}"
              f"  {'wins' if t['wins_latency'] else 'loses':<8} {'wins' if t['wins_gpu_cost'] else 'loses'}")
    return 0


def _cmd_route(args: argparse.Namespace) -> int:
    import logging

    from sglang_tiered.fleet.router import serve

    twice = sorted({w for w in args.workers if args.workers.count(w) > 1})
    if twice:
        print(f"sglang-tiered route: --workers lists {', '.join(twice)} more than once", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    print(f"sglang-tiered router on http://{args.host}:{args.port} over {len(args.workers)} workers "
          f"(k={args.k}, index {args.redis or 'off'})", flush=True)
    serve(args.workers, args.redis, host=args.host, port=args.port, k=args.k, model_path=args.model,
          tenant_header=args.tenant_header, c_tok_us=args.c_tok_us, page_size=args.page_size,
          index_ttl_s=args.index_ttl_s, index_timeout_ms=args.index_timeout_ms,
          load_poll_s=args.load_poll_ms / 1e3, worker_api_key=args.worker_api_key,
          max_body_mb=args.max_body_mb, admin_api_key=args.admin_api_key,
          parse_limit_mb=args.parse_limit_mb)  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sglang-tiered", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("build-model", help="build the built-in tiny Llama and print its folder")
    b.add_argument("--layers", type=_whole(1, 1024), default=4)
    b.add_argument("--context", type=_whole(16, 1 << 24), default=4096)
    b.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    b.set_defaults(func=_cmd_build_model)

    s = sub.add_parser("serve", help="serve a model on CPU with --radix-cache-backend tiered")
    s.add_argument("--model", help="model folder (default: the built-in tiny model)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_PORT, default=30000)
    s.add_argument("--page-size", type=_POSITIVE, default=16)
    s.add_argument("--max-total-tokens", type=_POSITIVE, default=default_max_total_tokens())
    s.add_argument("--tp", type=_POSITIVE, default=1)
    s.add_argument("--log", help="server log file (default logs/serve.log)")
    s.add_argument("--start-timeout", type=_number(0.0, above=True), default=300.0)
    s.add_argument("sglang_args", nargs=argparse.REMAINDER, help="extra sglang.launch_server args after --")
    s.set_defaults(func=_cmd_serve)

    p = sub.add_parser("plan", help="break-even table: when does reading KV from a tier beat recomputing it")
    p.add_argument("--model-config", required=True, help="the model's config.json")
    p.add_argument("--params-b", type=_number(0.0, above=True), help="parameter count in billions (default: from the config)")
    p.add_argument("--gpu", default="h100", choices=["h100", "h200", "a100", "l40s", "b200"])
    p.add_argument("--flops", type=_number(0.0, above=True), help="dense bf16 FLOP/s per GPU (overrides --gpu)")
    p.add_argument("--tp", type=_POSITIVE, default=1)
    p.add_argument("--kv-dtype", default="fp16", choices=["fp16", "bf16", "fp8", "fp32"])
    p.add_argument("--tokens", type=_POSITIVE, default=2000)
    p.add_argument("--tier", action="append", type=_tier, help="NAME=GB/s (repeatable; default host-pcie5, nvme, network-100g)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_plan)

    from sglang_tiered.config import router_admin_key, worker_api_key

    r = sub.add_parser("route", help="tenant-affinity + cache-aware router over SGLang servers")
    r.add_argument("--workers", nargs="+", action="extend", type=_worker_url, required=True,
                   help="worker URLs, http://HOST:PORT (also their ids in the index; repeatable)")
    r.add_argument("--redis", type=_redis_url, help="hint index, redis://127.0.0.1:PORT/DB (default: none: affinity + load)")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=_PORT, default=30100)
    r.add_argument("--k", type=_POSITIVE, default=1, help="minimum rendezvous homes per affinity key (hot keys get more)")
    r.add_argument("--model", type=_model_dir, help="local model folder for the tokenizer (default: ask the workers)")
    r.add_argument("--tenant-header", type=_header_name, help="trusted tenant header (e.g. x-tenant-id); else cache_salt")
    r.add_argument("--c-tok-us", type=_number(0.0), default=35.0, help="recompute microseconds per prompt token")
    r.add_argument("--page-size", type=_POSITIVE, default=None,
                   help="the servers' --page-size (default: read from their /server_info; 16 until one answers)")
    r.add_argument("--index-ttl-s", type=_number(0.0, above=True), default=30.0)
    r.add_argument("--index-timeout-ms", type=_number(0.0, above=True), default=50.0)
    r.add_argument("--load-poll-ms", type=_number(0.0), default=250.0, help="poll each worker's /v1/loads every this many ms (0: off)")
    r.add_argument("--worker-api-key", default=worker_api_key(),
                   help="the servers' --api-key (or --admin-api-key), for the router's own calls to them "
                        "(/model_info, /server_info, /v1/loads); default: $SGLANG_TIERED_WORKER_API_KEY")
    r.add_argument("--admin-api-key", default=router_admin_key(),
                   help="required (Authorization: Bearer KEY) on the router's own /router/stats, /router/metrics "
                        "and /router/decisions, which show every tenant's traffic; default: "
                        "$SGLANG_TIERED_ROUTER_ADMIN_KEY, else open (as SGLang's admin routes without keys)")
    # (bounded: 1e308 MiB was an OverflowError traceback when the router sized its limits in bytes)
    r.add_argument("--max-body-mb", type=_number(0.0, above=True, hi=_MAX_MB), default=1024.0,
                   help="largest request body in MiB (default 1024)")
    r.add_argument("--parse-limit-mb", type=_number(0.0, hi=_MAX_MB), default=4.0,
                   help="bodies larger than this (MiB) are not parsed for routing (parsing holds the event loop: "
                        "64 MiB, half a second for every stream); they go by tenant header and load (default 4)")
    r.set_defaults(func=_cmd_route)

    from sglang_tiered.dev.server import ServerStartError

    args = ap.parse_args(argv)
    if getattr(args, "sglang_args", None) and args.sglang_args[0] == "--":
        args.sglang_args = args.sglang_args[1:]
    try:
        return args.func(args)
    except (OSError, ValueError, ServerStartError) as exc:  # a missing or malformed file, a bad model: say so, no traceback
        ap.exit(2, f"sglang-tiered {args.cmd}: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
