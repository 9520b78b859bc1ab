"""CPU the index publisher spends per page in the scheduler's process: the batch as one
``WRITE_LUA`` call per 4,096 pages (since session 23) against the same writes as pipelined
``HSET``/``EXPIRE``/``HDEL`` commands (before), same run, a throwaway redis-server on 127.0.0.1.

    .venv/bin/python bench/publish_cost.py
"""

from __future__ import annotations

import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def main() -> int:
    import redis

    from sglang_tiered.dev.server import free_port, start_redis
    from sglang_tiered.fleet.index import page_key
    from sglang_tiered.fleet.publisher import IndexPublisher

    port = free_port()
    p = start_redis(port)
    try:
        r = redis.Redis(port=port)
        pub = IndexPublisher(f"redis://127.0.0.1:{port}/0", "w", ttl_s=30, start=False)
        pub._client = pub._connect()
        pages = [i.to_bytes(16, "little") for i in range(4096)]

        def pipelined(stored, removed):
            pipe = r.pipeline(transaction=False)
            for h in removed:
                pipe.hdel(page_key(h), "w")
            for h in stored:
                pipe.hset(page_key(h), "w", "1")
                pipe.expire(page_key(h), 120)
            pipe.execute()

        def best_us(fn, *a):
            best = float("inf")
            for _ in range(7):
                t0 = time.process_time()
                fn(*a)
                best = min(best, time.process_time() - t0)
            return best * 1e6 / len(pages)

        for what, args in (("claim", (pages, [])), ("withdraw", ([], pages))):
            old, new = best_us(pipelined, *args), best_us(pub._send, *args)
            print(f"{what}: pipelined commands {old:.2f} us CPU/page, WRITE_LUA {new:.2f} us/page, {old / new:.1f}x less")
    finally:
        p.kill()
    return 0


if __name__ == "__main__":
    import argparse

    # (before session 39 --help ran the benchmark)
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    sys.exit(main())
