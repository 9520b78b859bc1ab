"""``sglang-tiered`` command line: build-model, serve (more subcommands join as they land)."""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import sys
import time


def _cmd_build_model(args: argparse.Namespace) -> int:
    from sglang_tiered.models.tiny import TinyModelSpec, build_model

    spec = TinyModelSpec(num_layers=args.layers, max_position_embeddings=args.context, dtype=args.dtype)
    print(build_model(spec))
    return 0


def default_max_total_tokens() -> int:
    # The tiny model's KV is 4 layers x 2 x 4 heads x 32 dims x 2 bytes = 2 KiB/token, so this pool
    # is 64 MiB; without the flag SGLang sizes the pool to host RAM (15 GB on a 24 GB machine).
    return 32768


def _cmd_serve(args: argparse.Namespace) -> int:
    from sglang_tiered.server import Server, ServerSpec

    model = args.model or os.environ.get("MODEL")
    if not model:
        from sglang_tiered.models.tiny import build_model

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
    server.start(timeout_s=args.start_timeout)
    print(
        f"\nsglang-tiered is serving {model} at {server.url}  (cache backend: tiered)\n"
        "try:\n"
        f"  curl -s {server.url}/generate -H 'Content-Type: application/json' \\\n"
        "    -d '{\"text\": \"def hello(world):\", \"sampling_params\": "
        "{\"temperature\": 0, \"max_new_tokens\": 16}}'\n"
        "Ctrl-C stops it.",
        flush=True,
    )
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    try:
        while not stop["now"] and server.proc.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0 if server.proc.returncode in (0, -15, None) else server.proc.returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sglang-tiered", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("build-model", help="build the built-in tiny Llama and print its folder")
    b.add_argument("--layers", type=int, default=4)
    b.add_argument("--context", type=int, default=4096)
    b.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    b.set_defaults(func=_cmd_build_model)

    s = sub.add_parser("serve", help="serve a model on CPU with --radix-cache-backend tiered")
    s.add_argument("--model", help="model folder (default: $MODEL, else the built-in tiny model)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=30000)
    s.add_argument("--page-size", type=int, default=16)
    s.add_argument("--max-total-tokens", type=int, default=default_max_total_tokens())
    s.add_argument("--tp", type=int, default=1)
    s.add_argument("--log", help="server log file (default logs/serve.log)")
    s.add_argument("--start-timeout", type=float, default=300.0)
    s.add_argument("sglang_args", nargs=argparse.REMAINDER, help="extra sglang.launch_server args after --")
    s.set_defaults(func=_cmd_serve)

    args = ap.parse_args(argv)
    if getattr(args, "sglang_args", None) and args.sglang_args[0] == "--":
        args.sglang_args = args.sglang_args[1:]
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
