"""The fleet hint index in Redis: chained page hash -> which servers hold that page.

Layout (all keys under ``st:``):

* ``st:p:<16-byte page hash>``: a Redis hash, field = server id, value = unix seconds of that
  server's last publication of the page. The key's expiry is refreshed on every publication.
* ``st:alive:<server id>``: heartbeat, expires after the TTL.
* ``st:ckey:<server id>``: the server's ``CacheKey`` (JSON), so a router hashes prompts the same way.

A reader counts server s as holding page p when s's field exists, is younger than the TTL, and
s's heartbeat is alive, so a dead server's entries are ignored within one TTL and vanish (their
keys expire) when nobody refreshes them. Removals are ``HDEL``. The index is a hint: it may be
stale in both directions and only ever changes where a request is routed, never its output.
"""

from __future__ import annotations

import time
from typing import Sequence

PREFIX = b"st:"


def page_key(h: bytes) -> bytes:
    return PREFIX + b"p:" + h


def alive_key(server_id: str) -> bytes:
    return PREFIX + b"alive:" + server_id.encode()


def ckey_key(server_id: str) -> bytes:
    """The server's cache identity (``CacheKey`` as JSON): routers need it to hash prompts."""
    return PREFIX + b"ckey:" + server_id.encode()


def holders_from_replies(page_replies: Sequence[dict], alive: dict[str, bool], ttl_s: float,
                         now: float | None = None) -> list[set]:  # fmt: skip
    """Per page, the set of live servers whose entry is fresh (``page_replies``: HGETALL results)."""
    now = time.time() if now is None else now
    out = []
    for rep in page_replies:
        s = set()
        for f, v in (rep or {}).items():
            sid = f.decode() if isinstance(f, bytes) else f
            try:
                fresh = now - float(v) <= ttl_s
            except (TypeError, ValueError):
                fresh = False
            if fresh and alive.get(sid, False):
                s.add(sid)
        out.append(s)
    return out
