"""The control-plane protocol between the HTTP process and the scheduler processes, in one place.

SGLang gives plugins no IPC type of their own, so the control plane rides on two existing
channels (hooks.py installs the handlers, http.py speaks it):

* **stats**: ``get_internal_state`` replies carry ``internal_state[STATE_KEY]`` = one rank's
  ``TieredRadixCache.stats_snapshot()`` (msgpack-safe), summed by ``stats.aggregate``;
* **invalidation**: ``set_internal_state`` carries numbers only, so an invalidation is a dict of
  ``INVALIDATE_KEYS`` -> non-negative int: names travel as 62-bit ``name_hash`` values. The nonce
  key comes first; the scheduler echoes it in ``last_invalidation`` so the HTTP side can sum what
  each rank dropped for *this* request.

Imports nothing from sglang and nothing from hooks.py or http.py (it is what breaks their circle).
"""

from __future__ import annotations

import enum
from typing import Optional

from sglang_tiered.core.tenants import name_hash

BACKEND_NAME = "tiered"  # --radix-cache-backend tiered (plugin.py registers it; hooks.py checks it)

STATE_KEY = "sglang_tiered"  # key of our per-rank stats in SGLang's internal_state reply
_PREFIX = "sglang_tiered_invalidate_"


class InvalidationKind(enum.Enum):
    NONCE = "nonce"  # request id, echoed back in last_invalidation
    GENERATION = "generation"  # T2's new generation for what follows (sent before it)
    TENANT = "tenant"  # name_hash(tenant)
    VERSION = "version"  # name_hash(model id, weights digest or weight version)
    ALL = "all"  # 1


INVALIDATE_KEYS = tuple(_PREFIX + k.value for k in InvalidationKind)  # nonce first, then the generation


def invalidation_args(nonce: int, *, tenant: Optional[str] = None, model_version: Optional[str] = None,
                      everything: bool = False, generation: Optional[int] = None) -> dict[str, int]:  # fmt: skip
    """The ``set_internal_state`` arguments of one invalidation (nonce first, then the generation)."""
    args = {_PREFIX + InvalidationKind.NONCE.value: nonce}
    if generation is not None:
        args[_PREFIX + InvalidationKind.GENERATION.value] = generation
    if tenant is not None:
        args[_PREFIX + InvalidationKind.TENANT.value] = name_hash(tenant)
    if model_version is not None:
        args[_PREFIX + InvalidationKind.VERSION.value] = name_hash(model_version)
    if everything:
        args[_PREFIX + InvalidationKind.ALL.value] = 1
    return args


def parse_invalidation_key(key: str) -> InvalidationKind:
    """The kind of an invalidation key; ValueError for a key outside ``INVALIDATE_KEYS``."""
    if not key.startswith(_PREFIX):
        raise ValueError(f"{key!r} is not an sglang-tiered invalidation key (expected one of {INVALIDATE_KEYS})")
    try:
        return InvalidationKind(key[len(_PREFIX):])
    except ValueError:
        raise ValueError(f"{key!r} is not an sglang-tiered invalidation key (expected one of {INVALIDATE_KEYS})") from None
