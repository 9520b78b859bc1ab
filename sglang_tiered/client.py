"""Client-side, per-execution cache-worthiness policy (seeds/004: KV-cache layering policy).

Retrieval from the prefix cache is always opportunistic; the one lever worth pulling per request is
the *store* side. ``KVCacheLayeringPolicy.decide`` scores one chat execution and says whether its
KV is worth storing; ``fold_kv_hint`` puts the answer into an OpenAI ``extra_body`` as LMCache's
``kv_transfer_params: {"lmcache.skip_save": bool}``, which sglang-tiered honours (and any server
that ignores the key simply ignores it, so the hint is always safe to attach).

Signals (cache-worthy => store):
  * long shared/system prefix:  >= KV_CACHE_MIN_PREFIX_TOKENS   (default 1024)
  * multi-turn conversation:    >= KV_CACHE_MIN_HISTORY_TURNS prior turns (default 1)
  * large fixed context:        >= KV_CACHE_MIN_CONTEXT_TOKENS  (default 2048)
  * reuse-heavy role:           a weak prior that only tips a borderline execution toward store
Token counts are estimated as chars / KV_CACHE_CHARS_PER_TOKEN (default 4.0): no tokenizer.
KV_CACHE_LAYERING=false makes the policy inert: no hint is attached. Knobs are read from the
environment on every call (live), unless given to the constructor.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

DEFAULTS = {
    "KV_CACHE_LAYERING": True,
    "KV_CACHE_MIN_PREFIX_TOKENS": 1024,
    "KV_CACHE_MIN_CONTEXT_TOKENS": 2048,
    "KV_CACHE_MIN_HISTORY_TURNS": 1,
    "KV_CACHE_CHARS_PER_TOKEN": 4.0,
}
REUSE_HEAVY_ROLES = frozenset({"agent", "planner", "orchestrator", "researcher", "coder", "rag",
                               "retriever", "analyst", "reviewer", "supervisor"})  # fmt: skip
BORDERLINE_FRACTION = 0.5  # an execution is borderline when a signal reaches half its threshold
SKIP_SAVE_KEY = "lmcache.skip_save"


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _env_bool(name: str) -> bool:
    """A yes/no knob; anything else is a ``ValueError`` (a typo such as ``flase`` meant "on"
    before session 23), as the numeric knobs are. Blank is unset, as for the numeric knobs (it
    switched the policy off before session 39)."""
    v = os.environ.get(name)
    if v is None or not v.strip():
        return DEFAULTS[name]
    w = v.strip().lower()
    if w not in _TRUE + _FALSE:
        raise ValueError(f"{name}={v!r}: expected one of {', '.join(_TRUE + _FALSE)}")
    return w in _TRUE


def _env_num(name: str, kind):
    v = os.environ.get(name)
    if v is None or not v.strip():
        return DEFAULTS[name]
    try:
        x = kind(v)
    except ValueError:
        raise ValueError(f"{name}={v!r} is not a valid {kind.__name__}") from None
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"{name}={v!r} must be a finite number >= 0")
    return x


@dataclass
class KVCacheDecision:
    cache_worthy: bool
    skip_save: bool
    score: float
    reasons: list[str] = field(default_factory=list)
    signals: dict[str, Any] = field(default_factory=dict)
    attach: bool = True  # False when the policy is switched off: attach no hint at all


def _str(x: Any) -> str:
    """Text of a value (None: no text)."""
    return "" if x is None else x if isinstance(x, str) else str(x)


def _as_message(message: Any) -> Any:
    """A message object (the OpenAI SDK's ``ChatCompletionMessage``, a pydantic model: what a chat
    loop appends to its history from ``resp.choices[0].message``) as a mapping; anything else as
    it is. Before session 37 such an object counted as its ``repr`` and as a user turn (a
    helper's audit: 2,115 context tokens for 128 characters, 64 turns)."""
    if isinstance(message, (str, Mapping)) or message is None:
        return message
    dump = getattr(message, "model_dump", None)
    if callable(dump):
        try:
            out = dump()
            if isinstance(out, Mapping):
                return out
        except Exception:  # noqa: BLE001 - not a pydantic model after all
            pass
    if hasattr(message, "content") or hasattr(message, "role"):
        return {"role": getattr(message, "role", None), "content": getattr(message, "content", None)}
    return message


def _text_of(message: Any) -> str:
    message = _as_message(message)
    if isinstance(message, str):
        return message
    if isinstance(message, Mapping):
        content = message.get("content", "")
        if content is None or isinstance(content, str):
            return _str(content)
        if isinstance(content, Mapping):  # one content part
            return _str(content.get("text"))
        if isinstance(content, Iterable):  # OpenAI content parts
            return "".join(_str(p.get("text")) if isinstance(p, Mapping) else _str(p) for p in content)
        return str(content)
    return _str(message)


def _prompt_text(prompt: Any) -> str:
    """Text of a system or user prompt: a string, or OpenAI content parts as a message's content
    is read (its text parts only). Before session 41 a list of parts counted as its ``repr``: 29
    characters of keys a text part, and a base64 image's whole data URL, so one 100 KB image in
    ``user_prompt`` made a 'large context' (25,000 tokens) that the same image in the history
    did not (review, session 41)."""
    return prompt if isinstance(prompt, str) else _text_of({"content": prompt})


def _prior_turns(history: Sequence[Any]) -> int:
    """Prior turns = user messages in the history (or messages, if they carry no roles)."""
    history = [_as_message(m) for m in history]
    roles = [m.get("role") for m in history if isinstance(m, Mapping)]
    if roles and any(r is not None for r in roles):
        return sum(1 for r in roles if r == "user")
    return len(history)


class KVCacheLayeringPolicy:
    def __init__(
        self,
        *,
        enabled: Optional[bool] = None,
        min_prefix_tokens: Optional[int] = None,
        min_context_tokens: Optional[int] = None,
        min_history_turns: Optional[int] = None,
        chars_per_token: Optional[float] = None,
    ):
        if enabled is not None and not isinstance(enabled, bool):
            raise ValueError(f"enabled must be True, False or None, got {enabled!r}")  # ("false" was on)
        # as the environment knobs are checked (a NaN threshold turned its signal off in silence,
        # a string one raised only in decide(): a helper's audit, session 37)
        for name, v, positive in (("min_prefix_tokens", min_prefix_tokens, False),
                                  ("min_context_tokens", min_context_tokens, False),
                                  ("min_history_turns", min_history_turns, False),
                                  ("chars_per_token", chars_per_token, True)):  # fmt: skip
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v == 0):
                raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'} or None, got {v!r}")
        self._enabled = enabled
        self._min_prefix = min_prefix_tokens
        self._min_context = min_context_tokens
        self._min_turns = min_history_turns
        self._cpt = chars_per_token

    # Live settings (env read on every call unless fixed in the constructor).
    @property
    def enabled(self) -> bool:
        return self._enabled if self._enabled is not None else _env_bool("KV_CACHE_LAYERING")

    @property
    def min_prefix_tokens(self) -> int:
        return self._min_prefix if self._min_prefix is not None else _env_num("KV_CACHE_MIN_PREFIX_TOKENS", int)

    @property
    def min_context_tokens(self) -> int:
        return self._min_context if self._min_context is not None else _env_num("KV_CACHE_MIN_CONTEXT_TOKENS", int)

    @property
    def min_history_turns(self) -> int:
        return self._min_turns if self._min_turns is not None else _env_num("KV_CACHE_MIN_HISTORY_TURNS", int)

    @property
    def chars_per_token(self) -> float:
        cpt = self._cpt if self._cpt is not None else _env_num("KV_CACHE_CHARS_PER_TOKEN", float)
        if not (math.isfinite(cpt) and cpt > 0):
            raise ValueError(f"KV_CACHE_CHARS_PER_TOKEN must be a finite number > 0, got {cpt!r}")
        return cpt

    def estimate_tokens(self, text: str) -> int:
        return int(len(text) / self.chars_per_token)

    def decide(
        self,
        system_prompt: Optional[str] = None,
        user_prompt: Optional[str] = None,
        message_history: Optional[Sequence[Any]] = None,
        rag_context: Optional[str | Sequence[str]] = None,
        role: Optional[str] = None,
    ) -> KVCacheDecision:
        if not self.enabled:
            return KVCacheDecision(True, False, 0.0, ["policy disabled (KV_CACHE_LAYERING=false)"],
                                   {}, attach=False)  # fmt: skip
        if isinstance(message_history, (str, bytes, bytearray, Mapping)) or not (
                message_history is None or isinstance(message_history, Iterable)):
            # one string counted each character as a turn, one message dict its keys (session 39)
            raise TypeError(f"message_history must be a list of messages, got {type(message_history).__name__}")
        if isinstance(rag_context, (bytes, bytearray, Mapping)) or not (
                rag_context is None or isinstance(rag_context, (str, Iterable))):
            # a number was "'int' object is not iterable", bytes counted their byte values' digits
            # and one mapping its keys (review, session 41), as message_history's shapes were
            raise TypeError(f"rag_context must be a string or a list of documents, got {type(rag_context).__name__}")
        if role is not None and not isinstance(role, str):
            raise TypeError(f"role must be a str or None, got {type(role).__name__}")
        history = list(message_history or [])
        rag = rag_context if isinstance(rag_context, str) else "".join(_str(d) for d in (rag_context or []))
        prefix_tokens = self.estimate_tokens(_prompt_text(system_prompt))
        history_tokens = sum(self.estimate_tokens(_text_of(m)) for m in history)
        context_tokens = prefix_tokens + history_tokens + self.estimate_tokens(_prompt_text(user_prompt)) + self.estimate_tokens(rag)
        turns = _prior_turns(history)
        t_prefix, t_ctx, t_turns = self.min_prefix_tokens, self.min_context_tokens, self.min_history_turns
        signals = {
            "prefix_tokens": prefix_tokens,
            "context_tokens": context_tokens,
            "history_turns": turns,
            "rag_tokens": self.estimate_tokens(rag),
            "role": role,
            "long_prefix": prefix_tokens >= t_prefix,
            "multi_turn": turns >= t_turns,
            "large_context": context_tokens >= t_ctx,
            "reuse_heavy_role": (role or "").lower() in REUSE_HEAVY_ROLES,
        }
        reasons, score = [], 0.0
        if signals["long_prefix"]:
            reasons.append(f"long shared prefix: ~{prefix_tokens} >= {t_prefix} tokens")
            score += 1.0
        if signals["multi_turn"]:
            reasons.append(f"multi-turn: {turns} >= {t_turns} prior turns")
            score += 1.0
        if signals["large_context"]:
            reasons.append(f"large context: ~{context_tokens} >= {t_ctx} tokens")
            score += 1.0
        strong = score > 0
        # any signal at half its threshold, prior turns too, as the docstring and README say (before
        # session 41 the turns were left out: 2 of KV_CACHE_MIN_HISTORY_TURNS=4 with a reuse-heavy
        # role was skipped as a clear one-off; at the default threshold, 1, nothing changes)
        borderline = (prefix_tokens >= BORDERLINE_FRACTION * t_prefix
                      or context_tokens >= BORDERLINE_FRACTION * t_ctx
                      or turns >= BORDERLINE_FRACTION * t_turns)  # fmt: skip
        signals["borderline"] = borderline and not strong
        worthy = strong
        if signals["reuse_heavy_role"]:
            score += 0.25
            if not strong and borderline:
                worthy = True
                reasons.append(f"borderline execution tipped by reuse-heavy role {role!r}")
            elif not strong:
                reasons.append(f"reuse-heavy role {role!r} ignored: clear one-off")
        if not worthy and not reasons:
            reasons.append("one-off short single-shot prompt: no reuse signal")
        return KVCacheDecision(worthy, not worthy, score, reasons, signals)


def fold_kv_hint(extra_body: Optional[Mapping[str, Any]], decision: KVCacheDecision) -> dict:
    """Return a copy of ``extra_body`` with ``kv_transfer_params["lmcache.skip_save"]`` set from
    the decision; every other key (and other kv_transfer_params entries) is kept as it was."""
    body = copy.deepcopy(dict(extra_body or {}))
    if not decision.attach:
        return body
    old = body.get("kv_transfer_params")
    kv = dict(old) if isinstance(old, Mapping) else {}  # (anything else is no parameters)
    kv[SKIP_SAVE_KEY] = bool(decision.skip_save)
    body["kv_transfer_params"] = kv
    return body
