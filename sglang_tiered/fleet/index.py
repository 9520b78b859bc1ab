"""The fleet hint index in Redis: chained page hash -> which servers hold that page.

Layout (all keys under ``st:``):

* ``st:p:<16-byte page hash>``: a Redis hash, field = server id, value = unix seconds of that
  server's last publication of the page. The key's expiry is refreshed on every publication. A
  server with several trees (data-parallel replicas, DP attention ranks) publishes each tree's
  pages under a field of its own, ``<server id>#<rank>`` (``holder_field``): a reader counts it
  as the server's, each tree on its own (a server matches its best tree's prefix: session 41).
  With one field, only the first tree published (its pages alone were seen), and
  trees sharing it would withdraw or clear each other's claims (session 40).
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
from collections import deque
from typing import Sequence

PREFIX = b"st:"


def page_key(h: bytes) -> bytes:
    return PREFIX + b"p:" + h


def alive_key(server_id: str) -> bytes:
    return PREFIX + b"alive:" + server_id.encode()


def ckey_key(server_id: str) -> bytes:
    """The server's cache identity (``CacheKey`` as JSON): routers need it to hash prompts."""
    return PREFIX + b"ckey:" + server_id.encode()


def holder_field(server_id: str, rank: str = "") -> str:
    """The field a server's tree claims pages under: the server id, or for a tree other than its
    first, ``<server id>#<rank>`` (server ids have no ``#``: config.py)."""
    return f"{server_id}#{rank}" if rank else server_id


def holder_of(field: str) -> str:
    """The server id a page field names (``holder_field``)."""
    return field.split("#", 1)[0]


def holders_from_replies(page_replies: Sequence[dict], alive: dict[str, bool], ttl_s: float,
                         now: float | None = None) -> list[set]:  # fmt: skip
    """Per page, the set of fresh fields (trees: ``holder_field``) of live servers (``page_replies``:
    HGETALL results; ``alive``: by server id). A server with one tree: its id. ``longest_match``
    over them gives each tree's prefix, ``servers_match`` each server's (its best tree's)."""
    now = time.time() if now is None else now
    out = []
    for rep in page_replies:
        s = set()
        for f, v in (rep or {}).items():
            f = f.decode() if isinstance(f, bytes) else f
            sid = holder_of(f)
            try:
                fresh = now - float(v) <= ttl_s
            except (TypeError, ValueError):
                fresh = False
            if fresh and alive.get(sid, False):
                s.add(f)
        out.append(s)
    return out


def servers_match(tree_matched: dict[str, int]) -> dict[str, int]:
    """Per server id, its best tree's match (``tree_matched``: by field, ``holder_field``): a request
    lands on one tree, so a server holds no more of a prompt than its best tree does."""
    out: dict[str, int] = {}
    for f, m in tree_matched.items():
        sid = holder_of(f)
        if m > out.get(sid, 0):
            out[sid] = m
    return out


# KEYS = n heartbeat keys, then page keys in prompt order; ARGV = n, now (unix s), ttl (s), then the
# n server ids (same order as the heartbeats). Returns {server id, matched pages, ...} for every
# live server holding at least the first page (a server counts for a page when its field is no
# older than the TTL). A server with several trees (fields ``<id>#<rank>``: ``holder_field``)
# matches its best tree's prefix: the walk follows each tree (field) on its own, and a server's
# match is the longest of its trees'. Counted over all its trees together, a prefix whose first
# pages one tree holds and later pages another counted as one long match, which no tree (the one
# the request lands on) holds (review, session 41). Same rule as holders_from_replies +
# routing.longest_match + servers_match. A page key that is
# not a hash (WRONGTYPE) ends the match there: before session 37 it failed the script, which the
# router took for Redis down, so one bad key cost every tenant the index for a second at a time.
LOOKUP_LUA = """
local n = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
local ttl = tonumber(ARGV[3])
local alive = {}
for i = 1, n do
  if redis.call('EXISTS', KEYS[i]) == 1 then alive[ARGV[3 + i]] = true end
end
local cur = nil
local matched = {}
for j = n + 1, #KEYS do
  local h = redis.pcall('HGETALL', KEYS[j])
  if h.err then h = {} end
  local nxt = {}
  local any = false
  for k = 1, #h, 2 do
    local f = h[k]
    local sid = f
    local cut = string.find(f, '#', 1, true)
    if cut then sid = string.sub(f, 1, cut - 1) end
    local v = tonumber(h[k + 1])
    if alive[sid] and (cur == nil or cur[f]) and v and now - v <= ttl then
      nxt[f] = true
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


class LookupConnection:
    """The router's read path: ``LOOKUP_LUA`` by ``EVALSHA`` over one pipelined RESP connection.

    Why not redis-py's asyncio client: per lookup it took a pooled connection, encoded every
    argument in Python and parsed through an asyncio StreamReader: 0.31 of the router's 3.75 ms
    per request under cProfile (bench/router_cpu.py --profile, before issue #13's CPU work). Here a
    lookup is one ``hiredis.pack_command``, one write, and a reply parsed by ``hiredis.Reader`` in
    ``data_received``.

    I1 Redis answers a connection's commands in order: ``_pending`` holds one future per command
       sent, in order, and each reply resolves the oldest. A caller that stopped waiting (a
       timeout cancels its future) leaves its future there, so its late reply is read and dropped
       and the next reply still goes to the next command.
    I2 A lost connection fails every pending future with ``ConnectionError`` and the next lookup
       reconnects (``reset()`` drops a connection that stopped answering).
    Only ``redis://[:password@]host[:port][/db]`` URLs; the router keeps redis-py for the others.
    """

    def __init__(self, url: str, script: str, connect_timeout_s: float = 1.0):
        import hashlib
        from urllib.parse import unquote, urlsplit

        u = urlsplit(url)
        if u.scheme != "redis":
            raise ValueError(f"LookupConnection takes redis://host:port/db URLs, got {url!r}")
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 6379
        self.password = unquote(u.password) if u.password else None
        self.username = unquote(u.username) if u.username else None
        self.db = int(u.path.lstrip("/") or 0)
        self.script = script
        self.sha = hashlib.sha1(script.encode()).hexdigest()
        self.connect_timeout_s = connect_timeout_s
        self._transport = None
        self._proto = None  # the current connection's protocol (a closed one's events are ignored)
        self._pending: deque = deque()
        self._lock = None  # asyncio.Lock, made on first use (inside the running loop)

    @classmethod
    def supports(cls, url: str) -> bool:
        try:
            import hiredis  # noqa: F401
        except ImportError:
            return False
        return url.startswith("redis://")

    async def evalsha(self, keys: Sequence[bytes], args: Sequence) -> object:
        """``EVALSHA`` of the script (loaded on every connection; NOSCRIPT: loaded, sent once more)."""
        reply = await self._call(("EVALSHA", self.sha, len(keys), *keys, *args))
        if isinstance(reply, Exception):
            if not str(reply).startswith("NOSCRIPT"):
                raise reply
            await self._call(("SCRIPT", "LOAD", self.script))
            reply = await self._call(("EVALSHA", self.sha, len(keys), *keys, *args))
            if isinstance(reply, Exception):
                raise reply
        return reply

    def reset(self) -> None:
        """Drop the connection (the next call reconnects)."""
        transport = self._transport
        self._lost(ConnectionError("connection reset"))
        if transport is not None:
            transport.close()

    close = reset

    # ---------------------------------------------------------------- the connection
    async def _call(self, command: tuple):
        import hiredis

        if self._transport is None:
            await self._connect()
        return await self._send(hiredis.pack_command(_resp_args(command)))

    def _send(self, packed: bytes):
        import asyncio

        if self._transport is None:
            raise ConnectionError(f"redis {self.host}:{self.port}: not connected")
        fut = asyncio.get_running_loop().create_future()
        self._pending.append(fut)
        self._transport.write(packed)
        return fut

    async def _connect(self) -> None:
        import asyncio

        import hiredis

        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._transport is not None:
                return
            loop = asyncio.get_running_loop()
            self._transport, self._proto = await asyncio.wait_for(
                loop.create_connection(lambda: _LookupProtocol(self), self.host, self.port),
                self.connect_timeout_s)  # fmt: skip
            hello = []
            if self.password is not None:
                hello.append(("AUTH", self.username, self.password) if self.username else ("AUTH", self.password))
            if self.db:
                hello.append(("SELECT", self.db))
            hello.append(("SCRIPT", "LOAD", self.script))
            futs = [self._send(hiredis.pack_command(_resp_args(c))) for c in hello]
            for r in await asyncio.wait_for(asyncio.gather(*futs), self.connect_timeout_s):
                if isinstance(r, Exception):
                    self.reset()
                    raise ConnectionError(f"redis {self.host}:{self.port}: {r}")

    def _replies(self, replies: list) -> None:
        for r in replies:
            fut = self._pending.popleft()  # I1
            if not fut.done():
                fut.set_result(r)

    def _lost(self, exc: BaseException) -> None:
        self._transport = self._proto = None
        pending, self._pending = self._pending, deque()
        for fut in pending:  # I2
            if not fut.done():
                fut.set_exception(ConnectionError(f"redis {self.host}:{self.port}: {exc}"))


def _resp_args(command: tuple) -> tuple:
    # floats as repr (what redis-py sends); the script reads them with tonumber()
    return tuple(repr(a) if isinstance(a, float) else a for a in command)


class _LookupProtocol:
    """asyncio.Protocol of a LookupConnection: RESP replies parsed by hiredis as they arrive."""

    def __init__(self, conn: LookupConnection):
        import hiredis

        self.conn = conn
        self.reader = hiredis.Reader()

    def connection_made(self, transport) -> None:
        pass

    def data_received(self, data: bytes) -> None:
        if self.conn._proto is not self:  # a connection reset() dropped: its futures have failed
            return
        self.reader.feed(data)
        out = []
        while (r := self.reader.gets()) is not False:
            out.append(r)
        self.conn._replies(out)

    def eof_received(self):
        return False

    def connection_lost(self, exc) -> None:
        if self.conn._proto is self:
            self.conn._lost(exc or ConnectionError("closed by the server"))

    def pause_writing(self) -> None:
        pass

    def resume_writing(self) -> None:
        pass
