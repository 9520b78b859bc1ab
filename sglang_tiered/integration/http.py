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

import itertools
import json
import logging
import os
import time

import msgspec
from fastapi import Request
from typing import Optional

from sglang_tiered.core.tenants import name_hash
from sglang_tiered.integration.hooks import STATE_KEY
from sglang_tiered.stats import aggregate

logger = logging.getLogger("sglang_tiered")
_installed = False
_nonce = itertools.count(int(time.time() * 1000) % (1 << 40))

HINT_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
TENANT_HEADER_ENV = "SGLANG_TIERED_TENANT_HEADER"


class InvalidateRequest(msgspec.Struct, forbid_unknown_fields=True):
    tenant: Optional[str] = None
    model_version: Optional[str] = None
    all: Optional[bool] = None


def _error(status: int, message: str):
    from fastapi.responses import ORJSONResponse

    return ORJSONResponse({"error": {"code": status, "message": message}}, status_code=status)


async def _rank_stats():
    from sglang.srt.entrypoints.http_server import get_global_state

    states = await get_global_state().tokenizer_manager.get_internal_state()
    return [s[STATE_KEY] for s in states if isinstance(s, dict) and STATE_KEY in s]


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
    return req


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
        ranks = await _rank_stats()
        if not ranks:
            return _error(503, "the tiered cache backend is not active (--radix-cache-backend tiered?)")
        return Response(msgspec.json.encode(aggregate(ranks, tenant)), media_type="application/json")

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def cache_invalidate(request: Request):
        try:
            req = parse_invalidate(await request.body())
        except ValueError as exc:
            return _error(400, str(exc))
        nonce = next(_nonce)
        args: dict[str, int] = {"sglang_tiered_invalidate_nonce": nonce}
        if req.tenant is not None:
            args["sglang_tiered_invalidate_tenant"] = name_hash(req.tenant)
        if req.model_version is not None:
            args["sglang_tiered_invalidate_version"] = name_hash(req.model_version)
        if req.all:
            args["sglang_tiered_invalidate_all"] = 1
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


class HintMiddleware:
    """Pure ASGI middleware: fold LMCache's no-store hint and a trusted tenant header into the
    request body fields SGLang carries to the scheduler. Anything it cannot parse passes through
    untouched (SGLang then answers it as usual)."""

    def __init__(self, app, tenant_header: str | None = None):
        self.app = app
        self.tenant_header = (tenant_header or "").lower().encode() or None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in HINT_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if headers.get(b"content-encoding"):
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        raw = b"".join(chunks)
        tenant = headers.get(self.tenant_header).decode() if self.tenant_header and self.tenant_header in headers else None
        new = rewrite_body(raw, scope["path"], tenant)
        if new is not raw:
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"content-length"] + [
                (b"content-length", str(len(new)).encode())
            ]
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": new, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


def rewrite_body(raw: bytes, path: str, tenant: str | None):
    """Return the rewritten body, or ``raw`` itself when nothing changes or it is not JSON."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw
    if not isinstance(body, dict):
        return raw
    changed = False
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
                        cp = sp.get("custom_params") or {}
                        cp["lmcache.skip_save"] = skip
                        sp["custom_params"] = cp
            else:
                cp = body.get("custom_params") or {}
                cp["lmcache.skip_save"] = skip
                body["custom_params"] = cp
    if tenant:
        body["cache_salt"] = tenant
        changed = True
    return json.dumps(body).encode() if changed else raw


def install() -> None:
    """Mount the routes and middleware on SGLang's app (idempotent)."""
    global _installed
    if _installed:
        return
    from sglang.srt.entrypoints.http_server import app

    add_routes(app)
    app.add_middleware(HintMiddleware, tenant_header=os.environ.get(TENANT_HEADER_ENV))
    _installed = True
    logger.info("sglang-tiered: mounted /cache/stats, /cache/invalidate and the request-hint middleware")
