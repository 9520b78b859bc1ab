"""Frequency sketch for TinyLFU: a count-min sketch of 4-bit saturating counters plus a doorkeeper.

* Depth 4, width a power of two; the four row indices (bits 0, 32, 64, 96) and the two
  doorkeeper bits (bits 16, 80) come from the 16-byte page hash itself (no rehashing). Counters
  saturate at 15 (4 bits); they are stored one per byte for speed in pure Python, which costs 2x
  the memory of nibble packing and nothing else.
* Doorkeeper: a Bloom filter that absorbs the first sighting of a key, so one-hit wonders never
  reach the counters. ``estimate = min(row counters) + (1 if in doorkeeper)``.
* Aging by events, never wall-clock time: after ``sample_size`` increments every counter is
  halved and the doorkeeper cleared. Every TP rank sees the same events in the same order and so
  holds the same sketch.

``FrequencySketch`` is the optional C extension's (``_bookkeeping.FrequencySketch``: issue #11,
session 42) when it was built and ``SGLANG_TIERED_PURE_PYTHON`` is not ``1``; otherwise
``FrequencySketchPy`` below, the reference the C is tested against: same counters, same
doorkeeper, same aging points (tests/test_bookkeeping_c.py). ``SKETCH_IMPL`` says which: ``"c"``
or ``"python"``. Both expose ``rows`` and ``door`` as the live bytearrays. ``select`` (the pages
a mask samples) is the C extension's too where it is used.
"""

from __future__ import annotations

from sglang_tiered.core.keys import PURE_PYTHON

MAX_COUNT = 15
DEPTH = 4  # rows; the code below is unrolled for four


class FrequencySketchPy:
    def __init__(self, capacity: int, sample_factor: int = 10, sample_shift: int = 0):
        """``sample_shift``: the caller counts ``2**sample_shift`` times fewer pages than its
        default sample; the sketch ages after as many references as it would at that sample."""
        width = 16
        while width < max(16, capacity):
            width <<= 1
        self.width = width
        self.mask = width - 1
        self.rows = [bytearray(width) for _ in range(DEPTH)]
        self.door_bits = width * 8  # a power of two: ``% door_bits`` is ``& (door_bits - 1)``
        self.door = bytearray(self.door_bits // 8)
        self.sample_size = max(64, (sample_factor * width) >> sample_shift)
        self.additions = 0
        self.resets = 0

    def estimate(self, key: bytes) -> int:
        v = int.from_bytes(key, "little")  # rows and doorkeeper bits come from the key itself
        m, n1 = self.mask, self.door_bits - 1
        r0, r1, r2, r3 = self.rows
        est = min(r0[v & m], r1[(v >> 32) & m], r2[(v >> 64) & m], r3[(v >> 96) & m])
        a, b = (v >> 16) & n1, (v >> 80) & n1
        door = self.door
        if door[a >> 3] & (1 << (a & 7)) and door[b >> 3] & (1 << (b & 7)):
            est += 1
        return est

    def increment(self, key: bytes) -> None:
        self.increment_all((key,))

    def increment_all(self, keys) -> None:
        """Count each key in turn (one call for a request's pages): the doorkeeper absorbs a key's
        first sighting, later ones raise its minimum counters (conservative update); every
        ``sample_size`` additions the sketch ages."""
        n1, m, size = self.door_bits - 1, self.mask, self.sample_size
        door = self.door
        r0, r1, r2, r3 = self.rows
        adds = self.additions
        frm = int.from_bytes
        for key in keys:
            adds += 1
            v = frm(key, "little")
            a, b = (v >> 16) & n1, (v >> 80) & n1
            ia, ib, ba, bb = a >> 3, b >> 3, 1 << (a & 7), 1 << (b & 7)
            if not (door[ia] & ba and door[ib] & bb):
                door[ia] |= ba
                door[ib] |= bb
            else:
                i0, i1, i2, i3 = v & m, (v >> 32) & m, (v >> 64) & m, (v >> 96) & m
                c0, c1, c2, c3 = r0[i0], r1[i1], r2[i2], r3[i3]
                low = min(c0, c1, c2, c3)
                if low < MAX_COUNT:  # conservative update: raise only the minimum counters
                    if c0 == low:
                        r0[i0] = low + 1
                    if c1 == low:
                        r1[i1] = low + 1
                    if c2 == low:
                        r2[i2] = low + 1
                    if c3 == low:
                        r3[i3] = low + 1
            if adds >= size:
                self.additions = adds
                self.age()
                adds = self.additions
                door = self.door
                r0, r1, r2, r3 = self.rows
        self.additions = adds

    def increment_masked(self, pages, mask: int) -> None:
        """Count the pages whose first hash byte ``& mask`` is 0 (the sampled ones), then the
        last page if it was not one of them (a request's last page is always counted):
        ``AdaptivePolicy.observe``'s counting in one call."""
        if mask:
            self.increment_all(_select_py(pages, mask))
            if pages and pages[-1][0] & mask:
                self.increment(pages[-1])
        else:
            self.increment_all(pages)

    def age(self) -> None:
        half = bytes(v >> 1 for v in range(256))
        self.rows = [row.translate(half) for row in self.rows]
        self.door = bytearray(len(self.door))
        self.additions //= 2
        self.resets += 1


def _select_py(pages, mask: int) -> list:
    """The pages whose first hash byte ``& mask`` is 0 (a new list), the reference of the C one."""
    return [h for h in pages if not h[0] & mask]


try:
    from sglang_tiered.core._bookkeeping import FrequencySketch as _FrequencySketchC
    from sglang_tiered.core._bookkeeping import select as _select_c
except ImportError:  # not built (no compiler: setup.py's extension is optional)
    _FrequencySketchC = _select_c = None

# SGLANG_TIERED_PURE_PYTHON=1: the reference even where the extension is built
SKETCH_IMPL = "c" if _FrequencySketchC is not None and not PURE_PYTHON else "python"
FrequencySketch = _FrequencySketchC if SKETCH_IMPL == "c" else FrequencySketchPy
select = _select_c if SKETCH_IMPL == "c" else _select_py
