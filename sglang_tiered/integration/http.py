"""HTTP control plane, mounted into SGLang's FastAPI app in the launcher process.

* ``GET /cache/stats[?tenant=NAME]`` -> ``CacheStats`` (sglang_tiered/stats.py), summed over the
  server's data-parallel ranks.
* ``POST /cache/invalidate`` with ``{"tenant": str}`` and/or ``{"model_version": str}``, or
  ``{"all": true}`` -> 202 with what was dropped. Bad payloads get a 400 with a message.
* A middleware folds per-request hints into fields SGLang already carries to the scheduler:
  LMCache's ``kv_transfer_params: {"lmcache.skip_save": true}`` (top level on ``/generate``, or
  OpenAI ``extra_body``) becomes ``custom_params["lmcache.skip_save"]``; a trusted gateway header
  (``SGLANG_TIERED_TENANT_HEADER``, e.g. ``x-tenant-id``) becomes ``cache_salt``.
Both endpoints carry SGLang's ``AuthLevel.ADMIN_OPTIONAL``: with ``--admin-api-key`` set they need
it; with only ``--api-key`` they need that.
"""

import functools
import itertools
import json
import logging
import time

import msgspec
from fastapi import Request
from typing import Optional

from sglang_tiered.config import hashed_tenant_labels, load_config, sglang_route_names, vertex_route
from sglang_tiered.core.keys import client_extra_key
from sglang_tiered.core.tenants import RESPONSE_ID_PREFIX, response_not_found, scoped_response_id, scoped_session_id
from sglang_tiered.integration.protocol import STATE_KEY, invalidation_args
from sglang_tiered.stats import aggregate

logger = logging.getLogger("sglang_tiered")
_installed = False
_nonce = itertools.count(int(time.time() * 1000) % (1 << 40))



class InvalidateRequest(msgspec.Struct, forbid_unknown_fields=True):
    tenant: Optional[str] = None
    model_version: Optional[str] = None
    all: Optional[bool] = None
    # T2's new generation for what is invalidated (ns, 1 to 2^62): servers given the same one
    # keep sharing its T2 pages (the router's broadcast sends one); none: the server's clock
    generation: Optional[int] = None


GENERATION_AHEAD_NS = 300 * 10**9  # a tenant's call may name a T2 generation this far ahead of the clock


def _error(status: int, message: str):
    from fastapi.responses import ORJSONResponse

    return ORJSONResponse({"error": {"code": status, "message": message}}, status_code=status)


async def _rank_stats():
    from sglang.srt.entrypoints.http_server import get_global_state

    states = await get_global_state().tokenizer_manager.get_internal_state()
    return [s[STATE_KEY] for s in states if isinstance(s, dict) and STATE_KEY in s]


INVALIDATE_BODY_MAX = 1 << 20  # bytes of a /cache/invalidate body (a name past it: {"all": true})


async def _bounded_body(request, limit: int) -> bytes:
    """The request's body, or a ``BadRequest`` (413) once it passes ``limit`` bytes: read whole,
    a body of any size was held in memory and its name echoed back in the 202 (a helper's audit,
    session 40: a 64 MB tenant was accepted and sent back)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"request body is larger than {limit} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_invalidate(body: bytes) -> InvalidateRequest:
    """Validate a /cache/invalidate body; raises ValueError with a message for a 400."""
    if not body or not body.strip():
        raise ValueError("empty body: send a JSON object with 'tenant', 'model_version' or 'all'")
    try:
        req = msgspec.json.decode(body, type=InvalidateRequest)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid payload: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"body is not valid JSON: {exc}") from None
    if req.all is False:
        raise ValueError("'all' must be true when given")
    if req.tenant is None and req.model_version is None and not req.all:
        raise ValueError("nothing to invalidate: give 'tenant', 'model_version' or 'all': true")
    for name in ("tenant", "model_version"):
        v = getattr(req, name)
        if v is not None and not v.strip():
            raise ValueError(f"'{name}' must be a non-empty string")
    if req.generation is not None and (isinstance(req.generation, bool) or not 1 <= req.generation < 1 << 62):
        raise ValueError("'generation' must be a whole number in [1, 2^62)")
    return req


SCOPED = ("with SGLANG_TIERED_TENANT_HEADER set and no --admin-api-key, a call carrying the tenant header "
          "acts on that tenant only on /cache/stats and /cache/invalidate")


def confined_invalidation_refused(req: InvalidateRequest, own: Optional[str]) -> Optional[tuple[int, str]]:
    """Why a tenant's own call (``own``: ``caller_tenant``) may not make invalidation ``req``, as
    (status, message); None when it may (or the call is the operator's)."""
    if own is None:
        return None
    if req.tenant != own or req.model_version is not None or req.all:
        return 403, SCOPED
    if req.generation is not None and req.generation > time.time_ns() + GENERATION_AHEAD_NS:
        # T2 raises the next invalidation of everything above the highest tenant generation: a
        # tenant's call far ahead of the clocks set this server's apart from its peers' for every
        # tenant (a helper's audit, session 37). The router sends its own clock's.
        return 400, (f"'generation' is more than {GENERATION_AHEAD_NS // 10**9} s ahead of this server's clock "
                     "(a time in ns; the router sends its own)")  # fmt: skip
    return None


def label_refused(req: InvalidateRequest, own: Optional[str]) -> Optional[tuple[int, str]]:
    """A 400 for the operator's ``{"tenant": "salt~<16 hex digits>"}`` where stats show salts
    hashed: that is how /cache/stats and /metrics label a tenant, not its name, and it was
    accepted with a 202 that dropped nothing, the tenant's KV still served (a helper's audit,
    session 40). A salt so shaped is dropped with ``{"all": true}``."""
    import re

    if own is not None or req.tenant is None or not hashed_tenant_labels(load_config()):
        return None
    if re.fullmatch(r"salt~[0-9a-f]{16}", req.tenant):
        return 400, (f"'tenant' takes the salt itself; {req.tenant!r} is how /cache/stats and /metrics label "
                     "a salt (its digest), which cannot be invalidated by name")  # fmt: skip
    return None


def caller_tenant(request, admin_api_key) -> Optional[str]:
    """The tenant a control-plane call is confined to, or None for the operator's whole view.

    With a trusted tenant header configured, the gateway that sets it tags every tenant's
    requests (it must: untagged generation requests share the ``default`` namespace). Unless
    SGLang's ``--admin-api-key`` guards these routes (then only its holders get here), a call that
    carries the header sees and invalidates only that tenant (review, session 21: any tenant read
    every tenant's names and counters and could drop another tenant's cache); one without it
    comes from behind the gateway, the operator's side, and gets the whole view."""
    from sglang_tiered.core.tenants import tenant_of

    header = load_config().tenant_header
    if not header or admin_api_key:
        return None
    value = header_value(request.scope, header.lower().encode())  # as the middleware reads it
    if value == "":  # (as 'default' itself: its scope would be the untagged requests' namespace)
        raise BadRequest(f"the tenant header {header} is empty")
    return None if value is None else tenant_of(value)


def header_value(scope, name: bytes) -> Optional[str]:
    """The tenant header ``name`` of an ASGI request, stripped; None when absent. A repeated or
    non-UTF-8 one is a ``BadRequest``: forwarded, a gateway's appended copy would decide."""
    values = [v for k, v in scope.get("headers") or [] if k.lower() == name]
    if len(values) > 1:
        raise BadRequest(f"the tenant header {name.decode()} must appear at most once")
    if not values:
        return None
    try:
        value = values[0].decode("utf-8").strip()
    except UnicodeDecodeError:
        raise BadRequest(f"the tenant header {name.decode()} is not valid UTF-8") from None
    from sglang_tiered.core.tenants import DEFAULT, OTHER

    if value in (DEFAULT, OTHER):
        # 'default' is the untagged requests' namespace (T1's and T2's tenant tag, the stats row,
        # what {"tenant": "default"} invalidates); '__other__' the row of the tenants past the
        # stats table's bound: a tenant so named read their counters and dropped their cache
        raise BadRequest(f"the tenant header {name.decode()} may not be {value!r} (a reserved tenant name)")
    return value


def add_routes(app) -> None:
    """Add the endpoints as plain routes on the app itself: SGLang's API-key middleware reads each
    route's endpoint ``_auth_level``, which a FastAPI included router would hide behind a wrapper."""
    from fastapi.responses import Response
    from sglang.srt.entrypoints.http_server import get_global_state
    from sglang.srt.managers.io_struct import SetInternalStateReq
    from sglang.srt.utils.auth import AuthLevel, auth_level

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def cache_stats(request: Request):
        tenant = request.query_params.get("tenant")
        if tenant is not None and not tenant.strip():
            return _error(400, "'tenant' must be a non-empty string")
        try:
            own = caller_tenant(request, admin_key())
        except BadRequest as exc:
            return _error(exc.status, str(exc))
        if own is not None:
            if tenant is not None and tenant != own:
                return _error(403, SCOPED)
            tenant = own
        ranks = await _rank_stats()
        if not ranks:
            return _error(503, "the tiered cache backend is not active (--radix-cache-backend tiered?)")
        hashed = hashed_tenant_labels(load_config())
        return Response(msgspec.json.encode(aggregate(ranks, tenant, hashed, confined=own is not None)),
                        media_type="application/json")  # fmt: skip

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def cache_invalidate(request: Request):
        try:
            req = parse_invalidate(await _bounded_body(request, INVALIDATE_BODY_MAX))
            own = caller_tenant(request, admin_key())
        except BadRequest as exc:
            return _error(exc.status, str(exc))
        except ValueError as exc:
            return _error(400, str(exc))
        refused = confined_invalidation_refused(req, own) or label_refused(req, own)
        if refused is not None:
            return _error(*refused)
        nonce = next(_nonce)
        if req.generation is None:  # one for every data-parallel rank (each would take its own clock)
            req.generation = time.time_ns()
        args = invalidation_args(nonce, tenant=req.tenant, model_version=req.model_version, everything=bool(req.all),
                             generation=req.generation)  # fmt: skip
        tm = get_global_state().tokenizer_manager
        updated = await tm.set_internal_state(SetInternalStateReq(server_args=args))
        if not updated or not all(updated):
            return _error(503, "the tiered cache backend did not accept the invalidation")
        dropped = deferred = 0
        for rs in await _rank_stats():
            inv = rs.get("last_invalidation") or {}
            if inv.get("nonce") == nonce:
                dropped += inv.get("dropped_tokens", 0)
                deferred += inv.get("deferred_tokens", 0)
        body = {
            "accepted": msgspec.to_builtins(req),
            "dropped_tokens": dropped,
            "deferred_tokens": deferred,
            "note": "entries held by running requests stop matching now and are freed on release",
        }
        return Response(json.dumps(body), status_code=202, media_type="application/json")

    app.add_api_route("/cache/stats", cache_stats, methods=["GET"])
    app.add_api_route("/cache/invalidate", cache_invalidate, methods=["POST"])


# Routes that carry SGLang's ``cache_salt`` to the scheduler (GenerateReqInput, the OpenAI
# completion, chat and responses requests; SageMaker's /invocations is a chat request).
SALT_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations")
RESPONSES_PATH = "/v1/responses"
RESPONSE_ROUTES = RESPONSES_PATH + "/"  # (a stored response's: /v1/responses/{id}[/cancel])
# Routes that reach the scheduler (and so the shared prefix cache) but cannot carry a salt: with a
# trusted tenant header configured they would put every tenant into one namespace, so they are
# refused (403) rather than silently shared.
UNSALTED_PATHS = (
    "/v1/messages", "/api/chat", "/api/generate", "/vertex_generate", "/encode", "/v1/embeddings",
    "/classify", "/v1/classify", "/v1/score", "/v1/rerank", "/v1/decisions", "/v1/systemone",
    "/v1/audio/transcriptions",
)  # fmt: skip
# SGLang's websocket routes that reach the scheduler (OpenAI Realtime transcription): no salt.
WEBSOCKET_PATHS = frozenset(("/v1/realtime",))
# SGLang's session routes (served on GET too, with a JSON body): a session's history is a prompt
# and its output, which SGLang keys by the session id alone. In tenant mode each tenant's ids are
# scoped to it (``scoped_session_id``), so one tenant cannot continue, read or close another's.
SESSION_PATHS = frozenset(("/open_session", "/close_session"))


def _scope_session_fields(body: dict, tenant: str) -> None:
    """A request's ``session_params.id`` (a dict, or a batch's list of them) and ``session_id``,
    scoped to ``tenant``; other shapes are left for SGLang to refuse."""
    sps = body.get("session_params")
    for sp in sps if isinstance(sps, list) else [sps]:
        if isinstance(sp, dict) and isinstance(sp.get("id"), str) and sp["id"]:
            sp["id"] = scoped_session_id(tenant, sp["id"])
    if isinstance(body.get("session_id"), str) and body["session_id"]:
        body["session_id"] = scoped_session_id(tenant, body["session_id"])


def rewrite_session_route(raw: bytes, path: str, tenant: str) -> bytes:
    """``/open_session`` / ``/close_session`` body of a tenant's call, its id scoped (an open
    without an id gets a fresh one: SGLang's own would be unscoped)."""
    import uuid

    try:
        body = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        raise BadRequest("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    sid = body.get("session_id")
    if sid is None and path == "/open_session":
        sid = uuid.uuid4().hex
    if not isinstance(sid, str) or not sid:
        raise BadRequest("session_id must be a non-empty string")
    body["session_id"] = scoped_session_id(tenant, sid)
    return json.dumps(body).encode()


# SGLang's stored OpenAI Responses (``--enable-response-store``), kept by id alone as sessions are:
# in tenant mode a tenant's ids are scoped to it (``scoped_response_id``) in the creation's body and
# in the path of ``/v1/responses/{id}[/cancel]``, and SGLang's 404 names the id as it was sent.
def _scope_response_fields(body: dict, tenant: str) -> None:
    """A Responses request's own id (``request_id``: SGLang stores the response under it; a fresh
    one where the client named none, as SGLang would make it) and ``previous_response_id``,
    scoped to ``tenant``; other shapes are left for SGLang to refuse."""
    import uuid

    if "request_id" not in body:  # (a null is SGLang's to refuse, as it does: a string or none)
        body["request_id"] = f"{RESPONSE_ID_PREFIX}{uuid.uuid4().hex}"  # (SGLang's default_factory, protocol.py)
    rid = body["request_id"]
    if isinstance(rid, str):
        body["request_id"] = scoped_response_id(tenant, rid)
    prev = body.get("previous_response_id")
    if isinstance(prev, str):
        body["previous_response_id"] = scoped_response_id(tenant, prev)


def _scoped_response_path(scope, path: str, tenant: str) -> tuple[dict, str]:
    """``scope`` with the response id of ``/v1/responses/{id}[/...]`` (``path``, the route's
    path) scoped to ``tenant``: the route's path and the ASGI ``path`` (under any root path) and
    ``raw_path``; the same scope where the id stays as it is. And the id as sent."""
    from urllib.parse import quote

    rid, sep, rest = path[len(RESPONSE_ROUTES) :].partition("/")
    scoped = scoped_response_id(tenant, rid)
    if scoped == rid:
        return scope, rid
    full = scope["path"][: len(scope["path"]) - len(path)] + RESPONSE_ROUTES + scoped + sep + rest
    return dict(scope, path=full, raw_path=quote(full).encode("ascii")), rid


NOT_FOUND_CAP = 64 << 10  # (SGLang's not-found answer is a few hundred bytes; past this, passed on)


def _naming_as_sent(send, tenant: str, originals):
    """``send`` for a tenant's call on a Responses route whose ids were scoped: SGLang's 404 for
    a response it does not hold (``_make_not_found_error``) names the id as the client sent it
    (one of ``originals()``, called only then), byte for byte as SGLang answers it, not its
    scoped form. The scoped form told a tenant, through the router, another tenant's id (the
    router answers SGLang's 404 naming the id as sent, without reaching a worker) from one
    nobody holds (the worker's 404, naming ``resp_t<its digest>~...``): an existence oracle
    (a helper's review, session 44). Anything else goes as it was."""
    return _rewritten_body(send, NOT_FOUND_CAP, lambda raw: _not_found_as_sent(raw, tenant, originals()),
                           holds=lambda start: start.get("status") == 404)  # fmt: skip


def _not_found_as_sent(raw: bytes, tenant: str, originals) -> Optional[bytes]:
    """SGLang's 404 naming the id of ``originals`` whose scoped form ``raw`` is SGLang's 404 for
    (``response_not_found``, the router's answer too); None when ``raw`` is no such answer."""
    for rid in originals:
        scoped = scoped_response_id(tenant, rid)
        if scoped != rid and raw == response_not_found(scoped)[1]:
            return response_not_found(rid)[1]
    return None


def _previous_response_id(raw: bytes) -> list:
    """The ``previous_response_id`` of a Responses creation's body as the client sent it."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        return []
    prev = body.get("previous_response_id") if isinstance(body, dict) else None
    return [prev] if isinstance(prev, str) else []


# Routes whose token ids reach the model's embedding: checked on every server (issue #10; review,
# session 21: /v1/score's query, items and label_token_ids crash the scheduler the same way).
# Vertex AI's predict route (SGLang reads AIP_PREDICT_ROUTE when it imports its HTTP server).
VERTEX_PATH = vertex_route()
ID_PATHS = frozenset(("/generate", "/v1/completions", "/v1/score", VERTEX_PATH))
# Methods that carry no body to the scheduler: passed through. Every other method is checked as
# POST is (SGLang serves /generate, /encode, /classify and /v1/rerank on PUT too).
BODYLESS_METHODS = ("GET", "HEAD", "OPTIONS")


def unsalted_paths() -> frozenset:
    """``UNSALTED_PATHS`` plus the names the environment gives the renamable ones (Vertex's and
    Ollama's routes: ``config.sglang_route_names``)."""
    return frozenset(UNSALTED_PATHS) | sglang_route_names()


class BadRequest(ValueError):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def route_path(scope) -> str:
    """The path routes are matched by: Starlette's ``get_route_path``, the request's path less
    ``--fastapi-root-path`` (uvicorn hands the app both joined). Matched by the raw path, every
    request under a root path passed the middleware unchecked: a client's own ``cache_salt``
    picked its tenant, and a bad token id killed the scheduler (a helper's audit, session 37)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    if path == root:
        return ""
    return path[len(root) :] if path[len(root)] == "/" else path


# SGLang's /server_info returns every rank's get_internal_state reply, which carries our per-rank
# stats (every tenant's name and counters: /cache/stats keeps them behind the admin key and
# confines a tenant's call to its own); they are taken out of the answer (a helper's audit,
# session 37: anyone with the user key, or with only --admin-api-key set no key at all, read them)
INFO_PATHS = frozenset(("/server_info", "/get_server_info"))
STATS_CAP = 64 << 20  # (an answer past this is passed on as it is: not ours)
SCOPED_STATE = ("with SGLANG_TIERED_TENANT_HEADER set and no --admin-api-key, a call carrying the tenant header "
                "cannot change the server's internal state (it carries cache invalidations)")  # fmt: skip
SCOPED_ADMIN = ("is one of SGLang's admin routes: with SGLANG_TIERED_TENANT_HEADER set and no --admin-api-key, a "
                "call carrying the tenant header (a tenant's, through the gateway) cannot use it; call it without "
                "the header from behind the gateway, or set --admin-api-key")  # fmt: skip
SCOPED_METRICS = ("/metrics names every tenant and its traffic: with SGLANG_TIERED_TENANT_HEADER set, a call "
                  "carrying the tenant header cannot read it (scrape it without the header, from the operator's network)")  # fmt: skip
# our own admin routes confine a tenant's call to that tenant instead (``cache_stats``,
# ``cache_invalidate``); /set_internal_state has its own message (SCOPED_STATE)
OWN_ADMIN_PATHS = frozenset(("/cache/stats", "/cache/invalidate", "/set_internal_state"))


@functools.lru_cache(maxsize=1)
def sglang_admin_paths() -> frozenset:
    """The paths of SGLang's own admin routes: those its ``@auth_level`` marks ADMIN_OPTIONAL or
    ADMIN_FORCE (``/flush_cache``, ``/update_weights_from_disk``, ``/abort_request``,
    ``/pause_generation``, ``/release_memory_occupation``, ``/load_lora_adapter``, ...; 37 in
    0.5.23), read from SGLang's app, less ``OWN_ADMIN_PATHS``. SGLang lets the user key (or no
    key) call them when no --admin-api-key is set; in tenant mode that key is every tenant's, so
    any tenant flushed every other's cache, aborted their requests (``abort_all``) or swapped the
    served weights (session 38)."""
    try:
        from sglang.srt.entrypoints.http_server import app
        from sglang.srt.utils.auth import AuthLevel

        admin = (AuthLevel.ADMIN_OPTIONAL, AuthLevel.ADMIN_FORCE)
        paths = {r.path for r in app.routes if getattr(getattr(r, "endpoint", None), "_auth_level", None) in admin}
    except Exception:  # noqa: BLE001 - (SGLang's app not importable: its 0.5.23 list)
        logger.warning("sglang-tiered: SGLang's admin routes could not be read; using 0.5.23's", exc_info=True)
        paths = set(SGLANG_ADMIN_PATHS_0523)
    return frozenset(paths - OWN_ADMIN_PATHS)


# SGLang 0.5.23's admin routes (``sglang_admin_paths`` reads them from its app; this is the
# fallback, and tests/test_http_review38.py checks the two agree)
SGLANG_ADMIN_PATHS_0523 = frozenset((
    "/abort_request", "/add_external_corpus", "/begin_weight_update", "/configure_logging", "/continue_generation",
    "/destroy_weights_update_group", "/dump_expert_distribution_record", "/end_weight_update", "/flush_cache",
    "/freeze_gc", "/get_remote_instance_transfer_engine_info", "/get_weights_by_name", "/hicache/storage-backend",
    "/hicache/storage-backend/clear", "/init_weights_send_group_for_remote_instance", "/init_weights_update_group",
    "/list_external_corpora", "/load_lora_adapter", "/load_lora_adapter_from_tensors", "/pause_generation",
    "/pd_role_switch", "/release_memory_occupation", "/remote_instance_transfer_engine_info",
    "/remove_external_corpus", "/resume_memory_occupation", "/send_weights_to_remote_instance", "/set_trace_level",
    "/slow_down", "/start_expert_distribution_record", "/start_profile", "/stop_expert_distribution_record",
    "/stop_profile", "/unload_lora_adapter", "/update_weight_version", "/update_weights_from_disk",
    "/update_weights_from_distributed", "/update_weights_from_ipc", "/update_weights_from_tensor", "/weights_checker",
))  # fmt: skip


def _without_cache_stats(send):
    """``send`` for a /server_info answer: the body collected, ``STATE_KEY`` taken out of each of
    its ``internal_states``, then sent with its length corrected. Anything else goes as it was."""
    return _rewritten_body(send, STATS_CAP, _strip_cache_stats)


def _rewritten_body(send, cap: int, rewrite, holds=None):
    """``send`` that holds back an answer (its start, where ``holds(start)``; any start without
    ``holds``) and its body up to ``cap`` bytes, then sends ``rewrite(body)`` with its length
    corrected; where that is None, or the body passed ``cap``, the answer goes as it was. Any
    other message goes on at once. (The /server_info and stored-response rewrites.)"""
    held: list = []
    size = 0

    async def wrapped(msg):
        nonlocal size
        if msg["type"] == "http.response.start" and not held:
            if holds is not None and not holds(msg):
                return await send(msg)
            held.append(msg)
            return None
        if msg["type"] != "http.response.body" or not held:
            return await send(msg)
        held.append(msg)
        size += len(msg.get("body", b""))
        if msg.get("more_body", False) and size <= cap:
            return None
        start, bodies = held[0], held[1:]
        held.clear()
        new = None if msg.get("more_body", False) else rewrite(b"".join(m.get("body", b"") for m in bodies))
        if new is None:
            await send(start)
            for m in bodies:
                await send(m)
            return None
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        await send({**start, "headers": headers + [(b"content-length", str(len(new)).encode())]})
        return await send({"type": "http.response.body", "body": new, "more_body": False})

    return wrapped


def _strip_cache_stats(raw: bytes) -> Optional[bytes]:
    """``raw`` (a /server_info JSON answer) without ``STATE_KEY`` in its internal states; None when
    there is nothing to take out (or it is not such an answer)."""
    if STATE_KEY.encode() not in raw:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    states = doc.get("internal_states") if isinstance(doc, dict) else None
    if not isinstance(states, list):
        return None
    for st in states:
        if isinstance(st, dict):
            st.pop(STATE_KEY, None)
    return json.dumps(doc).encode()


def admin_key() -> Optional[str]:
    """SGLang's ``--admin-api-key`` (None when unset, or not served: unit tests)."""
    try:
        from sglang.srt.entrypoints.http_server import get_global_state

        return get_global_state().tokenizer_manager.server_args.admin_api_key
    except Exception:  # noqa: BLE001
        return None


class HintMiddleware:
    """Pure ASGI middleware: fold LMCache's no-store hint and a trusted tenant header into the
    request body fields SGLang carries to the scheduler.

    It is installed *innermost* (next to the routes, after SGLang's own middlewares such as
    request decompression), so the body it checks is byte for byte the body the route parses.
    With a tenant header configured, every body on a salted route is parsed and re-encoded with
    the header's tenant as ``cache_salt`` (a client's own salt is removed when the header is
    absent); a body it cannot parse, a repeated or non-UTF-8 header, and routes that cannot carry
    a tenant get a 4xx with a message, never a pass-through. Without a tenant header only bodies
    that carry ``kv_transfer_params`` or a client's ``extra_key`` (``client_extra_key``) are
    rewritten. No input makes it raise (issue #10)."""

    def __init__(self, app, tenant_header: str | None = None):
        self.app = app
        self.tenant_header = (tenant_header or "").lower().encode() or None
        self.unsalted = unsalted_paths()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket" and self.tenant_header is not None and route_path(scope) in WEBSOCKET_PATHS:
            # (it reaches the scheduler without a salt, as UNSALTED_PATHS do: a helper's audit,
            # session 37) closed before it is accepted: the client sees a 403
            await receive()  # (websocket.connect)
            return await send({"type": "websocket.close", "code": 1008,
                               "reason": "disabled while SGLANG_TIERED_TENANT_HEADER is set"})  # fmt: skip
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = route_path(scope)
        if path in INFO_PATHS:  # (GET: SGLang serves them on GET alone)
            return await self.app(scope, receive, _without_cache_stats(send))
        tenant_mode = self.tenant_header is not None
        if tenant_mode and scope.get("method") != "OPTIONS" and (
                path.startswith(("/metrics", RESPONSE_ROUTES)) or path in SESSION_PATHS
                or path == "/set_internal_state" or path in sglang_admin_paths()):  # fmt: skip
            try:
                tenant = self._tenant(scope)
            except BadRequest as exc:
                return await _error(exc.status, str(exc))(scope, receive, send)
            if tenant is not None:  # (a tenant's call; the operator's, without the header, passes)
                if path.startswith("/metrics"):
                    # SGLang serves it to anyone, keys or not (auth.py), and our series name
                    # every tenant and its traffic (session 38)
                    return await _error(403, SCOPED_METRICS)(scope, receive, send)
                if path in SESSION_PATHS:  # (any method: SGLang serves them on GET with a body)
                    return await self._session_route(scope, receive, send, path, tenant)
                if path.startswith(RESPONSE_ROUTES):
                    # a stored response's routes (GET /v1/responses/{id}, POST .../{id}/cancel):
                    # a tenant's call reaches its own responses alone (``scoped_response_id``)
                    scoped, sent = _scoped_response_path(scope, path, tenant)
                    if scoped is not scope:
                        scope, send = scoped, _naming_as_sent(send, tenant, lambda: [sent])
                elif not admin_key():
                    # /set_internal_state carries our invalidations (session 37); SGLang's admin
                    # routes act on every tenant, GET too (session 38)
                    return await _error(403, SCOPED_STATE if path == "/set_internal_state" else f"{path} {SCOPED_ADMIN}")(
                        scope, receive, send)  # fmt: skip
        if scope.get("method") in BODYLESS_METHODS:
            return await self.app(scope, receive, send)
        if tenant_mode and path in self.unsalted:
            return await _error(403, f"{path} cannot carry a tenant and is disabled while SGLANG_TIERED_TENANT_HEADER "
                                "is set (tenants would share one cache namespace)")(scope, receive, send)  # fmt: skip
        shape_only = path not in SALT_PATHS and path not in ID_PATHS
        if shape_only and (path not in self.unsalted or _is_multipart(scope)):
            return await self.app(scope, receive, send)
        raw, gone = await _read_body(receive)
        if gone is not None:
            # the client went away mid-body: the app sees what it sees without us, an unfinished
            # body and the disconnect (Starlette: ClientDisconnect, nothing runs). Handing it the
            # part read as a whole body ran it unchecked and unsalted: a bad token id killed the
            # scheduler, a body's own cache_salt picked the tenant (review, session 29)
            return await self.app(scope, _replay(raw, receive, gone), send)
        try:
            tenant = self._tenant(scope) if tenant_mode else None
            # token ids are checked on every server (a bad id crashes stock SGLang's scheduler):
            # bodies on those routes are always parsed (a key may be written with JSON escapes,
            # which a byte search would miss), and any escaped body may hide a hint
            if shape_only:
                _check_json_shape(raw)
                new = raw
            elif (tenant_mode or path in ID_PATHS or b"kv_transfer_params" in raw or b"\\u" in raw
                  or (path in SALT_PATHS and b"extra_key" in raw)  # (the fence: every salted route)
                  or b"logprobs" in raw or b"logit_bias" in raw or b'"n"' in raw or b"best_of" in raw
                  or b"stop_regex" in raw or b"pattern" in raw
                  or _odd_shape(raw)):  # fmt: skip
                new = rewrite_body(raw, path, tenant, tenant_mode)
            else:
                new = raw
        except BadRequest as exc:
            return await _error(exc.status, str(exc))(scope, receive, send)
        if tenant and path == RESPONSES_PATH:  # (its previous_response_id was scoped)
            send = _naming_as_sent(send, tenant, lambda: _previous_response_id(raw))
        return await self.app(scope if new is raw else _with_length(scope, new), _replay(new, receive), send)

    def _tenant(self, scope) -> str | None:
        return header_value(scope, self.tenant_header) or None

    async def _session_route(self, scope, receive, send, path, tenant: str):
        """``SESSION_PATHS``, a tenant's call: it acts on its own sessions only."""
        raw, gone = await _read_body(receive)
        if gone is not None:  # (as ``__call__``: the app sees the unfinished body and the disconnect)
            return await self.app(scope, _replay(raw, receive, gone), send)
        try:
            new = rewrite_session_route(raw, path, tenant)
        except BadRequest as exc:
            return await _error(exc.status, str(exc))(scope, receive, send)
        return await self.app(_with_length(scope, new), _replay(new, receive), send)


async def _read_body(receive) -> tuple[bytes, Optional[dict]]:
    """An ASGI request's body, and the message that ended it early (a disconnect) or None."""
    chunks, more = [], True
    while more:
        msg = await receive()
        if msg["type"] != "http.request":
            return b"".join(chunks), msg
        chunks.append(msg.get("body", b""))
        more = msg.get("more_body", False)
    return b"".join(chunks), None


def _with_length(scope, body: bytes) -> dict:
    """``scope`` with its content-length set to ``body``'s (a rewritten body)."""
    scope = dict(scope)
    scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"content-length"] + [
        (b"content-length", str(len(body)).encode())
    ]
    return scope


def _is_multipart(scope) -> bool:
    """A form upload (SGLang's audio route): not JSON, passed through unread."""
    return any(k.lower() == b"content-type" and b"multipart/" in v.lower() for k, v in scope.get("headers") or [])


def _odd_shape(raw: bytes) -> bool:
    """A body that may not be a JSON object, or may nest deeper than Python's parsers recurse
    (cheap byte checks; only such bodies are parsed to tell). Stock SGLang 0.5.23 answers both with
    a 500 on its JSON routes (``'list' object has no attribute 'get'``, RecursionError: the HTTP
    fuzz with random seeds against a server without a tenant header, session 26)."""
    return raw.lstrip()[:1] != b"{" or raw.count(b"[") + raw.count(b"{") > ODD_NESTING


ODD_NESTING = 256  # brackets in a body past which its depth is checked (Python recurses ~1,000 deep)


def _check_json_shape(raw: bytes) -> None:
    """A 400 for a body that is valid JSON but not an object, or nested too deeply to parse;
    anything else (an object, or not JSON at all) is left to the route."""
    if not _odd_shape(raw):
        return
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None
    except ValueError:  # not JSON (UnicodeDecodeError is a ValueError): the route answers it
        return
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")


def _replay(body: bytes, receive, pending=None):
    """``receive`` for the app: the body we read (or rewrote) first, then ``pending`` (a
    disconnect seen while reading: the body is then unfinished, as the client left it), then
    whatever the client sends next."""
    queue = [{"type": "http.request", "body": body, "more_body": pending is not None}]
    if pending is not None:
        queue.append(pending)

    async def replay():
        if queue:
            return queue.pop(0)
        return await receive()

    return replay


def _merge_custom_params(holder: dict, skip: bool, where: str) -> None:
    cp = holder.get("custom_params")
    if cp is None:
        cp = {}
    elif not isinstance(cp, dict):
        raise BadRequest(f"{where}custom_params must be a JSON object to carry kv_transfer_params, "
                         f"got {type(cp).__name__}")  # fmt: skip
    cp["lmcache.skip_save"] = skip
    holder["custom_params"] = cp


def _check_generate_shape(body: dict) -> None:
    """Shapes that stock SGLang 0.5.23 answers with a 500 instead of a 400 (found by the HTTP fuzz
    test): an empty ``sampling_params`` list (IndexError, io_struct.py:540) and a list for a single
    prompt (AttributeError, tokenizer_manager.py:1354)."""
    sps = body.get("sampling_params")
    if not isinstance(sps, list):
        return
    if not sps:
        raise BadRequest("sampling_params must be an object or a non-empty list")
    text, ids = body.get("text"), body.get("input_ids")
    batch = isinstance(text, list) or (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list))
    if not batch:
        raise BadRequest("a list of sampling_params needs a batch of prompts (text or input_ids as a list of prompts)")


def in_session(session_id, session_params) -> bool:
    """A request whose prompt a session's history supplies (SGLang's ``session_id`` or
    ``session_params.id``; SGLang aborts one still empty after restoring the history)."""
    return session_id is not None or (isinstance(session_params, dict) and bool(session_params.get("id")))


def _check_empty_prompts(value, what: str) -> None:
    """A batch of token-id prompts with an empty one: stock SGLang 0.5.23 schedules a forward over
    0 tokens and its scheduler dies (``cannot reshape tensor of 0 elements`` in the rotary
    embedding), so one request takes the server down (found by the HTTP fuzz test in CI, session
    26; ``{"input_ids": [[5], []]}`` on ``/generate``, ``{"prompt": [[5], []]}`` on
    ``/v1/completions``). SGLang refuses a single empty prompt itself."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        for i, seq in enumerate(value):
            if isinstance(seq, list) and not seq:
                raise BadRequest(f"{what}[{i}] is empty; every prompt needs at least one token")


def _check_text_and_ids(body: dict) -> None:
    """``/generate`` with both ``text`` and ``input_ids``: SGLang 0.5.23 takes the batch shape from
    ``text`` and the tokens from ``input_ids`` (io_struct.py ``_determine_batch_size``), and checks
    neither against the other. An empty ``input_ids`` next to a text then reaches the scheduler as
    a 0-token prompt (its scheduler dies: found by the HTTP fuzz test in CI, session 26), and
    shapes that disagree answer 500 or break a stream mid-way. Answer 400 instead; agreeing
    shapes pass as before (SGLang serves ``input_ids``)."""
    text, ids = body.get("text"), body.get("input_ids")
    if not isinstance(ids, list):
        return
    _check_empty_prompts(ids, "input_ids")
    if text is None:
        return  # (SGLang refuses an empty input_ids itself unless a session supplies the prompt)
    if not ids:
        if in_session(body.get("session_id"), body.get("session_params")):
            return  # the session's history is the prompt; SGLang aborts a request still empty after it
        raise BadRequest("input_ids is empty; send text or input_ids, not an empty input_ids next to text")
    ids_batch = isinstance(ids[0], list)
    if isinstance(text, str) and ids_batch:
        raise BadRequest("text is one prompt but input_ids is a batch; send text or input_ids, not both")
    if isinstance(text, list) and (not ids_batch or len(ids) != len(text)):
        got = f"a batch of {len(ids)}" if ids_batch else "one prompt"
        raise BadRequest(f"text is a batch of {len(text)} but input_ids is {got}; send text or input_ids, not both")


_vocab: list = []  # [vocab size] once known (the served model's), read lazily in the HTTP process


def _vocab_size() -> int | None:
    if not _vocab:
        try:
            from sglang.srt.entrypoints.http_server import get_global_state

            _vocab.append(int(get_global_state().tokenizer_manager.model_config.vocab_size))
        except Exception:  # noqa: BLE001 - not served yet (unit tests): only the sign is checked
            return None
    return _vocab[0]


def _as_sglang_reads(value, model: str, field: str):
    """``value`` as SGLang's own OpenAI request model coerces it (pydantic, lax): ``5000.0`` and
    ``"5000"`` in a list of ids become the id 5000, a list of strings stays text. None when that
    model refuses it (SGLang answers its own 400 then)."""
    adapter = _adapters.get((model, field))
    if adapter is None:
        from pydantic import TypeAdapter
        from sglang.srt.entrypoints.openai import protocol

        adapter = _adapters[(model, field)] = TypeAdapter(getattr(protocol, model).model_fields[field].annotation)
    try:
        return adapter.validate_python(value)
    except Exception:  # noqa: BLE001 - pydantic's ValidationError: not ours to answer
        return None


_adapters: dict = {}


def _plain_ids(value) -> bool:
    """A list of ints or a list of lists of ints (what the range check reads as it is)."""
    seqs = value if value and isinstance(value[0], list) else [value]
    return all(isinstance(seq, list) and all(type(t) is int for t in seq) for seq in seqs)


def _check_model_ids(value, what: str, model: str, field: str, nonempty: bool = False) -> None:
    """``_check_token_ids`` on what SGLang's pydantic model will make of ``value`` (review,
    session 21: ``"prompt": [11, 5000.0]`` passed the check as a float, SGLang read it as the id
    5000, and the scheduler died); ``nonempty``: a batch of prompts may not hold an empty one."""
    if not isinstance(value, list) or not value:
        return
    if not _plain_ids(value):
        value = _as_sglang_reads(value, model, field)
    if nonempty:
        _check_empty_prompts(value, what)
    _check_token_ids(value, what)


def _check_vertex_ids(body: dict) -> None:
    """Vertex AI's route (``AIP_PREDICT_ROUTE``, default ``/vertex_generate``) hands each instance's
    ``input_ids`` to the scheduler as a batch (http_server.py ``vertex_generate``): an id outside
    the vocabulary there kills stock SGLang's scheduler as on ``/generate`` (session 26)."""
    instances = body.get("instances")
    if not isinstance(instances, list):
        return
    for i, inst in enumerate(instances):
        if isinstance(inst, dict):
            _check_token_ids(inst.get("input_ids"), f"instances[{i}].input_ids")


def vertex_as_generate(body: dict) -> Optional[dict]:
    """The ``/generate`` request Vertex's route builds from ``body`` (http_server.py
    ``vertex_generate``: the first of text / input_ids / input_embeds the first instance has,
    taken from every instance, their image data, then ``**parameters``), or None for a body
    SGLang's own model refuses. Its ``parameters`` are any ``/generate`` field, so every check
    ``/generate`` gets applies to it (session 38: only the instances' ids were checked, and
    ``parameters`` carried ids, a top-k, ``n``, a grammar or a ``lora_id`` past them)."""
    instances, params = body.get("instances"), body.get("parameters")
    if not isinstance(instances, list) or not instances or not all(isinstance(i, dict) for i in instances):
        return None
    if params is not None and not isinstance(params, dict):
        return None
    req: dict = {}
    for key in ("text", "input_ids", "input_embeds"):
        if instances[0].get(key):
            req[key] = [inst.get(key) for inst in instances]
            break
    images = [inst.get("image_data") for inst in instances if inst.get("image_data") is not None]
    req["image_data"] = images or None
    req.update(params or {})
    return req


def _check_as_generate(body: dict) -> None:
    """Every check ``rewrite_body`` makes of a ``/generate`` body."""
    _check_generate_shape(body)
    _check_text_and_ids(body)
    _check_token_ids(body.get("input_ids"), "input_ids")
    _check_top_k(body, "/generate")
    _check_sampling_values(body, "/generate")
    _check_grammar_specs(body, "/generate")
    _check_rid(body)
    _check_per_prompt_lists(body)
    _check_internal_fields(body)


def _check_token_ids(value, what: str) -> None:
    """Token ids outside the model's vocabulary reach the embedding and crash the scheduler in stock
    SGLang 0.5.23 (IndexError in vocab_parallel_embedding.py:481, found by the HTTP fuzz test): one
    request takes the server down. Answer 400 instead. Anything that is not a list of integers is
    left to SGLang's own checks (``/generate`` refuses non-integer ids itself; the OpenAI routes
    coerce first, ``_check_model_ids``)."""
    if not isinstance(value, list) or not value:
        return
    seqs = value if isinstance(value[0], list) else [value]
    vocab = None
    for seq in seqs:
        if not isinstance(seq, list):
            continue
        for t in seq:
            if isinstance(t, bool) or not isinstance(t, int):
                continue
            if vocab is None:
                vocab = _vocab_size() or 0
            if t < 0 or (vocab and t >= vocab):
                bound = f"[0, {vocab})" if vocab else ">= 0"
                raise BadRequest(f"{what} holds token id {t}; token ids must be in {bound}"[:300])


# Fields that ask for the top k logprobs of every position, per route (and the pydantic model and
# field SGLang reads them with, on the OpenAI routes).
TOP_K_FIELDS = {
    "/generate": ("top_logprobs_num", None, None),
    "/v1/completions": ("logprobs", "CompletionRequest", "logprobs"),
    "/v1/chat/completions": ("top_logprobs", "ChatCompletionRequest", "top_logprobs"),
    "/invocations": ("top_logprobs", "ChatCompletionRequest", "top_logprobs"),
    "/v1/responses": ("top_logprobs", "ResponsesRequest", "top_logprobs"),
}


def _check_top_k(body: dict, path: str) -> None:
    """A top-k of logprobs larger than the vocabulary kills stock SGLang 0.5.23's scheduler
    (``torch.topk``: ``selected index k out of range``, logprob_processor.py:106): one request,
    ``{"top_logprobs_num": 100000}`` on ``/generate`` or ``"top_logprobs": 100000`` on chat, took
    the server down (session 26). Answer 400 instead."""
    spec = TOP_K_FIELDS.get(path)
    if spec is None or spec[0] not in body:
        return
    field, model, model_field = spec
    value = body[field]
    if model is not None and type(value) is not int:
        value = _as_sglang_reads(value, model, model_field) if value is not None else None
    for k in value if isinstance(value, list) else [value]:
        if isinstance(k, bool) or not isinstance(k, (int, float)):
            continue
        vocab = _vocab_size()
        if vocab and k > vocab:
            raise BadRequest(f"{field} is {k}; it may be at most the vocabulary size ({vocab})"[:300])


LOGIT_BIAS_MAX = 1e30  # |bias| past which float32 overflows once divided by the temperature (>= 1e-6)
MAX_N = 1024  # choices per prompt (``n``, ``best_of``)


def _sampling_holders(body: dict, path: str) -> list:
    """The dicts that carry ``logit_bias`` and ``n``: ``/generate``'s sampling params (one or a
    batch's list), the OpenAI routes' body itself."""
    if path == "/generate":
        sps = body.get("sampling_params")
        return [sp for sp in (sps if isinstance(sps, list) else [sps]) if isinstance(sp, dict)]
    return [body] if path in ("/v1/completions", "/v1/chat/completions", "/invocations") else []


def _number(v):
    """``v`` as a float the way a lax model reads it (numbers and numeric strings), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        return None
    try:
        return float(v)
    except (ValueError, OverflowError):
        return None


@functools.lru_cache(maxsize=1024)  # (a client may send the same stop_regex with every request)
def _nested_repeat(pattern: str) -> bool:
    """Whether a regex can backtrack exponentially: a repeat with no upper bound (or a bound past
    100) around another repeat or an alternation (``(a+)+b``, ``(.+)+x``, ``(a|aa)*``). Heuristic:
    patterns that are only polynomially slow (``.*.*x``) are not caught. A pattern that does not
    compile is left to SGLang (it refuses it)."""
    try:
        from re import _constants as C, _parser
    except ImportError:  # Python < 3.11
        import sre_constants as C
        import sre_parse as _parser
    try:
        tree = _parser.parse(pattern)
    except Exception:  # noqa: BLE001 - SGLang's own 400
        return False
    repeats = (C.MAX_REPEAT, C.MIN_REPEAT) + ((C.POSSESSIVE_REPEAT,) if hasattr(C, "POSSESSIVE_REPEAT") else ())

    def walk(items, inside: bool) -> bool:
        for op, av in items:
            if op in repeats:
                lo, hi, sub = av
                if inside and hi > 1:
                    return True
                if walk(sub, inside or hi == C.MAXREPEAT or hi > 100):
                    return True
            elif op == C.BRANCH:
                if inside:
                    return True
                if any(walk(b, inside) for b in av[1]):
                    return True
            elif op == C.SUBPATTERN:
                if walk(av[-1], inside):
                    return True
            elif op in (C.ASSERT, C.ASSERT_NOT):
                if walk(av[1], inside):
                    return True
        return False

    try:
        return walk(tree, False)
    except RecursionError:  # nested past Python's recursion limit: refused
        return True


def _check_stop_regex(holder: dict) -> None:
    """A ``stop_regex`` that backtracks exponentially hangs SGLang 0.5.23's scheduler: it runs
    ``re.search`` over the whole output at every decode step (schedule_batch.py:1933), so
    ``"stop_regex": "(a+)+b"`` on an output of a few dozen ``a`` stopped the server serving
    anyone (a helper's hunt, session 27; stock too). Refused: a repeat around a repeat or an
    alternation (``_nested_repeat``)."""
    stops = holder.get("stop_regex")
    for pat in stops if isinstance(stops, list) else [stops]:
        if not isinstance(pat, str):
            continue
        if len(pat) > 10_000:
            raise BadRequest("stop_regex is longer than 10,000 characters")
        if _nested_repeat(pat):
            raise BadRequest(f"stop_regex {pat[:80]!r} nests a repeat in a repeat (it can backtrack "
                             "exponentially at every decoded token); write it without nesting"[:300])  # fmt: skip


def _check_sampling_values(body: dict, path: str) -> None:
    """Two sampling fields stock SGLang 0.5.23 takes unchecked (its sampling fuzz, session 27):
    a ``logit_bias`` value that overflows float32 once divided by the temperature kills the
    scheduler (``{"logit_bias": {"500": 1e39}, "top_k": 5}``: ``torch.multinomial``, probability
    tensor contains inf or nan, sampler.py:838; sampling_params.py checks only the keys), and an
    ``n`` of hundreds of thousands made one request grow a server by 9 GB in two minutes. Both are
    400s here: a bias must be finite and within +-1e30 (OpenAI's range is +-100; -100 bans a token),
    ``n`` and ``best_of`` at most ``MAX_N``."""
    for holder in _sampling_holders(body, path):
        _check_stop_regex(holder)
        bias = holder.get("logit_bias")
        if isinstance(bias, dict):
            for tok, v in bias.items():
                x = _number(v)
                if x is not None and not (abs(x) <= LOGIT_BIAS_MAX):
                    raise BadRequest(f"logit_bias[{tok!r}] is {v!r}; a bias must be finite and within "
                                     f"+-{LOGIT_BIAS_MAX:g} (-100 bans a token)"[:300])  # fmt: skip
        for field in ("n", "best_of"):
            x = _number(holder.get(field))
            if x is not None and x > MAX_N:
                raise BadRequest(f"{field} is {holder[field]!r}; at most {MAX_N} choices per prompt"[:300])
            # the OpenAI routes with n < 1: a 400 from SGLang when not streamed ("range() arg 3
            # must not be zero"), a 200 stream cut off when streamed with include_usage
            # (serving_chat.py counts usage over range(0, len, n) after the 200 went out)
            if field == "n" and x is not None and x < 1 and path != "/generate":
                raise BadRequest(f"n is {holder['n']!r}; it must be at least 1"[:300])


MAX_PATTERN_DEPTH = 1000  # groups nested in a JSON-schema pattern (xgrammar's own EBNF parser stops at ~1,000)
MAX_QUANTIFIER_RUN = 8  # quantifiers in a row (``a*?`` and ``a++`` are 2; more mean nothing)
SCHEMA_FIELDS = ("json_schema", "structural_tag", "response_format", "tools")


def _regex_shape(pattern: str) -> tuple[int, int]:
    """(deepest group nesting, longest run of quantifiers in a row) of a regex, in one pass:
    escapes and character classes skipped, ``{m,n}`` counted as one quantifier."""
    depth = deepest = run = longest = 0
    i, n, in_class = 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\":
            i, run = i + 2, 0
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class, run = True, 0
        elif c == "(":
            depth, run = depth + 1, 0
            deepest = max(deepest, depth)
        elif c == ")":
            depth, run = max(0, depth - 1), 0
        elif c in "*+?" or (c == "{" and (end := _bound_end(pattern, i)) > i):
            run += 1
            longest = max(longest, run)
            if c == "{":
                i = end
        else:
            run = 0
        i += 1
    return deepest, longest


def _bound_end(pattern: str, i: int) -> int:
    """The index of the ``}`` closing a ``{m}`` / ``{m,n}`` bound at ``i``; ``i`` if it is none."""
    j = pattern.find("}", i, i + 40)
    body = pattern[i + 1 : j] if j > i else ""
    return j if body and all(ch.isdigit() or ch == "," for ch in body) and body.count(",") <= 1 else i


def _check_schema_patterns(value, field: str) -> None:
    """Every regex a JSON schema carries (``pattern``, ``patternProperties``' keys, also in
    ``propertyNames``, ``$defs``, structural tags' schemas and formats, tools' parameters), walked
    without recursion. xgrammar compiles such a pattern with a recursive visitor: a pattern of
    400,000 nested groups (800 KB) overflowed the stack of SGLang's grammar thread and killed the
    scheduler with SIGSEGV, stock too (``compile_json_schema``, xgrammar_backend.py:394; a helper's
    hunt, session 28); a run of tens of thousands of ``*`` compiled for minutes (quadratic) and
    filled the grammar pool. Its ``regex`` and ``ebnf`` fields go through xgrammar's EBNF parser,
    which refuses nesting past ~1,000 itself; these patterns did not."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            for k, x in v.items():
                if k == "pattern" and isinstance(x, str):
                    pats = [x]
                elif k == "patternProperties" and isinstance(x, dict):
                    pats = [p for p in x if isinstance(p, str)]
                else:
                    pats = []
                for pat in pats:
                    deepest, run = _regex_shape(pat)
                    if deepest > MAX_PATTERN_DEPTH:
                        raise BadRequest(f"{field}: a pattern nests {deepest} groups; at most {MAX_PATTERN_DEPTH}")
                    if run > MAX_QUANTIFIER_RUN:
                        raise BadRequest(f"{field}: a pattern has {run} quantifiers in a row; at most "
                                         f"{MAX_QUANTIFIER_RUN}")  # fmt: skip
                if isinstance(x, (dict, list)):
                    stack.append(x)
        elif isinstance(v, list):
            stack.extend(x for x in v if isinstance(x, (dict, list)))


def _check_grammar_specs(body: dict, path: str) -> None:
    """``_check_schema_patterns`` over the grammar fields of every sampling holder: ``json_schema``
    and ``structural_tag`` (``/generate`` takes them as JSON text), the OpenAI routes'
    ``response_format`` and ``tools``. A spec that is not JSON is left to SGLang (its 400)."""
    for holder in _sampling_holders(body, path):
        for field in SCHEMA_FIELDS:
            v = holder.get(field)
            if isinstance(v, str):
                try:
                    v = json.loads(v)
                except (ValueError, RecursionError):
                    continue
            if isinstance(v, (dict, list)):
                _check_schema_patterns(v, field)


def _one_prompt(body: dict) -> bool:
    """``/generate``'s body names one prompt (not a batch), as io_struct.py tells them apart."""
    text, ids, emb = body.get("text"), body.get("input_ids"), body.get("input_embeds")
    if text is not None:
        return isinstance(text, str)
    if ids is not None:
        return not (isinstance(ids, list) and ids and isinstance(ids[0], list))
    return not (isinstance(emb, list) and emb and isinstance(emb[0], list) and emb[0] and isinstance(emb[0][0], list))


PER_PROMPT_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_sampling_mask",
                     "sampling_logprobs_mode", "token_ids_logprob", "return_hidden_states", "bootstrap_room",
                     "bootstrap_host", "bootstrap_port", "bootstrap_pair_key", "decode_tp_size",
                     "custom_logit_processor", "lora_path")  # fmt: skip
GRAMMAR_FIELDS = ("regex", "json_schema", "ebnf", "structural_tag")
# per-prompt fields whose list, on one prompt, reaches the scheduler as it is and kills it
SCALAR_FOR_ONE_PROMPT = ("top_logprobs_num", "logprob_start_len", "return_hidden_states")


def _batch_size(body: dict) -> int | None:
    """Prompts in ``/generate``'s batch (None: one prompt, or a shape SGLang refuses itself)."""
    if _one_prompt(body):
        return None
    for field in ("text", "input_ids", "input_embeds"):
        v = body.get(field)
        if v is not None:
            return len(v) if isinstance(v, list) else None
    return None


def _check_per_prompt_lists(body: dict) -> None:
    """``/generate``'s per-prompt fields given as lists that SGLang 0.5.23 does not check against
    the prompts (io_struct.py ``_normalize_single_inputs`` / ``_normalize_logprob_params``; session
    27, the sampling-field fuzz in ``make soak``): a list ``top_logprobs_num`` or
    ``logprob_start_len`` for one prompt (``[]`` or ``[1]``) kills the scheduler (``TypeError:
    '>' not supported between 'list' and 'int'``, logits_processor.py:373), and a batch's list
    shorter than its prompts is a 500, or a streamed 200 cut off after its headers. Answer 400;
    a list of the batch's length, scalars, and lists one prompt can take pass as before.
    ``return_hidden_states: []`` on one prompt kills it too (``get_return_hidden_states_mode``,
    schedule_batch.py:192, raised in the scheduler: an empty list slips past the tokenizer
    manager's check, and on a server with hidden states on, any list does), and so does a
    ``logprob_start_len`` below -1 (``AssertionError``, logprob_result_processor.py:296; -1 is
    "the default")."""
    start = body.get("logprob_start_len")
    for x in start if isinstance(start, list) else [start]:
        if type(x) is int and x < -1:
            raise BadRequest(f"logprob_start_len is {x}; it must be -1 (the default) or a position >= 0")
    n = _batch_size(body)
    for field in PER_PROMPT_FIELDS:
        v = body.get(field)
        if not isinstance(v, list):
            continue
        if field == "token_ids_logprob":  # (one prompt: a flat list of ids; a batch: one list per prompt)
            if n is None or not v or not isinstance(v[0], list):
                continue
        elif n is None:
            if field in SCALAR_FOR_ONE_PROMPT:
                raise BadRequest(f"{field} is a list but the request is one prompt; send one value")
            continue
        if len(v) < n:
            raise BadRequest(f"{field} has {len(v)} values for a batch of {n} prompts; send one per prompt, or one value")


def _check_internal_fields(body: dict) -> None:
    """``/generate`` fields a client cannot use safely (a helper's hunt over SGLang's own field
    lists, session 27; each kills stock SGLang 0.5.23's scheduler):

    * ``lora_id``: SGLang derives it from ``lora_path`` (tokenizer_manager.py:3791); a client's
      list kills the scheduler (``{"lora_id": [null]}``: a TypeError, schedule_batch.py:1166), and
      a client's string is appended to the request's ``extra_key`` as it is: a base-model
      request could name an adapter's cache namespace (``_fence_extra_key`` fences the client's
      own ``extra_key`` for that reason).
    * ``positional_embed_overrides``: any value (``{}``, ``[]``) kills it (it needs tensors:
      AttributeError ``reconstruct``, scheduler.py:2232); no JSON form is valid.
    * ``token_indices_to_pool`` with a grammar: kills it (xgrammar_backend.py:131, a mask of None)."""
    if body.get("lora_id") is not None:
        raise BadRequest("lora_id is set by the server from lora_path; send lora_path instead")
    if body.get("positional_embed_overrides") is not None:
        raise BadRequest("positional_embed_overrides cannot be sent over HTTP")
    if body.get("token_indices_to_pool") is not None:
        for sp in _sampling_holders(body, "/generate"):
            if any(sp.get(g) is not None for g in GRAMMAR_FIELDS):
                raise BadRequest("token_indices_to_pool cannot be combined with a grammar (regex, json_schema, ebnf, structural_tag)")


def _check_rid(body: dict) -> None:
    """A list ``rid`` on one prompt: SGLang 0.5.23 keeps it (io_struct.py:563 fills only a missing
    rid; the length check is the batch path's) and then puts it in a set (tokenizer_manager.py:3835,
    ``TypeError: unhashable type: 'list'``): a 500, and with ``"stream": true`` a 200 cut off after
    its headers (http_server.py:957 catches only ValueError). The "not reproduced" broken response
    of session 26's sampling fuzz (found by a helper's hunt, session 27; stock SGLang does the same).
    A single prompt with an integer ``n`` > 1 (no beam search) fans out into a batch: its list passes."""
    if not isinstance(body.get("rid"), list) or not _one_prompt(body):
        return
    sp = body.get("sampling_params")
    sp = sp if isinstance(sp, dict) else {}
    n, beam = sp.get("n", 1), sp.get("beam_width") or 1
    if type(n) is int and n > 1 and not (isinstance(beam, (int, float)) and beam > 1):
        return
    raise BadRequest("rid is a list but the request is one prompt; send one rid (a string), or a batch of prompts")


def _fence_extra_key(body: dict) -> bool:
    """Rewrite a client's non-empty ``extra_key`` (a string, or a batch's list of them) with
    ``client_extra_key``; other values are left for SGLang to refuse. Returns whether it changed."""
    key = body.get("extra_key")
    if isinstance(key, str) and key:
        body["extra_key"] = client_extra_key(key)
        return True
    if isinstance(key, list) and any(isinstance(k, str) and k for k in key):
        body["extra_key"] = [client_extra_key(k) if isinstance(k, str) and k else k for k in key]
        return True
    return False


def rewrite_body(raw: bytes, path: str, tenant: str | None, tenant_mode: bool | None = None):
    """Return the rewritten body (or ``raw`` itself when nothing changes). Raises ``BadRequest``
    for a body it must understand and cannot: in tenant mode (a tenant header is configured;
    default: ``tenant`` given) every body; otherwise a body whose hint cannot be folded in."""
    if tenant_mode is None:
        tenant_mode = tenant is not None
    try:
        # UTF-8 only, as SGLang's own parser (orjson) takes it: ``json.loads`` of bytes also takes
        # a UTF-8 BOM and UTF-16/32, and the rewritten body, re-encoded, was served where stock
        # SGLang answers 400 (a helper's hunt, session 35)
        body = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        if not tenant_mode and not isinstance(exc, RecursionError):
            return raw  # not JSON: not ours to judge, SGLang answers it with a 400 as usual
        # (too deep: stock SGLang answers a 500, so it is refused on every server)
        reason = "nested too deeply" if isinstance(exc, RecursionError) else f"not valid JSON ({exc})"
        raise BadRequest(f"request body is {reason}"[:300]) from None
    if not isinstance(body, dict):  # (stock SGLang answers a 500 on its JSON routes)
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    if path == "/generate":
        _check_as_generate(body)
    elif path == "/v1/completions":
        _check_model_ids(body.get("prompt"), "prompt", "CompletionRequest", "prompt", nonempty=True)
    elif path == VERTEX_PATH:
        _check_vertex_ids(body)
        as_generate = vertex_as_generate(body)
        if as_generate is not None:
            _check_as_generate(as_generate)
    elif path == "/v1/score":
        for field in ("query", "items", "label_token_ids"):
            _check_model_ids(body.get(field), field, "ScoringRequest", field)
    if path != "/generate":
        _check_top_k(body, path)
        _check_sampling_values(body, path)
        _check_grammar_specs(body, path)
    changed = path in SALT_PATHS and _fence_extra_key(body)
    params = body.get("parameters") if path == VERTEX_PATH else None
    if isinstance(params, dict):
        # Vertex builds GenerateReqInput(**instances, **parameters): its parameters are /generate's
        # fields, the client's extra_key among them
        changed = _fence_extra_key(params) or changed
    if "kv_transfer_params" in body:
        kv = body.pop("kv_transfer_params")
        changed = True
        if isinstance(kv, dict) and "lmcache.skip_save" in kv:
            skip = kv["lmcache.skip_save"] is True
            if path == "/generate":
                sps = body.get("sampling_params")
                if sps is None:
                    sps = body["sampling_params"] = {}
                for sp in sps if isinstance(sps, list) else [sps]:
                    if isinstance(sp, dict):
                        _merge_custom_params(sp, skip, "sampling_params.")
            else:
                _merge_custom_params(body, skip, "")
    if tenant_mode:
        # The trusted header is the only source of the tenant: a client's own salt never passes.
        if tenant:
            body["cache_salt"] = tenant
            _scope_session_fields(body, tenant)  # (its sessions only)
            if path == RESPONSES_PATH:
                _scope_response_fields(body, tenant)  # (its stored responses only)
        else:
            body.pop("cache_salt", None)
        changed = True
    if not changed:
        return raw
    try:
        return json.dumps(body).encode()
    except (ValueError, RecursionError):
        raise BadRequest("request body is nested too deeply") from None


def guard_auth() -> None:
    """SGLang's API-key check (``utils/auth.py``, ``decide_request_auth``) compares the
    ``Authorization`` header with ``secrets.compare_digest``, which raises on a non-ASCII string:
    with any key set, a header with a byte past 0x7f (Starlette decodes it as Latin-1) was a 500 on
    every route, /cache/* included (a helper's audit, session 40). Such a header is no key (keys
    are ASCII) and is checked as no header: a 401 where a key is needed. Idempotent."""
    from sglang.srt.utils import auth

    original = auth.decide_request_auth
    if getattr(original, "_tiered_ascii", False):
        return

    @functools.wraps(original)
    def decide_request_auth(*args, **kwargs):
        header = kwargs.get("authorization_header")
        if isinstance(header, str) and not header.isascii():
            kwargs["authorization_header"] = None
        return original(*args, **kwargs)

    decide_request_auth._tiered_ascii = True
    auth.decide_request_auth = decide_request_auth


def install() -> None:
    """Mount the routes and middleware on SGLang's app (idempotent)."""
    global _installed
    if _installed:
        return
    from sglang.srt.entrypoints.http_server import app

    from starlette.middleware import Middleware

    add_routes(app)
    guard_auth()
    # Innermost (appended, where add_middleware prepends): it sees the body the route parses.
    app.user_middleware.append(Middleware(HintMiddleware, tenant_header=load_config().tenant_header))
    _installed = True
    logger.info("sglang-tiered: mounted /cache/stats, /cache/invalidate and the request-hint middleware")
