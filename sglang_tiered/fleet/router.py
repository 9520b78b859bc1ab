"""``sglang-tiered route``: a small HTTP router in front of several SGLang servers.

It proxies requests itself (aiohttp), rather than steering smg: smg has no policy hook, and its
``x-smg-target-worker`` header names a worker by its index in smg's worker list, an order that is
not stable across smg restarts or membership changes, so a routing decision made outside smg could
land on the wrong worker. One loopback hop costs well under a millisecond here.

Per request (``/generate``, ``/v1/completions``, ``/v1/chat/completions``, streaming included):

1. tenant = the trusted header (``--tenant-header``) if configured, and then only it (stripped;
   absent or empty: no tenant; repeated or not UTF-8: HTTP 400, as the servers answer), else the
   body's ``cache_salt``. In header mode the servers drop a client's own ``cache_salt``, so the
   router must not route or hash by it: a client without the header could otherwise name another
   tenant's salt and learn from the routing memory whether that tenant sent a prompt;
2. token ids: ``input_ids`` when given, else the served model's tokenizer (transformers
   AutoTokenizer from the local model path: ``encode(text)`` as SGLang does for text prompts; for
   chat, ``apply_chat_template(messages, add_generation_prompt=True)`` over the messages as
   SGLang hands them to the template (``messages_for_template``: text parts joined or kept as
   the template's content format asks, null content empty; the request's ``tools`` and
   ``chat_template_kwargs`` passed on), which matches SGLang's template path for text messages
   and is approximate otherwise (media, continue_final_message): a mismatch only costs
   locality, never correctness);
3. the same chained page hashes as the servers (seeded by the ``CacheKey`` each server publishes
   in the index and the namespace (tenant, the body's ``extra_key``)); a background task re-reads
   every worker's key every ``KEY_REFRESH_S`` (a request never waits for it; a weight update
   re-seeds a server's key), a worker is looked up with the prompt hashed under its own key, and
   until a key is known, requests route without the index. The routing
   memory is keyed by the router's own chain of the same pages, so it works without the index;
4. one Redis round trip (``EVALSHA`` of ``index.LOOKUP_LUA`` over the heartbeats and the prompt's
   page keys) gives each worker's matched prefix; a lookup slower than ``--index-timeout-ms``
   routes that request without the index (``index_timeouts``), and so does Redis down
   (``index_errors``: a connection error, or ``SLOW_LOOKUPS_DOWN`` timeouts in a row, then the
   index is not asked for 1 s): affinity + the routing memory + load. A single slow lookup does
   not switch the index off: on 2 busy cores one lookup in a few waits past 50 ms behind other
   requests' work in the event loop, and the 1 s pause that followed had routed 187 of 360
   requests of a live run blind (bench/fleet_live.py, decisions log);
5. ``AffinityCachePolicy`` picks the worker (see routing.py); load = requests in flight on the
   worker, queue delay = their not-yet-cached prompt tokens x c_tok. Both are this router's own
   counts (exact and current for what it sent) raised to what the worker last reported at
   ``/v1/loads`` (polled every ``load_poll_s``: running + waiting requests, waiting uncached
   tokens), so traffic that bypasses this router, or another router, is seen too (smg polls the
   same endpoint). A poll that fails or is older than 4 periods is ignored, and the requests of
   this router that the report counted and that have finished since are taken off it: on a
   sequential client a report up to 1 s old showed the worker that served the previous request
   as busy, and the cold rule moved the next request off its home (decisions log of the fleet test).

``GET /router/decisions`` returns the last ``DECISIONS_KEPT`` routing decisions (per request: its
``x-request-id``, its tenant's digest (``tenant_digest``: the route is open, a salt is a secret), prompt tokens, what the index and the routing memory said each worker
holds, each worker's load and queue estimate, the chosen worker, the policy's reason, the routing
time), to explain a run after the fact (bench/fleet_live.py joins them with what the servers
reported as cached).

CPU per request (``bench/router_cpu.py``: stub workers, a real Redis index, the live bench's
workload; bench/results/router_cpu.json): 2.26 -> 1.79 ms, interleaved over 6 rounds against the
router before this work, lower in every round, with the same decisions (tests/test_fleet.py
replays). It runs on uvloop, reads the index over its own pipelined connection
(``index.LookupConnection``), hashes the token ids from one ``array('q')``, and asks the routing
memory once per request. What is left is the proxy itself (aiohttp: HTTP parsing, one write and
its syscall per streamed chunk, new client connections) and the tokenizer (about 0.1 ms CPU per
prompt); the policy takes about 0.02 ms.

A worker that fails health checks or cannot be connected to leaves the routing set (its tenants
rehome by rendezvous, about 1/n of them) until it answers again; a request whose connection fails
before any byte reached the client is sent again: to the same worker on a new connection when the
connection closed unanswered (the worker's keep-alive ran out: it keeps its tenants), to the next
choice when the worker cannot be reached. Idle upstream connections close after 3 s, before
SGLang's server closes them (5 s). A client that leaves closes its
upstream request (``serve()`` cancels the handler), so the worker aborts it; that is counted as
``client_gone``, never as a worker's failure.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import re
import time
from array import array
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Optional

from sglang_tiered.config import MAX_INDEX_TTL_S
from sglang_tiered.core.keys import CacheKey, chain_page_hashes, client_extra_key
from sglang_tiered.core.tenants import (
    MAX_LABEL_CHARS,
    RESPONSE_ID_PREFIX,
    name_hash,
    response_not_found,
    scoped_response_id,
    scoped_session_id,
    tenant_label,
)
from sglang_tiered.fleet.index import LOOKUP_LUA, LookupConnection, alive_key, ckey_key, matched_from_lookup, page_key
from sglang_tiered.fleet.routing import AffinityCachePolicy, Decision, FleetView, RouteRequest, token_affinity_key

logger = logging.getLogger("sglang_tiered.router")
ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
# Anthropic's Messages and OpenAI's Responses: generations too, routed by ``handle`` as ROUTES are
# (tenant, prompt tokens where the router can render them as the worker will: ``api_tokens``), with
# its retry before the first byte and its bound on a worker frozen before its headers. Review,
# session 42: they went through ``passthrough`` (least busy worker, no cache routing), and a
# worker that closed the connection before answering failed the request, or, frozen before its
# headers, held the client for good.
API_ROUTES = ("/v1/messages", "/v1/responses")
MAX_LOOKUP_PAGES = 512
SLOW_LOOKUPS_DOWN = 3  # index lookups timing out in a row before the index is treated as down for 1 s
MEMORY_KEY = CacheKey(model_id="sglang-tiered-router-memory")  # seeds the routing memory's page chain
DEFAULT_PAGE_SIZE = 16  # until the workers' own is known (SGLang's default is 1; CUDA backends often 16+)
KEY_REFRESH_S = 2.0  # the workers' CacheKeys are re-read this often
BIG_PROMPT_CHARS = 1 << 16  # prompts of bodies longer than this are tokenized off the event loop
# Bodies longer than this are not parsed for routing (``parse_limit_mb``): ``json.loads`` holds the
# GIL, so on a worker thread it stalls the event loop as much as on it (64 MiB: 0.45 s vs 0.55 s,
# every stream the router proxies waits; measured session 24). Such a body (past any model's
# context as text; large multimodal payloads) is routed by the tenant header and load alone and
# forwarded as it is; the worker parses it, as it would without the router.
PARSE_LIMIT_MB = 4.0
# Idle upstream connections are closed after this many seconds: below SGLang's own keep-alive
# (uvicorn's, ``SGLANG_TIMEOUT_KEEP_ALIVE``, 5 s by default). With aiohttp's 15 s the router sent
# requests on connections the worker was closing: "Server disconnected" before any answer, a
# healthy worker marked down and its tenants moved, and 502s with one worker (review, session 29).
UPSTREAM_KEEPALIVE_S = 3.0
# The client side (aiohttp's defaults: 8,190-byte header lines, 128 headers, a listen backlog of
# 128): a 10 KB bearer token, a 16 KB cookie or a 9 KB query string that SGLang's server takes were
# a bare 400 from the router, and a burst of new connections waited 1 s for a second SYN.
# uvicorn (SGLang's server) allows a 2,048 backlog; smg takes such headers too.
MAX_HEADER_LINE = 65536
MAX_HEADERS = 256
LISTEN_BACKLOG = 2048
# Routes that change every server's state go to every worker, and the answer is each worker's
# (keyed by worker) with the worst status (review, session 32: through the router these reached
# one worker, the least busy, so ``/abort_request`` went to a worker that did not run the request
# and the generation ran to its end, and a weight or adapter update left the fleet mixed).
FLEET_WIDE = frozenset(("/flush_cache", "/cache/invalidate", "/abort_request", "/pause_generation",
                        "/continue_generation", "/update_weights_from_disk", "/update_weight_version",
                        "/load_lora_adapter", "/unload_lora_adapter"))  # fmt: skip
# Calls that change one server's weights, adapters or memory with what only that server can take
# (tensors or IPC handles of its own process, a process group it joins, its own sleep): through the
# router they reached the least busy worker alone, and the fleet served mixed weights with nothing
# said (session 40). Refused with a 400 that says to call each worker.
ONE_SERVER_UPDATES = frozenset(("/update_weights_from_tensor", "/update_weights_from_distributed",
                                "/update_weights_from_ipc", "/load_lora_adapter_from_tensors",
                                "/begin_weight_update", "/end_weight_update", "/init_weights_update_group",
                                "/destroy_weights_update_group", "/release_memory_occupation",
                                "/resume_memory_occupation"))  # fmt: skip
# SGLang's sessions (``/open_session``, then requests with ``session_params.id``) live in the one
# server that opened them: the router remembers which (this many, the oldest forgotten first)
SESSIONS_KEPT = 65536
# SGLang's stored OpenAI Responses (``store``, on a server started with --enable-response-store) live
# in the memory of the one server that answered them (``serving_responses.py``'s ``response_store``):
# a later ``previous_response_id``, ``GET /v1/responses/{id}`` and its ``/cancel`` find them there
# alone (any other answers 404). The router remembers which worker answered each id (this many, the least recently used forgotten
# first; an id past SESSION_ID_CHARS by its digest, ``session_memo``), learned from the answer:
# the JSON body's ``id`` (SGLang writes it first), a stream's ``response.created`` event (review,
# session 42: before, these went wherever the router sent any request, so with two workers they
# reached the wrong one and were refused as unknown)
RESPONSES_KEPT = 65536
RESPONSE_ID_ROUTE = re.compile(r"^/v1/responses/([^/]+)(?:/[^/]+)?$")  # GET /{id}, POST /{id}/cancel
FOREIGN = "\0foreign"  # ``Router._response_worker``: another tenant's stored response (never a worker URL)
RESPONSE_HEAD_MAX = 64 << 10  # the bytes of a JSON answer kept to find its id in
_RESPONSE_ID = re.compile(rb'\A\s*\{\s*"id"\s*:\s*("(?:[^"\\]|\\.)*")')
# A worker's answers that another worker may well serve (SGLang: 503 with its queue full, 500 for
# a fault of its own): before any byte reaches the client, the request goes once to another
# worker (as smg retries them); ``health_misses`` of them in a row take the worker out of the
# routing set for ERROR_COOLDOWN_S (its tenants go elsewhere meanwhile). Before session 37 a
# worker answering 500 kept its tenants for good and showed no failures (a helper's audit).
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
ERROR_COOLDOWN_S = 5.0
# An invalidation a worker did not take (down, unreachable, or a 5xx) is owed to it: the worker
# leaves the routing set, and the health loop delivers what it owes, in order, before it routes
# there again (before session 38 the broadcast answered 502 for it and forgot: a worker that came
# back served the tenant's old pages from its device, its named T1 and its old T2 generation).
# A newer invalidation of the same scope (same body but the generation, same tenant header and
# key: ``_owed_scope``) replaces an older one (generations only move up); past OWED_MAX scopes per
# worker the oldest is dropped, with a warning.
OWED_MAX = 4096
# The other fleet-wide calls a worker must not miss are owed the same way, in order with its
# owed invalidations (session 40: a worker down through a /flush_cache came back serving what the
# flush dropped, and one down through a weight or adapter update came back on the old weights or
# adapters, routed to again beside peers on the new ones). A newer call of one of SUPERSEDING
# replaces an owed older one (a flush, a full load, a version label: the last one is what counts);
# every adapter load and unload is kept, in order. The call, and its delivery, wait up to
# OWED_SLOW_S for a weight or adapter load (a checkpoint read), OWED_FLUSH_S plus its own wait for a
# flush (with T1 on it first copies the device tree to host memory), OWED_TIMEOUT_S for the others
# (past it, owed); a flush SGLang refuses on delivery (400: requests still running) is tried again
# at the next health check, not dropped.
OWED_ROUTES = frozenset(("/cache/invalidate", "/flush_cache", "/update_weights_from_disk", "/update_weight_version",
                         "/load_lora_adapter", "/unload_lora_adapter", "/pause_generation",
                         "/continue_generation"))  # fmt: skip
SUPERSEDING = frozenset(("/flush_cache", "/update_weights_from_disk", "/update_weight_version"))
ADAPTER_ROUTES = frozenset(("/load_lora_adapter", "/unload_lora_adapter"))  # (``Router.fleet_adapters``)
# Pausing and continuing (session 41) are owed too, as one scope: the later call replaces an owed
# earlier one, so a worker is owed the fleet's last word (paused, or generating). A worker that
# missed /continue_generation (down, or no answer in time) stayed paused for good: SGLang holds
# every request it gets while paused (``generate_request`` waits on ``is_pause_cond``) and its
# /health still answers 200, so it was routed to and each request there hung. One that missed a
# pause (restarted meanwhile: a new server is not paused) served while its peers were paused, e.g.
# across a weight update the pause was for. ``/abort_request`` is never owed: a worker that missed
# it while down lost its requests with its process, and an ``abort_all`` delivered later would
# abort requests sent after the call.
PAUSE_ROUTES = frozenset(("/pause_generation", "/continue_generation"))
# The fleet serves one set of weights (session 40): what the router last broadcast of these and a
# worker took (``Router.fleet_weights``: the body's ``model_path``, its ``weight_version`` or
# ``new_version``, as SGLang's /model_info then reports them) is compared with each worker's
# /model_info at its health checks, and a worker that reports other weights (restarted on its
# launch weights after an update it took) is out of the routing set while it does; one that refused
# (4xx) an update its peers took is out until it takes one (its /model_info may not tell: a reload
# from the same path). Before, both were routed to beside peers on the new weights, nothing said.
WEIGHT_ROUTES = frozenset(("/update_weights_from_disk", "/update_weight_version"))
WEIGHT_INFO = ("model_path", "weight_version")  # what /model_info says of the weights
WEIGHTS_SEEN_MAX = 64  # (``Router._weights_seen``)
OWED_TIMEOUT_S = 10.0
OWED_SLOW_S = 3600.0
OWED_FLUSH_S = 120.0
# Every fleet-wide call is bounded (``owed_timeout``; before session 41 /abort_request,
# /pause_generation and /continue_generation were not, and one hung worker held the caller for
# good). By what SGLang 0.5.23 does (tokenizer_manager.py): /abort_request only queues the abort
# for the scheduler and answers (OWED_TIMEOUT_S); /pause_generation in its default mode ("abort")
# aborts everything and then waits, 1 s at a time, until ``model_update_lock`` is free, i.e. until
# the requests in flight have left and a weight update that holds it has finished (a checkpoint
# read), and its other modes wait for the scheduler's reply; /continue_generation waits for
# ``is_pause_cond``, which a pause still waiting holds: both get OWED_SLOW_S, as a weight update.
# A call to a worker that stops answering altogether (``health_misses`` failed health checks in a
# row while it waits: SGLang's /health answers at once, paused or not) ends sooner: that worker's
# part of the answer is a 504 naming it (``Router._hang_up``), and an owed route is owed to it.
# A compressed request body is decoded to at most this many bytes (413 past it; ``max_body_mb``
# when lower): a 1 MiB gzip upload that decodes to 1.1 GiB held the event loop for 12-16 s and
# took the router to 2.1 GiB (review, session 32). SGLang itself does not decode request bodies.
MAX_DECODED_MB = 16.0
# The decisions log keeps a client's ``x-request-id`` up to this many characters (a 64 KiB id
# per request made the 4,096 kept decisions 300 MiB: review, session 32)
RID_CHARS = 128


def _pin(pins: OrderedDict, key, url, kept: int) -> None:
    """Remember that ``key`` (a session's or a stored response's id, ``session_memo``'d) lives on
    the worker at ``url`` (a response's: with its owner): most recently used last, the oldest
    forgotten beyond ``kept``."""
    pins[key] = url
    pins.move_to_end(key)
    while len(pins) > kept:
        pins.popitem(last=False)


def _response_not_found(rid: str):
    """SGLang's answer for a stored response it does not hold (``tenants.response_not_found``):
    what another tenant's id gets, so it learns nothing of it (review, session 43: aiohttp's
    spaced JSON with a charset, or ``param: previous_response_id``, told that the id was another
    tenant's). ``application/json``, as SGLang's ``ORJSONResponse``."""
    from aiohttp import web

    status, body = response_not_found(rid)
    return web.Response(body=body, status=status, content_type="application/json")


def _adapter_name(raw: bytes):
    """The ``lora_name`` of an adapter call's body (None when it has none)."""
    body = _parse_body(raw)
    name = body.get("lora_name") if isinstance(body, dict) else None
    return name if isinstance(name, str) else None


def _parse_body(raw: bytes):
    """A request body as JSON; ``{}`` when it is not JSON (or nests deeper than the parser goes):
    such a body routes by affinity and load, and the worker answers it."""
    try:
        return json.loads(raw) if raw else {}
    except (ValueError, RecursionError):
        return {}
DECISIONS_KEPT = 4096  # /router/decisions: the last this many (bounded; about 1 KiB each)
# request headers not forwarded as they came (aiohttp sets them for the upstream request) ...
HOP_REQUEST_HEADERS = frozenset(("host", "content-length", "transfer-encoding", "connection", "te", "upgrade",
                                 "keep-alive", "proxy-connection", "proxy-authorization", "trailer"))  # fmt: skip
# ... and response headers not copied back (aiohttp's own framing, date and server)
HOP_RESPONSE_HEADERS = frozenset(("content-length", "transfer-encoding", "connection", "content-encoding", "date",
                                  "server"))  # fmt: skip


def _reads_content(node) -> bool:
    """``message['content']`` / ``message.content`` (also of ``msg``, ``m``), through filters,
    tests and slices: SGLang's ``_is_var_or_elems_access`` (sglang/srt/parser/jinja_template_utils.py)."""
    import jinja2.nodes as jn

    while True:
        if isinstance(node, (jn.Filter, jn.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, jn.Getitem) and isinstance(node.arg, jn.Slice):
            node = node.node
        else:
            break
    if isinstance(node, jn.Getitem):
        key = node.arg.value if isinstance(node.arg, jn.Const) else None
    elif isinstance(node, jn.Getattr):
        key = node.attr
    else:
        return False
    base = node.node
    return key == "content" and isinstance(base, jn.Name) and base.ctx == "load" and base.name in ("message", "msg", "m")


def template_content_format(template) -> str:
    """What SGLang hands a chat template as a message's content when the request sends a list of
    parts (``detect_jinja_template_content_format``, sglang 0.5.23): ``"openai"`` (the parts, for
    templates that loop over the content, and every template naming image, audio, video or
    vision) or ``"string"`` (the text parts joined by spaces)."""
    if not isinstance(template, str):
        return "string"
    if any(k in template for k in ("image", "audio", "video", "vision")):
        return "openai"
    try:
        try:  # the environment SGLang parses with (transformers' own, with its extensions)
            from transformers.utils.chat_template_utils import _compile_jinja_template

            ast = _compile_jinja_template(template).environment.parse(template)
        except ImportError:
            import jinja2

            ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
        import jinja2.nodes as jn

        return "openai" if any(_reads_content(f.iter) for f in ast.find_all(jn.For)) else "string"
    except Exception:  # noqa: BLE001 - SGLang falls back to "string" too
        return "string"


_MEDIA = {"image_url": "image", "input_image": "image", "video_url": "video", "audio_url": "audio"}


def messages_for_template(msgs: list, fmt: str) -> list:
    """The messages as SGLang renders them (``process_content_for_template_format``, then
    ``normalize_tool_content``): fields that are None dropped, null content empty; list content
    flattened to its text parts joined by spaces (``string``) or normalized parts (``openai``:
    text kept, media as bare ``{"type": ...}``; a tool message's all-text parts joined)."""
    out = []
    for m in msgs:
        if not isinstance(m, dict):
            out.append(m)
            continue
        content = m.get("content")
        new = {k: v for k, v in m.items() if v is not None}
        if content is None:
            new["content"] = ""  # (SGLang's chat path: a null content is an empty one)
        if isinstance(content, list):
            texts = [c.get("text") for c in content if isinstance(c, dict) and c.get("type") in ("text", "input_text")]
            if fmt == "string":
                new["content"] = " ".join(t for t in texts if isinstance(t, str))
            else:
                parts = []
                for c in content:
                    if not isinstance(c, dict):
                        continue
                    t = c.get("type")
                    if t in ("text", "input_text"):
                        parts.append({"type": "text", "text": c.get("text")})
                    elif t in _MEDIA:
                        parts.append({"type": _MEDIA[t]})
                    elif t == "tool_reference":
                        parts.append(c)
                if new.get("role") == "tool" and all(p.get("type") == "text" for p in parts):
                    parts = " ".join(p.get("text", "") for p in parts)  # SGLang's normalize_tool_content
                new["content"] = parts
        out.append(new)
    return out

# ``apply_chat_template``'s own parameters: a client's ``chat_template_kwargs`` must not set them
# (review, session 21: ``padding``/``max_length`` padded every prompt to millions of tokens and
# stuck in the shared tokenizer; ``truncation`` cut every later prompt to one token; SGLang
# renders with its own). ``chat_template`` itself is refused by SGLang and not rendered here.
TEMPLATE_CALL_ARGS = frozenset((
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "return_attention_mask",
))  # fmt: skip
_FUNCTION_FIELDS = ("description", "name", "parameters", "strict", "defer_loading")


def _tool_as_sglang_dumps(tool) -> Optional[dict]:
    """``Tool.model_validate(tool).model_dump()`` of SGLang 0.5.23's protocol (the tool as its
    chat template sees it) without importing it (4.5 s and torch in the router's process):
    defaults filled, ``strict`` and ``defer_loading`` dropped from the function when unset, the
    client's key order kept. None when SGLang's model would refuse it (SGLang answers 400)."""
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        return None
    fn = tool["function"]
    ttype = tool.get("type", "function")
    if not isinstance(fn.get("name"), str) or not isinstance(ttype, str):
        return None
    for k, kinds in (("description", str), ("strict", bool), ("defer_loading", bool)):
        if fn.get(k) is not None and not isinstance(fn[k], kinds):
            return None
    if tool.get("defer_loading") is not None and not isinstance(tool["defer_loading"], bool):
        return None
    data = {k: fn.get(k) for k in _FUNCTION_FIELDS}
    if data["defer_loading"] is None and tool.get("defer_loading") is not None:
        data["defer_loading"] = tool["defer_loading"]  # (Tool._propagate_defer_loading)
    for k in ("defer_loading", "strict"):
        if data[k] is None:
            del data[k]
    order = list(fn)
    data = {k: data[k] for k in order + [k for k in data if k not in order] if k in data}
    return {"type": ttype, "function": data, "defer_loading": tool.get("defer_loading")}


def template_tools(body: dict) -> Optional[list]:
    """The tools SGLang hands the chat template (serving_chat.py, 0.5.23): none for
    ``tool_choice: "none"``, only the named one for a named choice, each as SGLang's ``Tool``
    dumps it (review, session 21: the raw list was rendered, and with ``"none"`` too, so tool
    prompts never matched the servers' page hashes)."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools:
        return None
    choice = body.get("tool_choice")
    if choice == "none":
        return None
    dumped = [_tool_as_sglang_dumps(t) for t in tools]
    if any(d is None for d in dumped):
        return tools  # SGLang refuses the request: nothing to match
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        return [d for d in dumped if d["function"]["name"] == name] or None
    return dumped


@dataclass
class WorkerState:
    url: str
    healthy: bool = True
    inflight: int = 0
    inflight_tokens: int = 0
    routed: int = 0
    failures: int = 0
    missed: int = 0  # failed health checks in a row
    down_until: float = 0.0
    # the worker's own report (/v1/loads, summed over its DP ranks) and when it arrived
    polled_reqs: int = 0
    polled_tokens: int = 0
    polled_at: float = 0.0
    poll_sent_at: float = 0.0  # when the last accepted report was asked for
    done_since_poll: int = 0  # this router's requests sent before that and finished since
    done_tokens_since_poll: int = 0  # ... and their uncached prompt tokens
    errors_in_row: int = 0  # RETRY_STATUSES answers in a row
    first_miss_at: float = 0.0  # when the health checks began to miss (``missed`` went from 0 to 1)
    answered_at: float = 0.0  # when the worker last answered a proxied request (its status line)
    heard_at: float = 0.0  # when its /health last answered at all, whatever the status (``_check``)
    waiting: dict = field(default_factory=dict)  # handler tasks waiting for its answer (-> None)
    calls: set = field(default_factory=set)  # its parts of fleet-wide broadcasts in flight (``_hang_up``)
    # handler tasks passing its answer on (status line received) -> when its last bytes came (``_check``)
    streams: dict = field(default_factory=dict)
    # fleet-wide calls it did not take (``OWED_ROUTES``): their scope (``Router._owed_scope``) ->
    # (body, that body without the generation, headers, method, path and query), oldest first
    owed: OrderedDict = field(default_factory=OrderedDict)
    owed_warned_at: float = -1e9
    owed_status: int = 502  # its answer to the last invalidation it did not take (a 5xx)
    # (``WEIGHT_ROUTES``) why its weights are not the fleet's, by its /model_info; and a weight
    # update its peers took that it refused (4xx), until it takes one: out of the routing set
    weights_differ: Optional[str] = None
    weights_refused: Optional[str] = None
    weights_resent: int = -1  # the fleet weight epoch last owed to it for differing (``_check_weights``)
    # (``Router.fleet_adapters``) the adapters the fleet took that it lacks and refused when they were
    # re-sent (name -> that load's entry): not sent again, and out of the routing set meanwhile
    adapters_refused: dict = field(default_factory=dict)
    adapters_missing: Optional[str] = None

    def load(self, max_age_s: float) -> tuple[float, float]:
        """(requests in flight, uncached prompt tokens queued): this router's counts, raised to
        the worker's last report (less what of it has finished since) when that is younger than
        ``max_age_s``."""
        if time.monotonic() - self.polled_at <= max_age_s:
            return (float(max(self.inflight, self.polled_reqs - self.done_since_poll)),
                    float(max(self.inflight_tokens, self.polled_tokens - self.done_tokens_since_poll)))  # fmt: skip
        return float(self.inflight), float(self.inflight_tokens)

    def polled(self, reqs: int, tokens: int, sent_at: float) -> None:
        """A /v1/loads report asked for at ``sent_at``."""
        self.polled_reqs, self.polled_tokens = reqs, tokens
        self.polled_at, self.poll_sent_at = time.monotonic(), sent_at
        self.done_since_poll = self.done_tokens_since_poll = 0

    def finished(self, started_at: float, pending_tokens: int) -> None:
        """One of this router's requests ended; the last report counted it if it started before."""
        self.inflight -= 1
        self.inflight_tokens -= pending_tokens
        if started_at <= self.poll_sent_at:
            self.done_since_poll += 1
            self.done_tokens_since_poll += pending_tokens


def _prom_escape(value: str) -> str:
    """A Prometheus label value: backslash, double quote and newline escaped."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@dataclass
class RouterStats:
    requests: int = 0
    spills: int = 0
    index_lookups: int = 0
    index_hits: int = 0  # requests sent to a worker the index (Redis) said holds part of the prompt
    warm_routes: int = 0  # requests sent to a worker the index or the router's memory said holds part
    index_errors: int = 0  # connection errors (Redis down), or SLOW_LOOKUPS_DOWN timeouts in a row
    index_timeouts: int = 0  # lookups slower than the timeout (that request routed without the index)
    index_unavailable: int = 0  # requests routed without the index
    retries: int = 0  # proxied requests sent again: on a new connection, or to another worker
    disconnects: int = 0  # proxied requests whose worker connection closed before any answer
    health_downs: int = 0  # workers taken out of the routing set by health checks
    error_downs: int = 0  # ... by RETRY_STATUSES answers in a row
    error_answers: int = 0  # RETRY_STATUSES answers of workers (each one tried again elsewhere where it could be)
    abandoned: int = 0  # requests waiting on a worker that stopped answering altogether, sent elsewhere
    owed_invalidations: int = 0  # invalidations a worker did not take, kept for it (``_owe``)
    owed_delivered: int = 0  # ... delivered later, before it was routed to again
    owed_refused: int = 0  # ... refused by it then (a 4xx: dropped, with a warning)
    owed_dropped: int = 0  # ... dropped past OWED_MAX scopes per worker (with a warning)
    weight_downs: int = 0  # workers taken out of the routing set for weights other than the fleet's
    load_polls: int = 0
    load_poll_errors: int = 0
    failed: int = 0
    client_gone: int = 0  # the client closed its connection before the response ended
    unparsed_bodies: int = 0  # bodies over the parse limit: routed by tenant header and load alone
    matched_tokens: int = 0  # prompt tokens the chosen worker held, by the index or the memory
    index_matched_tokens: int = 0  # ... by the index alone
    prompt_tokens: int = 0
    route_ms_total: float = 0.0
    reasons: dict = field(default_factory=dict)  # the policy's reason per routed request (warm, fresh, home, ...)


class Router:
    def __init__(self, workers: list[str], redis_url: Optional[str] = None, *, k: int = 1,
                 model_path: Optional[str] = None, tenant_header: Optional[str] = None,
                 c_tok_us: float = 35.0, page_size: Optional[int] = 16, index_ttl_s: float = 30.0,
                 index_timeout_ms: float = 50.0, health_interval_s: float = 1.0, health_misses: int = 3,
                 load_poll_s: float = 0.25, policy_kw: Optional[dict] = None,
                 worker_api_key: Optional[str] = None, max_body_mb: float = 1024.0,
                 admin_api_key: Optional[str] = None, parse_limit_mb: float = PARSE_LIMIT_MB):  # fmt: skip
        self.workers = {w.rstrip("/"): WorkerState(w.rstrip("/")) for w in workers}
        # the router's own routes show every tenant's traffic (prompt lengths, matched tokens, the
        # tenant's digest, per request): with a key, only its holders read them (review, session 23)
        self.admin_api_key = admin_api_key or None
        self.redis_url = redis_url
        self.policy = AffinityCachePolicy(**{"k": k, "c_tok_s": c_tok_us * 1e-6, **(policy_kw or {})})
        self.decisions: deque = deque(maxlen=DECISIONS_KEPT)
        self.model_path = model_path
        self.tenant_header = tenant_header.lower() if tenant_header else None
        # None: learnt from the workers' /server_info (16 until one answers); a hash chain at
        # another page size than the servers' never matches their index entries
        self.page_size_given = page_size is not None
        self.page_size = page_size or DEFAULT_PAGE_SIZE
        self.index_ttl_s = index_ttl_s
        self.index_timeout_s = index_timeout_ms / 1e3
        self.health_interval_s = health_interval_s
        self.health_misses = health_misses
        if load_poll_s < 0:
            raise ValueError(f"load_poll_s must be >= 0 (0: off), got {load_poll_s}")
        self.load_poll_s = load_poll_s
        self._checks: dict = {}  # worker URL -> its running health check (``_health_loop``)
        self._poll_task = None
        self.stats = RouterStats()
        self.tokenizer = None
        self._encode = None  # text -> token ids, as SGLang's tokenizer.encode(text)
        self._chat_format = None  # (tokenizer, its template's content format: template_content_format)
        # the servers' cache identities, per worker, re-read from the index every few seconds: a
        # weight update re-seeds a server's key (with its own lifetime id, so two servers updated
        # to the same weights still differ) and the router must hash with the new one
        self.cache_keys: dict[str, CacheKey] = {}
        self.cache_key: Optional[CacheKey] = None  # the key most workers share (RouteRequest's hashes)
        # each worker's startup LoRA adapters (name -> SGLang's lora_id), published with its key;
        # ``lora_ids``: those of the workers that share ``cache_key``
        self.adapters: dict[str, dict] = {}
        self.lora_ids: dict = {}
        self._owed_seq = 0  # (``_owed_scope``: each owed adapter call a scope of its own)
        # (``WEIGHT_ROUTES``) the weights the router last broadcast and a worker took; the weight
        # broadcasts in flight, and a count of those done (a health check that read a worker's
        # /model_info across one does not judge by it)
        self.fleet_weights: dict = {}
        self._weights_busy = 0
        self._weights_epoch = 0
        # (the weight broadcast ``fleet_weights`` comes from, by its epoch: an owed delivery of a
        # later one that no worker took in the broadcast itself, owed to all, sets them then)
        self._fleet_epoch = 0
        # the weight calls the fleet's weights come from (path -> (body, headers, method, path and
        # query, epoch)): owed again to a worker that reports other weights (session 41)
        self.weight_calls: dict = {}
        # the weights workers reported just before each weight broadcast (their /model_info's
        # WEIGHT_INFO, oldest first, at most WEIGHTS_SEEN_MAX): only a worker back on one of these
        # (restarted on its launch weights, or one that missed updates) is owed the calls again; one
        # on weights the router never saw was changed past it (an RL trainer's own update, say), and
        # re-sending the old calls would undo that: it stays out of the routing set, said in the log
        # (review, session 41)
        self._weights_seen: dict = {}
        # the adapters loaded through the router that a worker took, in load order (name -> (body,
        # headers, method, path and query)), less those unloaded since: owed again to a worker that
        # does not list one at /v1/models (restarted: session 41); and the adapter broadcasts in
        # flight, and a count of those done (as for weights)
        self.fleet_adapters: OrderedDict = OrderedDict()
        self._adapters_busy = 0
        self._adapters_epoch = 0
        self._seeds: dict = {}  # CacheKey -> {namespace memo: seed} (bounded)
        self._memory_seeds: dict = {}
        self._ckey_task = None
        self._ckey_warned_at = -1e9
        self._ckey_unreadable_warned_at = -1e9
        # each worker's claim lifetime (its SGLANG_TIERED_INDEX_TTL_S, published with its key): it
        # refreshes its claims every half of it, and a router judging them by its own shorter TTL
        # ignored live claims half the time (a helper's audit, session 37)
        self.claim_ttl: dict[str, float] = {}
        self.lookup_ttl_s = index_ttl_s
        self._redis = None
        self._redis_down_until = 0.0
        self._slow_lookups = 0  # timeouts in a row
        self._lookup = None  # the registered LOOKUP_LUA script (redis-py: URLs other than redis://)
        self._lookup_conn: Optional[LookupConnection] = None  # the lookups' own connection (redis://)
        self._session = None  # health checks, load polls, /model_info
        self._proxy = None  # proxied requests
        self._fresh = None  # proxied requests sent again after a closed connection: never a pooled one
        # the router's own calls to workers started with --api-key (review, session 21: without it
        # /model_info, /server_info and /v1/loads answered 401 and the router routed blind)
        self.worker_api_key = worker_api_key
        self._auth_warned = False
        if not max_body_mb > 0:
            raise ValueError(f"max_body_mb must be > 0, got {max_body_mb}")
        self.max_body = int(max_body_mb * (1 << 20))
        self.decoded_limit = min(self.max_body, int(MAX_DECODED_MB * (1 << 20)))
        if not parse_limit_mb >= 0:
            raise ValueError(f"parse_limit_mb must be >= 0, got {parse_limit_mb}")
        self.parse_limit = int(parse_limit_mb * (1 << 20))
        self.sessions: OrderedDict = OrderedDict()  # session_memo(session id) -> the worker that opened it
        # session_memo(response id as the workers store it: ``_stored_id``) -> (the worker that stored
        # it, its tenant's ``_response_owner``, whether a worker answered a tenant's id unscoped)
        self.responses: OrderedDict = OrderedDict()
        self._turn = 0  # (``_least_busy``'s rotation)
        self._tokenizer_failed: Optional[str] = None  # the last path no tokenizer loaded from
        self._tokenizer_backoff_s = 5.0
        self._tokenizer_retry_at = 0.0
        self._abandoned: set = set()  # handler tasks _abandon cancelled (not their clients)
        self._broadcasts: set = set()  # fleet-wide calls under way (``passthrough``: their callers may have left)

    # ------------------------------------------------------------------ setup
    async def start(self):
        import aiohttp

        # Proxied requests have their own session, with no cap on connections (aiohttp's default
        # is 100 in all): at 100 long generations in flight the next requests waited inside the
        # router, counted in flight but never sent. Health checks and load polls have another, so a
        # full proxy pool can never make them time out and mark a healthy worker down.
        # DummyCookieJar: a proxy keeps no cookies (aiohttp's jar filtered and stored them per request)
        # A second proxy session never reuses a connection: a request whose pooled connection
        # closed before any answer goes to the same worker once more on a new one (handle()).
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=2)
        self._proxy = aiohttp.ClientSession(timeout=timeout, cookie_jar=aiohttp.DummyCookieJar(),
                                            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S))
        self._fresh = aiohttp.ClientSession(timeout=timeout, cookie_jar=aiohttp.DummyCookieJar(),
                                            connector=aiohttp.TCPConnector(limit=0, force_close=True))
        auth = {"Authorization": f"Bearer {self.worker_api_key}"} if self.worker_api_key else None
        self._session = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar(), headers=auth,
                                              connector=aiohttp.TCPConnector(keepalive_timeout=UPSTREAM_KEEPALIVE_S))
        await self._learn_from_workers()
        if self.redis_url:
            import redis.asyncio as aredis

            self._redis = aredis.Redis.from_url(self.redis_url, socket_timeout=self.index_timeout_s * 4,
                                                socket_connect_timeout=self.index_timeout_s * 4)  # fmt: skip
            self._lookup = self._redis.register_script(LOOKUP_LUA)
            if LookupConnection.supports(self.redis_url):
                self._lookup_conn = LookupConnection(self.redis_url, LOOKUP_LUA, self.index_timeout_s * 4)
            self._ckey_task = asyncio.create_task(self._cache_key_loop())
        self._health_task = asyncio.create_task(self._health_loop())
        if self.load_poll_s:
            self._poll_task = asyncio.create_task(self._poll_loop())

    async def close(self):
        self._health_task.cancel()
        for task in self._broadcasts:
            task.cancel()
        for task in self._checks.values():
            task.cancel()
        for task in (self._poll_task, self._ckey_task):
            if task is not None:
                task.cancel()
        for session in (self._proxy, self._fresh, self._session):
            if session is not None:
                await session.close()
        if self._redis is not None:
            await self._redis.aclose()
        if self._lookup_conn is not None:
            self._lookup_conn.close()

    def _check_auth(self, url: str, status: int) -> None:
        """Say once when a worker refuses the router's own calls (--api-key on the servers)."""
        if status in (401, 403) and not self._auth_warned:
            self._auth_warned = True
            logger.warning("sglang-tiered router: %s answers %d to the router's own calls (/model_info, "
                           "/server_info, /v1/loads): give the servers' key with --worker-api-key "
                           "(SGLANG_TIERED_WORKER_API_KEY); until then it routes without their loads", url, status)

    async def _model_path_from_workers(self) -> Optional[str]:
        import aiohttp

        for w in self.workers:
            try:
                async with self._session.get(w + "/model_info", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    self._check_auth(w, r.status)
                    return (await r.json()).get("model_path")
            except Exception:  # noqa: BLE001
                continue
        return None

    async def _get_json(self, url: str):
        """``GET url``'s JSON answer within 2 s; None when there is none (no answer, not 200, not
        JSON). Never raises: what a worker does not say is not known."""
        import aiohttp

        try:
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                return await r.json(content_type=None) if r.status == 200 else None
        except Exception:  # noqa: BLE001 - not known
            return None

    async def _page_size_from_workers(self) -> Optional[int]:
        for w in self.workers:
            info = await self._get_json(w + "/server_info")
            ps = info.get("page_size") if isinstance(info, dict) else None
            if isinstance(ps, int) and not isinstance(ps, bool) and ps > 0:
                return ps
        return None

    def _learning(self) -> bool:
        """Whether the tokenizer (unless refused with ``model_path=""``) or the page size is
        still to be read from the workers."""
        return (self.tokenizer is None and self.model_path != "") or not self.page_size_given

    async def _learn_from_workers(self) -> None:
        """The tokenizer (the served model's, unless ``model_path`` was given) and the page size
        (unless given), from the workers. Called at start and then by the health loop until both
        are known: a router started before its workers used to route every prompt as 0 tokens
        for good (review, session 19)."""
        # ("": no tokenizer, by request; a path that failed is tried again less and less often)
        if self.tokenizer is None and self.model_path != "" and time.monotonic() >= self._tokenizer_retry_at:
            path = self.model_path or await self._model_path_from_workers()
            if path:
                try:
                    from transformers import AutoTokenizer

                    self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
                    self._encode = fast_encode(self.tokenizer)
                    self.model_path = path
                except Exception as exc:  # noqa: BLE001 - a path this host lacks: route without tokens
                    if self.model_path:  # given by the operator: say so loudly, once
                        raise
                    # said once per path, and tried again after 10 s, 20 s, ... 5 min (before: every
                    # health round, a warning and a blocking load each second: a helper's audit,
                    # session 37; the workers' model may be a hub id, or a path this host lacks)
                    if path != self._tokenizer_failed:
                        self._tokenizer_failed = path
                        self._tokenizer_backoff_s = 5.0
                        logger.warning("router: no tokenizer at %s (%s); routing by affinity and load", path, exc)
                    self._tokenizer_backoff_s = min(300.0, 2 * self._tokenizer_backoff_s)
                    self._tokenizer_retry_at = time.monotonic() + self._tokenizer_backoff_s
                    self.model_path = None
        if not self.page_size_given:
            ps = await self._page_size_from_workers()
            if ps is not None:
                if ps != self.page_size:
                    logger.info("router: the workers' page size is %d", ps)
                self.page_size = ps
                self.page_size_given = True

    async def _health_loop(self):
        while True:
            if self._learning():
                try:
                    await self._learn_from_workers()
                except Exception:  # noqa: BLE001 - try again next round
                    pass
            # each worker's check on its own: one by one (or a round waiting for all), each hung
            # worker held up every other's check by its 2 s timeout, and one that answers /health
            # but hangs on an owed invalidation by 10 s per round (review, session 39). A worker
            # whose last check is still running is not checked again meanwhile.
            for ws in list(self.workers.values()):
                task = self._checks.get(ws.url)
                if task is None or task.done():
                    self._checks[ws.url] = asyncio.create_task(self._check(ws))
            for url in [u for u, t in self._checks.items() if u not in self.workers and t.done()]:
                del self._checks[url]
            await asyncio.sleep(self.health_interval_s)

    async def _check(self, ws: "WorkerState") -> None:
        """One health check of ``ws`` (``_health_loop``), and what it owes delivered."""
        import aiohttp

        heard = False
        try:
            async with self._session.get(ws.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                ok = r.status == 200
                heard = True
        except Exception:  # noqa: BLE001
            ok = False
        # A worker leaves the routing set after `health_misses` failed checks in a row (a loaded
        # CPU server can answer /health late; one slow answer must not move its tenants), or at
        # once when a proxied request cannot connect (handle()).
        if not ok and ws.missed == 0:
            ws.first_miss_at = time.monotonic()
        if heard:
            ws.heard_at = time.monotonic()
        ws.missed = 0 if ok else ws.missed + 1
        if ws.missed >= self.health_misses and ws.calls:
            # it answers nothing: the broadcasts waiting on it answer its part now (``_hang_up``)
            logger.warning("router: %s stopped answering; %d fleet-wide call(s) waiting on it answer 504",
                           ws.url, len(ws.calls))  # fmt: skip
            for task in list(ws.calls):
                if task.cancel():
                    self._abandoned.add(task)
        if ws.missed >= self.health_misses and ws.streams and self._silent(ws):
            # answers it stopped sending mid-way: no byte since its checks began to miss (one
            # still sending is alive, however slow its /health); ended for their clients by
            # ``handle`` with an error event (session 41: before, the client waited for ever)
            for task, last in list(ws.streams.items()):
                if last < ws.first_miss_at and task.cancel():
                    self._abandoned.add(task)
        if ok and ws.owed:
            try:
                await self._pay(ws)  # (before it routes again; what it still owes keeps it out)
            except Exception:  # noqa: BLE001 - still owed: the next round tries again
                logger.exception("router: delivering %s's owed invalidations failed", ws.url)
        if ok and self.fleet_weights:
            await self._check_weights(ws)
        if ok and not ws.owed and (self.fleet_adapters or ws.adapters_missing):
            await self._check_adapters(ws)
        off = ws.weights_refused or ws.weights_differ or ws.adapters_missing
        if ok and time.monotonic() >= ws.down_until and not ws.owed and off is None:
            ws.healthy = True
        elif ws.missed >= self.health_misses and ws.healthy:
            ws.healthy = False
            self.stats.health_downs += 1
            if ws.answered_at < ws.first_miss_at:
                self._abandon(ws)
        elif off is not None:
            ws.healthy = False

    async def _check_weights(self, ws: "WorkerState") -> None:
        """``ws.weights_differ``: how ``ws``'s /model_info differs from ``fleet_weights`` (None:
        it does not). Left as it was when the worker does not say (no answer, not SGLang's), or a
        weight broadcast ran meanwhile (it may have read the weights before the update)."""
        epoch = self._weights_epoch
        if self._weights_busy:
            return
        info = await self._get_json(ws.url + "/model_info")
        if not isinstance(info, dict) or self._weights_busy or epoch != self._weights_epoch:
            return
        off = "; ".join(f"{k} {info.get(k)!r}, the fleet's {v!r}" for k, v in self.fleet_weights.items()
                        if info.get(k) != v)  # fmt: skip
        if off and ws.weights_differ is None:
            self.stats.weight_downs += 1
            logger.warning("router: %s reports other weights than the fleet's (%s): out of the routing set, "
                           "and owed the fleet's last weight update, until it reports the fleet's",
                           ws.url, off)  # fmt: skip
        ws.weights_differ = off or None
        if not off:
            ws.weights_resent = -1
        elif _weights_state(info) not in self._weights_seen:
            if ws.weights_resent != -2:
                ws.weights_resent = -2
                logger.warning("router: %s reports weights the fleet never had before a weight update through "
                               "this router (%s): changed past the router, so not sent the fleet's again; out of "
                               "the routing set until it reports the fleet's", ws.url, off)  # fmt: skip
        elif ws.weights_resent != self._fleet_epoch and not ws.owed and self.weight_calls:
            # owed the calls the fleet's weights come from, oldest first, once per fleet update
            # (session 41: before, it stayed out of the routing set until someone sent the update
            # again by hand; one that still differs after taking them stays out, said in the log)
            ws.weights_resent = self._fleet_epoch
            for raw, headers, method, path_qs, epoch in sorted(self.weight_calls.values(), key=lambda c: c[4]):
                self._owe(ws, raw, raw, headers, method, path_qs, epoch)

    async def _note_weights(self, targets: list) -> None:
        """Before a weight broadcast: remember the weights each worker reports (``_weights_seen``).
        One that does not answer in 2 s adds nothing."""
        for info in await asyncio.gather(*(self._get_json(ws.url + "/model_info") for ws in targets)):
            if isinstance(info, dict):
                state = _weights_state(info)
                self._weights_seen.pop(state, None)
                self._weights_seen[state] = None
        while len(self._weights_seen) > WEIGHTS_SEEN_MAX:
            del self._weights_seen[next(iter(self._weights_seen))]

    async def _check_adapters(self, ws: "WorkerState") -> None:
        """Owe ``ws`` the loads of ``fleet_adapters`` its /v1/models does not list (in load order:
        a worker restarted after a /load_lora_adapter came back without the adapter, and each
        request naming it there was a 400; session 41). Meanwhile it owes them, so it is out of the
        routing set. One it refused when re-sent (4xx: ``_pay``) is not sent again: it stays out
        (``adapters_missing``) until the fleet's adapters change. Left as it was when the worker
        does not say (no answer, not SGLang's), or an adapter broadcast ran meanwhile."""
        epoch = self._adapters_epoch
        if self._adapters_busy:
            return
        doc = await self._get_json(ws.url + "/v1/models")
        cards = doc.get("data") if isinstance(doc, dict) else None
        if not isinstance(cards, list) or self._adapters_busy or epoch != self._adapters_epoch:
            return
        held = {c.get("id") for c in cards if isinstance(c, dict)}
        refused = []
        for name, entry in self.fleet_adapters.items():
            if name in held:
                ws.adapters_refused.pop(name, None)
            elif ws.adapters_refused.get(name) is entry:
                refused.append(name)
            else:
                raw, headers, method, path_qs = entry
                self._owe(ws, raw, raw, headers, method, path_qs)
        ws.adapters_missing = (f"lacks the fleet's adapter(s) {', '.join(refused)} and refused them when re-sent"
                               if refused else None)  # fmt: skip

    def _take_adapter(self, path: str, raw: bytes, headers, method: str, path_qs: str) -> None:
        """A worker took the adapter call ``raw`` (``path``): ``fleet_adapters`` follows it."""
        name = _adapter_name(raw)
        if name is None:
            return
        self.fleet_adapters.pop(name, None)  # (a load again of a name goes last, in load order)
        if path == "/load_lora_adapter":
            self.fleet_adapters[name] = (raw, list(headers), method, path_qs)

    def _weights_broadcast(self, request, raw: bytes, targets: list, res: list, doc: dict, headers=()) -> bool:
        """After a ``WEIGHT_ROUTES`` broadcast: with a worker that took it, ``fleet_weights`` is
        what it asked for, and each worker that refused it (4xx) is out of the routing set until it
        takes one (said in its answer and /router/stats). True when a worker took it."""
        self._weights_epoch += 1
        took = [ws for ws, (_, st, _) in zip(targets, res) if 200 <= st < 300]
        if not took:
            return False  # (refused by all, or none reached: the fleet is as it was)
        self._take_weights(request.path, raw, self._weights_epoch, headers, request.method, request.path_qs)
        for ws in took:
            ws.weights_refused = None
        for ws, (u, st, text) in zip(targets, res):
            if 400 <= st < 500:
                self._refused_weights(ws, request.path, st, text)
                doc[self._worker_name(request, u)]["out_of_routing"] = ws.weights_refused
        return True

    def _take_weights(self, path: str, raw: bytes, epoch: int, headers=(), method: str = "POST",
                      path_qs: Optional[str] = None) -> None:  # fmt: skip
        """A worker took the weight update ``raw`` (``path``) of the broadcast ``epoch``: the
        fleet's weights are what it asked for, unless they come from a later broadcast; the call
        is kept (``weight_calls``) to be owed to a worker that reports other weights."""
        if epoch < self._fleet_epoch:
            return
        self.weight_calls[path] = (raw, list(headers), method, path_qs or path, epoch)
        body = _parse_body(raw)
        body = body if isinstance(body, dict) else {}
        if path == "/update_weights_from_disk":
            want = {"model_path": body.get("model_path"), "weight_version": body.get("weight_version")}
        else:
            want = {"weight_version": body.get("new_version")}
        self.fleet_weights.update({k: v for k, v in want.items() if isinstance(v, str)})
        self._fleet_epoch = epoch

    def _refused_weights(self, ws: "WorkerState", path: str, status: int, text: str) -> None:
        """``ws`` refused a weight update its peers took: out of the routing set until it takes one."""
        if ws.weights_refused is None and ws.weights_differ is None:
            self.stats.weight_downs += 1
        ws.weights_refused = f"refused {path} its peers took ({status}: {text[:200]})"
        ws.healthy = False
        logger.warning("router: %s %s: out of the routing set until it takes a weight update", ws.url,
                       ws.weights_refused)  # fmt: skip

    def _routable(self, exclude=()) -> list:
        """The workers a request may go to: the healthy ones not in ``exclude``; with none, any
        not in it, one that owes an invalidation last of all (``_owe``); with none, every one."""
        ws = [w for u, w in self.workers.items() if u not in exclude]
        return ([w for w in ws if w.healthy] or [w for w in ws if not w.owed] or ws
                or list(self.workers.values()))  # fmt: skip

    def _owe(self, ws: "WorkerState", raw: bytes, plain: bytes, headers: list, method: str = "POST",
             path_qs: str = "/cache/invalidate", epoch: int = 0) -> None:  # fmt: skip
        """``ws`` did not take the invalidation ``raw`` (``plain``: without its generation, for a
        server that refuses the field), or another of ``OWED_ROUTES`` (``method`` ``path_qs``,
        ``plain`` its body as well): kept for it, and it leaves the routing set until ``_pay``
        delivers it (``OWED_MAX``)."""
        key = self._owed_scope(plain, headers, path_qs.split("?", 1)[0])
        ws.owed.pop(key, None)  # (a newer one of the same scope replaces it: generations only move up)
        ws.owed[key] = (raw, plain, headers, method, path_qs, epoch)  # (epoch: a weight broadcast's)
        self.stats.owed_invalidations += 1
        if len(ws.owed) > OWED_MAX:
            ws.owed.popitem(last=False)
            self.stats.owed_dropped += 1
            logger.warning("router: %s owes over %d invalidations; the oldest is dropped", ws.url, OWED_MAX)
        ws.healthy = False

    def _owed_scope(self, plain: bytes, headers: list, path: str = "/cache/invalidate") -> tuple:
        """What an owed invalidation acts on: its body without the generation (canonical, as
        ``passthrough`` re-encodes it: keys sorted, one spacing), and the headers the workers
        judge it by (the tenant header, the key). Keyed by every header, each call with its own
        ``x-request-id`` or trace header was a new scope, so one tenant invalidating its own cache
        a few thousand times while a worker was down pushed another tenant's owed invalidation
        past OWED_MAX (review, session 39). Another route's: the route (``SUPERSEDING``: a newer
        call replaces the older), or a scope of its own (adapter loads and unloads: each kept)."""
        judged = ("authorization", self.tenant_header)
        judged = tuple(sorted((k.lower(), v) for k, v in headers if k.lower() in judged))
        if path in PAUSE_ROUTES:  # (one scope: the fleet's last word, paused or generating)
            return "/pause_generation", judged
        if path in SUPERSEDING:
            # (by whom too: with every worker down, a caller the workers will refuse replaced the
            # operator's owed call, and its delivery was refused and dropped)
            return path, judged
        if path != "/cache/invalidate":
            self._owed_seq += 1
            return path, self._owed_seq
        return plain, judged

    async def _pay(self, ws: "WorkerState") -> bool:
        """Deliver what ``ws`` owes, oldest first; True when it owes nothing now. A 2xx or a 4xx
        (never taken: dropped, with a warning) settles one; a 5xx or no answer stops until the
        next health check."""
        while ws.owed:
            key, entry = next(iter(ws.owed.items()))
            raw, plain, headers, method, path_qs, epoch = entry
            path = path_qs.split("?", 1)[0]
            timeout = owed_timeout(path_qs)
            try:
                if path == "/cache/invalidate":
                    status, text = await self._invalidate_one(ws, raw, plain, headers, timeout)
                else:
                    status, text = await self._send(ws, method, path_qs, raw, headers, timeout)
            except Exception as exc:  # noqa: BLE001 - still owed: the next health check tries again
                status, text = 502, f"{type(exc).__name__}: {exc}"
            if status >= 500 or (status == 400 and path == "/flush_cache"):  # (a flush: not idle yet)
                # (what a broadcast answers for it while it is queued behind this: a 5xx, so the
                # call is owed too; a flush's 400 read as a refusal of the call, owed to nobody)
                ws.owed_status = status if status >= 500 else 503
                now = time.monotonic()
                if now - ws.owed_warned_at >= 60.0:  # (the reason it stays out of the routing set)
                    ws.owed_warned_at = now
                    logger.warning("router: %s answers and owes %d fleet-wide call(s), but did not take %s (%d: %s); "
                                   "out of the routing set until it does", ws.url, len(ws.owed), path, status,
                                   text[:200])  # fmt: skip
                return False
            if ws.owed.get(key) is entry:
                # (only what was delivered: a newer invalidation of the same scope that replaced it
                # during the call, with a newer T2 generation, is still owed; popped by its key, it
                # was lost, and the worker kept reading T2 at the older generation: review, session 39)
                del ws.owed[key]
            if status < 300:
                self.stats.owed_delivered += 1
                if path in WEIGHT_ROUTES:
                    ws.weights_refused = None
                    # (owed to every worker, no one took it in the broadcast: the fleet's now;
                    # a health check that read /model_info before this does not judge by it)
                    self._take_weights(path, raw, epoch, headers, method, path_qs)
                    self._weights_epoch += 1
                if path in ADAPTER_ROUTES:
                    ws.adapters_refused.pop(_adapter_name(raw), None)
                    if epoch == -1:  # (owed to every worker, no one took it in the broadcast: the fleet's now)
                        self._take_adapter(path, raw, headers, method, path_qs)
            else:
                self.stats.owed_refused += 1
                if path in WEIGHT_ROUTES and epoch <= self._fleet_epoch:  # (a peer took it: the
                    self._refused_weights(ws, path, status, text)  # fleet's weights are not its)
                entry = self.fleet_adapters.get(_adapter_name(raw)) if path == "/load_lora_adapter" else None
                if entry is not None and entry[0] == raw:  # (an adapter the fleet holds: not sent again)
                    ws.adapters_refused[_adapter_name(raw)] = entry
                    ws.adapters_missing = f"refused the fleet's adapter {_adapter_name(raw)} ({status}: {text[:200]})"
                logger.warning("router: %s refused the %s it was owed (%d: %s); dropped",
                               ws.url, path, status, text[:200])  # fmt: skip
        return True

    async def _invalidate_one(self, ws: "WorkerState", raw: bytes, plain: bytes, headers: list,
                              timeout=None) -> tuple[int, str]:  # fmt: skip
        """POST ``raw`` to ``ws``'s /cache/invalidate (``plain`` again where a server from before
        session 23 refuses the generation field): (status, body)."""

        status, text = await self._send(ws, "POST", "/cache/invalidate", raw, headers, timeout)
        if status == 400 and "generation" in text and raw != plain:
            status, text = await self._send(ws, "POST", "/cache/invalidate", plain, headers, timeout)
        return status, text

    async def _send(self, ws: "WorkerState", method: str, path_qs: str, data: bytes, headers: list,
                    timeout=None) -> tuple[int, str]:  # fmt: skip
        """One call of a fleet-wide route to ``ws``: (status, the answer's first 1,000 characters)."""
        kw = {} if timeout is None else {"timeout": timeout}
        async with self._proxy.request(method, ws.url + path_qs, data=data, headers=headers, **kw) as up:
            return up.status, (await up.read()).decode("utf-8", "replace")[:1000]

    async def _hang_up(self, ws: "WorkerState", request, coro, timeout) -> tuple[int, str]:
        """``coro``, one worker's part of a fleet-wide broadcast: (url, status, body). Ended by
        ``_check`` when the worker stops answering altogether while it waits (``health_misses``
        failed health checks in a row): a 504 naming the worker, at once, rather than after the
        call's bound (OWED_SLOW_S for a pause: an hour). Session 41: /pause_generation,
        /continue_generation and /abort_request had no bound, and a frozen worker held the
        caller for good."""
        task = asyncio.ensure_future(coro)
        ws.calls.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            if task not in self._abandoned:  # (the router is closing: ``close``)
                raise
            self._abandoned.discard(task)
            return ws.url, 504, (f"worker {self._worker_name(request, ws.url)} stopped answering "
                                 f"({ws.missed} health checks missed) before it answered {request.path}")  # fmt: skip
        finally:
            ws.calls.discard(task)

    @staticmethod
    def _silent(ws: "WorkerState") -> bool:
        """Whether ``ws`` has answered nothing at all since its health checks began to miss: no
        /health answer of any status, no status line, no byte of any answer it streams. Only then
        are its silent streams cut (``_check``). Review, session 41: they were cut by their own
        silence alone, so a worker alive and answering /health 503 (SGLang's while it drains for
        a graceful shutdown, the requests in flight finishing) or 500 lost every stream still
        waiting for its first token (queued, or a long prefill) to an error event, while it was
        computing them."""
        t = ws.first_miss_at
        return ws.heard_at < t and ws.answered_at < t and all(last < t for last in ws.streams.values())

    def _abandon(self, ws: "WorkerState") -> None:
        """``ws`` answers nothing at all (no health check, no proxied request since the checks
        began to miss: stopped, frozen, cut off with its connections open): the requests still
        waiting for its answer, which no client has seen a byte of, go to another worker
        (``handle``). Before session 37 they waited for ever: the proxy has no read timeout (a
        generation may take long), and nothing looked at them (a helper's audit)."""
        for task in list(ws.waiting):
            if task.cancel():
                self._abandoned.add(task)

    async def poll_loads(self) -> None:
        """One round of ``GET /v1/loads?include=core`` on every worker (concurrently)."""
        await asyncio.gather(*(self._poll_one(ws) for ws in self.workers.values() if ws.healthy))

    async def _poll_one(self, ws: "WorkerState") -> None:
        """``GET /v1/loads?include=core`` of ``ws``: its report, or a poll error."""
        import aiohttp

        try:
            sent_at = time.monotonic()
            timeout = aiohttp.ClientTimeout(total=max(0.1, 2 * self.load_poll_s))
            async with self._session.get(ws.url + "/v1/loads?include=core", timeout=timeout) as r:
                self._check_auth(ws.url, r.status)
                doc = await r.json(content_type=None) if r.status == 200 else None
            loads = doc.get("loads") if isinstance(doc, dict) else None
            if not isinstance(loads, list):
                raise ValueError("no 'loads' list")
            ws.polled(sum(int(x.get("num_running_reqs", 0)) + int(x.get("num_waiting_reqs", 0)) for x in loads),
                      sum(int(x.get("num_waiting_uncached_tokens", 0)) for x in loads), sent_at)  # fmt: skip
            self.stats.load_polls += 1
        except Exception:  # noqa: BLE001 - an old server or a slow answer: own counts only
            self.stats.load_poll_errors += 1

    async def _poll_loop(self):
        """Each healthy worker polled every ``load_poll_s``, on its own (a worker whose last poll
        is still running is not polled again meanwhile): in rounds that waited for every worker,
        one slow to answer /v1/loads (up to its 2 x load_poll_s bound) held every other's
        report back, 3 periods apart instead of 1 (review, session 41: 6 reports of the fast
        worker in 4 s at 0.25 s, not 16)."""
        polls: dict = {}
        try:
            while True:
                for ws in list(self.workers.values()):
                    task = polls.get(ws.url)
                    if ws.healthy and (task is None or task.done()):
                        polls[ws.url] = asyncio.create_task(self._poll_one(ws))
                await asyncio.sleep(self.load_poll_s)
        finally:
            for task in polls.values():
                task.cancel()

    # ------------------------------------------------------------------ request -> tokens, hashes
    def tokens_of(self, path: str, body: dict) -> list[int]:
        ids = body.get("input_ids")
        if isinstance(ids, list) and ids and isinstance(ids[0], int):
            return ids
        tok = self.tokenizer
        if tok is None:
            return []
        if path in API_ROUTES:
            chat = api_chat_body(path, body)
            return self.tokens_of("/v1/chat/completions", chat) if chat is not None else []
        if path == "/v1/chat/completions":
            msgs = body.get("messages")
            if isinstance(msgs, list):
                try:
                    if self._chat_format is None or self._chat_format[0] is not tok:
                        self._chat_format = (tok, template_content_format(getattr(tok, "chat_template", None)))
                    msgs = messages_for_template(msgs, self._chat_format[1])
                    client_kw = body.get("chat_template_kwargs")
                    client_kw = client_kw if isinstance(client_kw, dict) else {}
                    if "chat_template" in client_kw:
                        return []  # SGLang refuses a request's own template; never rendered here
                    kw = {}
                    if body.get("reasoning_effort") is not None:  # as SGLang: then the client's kwargs
                        kw["reasoning_effort"] = body["reasoning_effort"]
                    kw.update((k, v) for k, v in client_kw.items() if k not in TEMPLATE_CALL_ARGS)
                    tools = template_tools(body)
                    if tools:
                        kw["tools"] = tools
                    out = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, **kw)
                    if hasattr(out, "keys") and "input_ids" in out:  # transformers 5: BatchEncoding
                        out = out["input_ids"]
                    return [int(t) for t in out]
                except Exception:  # noqa: BLE001 - no template / odd content: approximate
                    text = "".join(str(m.get("content", "")) for m in msgs if isinstance(m, dict))
                    return self._encode(text)
            return []
        text = body.get("text") if path == "/generate" else body.get("prompt")
        if isinstance(text, str):
            return self._encode(text)
        if isinstance(text, list) and text and isinstance(text[0], int):
            return text
        return []

    async def _ensure_cache_key(self):
        """Read every worker's published CacheKey (one MGET). A worker whose key expired (it
        stopped publishing) keeps its last one."""
        if self._redis is None:
            return
        workers = list(self.workers)
        raws = await self._redis.mget([ckey_key(w) for w in workers])
        unreadable = []
        for w, raw in zip(workers, raws):
            if raw:
                try:
                    doc = json.loads(raw)
                    adapters = doc.pop("adapters", None) or {}
                    ttl = doc.pop("index_ttl_s", None)  # the server's claims live this long
                    if not all(v is None or isinstance(v, str) for v in doc.values()):
                        # (a list there made CacheKey unhashable: every request then failed with a
                        # 500 in matched(); review, session 23)
                        raise TypeError("a CacheKey field that is not text")
                    self.cache_keys[w] = CacheKey(**doc)
                    self.adapters[w] = {k: v for k, v in adapters.items() if isinstance(k, str) and isinstance(v, str)}
                    ok_ttl = isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and 0 < ttl <= MAX_INDEX_TTL_S
                    self.claim_ttl[w] = float(ttl) if ok_ttl else self.index_ttl_s
                except (TypeError, ValueError, AttributeError, RecursionError) as exc:
                    # another version's key (or a corrupt value): its pages are not ours to match.
                    # RecursionError (a deeply nested value) escaped here and left every later
                    # worker's key unread (a helper's audit, session 37); and this was silent
                    self.cache_keys.pop(w, None)
                    self.adapters.pop(w, None)
                    self.claim_ttl.pop(w, None)
                    unreadable.append(f"{w} ({type(exc).__name__})")
        # (read every KEY_REFRESH_S, not per lookup: the longest, so no live claim is ignored)
        self.lookup_ttl_s = max([self.index_ttl_s, *self.claim_ttl.values()])
        if unreadable and time.monotonic() >= self._ckey_unreadable_warned_at + 60.0:
            self._ckey_unreadable_warned_at = time.monotonic()
            logger.warning("router: cannot read the cache keys %s publish (another sglang-tiered version?): "
                           "their pages are not looked up in the index", ", ".join(unreadable))  # fmt: skip
        if self.cache_keys:
            self.cache_key = Counter(self.cache_keys.values()).most_common(1)[0][0]
            ids: dict = {}
            for w, k in self.cache_keys.items():
                if k == self.cache_key:
                    for name, lid in self.adapters.get(w, {}).items():
                        ids.setdefault(name, lid)
            self.lora_ids = ids

    async def _cache_key_loop(self):
        """Read the servers' CacheKey from the index, off the request path, then load the lookup
        script. The first requests read it under the 50 ms lookup timeout, each timeout paused the
        index for 1 s, and the requests in that second had no page hashes (so no index and, before
        the memory had its own keys, no memory); on 2 cores at a load average of 18 the fleet
        test's first routing decision took 95 ms and lookups timed out 3 times in 39 requests."""
        loaded = False
        while True:
            try:
                await asyncio.wait_for(self._ensure_cache_key(), 2.0)
                if self.cache_key is not None and self._lookup_conn is None and not loaded:  # (it loads its own)
                    await asyncio.wait_for(self._redis.script_load(LOOKUP_LUA), 2.0)
                    loaded = True
            except Exception as exc:  # noqa: BLE001 - Redis down or slow: try again
                # said, once a minute at most (before: a refused or wrong --redis was silent, and
                # the router routed without the index for good; a helper's hunt, session 32)
                now = time.monotonic()
                if now >= self._ckey_warned_at + 60.0:
                    self._ckey_warned_at = now
                    logger.warning("router: cannot read the servers' cache keys from the index %s (%s: %s); "
                                   "routing by affinity and load until it answers", self.redis_url,
                                   type(exc).__name__, exc)  # fmt: skip
            # until every worker's key is known, soon; then every KEY_REFRESH_S (a weight update
            # re-seeds a server's key; until the router reads it, that server's pages do not match)
            known = len(self.cache_keys) == len(self.workers)
            await asyncio.sleep(KEY_REFRESH_S if known else 0.2)

    def _chain(self, key: CacheKey, seeds: dict, tokens, tenant, extra_key=None) -> list[bytes]:
        """Chained page hashes of the prompt (its first MAX_LOOKUP_PAGES pages) under ``key``'s
        namespace (``tenant``, ``extra_key``: SGLang's tree keeps each pair apart, and so do the
        servers' hashes); ``seeds`` caches the seeds (bounded)."""
        memo = (memo_key(tenant), memo_key(extra_key))
        s = seeds.get(memo)
        if s is None:
            if len(seeds) > 4096:
                seeds.clear()
            s = seeds[memo] = key.namespace_seed(tenant, extra_key)  # the whole tenant, as the servers
        return chain_page_hashes(s, tokens[: MAX_LOOKUP_PAGES * self.page_size], self.page_size)

    def _key_seeds(self, key: CacheKey) -> dict:
        seeds = self._seeds.get(key)
        if seeds is None:
            if len(self._seeds) > 64:  # keys of servers long gone
                self._seeds.clear()
            seeds = self._seeds[key] = {}
        return seeds

    def hashes_of(self, tokens, tenant, extra_key=None, key: Optional[CacheKey] = None) -> list[bytes]:
        """The servers' page hashes under ``key`` (default: the key most workers share; empty
        until a CacheKey has been read from the index)."""
        key = key or self.cache_key
        return [] if key is None else self._chain(key, self._key_seeds(key), tokens, tenant, extra_key)

    def memory_hashes_of(self, tokens, tenant) -> list[bytes]:
        """The routing memory's page keys: a chain of the same pages under the router's own seed
        (per tenant, as the servers' namespaces), known whether or not the index is."""
        return self._chain(MEMORY_KEY, self._memory_seeds, tokens, tenant)

    async def matched(self, hashes, workers, tokens=None, tenant=None, extra_key=None) -> Optional[dict]:
        """Matched prefix tokens per worker from the index; None when the index is unavailable.
        ``hashes`` are under ``cache_key``; a worker that publishes another key (``cache_keys``,
        e.g. after a weight update) is looked up with the prompt hashed under its own, when
        ``tokens`` are given."""
        if self._redis is None or self.cache_key is None or time.monotonic() < self._redis_down_until:
            return None  # no index, or its CacheKey not read yet (_cache_key_loop)
        groups: dict = {}
        for w in workers:
            groups.setdefault(self.cache_keys.get(w, self.cache_key), []).append(w)
        if len(groups) == 1 or tokens is None:
            return await self._matched_one(hashes, workers)
        parts = await asyncio.gather(*(
            self._matched_one(hashes if key == self.cache_key else self.hashes_of(tokens, tenant, extra_key, key), ws)
            for key, ws in groups.items()))  # fmt: skip
        if any(p is None for p in parts):
            return None
        out: dict = {}
        for p in parts:
            out.update(p)
        return out

    async def _matched_one(self, hashes, workers) -> Optional[dict]:
        if not hashes:
            return {}

        async def lookup():
            keys = [alive_key(w) for w in workers] + [page_key(h) for h in hashes]
            args = [len(workers), time.time(), self.lookup_ttl_s, *workers]
            if self._lookup_conn is not None:
                return await self._lookup_conn.evalsha(keys, args)
            return await self._lookup(keys=keys, args=args)

        try:
            reply = await asyncio.wait_for(lookup(), self.index_timeout_s)
        except asyncio.TimeoutError:  # slow (a busy event loop, or Redis): this request goes without
            self.stats.index_timeouts += 1
            self._slow_lookups += 1
            if self._slow_lookups >= SLOW_LOOKUPS_DOWN:  # persistently slow: stop paying the timeout
                self._index_down(f"{SLOW_LOOKUPS_DOWN} lookups in a row over {self.index_timeout_s * 1e3:g} ms")
            return None
        except Exception as exc:  # noqa: BLE001 - Redis down: route without it
            self._index_down(exc)
            return None
        self._slow_lookups = 0
        self.stats.index_lookups += 1
        return matched_from_lookup(reply, self.page_size)

    def _index_down(self, why) -> None:
        if self.stats.index_errors == 0 or time.monotonic() > self._redis_down_until + 60:
            logger.warning("router: index unavailable for 1 s (%s)", f"{type(why).__name__}: {why}"
                           if isinstance(why, BaseException) else why)  # fmt: skip
        self.stats.index_errors += 1
        self._slow_lookups = 0
        if self._lookup_conn is not None:  # a connection that stopped answering: the next lookup reconnects
            self._lookup_conn.reset()
        self._redis_down_until = time.monotonic() + 1.0

    async def choose(self, tokens, tenant, exclude=(), explain: Optional[dict] = None, label=None, extra_key=None):
        live = [w.url for w in self._routable(exclude)]
        hashes = self.hashes_of(tokens, tenant, extra_key)
        matched = await self.matched(hashes, live, tokens, tenant, extra_key)
        if matched is None:
            self.stats.index_unavailable += 1
        max_age = 4 * self.load_poll_s
        loads = {w: self.workers[w].load(max_age) for w in live}
        view = FleetView(live, {w: r for w, (r, _) in loads.items()},
                         {w: t * self.policy.c_tok_s for w, (_, t) in loads.items()}, matched)  # fmt: skip
        pol = self.policy
        if label is None:  # (handle passes the one it computed) the policy keeps its keys: bounded
            label = tenant_label(tenant) if tenant else tenant
        key = token_affinity_key(label, tokens, self.page_size, pol.affinity_pages, pol.per_prefix)
        req = RouteRequest(len(tokens), hashes, label, self.page_size, key=key,
                           memory_hashes=self.memory_hashes_of(tokens, tenant))  # fmt: skip
        remembered = pol.remembered(req, live)  # before route(): the memory as the policy sees it
        if explain is not None:
            explain.update(index=matched, memory=remembered, load=view.load,
                           queue_ms={w: round(q * 1e3, 2) for w, q in view.queue_s.items()})  # fmt: skip
        return pol.route(req, view, remembered)

    # ------------------------------------------------------------------ HTTP
    def _tenant(self, request, body) -> Optional[str]:
        """The request's tenant. With a tenant header configured it is that header's value and
        nothing else: the servers drop the body's ``cache_salt`` then, so routing or hashing by it
        would miss their namespaces and let a client without the header probe another tenant's
        routing memory. Raises ``ValueError`` (HTTP 400) for a repeated or non-UTF-8 header, as the
        servers do: forwarded, a gateway's appended copy would decide which tenant is served."""
        if self.tenant_header:
            values = request.headers.getall(self.tenant_header, [])
            if len(values) > 1:
                raise ValueError(f"the tenant header {self.tenant_header} must appear at most once")
            if not values:
                return None
            return values[0].strip() or None  # (headers that are not UTF-8 were refused in handle)
        if request.path == "/v1/messages":  # (SGLang's Anthropic request has no cache_salt: dropped,
            return None  # served in the default namespace, and routed so: its pages are there)
        salt = body.get("cache_salt") if isinstance(body, dict) else None
        return salt if isinstance(salt, str) and salt else None

    async def handle(self, request):
        from aiohttp import web

        t0 = time.perf_counter()
        try:
            raw = await read_body(request, self.decoded_limit)
        except UnreadableBody as exc:
            return exc.response()
        if len(raw) > self.parse_limit:  # (PARSE_LIMIT_MB: parsing it would stall every stream)
            self.stats.unparsed_bodies += 1
            body = {}
        else:
            body = _parse_body(raw)
        try:
            headers = self._upstream_headers(request)
        except ValueError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        try:
            tenant = self._tenant(request, body)
        except ValueError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        label = tenant_label(tenant) if tenant else None  # kept by the policy: bounded
        path = request.path
        extra = body.get("extra_key") if isinstance(body, dict) and path != "/v1/messages" else None  # (as cache_salt)
        # (SGLang: empty is none; the servers' middleware namespaces a client's key)
        extra = client_extra_key(extra) if isinstance(extra, str) and extra else None
        lora = self.lora_namespace(path, body) if isinstance(body, dict) else None
        if lora:  # SGLang: extra_key = (extra_key or "") + lora_id
            extra = (extra or "") + lora
        try:  # the prompt only steers locality: anything odd routes by affinity + load instead
            if not isinstance(body, dict):
                tokens = array("q")
            elif len(raw) > BIG_PROMPT_CHARS:
                # a 4 MiB prompt tokenized on the event loop stalled every stream the router
                # proxied for 7 s (review, session 19; the tokenizer releases the GIL)
                loop = asyncio.get_running_loop()
                tokens = await loop.run_in_executor(None, lambda: token_array(self.tokens_of(path, body)))
            else:
                tokens = token_array(self.tokens_of(path, body))
        except Exception:  # noqa: BLE001
            tokens = array("q")
        # Attempts: the chosen worker; after a connection that closed before any answer, the same
        # worker once more on a new connection (most often a keep-alive connection it was closing:
        # its tenants and their cache stay put; a worker that died fails that connect at once);
        # after a worker that cannot be reached, or a second close, one other worker.
        tried: list[str] = []
        d = ws = None
        again = False
        sse = SSECut(sse_api(path))  # (a stream that fails mid-way ends in its own API's events)
        # a follow-up of a stored response goes where it is stored (before a session's worker:
        # the worker without it refuses the request), as pinned as a session's
        prev = body.get("previous_response_id") if path == "/v1/responses" and isinstance(body, dict) else None
        session = self._response_worker(prev, tenant)
        if session == FOREIGN:
            return _response_not_found(prev)
        reason = "response" if session else "session"
        session = session or self._session_of(body, tenant)
        # a created response SGLang stores (``store`` true, its default): its id is learned from
        # the answer (``_learn_response``)
        learn = (path == "/v1/responses" and request.method == "POST"
                 and bool(body.get("store", True) if isinstance(body, dict) else True))  # fmt: skip
        named = body.get("request_id") if learn and isinstance(body, dict) else None
        if isinstance(named, str) and named and self._takes_over(named, tenant):
            # a client-named id (SGLang's response id) the workers store as sent, over a stored
            # response of another tenant: the router pinned it to this caller on the 200, before
            # SGLang stored anything (a stream is stored at its end: one failed or cut off stores
            # nothing), and this caller's next GET read the other tenant's response; one that ran
            # overwrote it (review, session 43). A tenant's own id is stored under its scope and
            # never refused: that told it another tenant had used the id (session 46)
            return web.json_response({"error": {"message": "request_id is in use by another stored response",
                                                "type": "invalid_request_error", "param": "request_id",
                                                "code": 400}}, status=400)  # fmt: skip

        def no_other() -> bool:
            """No other worker left to try: two tried, or the only one (a session's, a stored
            response's, or the fleet's; the third try went to the same one again, review session 32)."""
            return len(tried) == 2 or (bool(tried) and (bool(session) or len(tried) >= len(self.workers)))

        for attempt in range(3):
            if not again:
                if no_other():
                    break
                explain: Optional[dict] = {} if attempt == 0 else None
                if session:
                    d = Decision(session, reason=reason)
                    if explain is not None:
                        explain.update(session=True)
                else:
                    d = await self.choose(tokens, tenant, exclude=tried, explain=explain, label=label,
                                          extra_key=extra)  # fmt: skip
                ws = self.workers[d.worker]
                tried.append(d.worker)
                if attempt == 0:
                    route_ms = (time.perf_counter() - t0) * 1e3
                    # the tenant as a digest: /router/decisions is open to anyone who can reach the
                    # router, and a cache_salt is the secret that keeps tenants apart (review, session 19)
                    rid = request.headers.get("x-request-id")
                    self.decisions.append({"rid": rid if rid is None else rid[:RID_CHARS], "tenant": tenant_digest(tenant),
                                           "tokens": len(tokens), **explain, "worker": d.worker, "reason": d.reason,
                                           "matched": d.matched, "route_ms": round(route_ms, 3)})  # fmt: skip
                    self.stats.requests += 1
                    self.stats.spills += d.spill
                    self.stats.reasons[d.reason] = self.stats.reasons.get(d.reason, 0) + 1
                    # the index's own word apart from the router's memory of what it sent where
                    # (index_hits counted both, so it read as the index working with Redis down)
                    by_index = (explain.get("index") or {}).get(d.worker, 0) if explain else 0
                    self.stats.index_hits += by_index > 0
                    self.stats.index_matched_tokens += by_index
                    self.stats.warm_routes += d.matched > 0
                    self.stats.matched_tokens += d.matched
                    self.stats.prompt_tokens += len(tokens)
                    self.stats.route_ms_total += route_ms
            if attempt:
                self.stats.retries += 1
            conn = self._fresh if again else self._proxy
            again = False
            ws.routed += 1
            ws.inflight += 1
            pending = max(0, len(tokens) - d.matched)
            ws.inflight_tokens += pending
            started_at = time.monotonic()
            resp = None
            task = asyncio.current_task()
            ws.waiting[task] = None
            try:
                async with conn.request(request.method, ws.url + request.path_qs, data=raw,
                                        headers=headers) as up:  # fmt: skip
                    del ws.waiting[task]
                    ws.answered_at = time.monotonic()
                    if up.status in RETRY_STATUSES:
                        self._error_answer(ws, up.status)
                        if attempt < 2 and not no_other():
                            logger.info("router: %s answered %d; retrying on another worker", ws.url, up.status)
                            continue  # (leaving the `async with` drops the answer's connection)
                    else:
                        ws.errors_in_row = 0
                    resp = response_for(up, ws.url)
                    if self._is_admin(request):  # (with an admin key, worker URLs are for its holders)
                        resp.headers["x-sglang-tiered-worker"] = ws.url
                    if not await self._to_client(resp.prepare(request)):
                        return resp
                    streams = ws.streams
                    streams[task] = time.monotonic()
                    sse.start(up)
                    head = [] if learn and up.status == 200 else None  # (a JSON answer's first bytes)
                    if head is not None and isinstance(named, str) and named:
                        # the client named it (SGLang's response id is the request's ``request_id``):
                        # known now, whatever its length, before any byte of the answer goes out
                        # (a worker in tenant mode stores it under the tenant's scope, the id its
                        # answer carries: ``scoped_response_id``, session 44)
                        self._remember_response(self._stored_id(named, tenant), ws.url, tenant)
                        if not (self.tenant_header and tenant):
                            head = None  # (else the answer's id too: a worker that kept it unscoped)
                    async for chunk in up.content.iter_any():
                        streams[task] = time.monotonic()
                        if head is not None and not sse.on:
                            head = self._learn_response(head, chunk, ws.url, tenant)
                        chunk = sse.lines(chunk)
                        if head is not None and sse.on and sse.response is not None:
                            # (its ``response.created`` event, learned before the client has it)
                            self._remember_response(sse.response.get("id"), ws.url, tenant)
                            head = None
                        if chunk and not await self._to_client(resp.write(chunk)):
                            return resp
                    if head:  # (an id not first: the whole answer, when it was small)
                        self._learn_response(head, b"", ws.url, tenant, whole=True)
                    chunk = sse.rest()
                    if chunk and not await self._to_client(resp.write(chunk)):
                        return resp
                    await self._to_client(resp.write_eof())
                    return resp
            except asyncio.CancelledError:
                if task in self._abandoned:  # (_abandon: the worker answers nothing; not the client)
                    self._abandoned.discard(task)
                    task.uncancel()
                    ws.failures += 1
                    self.stats.abandoned += 1
                    if resp is not None and resp.prepared:
                        # stopped mid-answer (``_check``: no byte since its checks began to miss):
                        # the client's answer ends as a dying worker's does (session 41), never sent again
                        self.stats.failed += 1
                        logger.warning("router: %s stopped answering mid-answer; ending it", ws.url)
                        end = sse.failed(f"worker {self._worker_name(request, ws.url)} stopped answering "
                                         f"mid-stream ({ws.missed} health checks missed); the answer is "
                                         f"incomplete and was not sent again (part of it had reached the client)")  # fmt: skip
                        if end:
                            await self._to_client(resp.write(end))
                        raise WorkerStalled(ws.url)
                    logger.warning("router: %s stopped answering; %s", ws.url,
                                   "giving up" if attempt == 2 or no_other() else "retrying")  # fmt: skip
                    continue
                # the client left (serve() cancels the handler then): leaving the `async with`
                # closes the upstream connection, so the worker sees the disconnect and aborts
                # the request instead of generating to the end for nobody
                self.stats.client_gone += 1
                raise
            except Exception as exc:  # noqa: BLE001
                ws.failures += 1
                if resp is not None and resp.prepared:
                    self.stats.failed += 1  # bytes already went out: cannot retry transparently
                    # (a stream: its last whole event, then an error event naming the worker, and
                    # the connection cut without a clean end, as before: ``SSECut``)
                    end = sse.failed(f"worker {self._worker_name(request, ws.url)} failed mid-stream "
                                     f"({type(exc).__name__}); the answer is incomplete and was not sent "
                                     f"again (part of it had reached the client)")  # fmt: skip
                    if end:
                        await self._to_client(resp.write(end))
                    raise
                if unreachable(exc):
                    # nothing answers there: out of the routing set now (health checks bring it back)
                    ws.healthy = False
                    ws.down_until = time.monotonic() + 2.0
                else:
                    # closed before any answer: not a reason to move the worker's tenants (review,
                    # session 29: a keep-alive race took healthy workers down); once more on a new
                    # connection, unless that is what just failed
                    self.stats.disconnects += 1
                    again = conn is self._proxy
                last = attempt == 2 or (not again and no_other())
                logger.warning("router: %s failed (%s); %s", ws.url, exc, "giving up" if last else "retrying")
            finally:
                ws.waiting.pop(task, None)
                ws.streams.pop(task, None)
                ws.finished(started_at, pending)
        self.stats.failed += 1
        if reason == "response" and ws is not None:
            return self._response_gone(request, prev, ws, "previous_response_id", "it could not be reached")
        return web.json_response({"error": {"message": "no worker could serve the request"}}, status=502)

    def _response_owner(self, tenant: Optional[str]):
        """Whose a stored response is: with a tenant header, the tenant that created it (None: no
        header); without one, None for all (a ``GET /v1/responses/{id}`` carries no body, so no
        ``cache_salt``: no request could show whose it is)."""
        return memo_key(tenant) if self.tenant_header else None

    def _stored_id(self, rid: str, tenant: Optional[str]) -> str:
        """A stored response's id as the workers keep it: with a tenant header, a tenant's id under
        its scope, as their middleware scopes it (``scoped_response_id``: an id without ``resp_``
        stays as sent), so two tenants' equal ids are two ids; the caller's without the header (and
        every id without a tenant header) as sent."""
        return scoped_response_id(tenant, rid) if self.tenant_header and tenant else rid

    def _own_scope(self, wid: str, tenant: Optional[str]) -> bool:
        """Whether the worker's id ``wid`` lies in ``tenant``'s own scope (``resp_t<its digest>~``):
        on workers in tenant mode only that tenant's calls reach it, whoever named it first."""
        return bool(self.tenant_header and tenant and wid.startswith(RESPONSE_ID_PREFIX)
                    and scoped_response_id(tenant, wid) == wid)  # fmt: skip

    def _response_worker(self, rid, tenant: Optional[str] = None) -> Optional[str]:
        """The worker that stored the response ``rid`` (an answer this router passed on), or
        None: routed as any request (an id the router did not see, or forgot, is the worker's to
        refuse, as before). The map is keyed by the id as the workers store it (``_stored_id``):
        with a tenant header a tenant's ids are its scope's, and another tenant's equal id is
        another id (session 46: the map kept ids as sent, so one tenant's id was refused to, or
        claimed by, another). ``FOREIGN``: another's (review, session 43: SGLang's store is one per
        server and knows no tenant): a tenant's named by the caller without the header, an id a
        worker answered a tenant unscoped named by another, or one the caller without the header
        made in a tenant's scope (``_remember_response`` hands it to the tenant that creates it);
        the caller answers as SGLang does for an id it does not hold, as a worker in tenant mode
        answers another tenant's."""
        if not isinstance(rid, str) or not rid:
            return None
        wid = self._stored_id(rid, tenant)
        key = session_memo(wid)
        pin = self.responses.get(key)
        if pin is None and wid != rid:
            # an id a worker answered a tenant unscoped (``shared``) is kept as it answered; any
            # other pin of the id as sent is not what the caller's scoped id names on the workers
            key = session_memo(rid)
            pin = self.responses.get(key)
            if pin is not None and not pin[2]:
                return None
        if pin is None:
            return None
        url, owner, _shared = pin
        if owner != self._response_owner(tenant):  # (in its scope: one the caller without the header made)
            return FOREIGN
        if url not in self.workers:
            return None
        self.responses.move_to_end(key)
        return url

    def _takes_over(self, named: str, tenant: Optional[str]) -> bool:
        """Whether a creation naming ``named`` as its ``request_id`` would be stored over another
        tenant's stored response: named as sent by the caller without the header (the workers
        keep its ids unscoped, and a tenant's scoped id is then that tenant's), or named by a
        tenant as an id a worker answered another tenant unscoped. Never a tenant's own id, which
        the workers store under its scope (session 46), nor an id without ``resp_``, which no
        route of SGLang's reads."""
        if not self.tenant_header or not named.startswith(RESPONSE_ID_PREFIX):
            return False
        pin = self.responses.get(session_memo(named))
        return pin is not None and pin[1] != self._response_owner(tenant) and (pin[2] or not tenant)

    def _remember_response(self, wid, url: str, tenant: Optional[str] = None) -> None:
        """``wid`` (the id as the worker stores it: ``_stored_id``, or its answer's) was stored by
        the worker at ``url`` for ``tenant`` (RESPONSES_KEPT of them kept). An id another tenant
        holds is never handed over, but in the caller's own scope (where only it reaches on the
        workers: one named first by another caller was that caller's claim on it)."""
        if not isinstance(wid, str) or not wid:
            return
        key, owner = session_memo(wid), self._response_owner(tenant)
        own = self._own_scope(wid, tenant)
        pin = self.responses.get(key)
        if pin is not None and pin[1] != owner and not own:  # (handle refuses it: ``_takes_over``)
            return
        # (``shared``: a tenant's ``resp_`` id its worker answered unscoped, one that every tenant's
        # call names alike there: a worker without the tenant header)
        shared = bool(self.tenant_header and tenant and wid.startswith(RESPONSE_ID_PREFIX) and not own)
        _pin(self.responses, key, (url, owner, shared), RESPONSES_KEPT)

    def _learn_response(self, head: list, chunk: bytes, url: str, tenant: Optional[str] = None,
                        whole: bool = False) -> Optional[list]:
        """A created response's JSON answer, one chunk at a time (the chunks go on to the client
        as they come; this keeps a copy of the first RESPONSE_HEAD_MAX bytes): its ``id``, learned
        as soon as it is there (SGLang writes it first: the chunk that holds it has not reached the
        client yet). None once it is learned or given up; with ``whole`` (the answer ended), the
        whole answer if it fit is parsed for an id not written first."""
        size = sum(map(len, head))
        if chunk and size < RESPONSE_HEAD_MAX:
            head.append(chunk[: RESPONSE_HEAD_MAX - size])
            size += len(head[-1])
        data = b"".join(head)
        if len(head) > 1:
            head[:] = [data]
        m = _RESPONSE_ID.match(data)
        rid = None
        try:
            if m:
                rid = json.loads(m.group(1))
            elif whole and size < RESPONSE_HEAD_MAX:
                doc = json.loads(data)
                rid = doc.get("id") if isinstance(doc, dict) else None
        except (ValueError, RecursionError):
            rid = None
        if rid is not None:
            self._remember_response(rid, url, tenant)
            return None
        return head if size < RESPONSE_HEAD_MAX or whole else None

    def _response_gone(self, request, rid: str, ws: "WorkerState", param: str, why: str):
        """The answer for a stored response whose worker cannot be reached: a 502 in the
        Responses API's error shape, saying so. Not another worker's 404 ("not found", as for
        an id that never existed; no other worker holds it) nor a guess elsewhere: the worker may
        come back (a 502 is retried by the OpenAI SDK), and one restarted answers its own 404."""
        from aiohttp import web

        name = self._worker_name(request, ws.url)
        msg = (f"response {rid!r} is stored in the memory of worker {name}, which failed ({why}); SGLang "
               f"keeps a stored response in the server that answered it, and no other worker holds it")
        return web.json_response({"error": {"message": msg, "type": "worker_unavailable", "param": param,
                                            "code": 502}}, status=502)  # fmt: skip

    def _error_answer(self, ws: "WorkerState", status: int) -> None:
        """``ws`` answered one of RETRY_STATUSES: counted; ``health_misses`` in a row take it out
        of the routing set for ERROR_COOLDOWN_S (the health loop brings it back after that)."""
        ws.failures += 1
        ws.errors_in_row += 1
        self.stats.error_answers += 1
        if ws.errors_in_row >= self.health_misses and ws.healthy:
            ws.healthy = False
            ws.down_until = time.monotonic() + ERROR_COOLDOWN_S
            ws.errors_in_row = 0
            self.stats.error_downs += 1
            logger.warning("router: %s answered %d %d times in a row; out of the routing set for %g s",
                           ws.url, status, self.health_misses, ERROR_COOLDOWN_S)  # fmt: skip

    def _session_key(self, sid, tenant: Optional[str]):
        """A session id as the servers know it: with a tenant header, scoped to the caller's
        tenant as their middleware scopes it (``scoped_session_id``), so a tenant's own id finds
        its session and another tenant's names none of it."""
        if not isinstance(sid, str) or not sid:
            return None
        return session_memo(scoped_session_id(tenant, sid) if self.tenant_header and tenant else sid)

    def _session_of(self, body, tenant: Optional[str] = None) -> Optional[str]:
        """The worker that holds the request's SGLang session (``session_params.id``, opened
        through this router), or None: routed as any request (a session the router did not see
        opened, e.g. opened on a worker directly, is the worker's to refuse)."""
        params = body.get("session_params") if isinstance(body, dict) else None
        sid = self._session_key(params.get("id") if isinstance(params, dict) else None, tenant)
        if sid is None or sid not in self.sessions:
            return None
        self.sessions.move_to_end(sid)
        return self.sessions[sid]

    def _worker_name(self, request, url: str) -> str:
        """A worker as an answer names it: its URL for the admin key's holders (or with no admin
        key), else its position in ``--workers`` (the URLs are for the key's holders)."""
        if self._is_admin(request):
            return url
        return f"worker-{list(self.workers).index(url)}"

    async def _to_client(self, io) -> bool:
        """Await one write to the client (the headers, a chunk, the end); False when the client has
        gone (e.g. it closed after ``data: [DONE]``, or before the answer's headers): counted, not a
        worker fault, nothing to retry."""
        try:
            await io
            return True
        except ConnectionResetError:
            self.stats.client_gone += 1
            return False

    def lora_namespace(self, path: str, body: dict) -> Optional[str]:
        """What SGLang appends to a LoRA request's extra key: its adapter's ``lora_id``. The
        adapter is named by the OpenAI ``model`` ("base:adapter", as SGLang parses it) or by
        ``lora_path`` (one name; a batch's list is not routed by adapter). An adapter no worker
        published (loaded at run time: a random id) gets a namespace no page is in, so the index
        never credits a worker with base-model pages for it. Before session 23 every LoRA request
        was hashed as a base-model request."""
        name = None
        model = body.get("model") if path != "/generate" else None
        served = self.cache_key.model_id if self.cache_key is not None else None
        if isinstance(model, str) and ":" in model and model != served:
            # SGLang's _parse_model_parameter: the served name (which may hold colons) first
            if served and model.startswith(served + ":"):
                name = model[len(served) + 1 :].strip() or None
            else:
                name = model.split(":", 1)[1].strip() or None
        if name is None:
            lp = body.get("lora_path")
            name = lp if isinstance(lp, str) and lp else None
        if name is None:
            return None
        return self.lora_ids.get(name) or f"lora-unknown:{name}"

    def stats_doc(self) -> dict:
        s = self.stats
        n = max(1, s.requests)
        return {
            "requests": s.requests,
            "spill_rate": s.spills / n,
            "index_hit_rate": s.index_hits / n,
            "index_matched_token_rate": s.index_matched_tokens / max(1, s.prompt_tokens),
            "warm_route_rate": s.warm_routes / n,
            "matched_token_rate": s.matched_tokens / max(1, s.prompt_tokens),
            "index_lookups": s.index_lookups,
            "index_errors": s.index_errors,
            "index_timeouts": s.index_timeouts,
            "index_unavailable": s.index_unavailable,
            "retries": s.retries,
            "disconnects": s.disconnects,
            "health_downs": s.health_downs,
            "error_downs": s.error_downs,
            "error_answers": s.error_answers,
            "abandoned": s.abandoned,
            "owed_invalidations": s.owed_invalidations,
            "owed_delivered": s.owed_delivered,
            "owed_refused": s.owed_refused,
            "owed_dropped": s.owed_dropped,
            "weight_downs": s.weight_downs,
            "fleet_weights": dict(self.fleet_weights),
            "load_polls": s.load_polls,
            "load_poll_errors": s.load_poll_errors,
            "failed": s.failed,
            "client_gone": s.client_gone,
            "unparsed_bodies": s.unparsed_bodies,
            "mean_route_ms": s.route_ms_total / n,
            "reasons": dict(s.reasons),
            "workers": {w: {"routed": x.routed, "inflight": x.inflight, "healthy": x.healthy,
                            "failures": x.failures, "polled_reqs": x.polled_reqs, "owed": len(x.owed),
                            "weights_differ": x.weights_refused or x.weights_differ,
                            "adapters_missing": x.adapters_missing}
                        for w, x in self.workers.items()},  # fmt: skip
        }

    def _is_admin(self, request) -> bool:
        """No admin key configured, or the request carries it (``Authorization: Bearer KEY``)."""
        if self.admin_api_key is None:
            return True
        got = request.headers.get("authorization", "")
        return hmac.compare_digest(got.encode("utf-8", "surrogateescape"), f"Bearer {self.admin_api_key}".encode())

    def metrics_text(self) -> str:
        """The router's counters in Prometheus' text format (``GET /router/metrics``), from the
        same numbers as ``stats_doc``. Label sets are bounded: ``worker`` is the configured
        workers, ``reason`` the policy's few reasons. Built by hand (no registry, no dependency):
        one router per process, and the values are read at scrape time."""
        s = self.stats
        out: list[str] = []

        def metric(name: str, kind: str, doc: str, samples) -> None:
            full = f"sglang_tiered_router_{name}" + ("_total" if kind == "counter" else "")  # (format 0.0.4)
            out.append(f"# HELP {full} {doc}")
            out.append(f"# TYPE {full} {kind}")
            for labels, value in samples:
                lab = ",".join(f'{k}="{_prom_escape(v)}"' for k, v in labels)
                out.append(f"{full}{{{lab}}} {float(value)!r}" if lab else f"{full} {float(value)!r}")

        for name, doc, value in (
            ("requests", "Requests routed", s.requests),
            ("spills", "Requests spilled off their homes by the occupancy hatch", s.spills),
            ("index_lookups", "Index lookups", s.index_lookups),
            ("index_hits", "Requests sent to a worker the index said holds part of the prompt", s.index_hits),
            ("warm_routes", "Requests sent to a worker the index or the router's memory said holds part of the prompt",
             s.warm_routes),
            ("index_errors", "Index connection errors (or slow lookups in a row)", s.index_errors),
            ("index_timeouts", "Index lookups slower than the timeout", s.index_timeouts),
            ("index_unavailable", "Requests routed without the index", s.index_unavailable),
            ("matched_tokens", "Prompt tokens the chosen worker held, by the index or the router's memory",
             s.matched_tokens),
            ("index_matched_tokens", "Prompt tokens the chosen worker held, by the index", s.index_matched_tokens),
            ("prompt_tokens", "Prompt tokens routed", s.prompt_tokens),
            ("retries", "Proxied requests sent again (on a new connection, or to another worker)", s.retries),
            ("disconnects", "Proxied requests whose worker connection closed before any answer", s.disconnects),
            ("failed", "Requests that failed", s.failed),
            ("client_gone", "Requests whose client left before the response ended", s.client_gone),
            ("unparsed_bodies", "Bodies over the parse limit, routed by tenant header and load alone", s.unparsed_bodies),
            ("health_downs", "Workers taken out of the routing set by health checks", s.health_downs),
            ("error_downs", "Workers taken out of the routing set by error answers in a row", s.error_downs),
            ("error_answers", "Worker answers 429/500/502/503/504 (tried once more elsewhere where possible)",
             s.error_answers),
            ("abandoned", "Requests waiting on a worker that stopped answering, sent to another", s.abandoned),
            ("owed_invalidations", "Invalidations a worker did not take, kept for it", s.owed_invalidations),
            ("owed_delivered", "Owed invalidations delivered before the worker was routed to again", s.owed_delivered),
            ("owed_refused", "Owed invalidations the worker then refused (dropped)", s.owed_refused),
            ("owed_dropped", "Owed invalidations dropped past the per-worker bound", s.owed_dropped),
            ("weight_downs", "Workers taken out of the routing set for weights other than the fleet's", s.weight_downs),
            ("load_polls", "/v1/loads polls", s.load_polls),
            ("load_poll_errors", "/v1/loads polls that failed", s.load_poll_errors),
        ):
            metric(name, "counter", doc, [((), value)])
        metric("route_seconds", "counter", "Time spent choosing workers", [((), s.route_ms_total / 1e3)])
        metric("decisions", "counter", "Routed requests by the policy's reason",
               [((("reason", r),), n) for r, n in sorted(s.reasons.items())])  # fmt: skip
        ws = sorted(self.workers.items())
        metric("worker_routed", "counter", "Requests routed to each worker", [((("worker", w),), x.routed) for w, x in ws])
        metric("worker_failures", "counter", "Failed requests per worker", [((("worker", w),), x.failures) for w, x in ws])
        metric("worker_inflight", "gauge", "Requests in flight per worker (this router's)",
               [((("worker", w),), x.inflight) for w, x in ws])  # fmt: skip
        metric("worker_healthy", "gauge", "1 while the worker is in the routing set",
               [((("worker", w),), 1 if x.healthy else 0) for w, x in ws])  # fmt: skip
        metric("worker_owed_invalidations", "gauge", "Invalidations each worker owes (out of the routing set until taken)",
               [((("worker", w),), len(x.owed)) for w, x in ws])  # fmt: skip
        metric("index_connected", "gauge", "1 while the index is in use",
               [((), 1 if self._redis is not None and self.cache_key is not None  # (keys read: it answered)
                      and time.monotonic() >= self._redis_down_until else 0)])  # fmt: skip
        return "\n".join(out) + "\n"

    def _upstream_headers(self, request) -> list:
        """``forward_headers`` of ``request`` (``ValueError``: a 400). ``content-encoding`` goes
        only when aiohttp did not decode the body (``raw`` is what goes on, decoded)."""
        decoded = request.headers.get("content-encoding", "").strip().lower() in ("gzip", "deflate")
        return forward_headers(request.headers, decoded, self.tenant_header)

    async def passthrough(self, request):
        """Every other route (``/v1/models``, ``/get_model_info``, ``/health_generate``,
        ``/v1/tokenize``, CORS preflights, ...): proxied as it is to one healthy worker (the least
        busy), with no routing by cache (review, session 21: these were 404 or 405 through the
        router; the OpenAI SDK's ``models.list()`` failed). ``FLEET_WIDE`` routes go to every
        worker; ``/close_session`` to the worker whose ``/open_session`` this router proxied."""
        from aiohttp import web

        if request.path in ONE_SERVER_UPDATES:
            return web.json_response({"error": {"message": f"{request.path} changes one server (its own tensors, "
                                                           "process group or memory): send it to each worker, "
                                                           "not through the router"}}, status=400)  # fmt: skip
        try:
            raw = await read_body(request, self.decoded_limit)
        except UnreadableBody as exc:
            return exc.response()
        try:
            headers = self._upstream_headers(request)
        except ValueError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        live = self._routable()
        invalidate = request.path == "/cache/invalidate" and request.method == "POST"
        fleet_wide = request.path in FLEET_WIDE
        if invalidate:
            # every worker, with one T2 generation: they keep sharing the tenant's T2 pages after
            # it (each would take its own clock's), and none keeps serving what was invalidated
            # (session 23: the call reached one worker, and its peers kept the old KV, in T2 too)
            try:
                doc = json.loads(raw) if raw else None
            except (ValueError, RecursionError):
                doc = None
            plain = raw  # (a server from before session 23 refuses the field: sent again without it)
            if isinstance(doc, dict):
                # (keys sorted: also what an owed call's scope is keyed by, ``_owed_scope``)
                plain = json.dumps({k: v for k, v in doc.items() if k != "generation"}, sort_keys=True).encode()
            if isinstance(doc, dict) and doc.get("generation") is None:
                doc["generation"] = time.time_ns()
                raw = json.dumps(doc).encode()  # (content-length is not forwarded: aiohttp sets it)
        owable = fleet_wide and request.path in OWED_ROUTES
        if owable and not invalidate:
            plain = raw
        if fleet_wide:
            # an owed route's call is bounded as its delivery is: a worker that accepts and never
            # answers (frozen, cut off with its connection open) held the broadcast's answer for
            # good and was never owed the call (session 40); past the bound it owes it (one that
            # took an invalidation and answered late takes it again: its T2 generation moves once
            # more, off its peers', a cost in T2 sharing and never a page served stale)
            # (every fleet-wide route bounded, session 41: /abort_request, /pause_generation and
            # /continue_generation had no bound, and a hung worker held the caller for good)
            timeout = owed_timeout(request.path_qs)

            async def one(ws):
                return await self._hang_up(ws, request, call(ws), timeout)

            async def call(ws):
                try:
                    if owable:
                        if ws.owed:
                            # queued behind what it owes (``_pay`` delivers in order), answered as
                            # its last try went: sent now, it took this generation before an older
                            # one it owed, and the older one then moved its T2 to a generation of
                            # its own (max(given, current + 1)), off the fleet's, removing the
                            # fleet's objects under the one it had taken (review, session 39)
                            # (another owed route keeps its order with them too)
                            return ws.url, ws.owed_status, f"queued behind {len(ws.owed)} owed call(s)"
                        if invalidate:
                            return (ws.url, *await self._invalidate_one(ws, raw, plain, headers, timeout))
                    return (ws.url, *await self._send(ws, request.method, request.path_qs, raw, headers, timeout))
                except asyncio.TimeoutError:  # (aiohttp's too) the bound ran out: said so, naming it
                    return ws.url, 504, (f"worker {self._worker_name(request, ws.url)}: no answer to "
                                         f"{request.path} in {timeout.total:g} s")  # fmt: skip
                except Exception as exc:  # noqa: BLE001
                    return ws.url, 502, f"worker {self._worker_name(request, ws.url)}: {type(exc).__name__}: {exc}"[:1000]

            async def broadcast():
                """The call to every worker, and what it leaves owed: (answer, status)."""
                targets = list(self.workers.values())
                weights = request.path in WEIGHT_ROUTES and request.method == "POST"
                if weights:  # what each had before it (``_weights_seen``)
                    await self._note_weights(targets)
                adapter = request.path in ADAPTER_ROUTES and request.method == "POST"
                self._weights_busy += weights
                self._adapters_busy += adapter
                try:
                    res = await asyncio.gather(*(one(ws) for ws in targets))
                finally:
                    self._weights_busy -= weights
                    self._adapters_busy -= adapter
                    self._adapters_epoch += adapter
                adapter_took = adapter and any(200 <= st < 300 for _, st, _ in res)
                if adapter_took:
                    self._take_adapter(request.path, raw, headers, request.method, request.path_qs)
                # a request one worker refuses (4xx) is refused by all: the client's fault, whatever
                # else a down worker says (before, a bad body with a worker down was a 502)
                refused = [st for _, st, _ in res if 400 <= st < 500]
                status = min(refused) if refused else max(st for _, st, _ in res)
                doc = {self._worker_name(request, u): {"status": st, "body": b} for u, st, b in res}
                # (a flush has no body to refuse: one worker's 400, requests still running there, is
                # its own, and a worker down meanwhile still owes the flush; a 401 or 403 is not)
                flush = request.path == "/flush_cache"
                # (a weight update some worker took is owed to those down even when another refused it)
                took = weights and self._weights_broadcast(request, raw, targets, res, doc, headers)
                if owable and (took or not [st for st in refused if not (flush and st == 400)]):
                    for ws, (u, st, _) in zip(targets, res):
                        if st >= 500:  # it did not take it: kept for it, out of the routing set meanwhile
                            # (epoch: a weight broadcast's; -1, an adapter call no worker took: the
                            # fleet's once one takes it on delivery)
                            self._owe(ws, raw, plain, headers, request.method, request.path_qs,
                                      self._weights_epoch if weights else -1 if adapter and not adapter_took else 0)
                            ws.owed_status = st
                            doc[self._worker_name(request, u)]["owed"] = True
                return doc, status

            # Run to its end whatever the caller does (review, session 42: a caller that left
            # cancelled it, with handler_cancellation, and the workers not answered yet never got
            # the call: a flush or weight update some workers took and others never will, none of
            # them owed); a worker that fails its part is owed it as for any caller.
            job = asyncio.ensure_future(broadcast())
            self._broadcasts.add(job)
            job.add_done_callback(self._broadcast_done)
            doc, status = await asyncio.shield(job)
            return web.json_response(doc, status=status)
        ws = self._least_busy(live)
        sid = pinned = None
        if request.path in ("/close_session", "/open_session"):
            # an open naming a session this router maps goes where it lives too: that worker
            # refuses it while it is open, as one server does. Sent to the least busy worker, it
            # was opened there as well and the map moved to it: the first client's turns then ran
            # in the second one's session, another tenant's in cache_salt mode (review, session 39)
            doc = _parse_body(raw)
            try:
                tenant = self._tenant(request, None)
            except ValueError as exc:
                return web.json_response({"error": {"message": str(exc)}}, status=400)
            sid = self._session_key(doc.get("session_id") if isinstance(doc, dict) else None, tenant)
            if sid is not None and sid in self.sessions:
                ws = pinned = self.workers[self.sessions[sid]]
        stored = RESPONSE_ID_ROUTE.match(request.path) if request.path.startswith("/v1/responses/") else None
        holder = None
        if stored:
            try:
                holder = self._response_worker(stored.group(1), self._tenant(request, None))
            except ValueError as exc:
                return web.json_response({"error": {"message": str(exc)}}, status=400)
            if holder == FOREIGN:
                return _response_not_found(stored.group(1))
        if holder:  # GET /v1/responses/{id}, its /cancel: where SGLang stored it (else as before)
            ws = pinned = self.workers[holder]
        for attempt in range(2):
            cur = ws
            cur.inflight += 1  # (before session 37 only handle() counted: every route here went to worker 0)
            try:
                return await self._pass_to(request, ws, raw, headers, sid)
            except (WorkerUnreachable, WorkerSilent) as exc:
                # nothing reached it: out of the routing set now (as handle() does), and one other
                # worker tries (a session's close has no other); the same for a worker that closed
                # the connection before any answer, or answered nothing at all while its health
                # checks missed (``_abandon``: session 42, the client waited for good), as
                # ``handle``'s requests do (a closed connection does not take it out)
                ws.failures += 1
                if isinstance(exc, WorkerUnreachable):
                    ws.healthy = False
                    ws.down_until = time.monotonic() + 2.0
                others = [w for w in live if w is not ws and w.healthy]
                why = exc.why if isinstance(exc, WorkerSilent) else type(exc.__cause__).__name__
                if holder:
                    return self._response_gone(request, stored.group(1), ws, "response_id", why)
                if pinned is not None or not others or attempt == 1:
                    status = 504 if isinstance(exc, WorkerSilent) and exc.abandoned else 502
                    return web.json_response({"error": {"message": f"worker {self._worker_name(request, ws.url)}: "
                                                                   f"{why}"}}, status=status)  # fmt: skip
                self.stats.retries += 1
                ws = self._least_busy(others)
            finally:
                cur.inflight -= 1
        raise AssertionError("unreachable")

    def _broadcast_done(self, job) -> None:
        self._broadcasts.discard(job)
        if not job.cancelled() and job.exception() is not None:  # (its caller may have left: said here)
            logger.error("router: a fleet-wide call failed", exc_info=job.exception())

    def _least_busy(self, live: list) -> "WorkerState":
        """The worker with the fewest of this router's requests in flight; ties go round in turn
        (one request at a time, every worker ties at 0)."""
        self._turn = (self._turn + 1) % len(live)
        return min(live[self._turn :] + live[: self._turn], key=lambda w: w.inflight)

    async def _pass_to(self, request, ws, raw, headers, sid):
        """``passthrough``'s request to ``ws``; ``WorkerUnreachable`` when no connection could be made,
        ``WorkerSilent`` when the worker gave no answer at all (closed first, or stopped answering).
        An answer the worker breaks off or stops sending mid-way ends as ``handle``'s do: a stream
        with an error event in its own API (``SSECut``: /v1/messages, /v1/responses), then the
        connection cut without a clean end (review, session 42: those streams were cut with no
        error event, and one whose worker froze mid-way was left waiting for good)."""
        import aiohttp
        from aiohttp import web

        resp = None
        sse = SSECut(sse_api(request.path))
        task = asyncio.current_task()
        ws.waiting[task] = None  # (``_abandon``: until its headers come)
        try:
            async with self._proxy.request(request.method, ws.url + request.path_qs, data=raw,
                                           headers=headers, allow_redirects=False) as up:  # fmt: skip
                del ws.waiting[task]
                ws.answered_at = time.monotonic()
                resp = response_for(up, ws.url)
                if request.path == "/open_session" and up.status == 200:
                    # the session lives in this worker: its id (SGLang answers it as JSON) is
                    # remembered, so that its requests and its close go there
                    answer = await up.read()
                    opened = _parse_body(answer)
                    if isinstance(opened, str) and opened:
                        _pin(self.sessions, session_memo(opened), ws.url, SESSIONS_KEPT)
                    await resp.prepare(request)
                    await resp.write(answer)
                    await resp.write_eof()
                    return resp
                if request.path == "/close_session" and up.status == 200 and sid is not None:
                    self.sessions.pop(sid, None)
                # (a client that leaves is counted as gone, not as a failure: review, session 39)
                if not await self._to_client(resp.prepare(request)):
                    return resp
                streams = ws.streams  # (``_check`` ends it if the worker stops answering mid-way)
                streams[task] = time.monotonic()
                sse.start(up)
                async for chunk in up.content.iter_any():
                    streams[task] = time.monotonic()
                    chunk = sse.lines(chunk)
                    if chunk and not await self._to_client(resp.write(chunk)):
                        return resp
                chunk = sse.rest()
                if chunk and not await self._to_client(resp.write(chunk)):
                    return resp
                await self._to_client(resp.write_eof())
                return resp
        except asyncio.CancelledError:
            if task not in self._abandoned:  # (the client left)
                raise
            # (``_check``: no byte since the worker's checks began to miss; only an answer under
            # way is in ``ws.streams``: its headers went to the client)
            self._abandoned.discard(task)
            task.uncancel()
            self.stats.abandoned += 1
            if resp is None:  # (``_abandon``: no answer yet; ``passthrough`` tries another worker)
                logger.warning("router: %s stopped answering before it answered %s", ws.url, request.path)
                raise WorkerSilent(f"stopped answering ({ws.missed} health checks missed) before it "
                                   f"answered {request.path}", abandoned=True) from None  # fmt: skip
            ws.failures += 1
            self.stats.failed += 1
            logger.warning("router: %s stopped answering mid-answer (%s); ending it", ws.url, request.path)
            end = sse.failed(f"worker {self._worker_name(request, ws.url)} stopped answering mid-stream "
                             f"({ws.missed} health checks missed); the answer is incomplete")  # fmt: skip
            if end:
                await self._to_client(resp.write(end))
            raise WorkerStalled(ws.url)
        except Exception as exc:  # noqa: BLE001
            if resp is not None and resp.prepared:
                # the answer started: end the client's connection without a clean end, as the
                # worker's own failure would (returning here let aiohttp write the last chunk, so a
                # body cut off by a dying worker reached the client as a whole one: review, session 29),
                # a stream's after an error event (``SSECut``)
                self.stats.failed += 1
                end = sse.failed(f"worker {self._worker_name(request, ws.url)} failed mid-stream "
                                 f"({type(exc).__name__}); the answer is incomplete")  # fmt: skip
                if end:
                    await self._to_client(resp.write(end))
                raise
            if unreachable(exc):
                raise WorkerUnreachable() from exc
            if resp is None and isinstance(exc, aiohttp.ServerDisconnectedError):
                # closed before any answer (a worker that died with the request): another worker
                # tries, as in ``handle`` (session 42: a 502)
                self.stats.disconnects += 1
                raise WorkerSilent(type(exc).__name__) from exc
            ws.failures += 1
            return web.json_response({"error": {"message": f"worker {self._worker_name(request, ws.url)}: "
                                                           f"{type(exc).__name__}"}}, status=502)  # fmt: skip
        finally:
            ws.waiting.pop(task, None)
            ws.streams.pop(task, None)

    def app(self):
        from aiohttp import web

        app = web.Application(client_max_size=self.max_body)

        def admin(handler):
            async def checked(request):
                if not self._is_admin(request):
                    return web.json_response({"error": {"message": "the router's admin key is required"}},
                                             status=401)  # fmt: skip
                return await handler(request)

            return checked

        @admin
        async def stats(_):
            return web.json_response(self.stats_doc())

        @admin
        async def metrics(_):
            return web.Response(text=self.metrics_text(), content_type="text/plain", charset="utf-8",
                                headers={"x-prometheus-format": "0.0.4"})  # fmt: skip

        @admin
        async def decisions(_):
            return web.json_response(list(self.decisions))

        async def health(_):
            ok = any(s.healthy for s in self.workers.values())
            return web.json_response({"healthy": ok}, status=200 if ok else 503)

        async def on_startup(_):
            await self.start()

        async def on_cleanup(_):
            await self.close()

        app.router.add_get("/router/stats", stats)
        app.router.add_get("/router/decisions", decisions)
        app.router.add_get("/router/metrics", metrics)
        app.router.add_get("/health", health)
        for r in ROUTES + API_ROUTES:
            app.router.add_post(r, self.handle)
        app.router.add_put("/generate", self.handle)  # (SGLang serves it on PUT too)
        app.router.add_route("*", "/{tail:.*}", self.passthrough)
        app.on_startup.append(on_startup)
        app.on_cleanup.append(on_cleanup)
        return app


def _text_parts(content, kind: str = "text") -> Optional[list]:
    """The texts of ``content`` when it is text alone (blocks of type ``kind``); None otherwise."""
    if not isinstance(content, list):
        return None
    out = []
    for block in content:
        if not (isinstance(block, dict) and block.get("type") == kind and isinstance(block.get("text"), str)):
            return None
        out.append(block["text"])
    return out


def api_chat_body(path: str, body: dict) -> Optional[dict]:
    """The chat request SGLang 0.5.23's handler turns an Anthropic Messages (``/v1/messages``:
    ``anthropic/serving.py``, ``_convert_to_chat_completion_request``) or OpenAI Responses
    (``/v1/responses``: ``serving_responses.py``, ``_construct_input_messages``) request into,
    for its chat template, where the router can build it as the worker will: text messages and
    system prompts only. None (routed by tenant affinity and load) for anything else: tools,
    thinking, an output format or effort, images, tool calls and results, an inline system
    message (its place depends on the model's template), a Responses ``previous_response_id``
    (its history lives in the worker that answered it), reasoning, template kwargs, developer
    messages or items other than plain messages. The prompt only steers routing: a chat request
    built a little otherwise (a gpt-oss model's Harmony path) costs cache locality, never output."""
    if not isinstance(body, dict):
        return None
    msgs = []
    if path == "/v1/messages":
        if body.get("tools") or any(body.get(k) is not None for k in ("thinking", "output_config")):
            return None
        system = body.get("system")
        if isinstance(system, str):
            parts = [system] if system.strip() else []
        elif system is None:
            parts = []
        else:
            parts = _text_parts(system)
            if parts is None:
                return None
            parts = [t for t in parts if t]
        if parts:
            msgs.append({"role": "system", "content": "\n".join(parts)})
        turns = body.get("messages")
        if not isinstance(turns, list):
            return None
        for m in turns:
            if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
                return None
            content = m.get("content")
            if isinstance(content, str):
                msgs.append({"role": m["role"], "content": content})
                continue
            texts = _text_parts(content)
            if texts is None:
                return None
            if len(texts) == 1:
                msgs.append({"role": m["role"], "content": texts[0]})
            elif texts:
                msgs.append({"role": m["role"], "content": [{"type": "text", "text": t} for t in texts]})
            elif m["role"] == "assistant":  # (SGLang: an empty assistant turn stays, as "")
                msgs.append({"role": "assistant", "content": ""})
        return {"messages": msgs}
    if path == "/v1/responses":
        if body.get("tools") or any(body.get(k) is not None for k in
                                    ("previous_response_id", "reasoning", "chat_template_kwargs")):  # fmt: skip
            return None
        instructions = body.get("instructions")
        if instructions:
            if not isinstance(instructions, str):
                return None
            msgs.append({"role": "system", "content": instructions})
        items = body.get("input")
        if isinstance(items, str):
            items = [{"role": "user", "content": items}]
        if not isinstance(items, list):
            return None
        for m in items:
            if (not isinstance(m, dict) or m.get("role") not in ("user", "assistant")
                    or m.get("type", "message") != "message" or not set(m) <= {"role", "content", "type"}):  # fmt: skip
                return None
            content = m.get("content")
            if not isinstance(content, str):
                return None
            if m["role"] == "assistant" and msgs and msgs[-1]["role"] == "assistant":
                return None  # (SGLang merges consecutive assistant items into one turn)
            msgs.append({"role": m["role"], "content": content})
        return {"messages": msgs}
    return None


def sse_api(path: str) -> str:
    """Whose events a streamed answer on ``path`` carries, for the error event that ends it when
    its worker fails (``SSECut``): Anthropic's (``/v1/messages``), OpenAI Responses'
    (``/v1/responses``), or SGLang's ``data: {"error": ...}`` (every other stream)."""
    if path == "/v1/messages":
        return "anthropic"
    if path == "/v1/responses":
        return "responses"
    return "openai"


RESPONSES_ENDS = (b"response.completed", b"response.incomplete", b"response.failed")
_SEQ = re.compile(rb'"sequence_number":\s*(-?\d+)')


def _event_lines(out: bytes, name: bytes) -> int:
    """How many ``event: <name>`` lines ``out`` (whole lines) holds. A data line is one line of
    JSON, its newlines escaped: the name at a line's start is an event line, never an event's text."""
    line = b"event: " + name + b"\n"
    return out.count(b"\n" + line) + out.startswith(line)


class SSECut:
    """A streamed answer (``text/event-stream``) as the client gets it, for a worker that dies
    mid-stream (review, session 41). Whole lines go on as they come, a line the worker has not
    ended yet waits for its end (an event with ``event:`` lines: the event; SGLang writes each event
    whole: nothing waits then), so when the
    worker's connection breaks, the client has whole events only, and gets one more: an error
    event naming the worker in the stream's own API (``sse_api``), before the connection is cut
    without a clean end, as before. Before, the client got the half event the worker had written
    (``data: {"text": "ab``) and then a transfer-encoding error, nothing said. Nothing is sent
    again: the tokens the client already has are never duplicated by a retry elsewhere.

    The error event is the one SGLang's own handler writes when its stream fails mid-way:
    ``data: {"error": {...}}`` for /generate and the OpenAI routes (the OpenAI SDK raises it as an
    APIError); for /v1/messages, the open content block's ``content_block_stop``, then
    ``event: error`` with ``{"type": "error", "error": {"type": "api_error", "message": ...}}``
    and ``message_stop`` (``_flush_on_error``); for /v1/responses, ``response.failed`` with the
    stream's response (from its ``response.created``), its status ``failed`` and its ``error``,
    numbered after the last event (review, session 42: those streams went through the router
    with no error event at all, cut or left waiting)."""

    # A line longer than this goes on in parts as it comes (review, session 41: held whole, a
    # worker's line without an end was buffered without bound, beside the client's copy)
    HELD_MAX = 4 << 20

    def __init__(self, api: str = "openai"):
        self.api = api
        self.on = False
        # the line not ended yet, in the parts it came in: joined once, when its end comes (review,
        # session 41: ``held + chunk`` at every chunk, and a rescan of it for a line end, copied
        # an event of E bytes arriving in k parts k times: SGLang's non-incremental /generate
        # stream repeats the whole text so far, and its logprobs, in each event)
        self.held: list = []
        self.held_bytes = 0
        self.tail = b"\n\n"  # the last bytes the client got (an event ended: a blank line)
        self._reset()

    def _reset(self) -> None:
        # Anthropic: message started; content blocks started and stopped (SGLang numbers them
        # from 0, one open at a time). Responses: the last event's number; the stream's response.
        self.started, self.blocks, self.stopped = False, 0, 0
        self.seq, self.response = -1, None
        self.ended = False  # its last event went out (message_stop; response.completed, ...)

    def start(self, up) -> bool:
        """Whether ``up`` is a stream of events (then its chunks go through ``lines``)."""
        self.on = up.headers.get("content-type", "").split(";", 1)[0].strip().lower() == "text/event-stream"
        self.held, self.held_bytes, self.tail = [], 0, b"\n\n"
        self._reset()
        return self.on

    def lines(self, chunk: bytes) -> bytes:
        """What of ``chunk`` goes to the client now: through its last line end (all of it once
        the line not ended yet is past ``HELD_MAX``); all of it for an answer that is not a stream."""
        if not self.on:
            return chunk
        cut = chunk.rfind(b"\n") + 1 if self.api == "openai" else self._event_end(chunk)
        if not cut and self.held_bytes + len(chunk) <= self.HELD_MAX:
            if chunk:
                self.held.append(chunk)
                self.held_bytes += len(chunk)
            return b""
        if not cut:
            cut = len(chunk)
        out = b"".join((*self.held, chunk[:cut])) if self.held else chunk[:cut]
        rest = chunk[cut:]
        self.held, self.held_bytes = ([rest], len(rest)) if rest else ([], 0)
        if out:
            self.tail = (self.tail + out[-4:])[-4:]
            if self.api != "openai":
                self._watch(out)
        return out

    def _event_end(self, chunk: bytes) -> int:
        """Where in ``chunk`` the last event ends (0: none does). An event with ``event:`` lines
        goes on whole: its ``event:`` line alone, then the error event's blank line, reached the
        OpenAI and Anthropic SDKs as an event with no data, which they fail to parse as JSON
        before they get to the error."""
        t = self.held[-1][-3:] if self.held else b""  # (an end across two chunks)
        probe = t + chunk if t else chunk
        a, b = probe.rfind(b"\n\n"), probe.rfind(b"\n\r\n")
        return max(0, max(a + 2 if a >= 0 else 0, b + 3 if b >= 0 else 0) - len(t))

    def _watch(self, out: bytes) -> None:
        """What the error event of this stream's API needs to know of the events that went out."""
        if self.api == "anthropic":
            self.started = self.started or _event_lines(out, b"message_start") > 0
            self.blocks += _event_lines(out, b"content_block_start")
            self.stopped += _event_lines(out, b"content_block_stop")
            self.ended = self.ended or _event_lines(out, b"message_stop") > 0
            return
        self.ended = self.ended or any(_event_lines(out, e) for e in RESPONSES_ENDS)
        at = out.rfind(b'"sequence_number":')
        m = _SEQ.match(out, at) if at >= 0 else None
        if m:
            self.seq = int(m.group(1))
        if self.response is None:
            at = out.find(b"event: response.created\n")
            if at >= 0 and (at == 0 or out[at - 1] == 10):
                at = out.find(b"data: ", at)
                end = out.find(b"\n", at)
                try:
                    doc = json.loads(out[at + 6 : end]) if 0 <= at < end else None
                except ValueError:
                    doc = None
                if isinstance(doc, dict) and isinstance(doc.get("response"), dict):
                    self.response = doc["response"]

    def rest(self) -> bytes:
        """The end of a stream that ended cleanly: whatever waits goes."""
        out = b"".join(self.held)
        self.held, self.held_bytes = [], 0
        return out

    def failed(self, message: str) -> bytes:
        """The bytes that end a stream whose worker failed: an event that is not ended yet ended
        (the half line that waits is dropped), then the error event in the stream's API. Empty
        for an answer that is not a stream."""
        if not self.on or self.ended:  # (a stream whose last event went out has all it needs)
            return b""
        # the event under way ended: its line (a part of an event past HELD_MAX may have gone out
        # mid-line), then a blank line, so the error is an event of its own (review, session 42:
        # a line end alone made the error's lines more of the half event, its data the half JSON)
        if self.tail.endswith(b"\n\n") or self.tail.endswith(b"\r\n\r\n"):
            end = b""
        else:
            end = b"\n" if self.tail.endswith(b"\n") else b"\n\n"
        return end + b"".join(self._error_events(message))

    def _error_events(self, message: str) -> list:
        def event(name: str, doc: dict) -> bytes:
            return f"event: {name}\ndata: ".encode() + json.dumps(doc).encode() + b"\n\n"

        if self.api == "anthropic":  # (SGLang's anthropic/serving.py, ``_flush_on_error``)
            out = []
            if self.blocks > self.stopped:
                out.append(event("content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1}))
            out.append(event("error", {"type": "error", "error": {"type": "api_error", "message": message}}))
            if self.started:
                out.append(event("message_stop", {"type": "message_stop"}))
            return out
        if self.api == "responses":  # (SGLang's serving_responses.py: its stream's ``except``)
            response = dict(self.response or {"id": "resp_unknown", "object": "response",
                                              "created_at": int(time.time())})  # fmt: skip
            response.update(status="failed", output=[], usage=None,
                            error={"code": "server_error", "message": message})  # fmt: skip
            return [event("response.failed", {"type": "response.failed", "sequence_number": self.seq + 1,
                                              "response": response})]  # fmt: skip
        doc = {"error": {"message": message, "type": "worker_failed", "code": 502}}
        return [b"data: " + json.dumps(doc).encode() + b"\n\n"]


class UnreadableBody(ValueError):
    """A request body aiohttp could not read, or one that decodes past its limit (``read_body``)."""

    status = 400

    def response(self):
        """A 400 (413) that closes the connection: aiohttp's parser stopped inside this body, so
        the connection cannot carry another request."""
        from aiohttp import web

        resp = web.json_response({"error": {"message": str(self)}}, status=self.status)
        resp.force_close()
        return resp


class BodyTooLarge(UnreadableBody):
    status = 413


async def read_body(request, decoded_limit: Optional[int] = None) -> bytes:
    """The request's body, decoded as its ``Content-Encoding`` says (aiohttp decodes gzip and
    deflate, and br with Brotli installed). ``UnreadableBody`` (a 400) for a body aiohttp cannot
    read: one that is not what its ``Content-Encoding`` says, or a broken chunked encoding. Before,
    the error escaped the handler and the client got a 500 (a differential fuzz of the router
    against its worker, session 27: ``Content-Encoding: gzip`` on a plain JSON body, which SGLang
    itself reads as plain JSON; the router cannot, once aiohttp has started decoding). The body's
    stream is marked ended, or aiohttp would read it again after the answer and log the error."""
    from aiohttp.web import RequestPayloadError

    enc = request.headers.get("content-encoding", "").strip().lower()
    try:
        if decoded_limit is None or enc in ("", "identity"):
            return await request.read()
        # compressed: decoded a chunk at a time (aiohttp inflates as the reader asks), refused
        # once past the limit; the rest is never inflated (the stream is ended, the connection closed)
        body = bytearray()
        async for chunk in request.content.iter_chunked(1 << 16):
            body += chunk
            if len(body) > decoded_limit:
                request.content.feed_eof()
                raise BodyTooLarge(f"the request body (Content-Encoding: {enc}) decodes to more than "
                                   f"{decoded_limit} bytes, the router's limit for compressed bodies")  # fmt: skip
        return bytes(body)
    except RequestPayloadError as exc:
        request.content.feed_eof()
        enc = request.headers.get("content-encoding")
        why = str(exc.__cause__ or exc).strip().splitlines()[-1].strip()
        raise UnreadableBody(f"cannot read the request body{f' (Content-Encoding: {enc})' if enc else ''}: {why}") from None


def response_for(up, origin: Optional[str] = None):
    """The client's response for a worker's answer ``up``: its status and its headers, less the
    hop-by-hop ones (added, not set: two set-cookie stay two). A ``Location`` on the worker
    ``origin`` becomes a path on the router: the worker builds it from the Host it was sent (its
    own), so ``POST /generate/``'s redirect sent the client to the worker, past the router
    (review, session 32)."""
    from aiohttp import web

    resp = web.StreamResponse(status=up.status)
    for k, v in up.headers.items():
        lk = k.lower()
        if lk in HOP_RESPONSE_HEADERS:
            continue
        if lk == "location" and origin and (v == origin or v.startswith(origin + "/") or v.startswith(origin + "?")):
            v = v[len(origin):] or "/"
        resp.headers.add(k, v)
    return resp


_warned_headers: set = set()


def forward_headers(headers, decoded: bool, tenant_header: Optional[str]) -> list:
    """The request's headers as they go to a worker: pairs (a header sent twice goes twice), less
    the hop-by-hop ones (and those the ``Connection`` header names, but the tenant header) and
    ``content-encoding`` when aiohttp decoded the body. aiohttp keeps header bytes that are not UTF-8 as lone surrogates,
    which the upstream request cannot encode: the tenant header and ``authorization`` must then be
    refused (``ValueError``: a 400), any other such header is dropped with a warning (review,
    session 21: python-requests sends ``X-End-User: José`` as latin-1, which SGLang serves)."""
    named = {t.strip().lower() for v in headers.getall("connection", []) for t in v.split(",")}
    out = []
    for k, v in headers.items():
        lk = k.lower()
        if lk in HOP_REQUEST_HEADERS or (decoded and lk == "content-encoding"):
            continue
        if lk in named and lk != tenant_header:
            # (the tenant header goes on whatever ``Connection`` names: the router routed and
            # hashed by it, and a worker without it serves the call untagged, i.e. in the
            # ``default`` namespace, or as the operator's on control routes: review, session 39)
            continue
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            if lk == tenant_header or lk == "authorization":
                raise ValueError(f"header {k} is not valid UTF-8") from None
            if len(_warned_headers) < 64 and lk not in _warned_headers:
                _warned_headers.add(lk)
                logger.warning("sglang-tiered router: dropping header %s (not UTF-8)", k)
            continue
        out.append((k, v))
    return out


def _weights_state(info: dict) -> tuple:
    """The weights a worker's /model_info reports (``WEIGHT_INFO``), as a key."""
    return tuple(repr(info.get(k)) for k in WEIGHT_INFO)


def owed_timeout(path_qs: str):
    """How long a fleet-wide call (``FLEET_WIDE``: an owed route's, sent or delivered, and
    /abort_request's) is given (``path_qs``: its path and query); see OWED_SLOW_S. A flush is given OWED_FLUSH_S plus the wait its ``timeout`` query asks
    SGLang for (until the server is idle): with T1 on, a flush first copies the device tree to host
    memory; at OWED_TIMEOUT_S a big pool's flush answered the client 502 (review, session 40)."""
    import aiohttp
    from urllib.parse import parse_qs

    path, _, qs = path_qs.partition("?")
    if path in ("/update_weights_from_disk", "/load_lora_adapter") or path in PAUSE_ROUTES:
        return aiohttp.ClientTimeout(total=OWED_SLOW_S)
    if path == "/flush_cache":
        try:
            wait = float(parse_qs(qs).get("timeout", ["0"])[-1])
        except ValueError:  # (SGLang answers it a 422)
            wait = 0.0
        wait = min(max(wait, 0.0), OWED_SLOW_S) if wait == wait else 0.0
        return aiohttp.ClientTimeout(total=OWED_FLUSH_S + wait)
    return aiohttp.ClientTimeout(total=OWED_TIMEOUT_S)


def tenant_digest(tenant: Optional[str]) -> Optional[str]:
    """A tenant as the decisions log shows it: its ``name_hash`` in hex, as the servers' own
    invalidation keys name it (one tenant's requests stay recognisable; its name, a client's
    secret salt, is not shown)."""
    return None if tenant is None else f"{name_hash(tenant):016x}"


def memo_key(tenant: Optional[str]):
    """The key a tenant's namespace seed is memoised under: the tenant itself, or, past
    ``MAX_LABEL_CHARS`` characters, a 16-byte digest of it (bytes, so never equal to a short
    tenant's str key): a client's 1 MiB ``cache_salt`` is hashed whole, not kept."""
    if tenant is None or len(tenant) <= MAX_LABEL_CHARS:
        return tenant
    return hashlib.blake2b(tenant.encode("utf-8", "surrogatepass"), digest_size=16).digest()


SESSION_ID_CHARS = 256  # session ids longer than this are remembered by a digest (``session_memo``)


def session_memo(sid: str):
    """A session id as ``Router.sessions`` keys it: itself, or past ``SESSION_ID_CHARS`` a 16-byte
    digest (bytes, never equal to a short id's str). The id is the client's ``session_id``, any
    length, and a session opened with a short ``timeout`` leaves its worker but not this map:
    SESSIONS_KEPT ids of 1 MiB held 64 GiB (review, session 39)."""
    if len(sid) <= SESSION_ID_CHARS:
        return sid
    return hashlib.blake2b(sid.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def token_array(ids) -> array:
    """Token ids as ``array('q')``: one conversion that checks them (as ``int(t)`` for each did)
    and that the page hashes and the affinity key then hash without converting again."""
    if isinstance(ids, array) and ids.typecode == "q":
        return ids
    try:
        return array("q", ids)
    except TypeError:  # ids that int() accepts but array does not (e.g. numpy ints, "5")
        return array("q", [int(t) for t in ids])


def fast_encode(tok):
    """``tok.encode`` through the Rust tokenizer directly when that gives the same ids (0.29 vs
    0.45 ms per live-bench prompt here: the Python wrapper's share), else ``tok.encode``."""
    backend = getattr(tok, "backend_tokenizer", None)
    probe = "Hello, world!  A probe: 123 \u00e9\u4e2d <s> </s>\n\tend"
    try:
        if backend is not None and backend.encode(probe).ids == list(tok.encode(probe)):
            # encode_batch_fast (tokenizers >= 0.20) skips the offsets the router never reads: 0.082
            # vs 0.112 ms CPU per live-bench prompt here (bench/router_cpu.py's workload), same ids
            fast = getattr(backend, "encode_batch_fast", None)
            if fast is not None and fast([probe])[0].ids == backend.encode(probe).ids:
                return lambda text: fast([text])[0].ids
            return lambda text: backend.encode(text).ids
    except Exception:  # noqa: BLE001
        pass
    return tok.encode


def serve(workers, redis_url=None, *, host="127.0.0.1", port=30100, **kw) -> None:
    from aiohttp import web

    router = Router(workers, redis_url, **kw)
    # shutdown_timeout: aiohttp's default waits up to 60 s for open connections on SIGTERM; a
    # router behind 6 keep-alive clients took 13-20+ s to exit (the live bench's 20 s wait ran out)
    # handler_cancellation: a client that leaves cancels its handler, which closes the upstream
    # request (aiohttp's default leaves the handler running): without it a worker kept generating a
    # non-streamed answer for nobody, and the router counted it in flight until the end
    web.run_app(router.app(), host=host, port=port, print=None, access_log=None, shutdown_timeout=2.0,
                handler_cancellation=True, loop=event_loop(), backlog=LISTEN_BACKLOG,
                max_line_size=MAX_HEADER_LINE, max_field_size=MAX_HEADER_LINE, max_headers=MAX_HEADERS)  # fmt: skip


class WorkerStalled(Exception):
    """A worker stopped sending an answer mid-way (``Router._check``): raised by the handler
    after the client's last bytes, so aiohttp ends the client's connection without a clean end."""


class WorkerUnreachable(Exception):
    """No connection could be made to a worker (``unreachable``; the cause is chained)."""


class WorkerSilent(Exception):
    """A worker gave ``passthrough`` no answer at all: it closed the connection before one, or
    stopped answering altogether while the request waited (``abandoned``: ``Router._abandon``)."""

    def __init__(self, why: str, abandoned: bool = False):
        super().__init__(why)
        self.why = why
        self.abandoned = abandoned


def unreachable(exc: BaseException) -> bool:
    """A proxied request's failure that says the worker cannot be reached (no connection could be
    made), as opposed to a connection that closed before the answer."""
    import aiohttp

    return isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))


def event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (SGLang depends on it), else asyncio's. The
    router's CPU goes mostly to the event loop and its sockets, not to routing (bench/router_cpu.py
    --profile): uvloop does that part in C."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
