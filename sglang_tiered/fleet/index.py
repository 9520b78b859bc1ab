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

A router reads it with one ``EVALSHA`` of ``LOOKUP_LUA`` per request (``KEYS``: the workers'
heartbeats, then the prompt's page keys in order): Redis walks the pages and answers each live
worker's matched prefix, in pages, instead of one ``HGETALL`` reply per page that the router
would decode and intersect itself (``holders_from_replies`` + ``routing.longest_match``, the same
rule, kept as the reference the script is tested against). The walk stops at the first page no
live worker still matching holds, so a long prompt with a short cached head costs a few reads.
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


# KEYS = n heartbeat keys, then page keys in prompt order; ARGV = n, now (unix s), ttl (s), then the
# n server ids (same order as the heartbeats). Returns {server id, matched pages, ...} for every
# live server holding at least the first page (a server counts for a page when its field is no
# older than the TTL). Same rule as holders_from_replies + routing.longest_match.
LOOKUP_LUA = """
local n = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
local ttl = tonumber(ARGV[3])
local cur = {}
for i = 1, n do
  if redis.call('EXISTS', KEYS[i]) == 1 then cur[ARGV[3 + i]] = true end
end
local matched = {}
for j = n + 1, #KEYS do
  local h = redis.call('HGETALL', KEYS[j])
  local nxt = {}
  local any = false
  for k = 1, #h, 2 do
    local sid = h[k]
    local v = tonumber(h[k + 1])
    if cur[sid] and v and now - v <= ttl then
      nxt[sid] = true
      any = true
      matched[sid] = j - n
    end
  end
  if not any then break end
  cur = nxt
end
local out = {}
for sid, m in pairs(matched) do
  out[#out + 1] = sid
  out[#out + 1] = m
end
return out
"""


def matched_from_lookup(reply, page_size: int) -> dict[str, int]:
    """``LOOKUP_LUA``'s reply as matched prefix tokens per server id."""
    out = {}
    for i in range(0, len(reply) - 1, 2):
        sid = reply[i].decode() if isinstance(reply[i], bytes) else str(reply[i])
        out[sid] = int(reply[i + 1]) * page_size
    return out
