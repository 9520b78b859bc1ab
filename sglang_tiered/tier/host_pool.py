"""T1 host pool: KV pages in the canonical, TP-independent layout ``[kv][layer][kv_head][page][token][dim]``.

* One copy per server: a named shared-memory file (``/dev/shm/sglang-tiered-<name>``) that every TP
  rank of the server maps; rank r reads and writes only the KV heads SGLang gives it (contiguous
  ranges, ``heads_for_rank``). The file outlives the server, so a restart, also at another TP
  degree, finds the pages again (warm restart). Without a name the pool is private memory.
* The index (page hash -> slot) lives in the same file: a 16-byte hash, a tenant and a valid byte
  per slot, and a 16-byte hash per (slot, KV head): the page whose KV that head's slice holds.
  Every rank runs the same tree and reaches the same decisions, so each keeps an identical dict,
  but the ranks are not in lock step between forward passes: one may already have reused a slot
  that another is about to drop or read. So a rank decides from its own records only (this
  process's slot -> hash and tenant, and the per-head hashes of its own heads, which no other
  rank writes), never from the shared per-slot entries another rank may have overwritten
  (review, session 18: a lagging rank's eviction read the leader's new hash and kept a stale
  entry; the ranks then disagreed on hits). A write zeroes the rank's per-head hashes first, then
  copies the data, then sets them: a promotion re-checks them before and after its copy.
* A restart attaches a slot only when every KV head's hash names the same page: a server killed
  between two ranks' copies (or a copy that failed on one rank) leaves a slot whose heads hold
  different pages, and that slot is dropped, never served as mixed KV.
* Ranks that replicate a KV head (TP > KV heads) would write the same bytes out of step: a named
  T1 refuses them (``HostTier.build``); without a name every TP rank keeps a private T1 of its own
  heads.
* Page identity is the chained page hash (sglang_tiered/core/keys.py), which includes the exact
  weights digest, KV dtype and RoPE config: a restart with other weights finds nothing.
* Each slot's index entry also carries the 62-bit hash of the tenant that stored it, so tenant
  invalidation reaches pages restored after a restart, and the per-slot table is bounded by the
  pool's size.
* **One server per named T1** (issue #10, finding 1): two live servers writing one file would
  overwrite each other's slots. The launcher takes an exclusive ``flock`` on
  ``sglang-tiered-<name>.lock`` (``acquire_owner``) and hands its token to its own scheduler
  processes through the environment; a second server fails fast at launch. The kernel drops the
  lock when the owner dies (also on ``kill -9``), so a restart can attach. Promotions re-check
  every slot's stored hash (and valid byte) before and after the copy: a slot that does not hold
  the page asked for is a clean miss, never foreign KV.
* The file's space is reserved at creation (``posix_fallocate``): a T1 larger than the tmpfs behind
  it (Docker's default ``/dev/shm`` is 64 MB) fails there and T1 turns off with one warning,
  instead of a SIGBUS when the pages are first written (finding 2). Private T1 memory is checked
  against ``MemAvailable`` before it is allocated.
* Accounting: ``free + resident == capacity`` always (``check_invariants``).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import pathlib
import secrets
from collections import OrderedDict
from dataclasses import asdict, dataclass

import numpy as np
import torch

from sglang_tiered.config import shm_dir

logger = logging.getLogger("sglang_tiered")
HASH_BYTES = 16
SHM_DIR = shm_dir()  # SGLANG_TIERED_SHM_DIR (config.py)
LAYOUT_VERSION = 3  # 3: per-head page hashes (session 18)
OWNER_ENV = "SGLANG_TIERED_T1_OWNER"  # "name:token" of the named T1 this server's launcher owns
_owned: dict[str, tuple[int, str]] = {}  # name -> (lock fd, token) held by this process


@dataclass(frozen=True)
class PoolLayout:
    num_pages: int
    layers: int
    kv_heads: int
    page_size: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "bfloat16"; fp8 pools are stored as "uint8"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page for all layers and all KV heads (K and V)."""
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.page_size * self.head_dim * elem

    @property
    def data_bytes(self) -> int:
        return self.page_bytes * self.num_pages


def heads_for_rank(total_kv_heads: int, tp_size: int, tp_rank: int) -> range:
    """KV heads SGLang gives attention-TP rank ``tp_rank`` (sglang/srt/layers/linear.py:1140-1145,
    1499-1503 in 0.5.23): contiguous ranges; when tp_size > heads, each head is replicated on
    tp_size / heads consecutive ranks."""
    if tp_size <= total_kv_heads:
        if total_kv_heads % tp_size:
            raise ValueError(f"{total_kv_heads} KV heads do not split over TP {tp_size}")
        per = total_kv_heads // tp_size
        return range(tp_rank * per, (tp_rank + 1) * per)
    if tp_size % total_kv_heads:
        raise ValueError(f"TP {tp_size} is not a multiple of {total_kv_heads} KV heads")
    replicas = tp_size // total_kv_heads
    h = tp_rank // replicas
    return range(h, h + 1)


class HostPoolError(RuntimeError):
    pass


def _lock_path(name: str) -> pathlib.Path:
    return SHM_DIR / f"sglang-tiered-{name}.lock"


def _init_lock_path(name: str) -> pathlib.Path:
    return SHM_DIR / f"sglang-tiered-{name}.init"


def _meta_path(name: str) -> pathlib.Path:
    """The named T1's layout (not ``path.with_suffix``: a name may hold dots, and "v1.2" and
    "v1.3" then shared "sglang-tiered-v1.json", each recreating the other's file)."""
    return SHM_DIR / f"sglang-tiered-{name}.json"


MEMORY_FILESYSTEMS = ("tmpfs", "ramfs", "hugetlbfs")


def filesystem_type(path: pathlib.Path, mounts: str = "/proc/mounts") -> str | None:
    """The type of the filesystem that holds ``path`` (its longest mount point in ``mounts``);
    None where that cannot be read."""
    try:
        real = os.path.realpath(path)
        best, kind = "", None
        with open(mounts, encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                point = parts[1].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, parts[2]
        return kind
    except OSError:
        return None


_warned_fs: set = set()


def warn_unless_memory(directory: pathlib.Path) -> None:
    """A named T1 is a file in ``directory``: on a disk filesystem it still works, but its pages
    are written back to the disk and survive a reboot. Said once per directory (a helper's hunt,
    session 32: SGLANG_TIERED_SHM_DIR was taken without a look)."""
    kind = filesystem_type(directory)
    if kind is None or kind in MEMORY_FILESYSTEMS or directory in _warned_fs:
        return
    _warned_fs.add(directory)
    logger.warning("sglang-tiered: named T1 segments are kept in %s, on a %s filesystem, not in memory "
                   "(tmpfs): T1's pages are written back to disk; set SGLANG_TIERED_SHM_DIR to a tmpfs "
                   "such as /dev/shm", directory, kind)  # fmt: skip


def acquire_owner(name: str, export: bool = False) -> str:
    """Take exclusive ownership of the named T1 for this process (and, with ``export``, for the
    processes it starts, through ``OWNER_ENV``). Idempotent per process. Raises
    ``HostPoolError`` naming the owner when another live process holds it."""
    if name in _owned:
        token = _owned[name][1]
        if export:
            os.environ[OWNER_ENV] = f"{name}:{token}"
        return token
    path = _lock_path(name)
    try:
        SHM_DIR.mkdir(parents=True, exist_ok=True)
        warn_unless_memory(SHM_DIR)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise HostPoolError(f"cannot open T1 lock {path}: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 256, 0).decode(errors="replace").strip()
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise HostPoolError(
                f"T1 {name!r} is in use by another live server ({holder or 'unknown owner'}); "
                "give each server its own SGLANG_TIERED_HOST_NAME, or stop the other one first"
            ) from None
        raise HostPoolError(f"cannot lock T1 {path}: {exc}") from exc
    token = f"pid={os.getpid()} token={secrets.token_hex(8)}"
    os.ftruncate(fd, 0)
    os.pwrite(fd, token.encode(), 0)
    _owned[name] = (fd, token)
    if export:
        os.environ[OWNER_ENV] = f"{name}:{token}"
    return token


def release_owner(name: str) -> None:
    """Give up ownership taken by this process (tests; the kernel does it at exit)."""
    entry = _owned.pop(name, None)
    if entry is not None:
        os.close(entry[0])
        if os.environ.get(OWNER_ENV, "").startswith(f"{name}:"):
            del os.environ[OWNER_ENV]


def inherited_owner(name: str) -> bool:
    """Whether this process was started by the launcher that owns the named T1 (``OWNER_ENV``)."""
    return os.environ.get(OWNER_ENV, "").startswith(f"{name}:")


def check_owner(name: str) -> None:
    """A process about to map the named T1 must own it, or belong to the server that does
    (its launcher's token in ``OWNER_ENV`` equals the token in the lock file). Otherwise it
    tries to take the lock itself (library use, one process)."""
    if name in _owned:
        return
    want = os.environ.get(OWNER_ENV, "")
    if want.startswith(f"{name}:"):
        try:
            holder = _lock_path(name).read_text().strip()
        except OSError:
            holder = ""
        if holder == want[len(name) + 1 :]:
            return
        raise HostPoolError(f"T1 {name!r} is now owned by another server ({holder or 'nobody'}); not attaching")
    acquire_owner(name)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _align(n: int, a: int = 64) -> int:
    return (n + a - 1) // a * a


class HostPool:
    def __init__(self, layout: PoolLayout, *, name: str | None = None, pin_memory: bool = False,
                 staging: int = 0):  # fmt: skip
        """A named pool maps ``SHM_DIR/sglang-tiered-<name>`` (this process must own the name or
        belong to the server that does: ``check_owner``); without a name, private memory.
        ``staging``: slots of ``layout.num_pages`` kept outside T1's counted capacity for
        write-ahead copies (``reserve_staging``); T1 holds at most ``num_pages - staging`` pages."""
        if not 0 <= staging < layout.num_pages:
            raise ValueError(f"staging must be in [0, {layout.num_pages}), got {staging}")
        self.layout = layout
        self.name = name
        self.staging = staging
        L, H, P, ps, D = layout.layers, layout.kv_heads, layout.num_pages, layout.page_size, layout.head_dim
        off_hash = _align(layout.data_bytes)
        off_tenant = off_hash + P * HASH_BYTES
        off_valid = off_tenant + P * 8
        off_heads = _align(off_valid + P)
        total = off_heads + P * H * HASH_BYTES
        self.attached = False
        if name:
            check_owner(name)
            path = SHM_DIR / f"sglang-tiered-{name}"
            meta_path = _meta_path(name)
            meta = {"version": LAYOUT_VERSION, **asdict(layout)}
            # The TP ranks of one server open the file at the same time: one at a time, or two
            # ranks that both find another layout each unlink the file the other just created and
            # map different files (each rank's heads then persist in a file no restart sees).
            try:
                init_fd = os.open(_init_lock_path(name), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                raise HostPoolError(f"cannot open T1 init lock for {path}: {exc}") from exc
            try:
                fcntl.flock(init_fd, fcntl.LOCK_EX)
                storage = self._open_named(path, meta_path, meta, total)
            finally:
                os.close(init_fd)  # (releases the lock)
            self.path = path
            raw = torch.empty(0, dtype=torch.uint8).set_(storage)
        else:
            self.path = None
            avail = _mem_available()
            if avail is not None and total > 0.9 * avail:
                raise HostPoolError(f"T1 needs {total / 1e9:.2f} GB but only {avail / 1e9:.2f} GB of host memory is available")
            try:
                raw = torch.zeros(total, dtype=torch.uint8, pin_memory=pin_memory)
            except RuntimeError as exc:
                raise HostPoolError(f"cannot allocate {total} bytes of host memory for T1: {exc}") from exc
        self.raw = raw
        data = raw[: layout.data_bytes].view(layout.torch_dtype)
        self.data = data.view(2, L, H, P, ps, D)
        self.index_hashes = raw[off_hash:off_tenant].view(P, HASH_BYTES)
        self.index_tenant = raw[off_tenant:off_valid].view(torch.int64)  # tenant hash per slot
        self.index_valid = raw[off_valid : off_valid + P]
        self.index_heads = raw[off_heads:total].view(P, H, HASH_BYTES)  # page hash per (slot, KV head)
        # numpy views of the same bytes for the per-page index reads and writes (a one-element
        # torch read or write costs microseconds; these run for every page T1 takes or drops)
        self._hashes_np = self.index_hashes.numpy()
        self._tenant_np = self.index_tenant.numpy()
        self._valid_np = self.index_valid.numpy()
        self._heads_np = self.index_heads.numpy()
        # the KV heads this process writes and reads (HostTier sets its rank's; all by default)
        self.own_heads = slice(0, H)
        # this process's own records of its slots (resident and staged): what it decides from
        self._hash_of: dict[int, bytes] = {}
        self._tenant_of: dict[int, int] = {}
        self.slot_of: dict[bytes, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # resident slots, least recent first
        self.free: list[int] = []
        # Write-through copies of pages still on the device, not used since (``commit(cold=True)``):
        # they sit at the LRU end and are not victims (T2 is not told when they go).
        self.cold: set[int] = set()
        # Write-ahead copies (page hash -> slot), oldest first: written, not resident (invisible to
        # probes, valid byte 0) until the device evicts the page and ``reserve`` adopts the slot.
        self.staged: OrderedDict[bytes, int] = OrderedDict()
        self.staged_used = 0  # staged pages adopted by an eviction (no copy at eviction)
        self.staged_dropped = 0  # staged pages dropped unused (staging full, or invalidated)
        self._renew: list[bytes] = []  # pages ``reserve`` made resident or used, re-touched by ``commit``
        self._load_index()

    def _open_named(self, path, meta_path, meta: dict, total: int):
        """Attach ``path`` when its layout is ``meta``, else recreate it (under the init lock)."""
        if path.exists() and meta_path.exists():
            try:
                old = json.loads(meta_path.read_text())
            except ValueError:
                old = None
            if old == meta and path.stat().st_size == total:
                self.attached = True
            else:
                logger.warning("sglang-tiered: T1 file %s has another layout; recreating it", path)
                path.unlink(missing_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, 0, total)  # reserve now: no SIGBUS when pages are written
            finally:
                os.close(fd)
        except OSError as exc:
            if not self.attached:
                path.unlink(missing_ok=True)
            raise HostPoolError(
                f"cannot reserve {total / 1e9:.3f} GB for T1 in {path} ({exc.strerror or exc}); "
                f"the filesystem behind {SHM_DIR} is too small (a container's /dev/shm is often "
                "64 MB: enlarge it, e.g. docker --shm-size, or lower SGLANG_TIERED_HOST_GB/RATIO)"
            ) from None
        try:
            storage = torch.UntypedStorage.from_file(str(path), True, total)
        except (OSError, RuntimeError) as exc:
            raise HostPoolError(f"cannot map T1 shared memory {path} ({total} bytes): {exc}") from exc
        if not self.attached:  # a clean index before another rank can read the new layout's meta
            raw = torch.empty(0, dtype=torch.uint8).set_(storage)
            raw[_align(self.layout.data_bytes) :].zero_()
            meta_path.write_text(json.dumps(meta))
        return storage

    # ------------------------------------------------------------------ index
    def _load_index(self) -> None:
        P = self.layout.num_pages
        valid = self.index_valid.tolist() if self.attached else [0] * P
        if not self.attached:
            self.index_valid.zero_()
        if self.attached:
            # a slot counts only when every KV head holds the page its index names
            whole = (self._heads_np == self._hashes_np[:, None, :]).all(axis=(1, 2)).tolist()
        else:
            self._heads_np[:] = 0
            whole = []
        for slot in range(P):
            if valid[slot] and whole[slot]:
                h = self._hashes_np[slot].tobytes()
                if h in self.slot_of:  # duplicate entry: keep the first
                    self._valid_np[slot] = 0
                    self.free.append(slot)
                    continue
                self.slot_of[h] = slot
                self._hash_of[slot] = h
                self._tenant_of[slot] = int(self._tenant_np[slot])
                self.lru[slot] = None
            else:
                if valid[slot]:
                    self._valid_np[slot] = 0  # heads of different pages: never served
                self.free.append(slot)
        self.free.reverse()  # pop() hands out low slots first
        while len(self.slot_of) > self.capacity:  # attached with a larger staging area than before
            self._forget(self.lru.popitem(last=False)[0])

    @property
    def capacity(self) -> int:
        """Pages T1 may hold (the staging slots are not counted)."""
        return self.layout.num_pages - self.staging

    @property
    def free_pages(self) -> int:
        """Room T1 has before its least recently used page must go."""
        return self.capacity - len(self.slot_of)

    @property
    def resident(self) -> int:
        return len(self.slot_of)

    def contains(self, h: bytes) -> bool:
        return h in self.slot_of

    def leading_hits(self, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.slot_of:
                break
            n += 1
        return n

    def slots_for(self, hashes: list[bytes], touch: bool = True) -> list[int]:
        slots = [self.slot_of[h] for h in hashes]
        if touch:
            for s in slots:
                self.lru.move_to_end(s)
                self.cold.discard(s)
        return slots

    def reserve(self, hashes: list[bytes], *, evict: bool = True, touch: bool = True) -> list[tuple[bytes, int]]:
        """Slots for pages not yet resident (least recently used pages make room when ``evict``).
        Returns (hash, slot) pairs to write, in order; fewer than asked when T1 is full.

        ``touch`` (a victim): pages of the batch T1 already holds count as used now, and are never
        the ones that make room; a write-through copy (cold) or a write-ahead copy (staged) of a
        page of the batch is adopted as is (no slot, no copy), made resident at once. ``commit``
        then orders the batch exactly as a store without those copies would: the pages it held
        first, then the others in the batch's order. Not ``touch`` (a write-through copy): free
        room only is used, staged pages are skipped, and nothing is touched."""
        out = []
        self._renew = []
        if touch:
            cold = self.cold
            for h in hashes:  # pages of this batch T1 holds: never the victims
                slot = self.slot_of.get(h)
                if slot is not None and slot not in cold:
                    self.lru.move_to_end(slot)
            for h in hashes:  # copies written through: the batch's now, kept like fresh victims
                slot = self.slot_of.get(h)
                if slot is not None and slot in cold:
                    cold.discard(slot)
                    self.lru.move_to_end(slot)
                    self._renew.append(h)
        for h in hashes:
            if h in self.slot_of:
                continue
            if not touch and h in self.staged:
                continue
            if self.capacity - len(self.slot_of) - len(out) <= 0:
                if not evict or not self.lru:
                    break
                self._evict_lru()
            slot = self.staged.pop(h, None) if touch else None
            if slot is not None:  # written ahead: publish the slot as is
                self.staged_used += 1
                self._valid_np[slot] = 1
                self.slot_of[h] = slot
                self.lru[slot] = None
            else:
                slot = self.free.pop()
                out.append((h, slot))
            if touch:
                self._renew.append(h)
        return out

    def _evict_lru(self) -> None:
        victim, _ = self.lru.popitem(last=False)
        if victim in self.cold:  # a copy of a page the device still holds: not a victim
            self.cold.discard(victim)
        elif self.victim_listener is not None:
            # T2: the page is still intact here; the listener copies it out
            self.victim_listener(self._hash_of[victim], victim, self._tenant_of[victim])
        self._forget(victim)

    def reserve_staging(self, hashes: list[bytes]) -> list[tuple[bytes, int]]:
        """Staging slots for write-ahead copies of pages T1 neither holds nor has staged; the
        oldest staged pages make room when the staging area is full. Returns (hash, slot) pairs."""
        out = []
        self._renew = []
        for h in hashes:
            if h in self.slot_of or h in self.staged:
                continue
            while len(self.staged) + len(out) >= self.staging:
                if not self.staged:
                    return out
                self._drop_staged(next(iter(self.staged)))
            out.append((h, self.free.pop()))
        return out

    def _drop_staged(self, h: bytes) -> None:
        slot = self.staged.pop(h)
        self.staged_dropped += 1
        self._hash_of.pop(slot, None)
        self._tenant_of.pop(slot, None)
        self.free.append(slot)

    def begin_write(self, slots: list[int]) -> None:
        """Before this process copies its heads into ``slots``: its per-head hashes there go to
        zero, so neither a promotion racing the copy nor a restart after a crash mid-copy takes
        the half-written heads for the page named before."""
        if slots:
            self._heads_np[slots, self.own_heads] = 0

    def has_copy(self, h: bytes) -> bool:
        """T1 holds the page, or has it staged (a write-ahead copy an eviction would adopt)."""
        return h in self.slot_of or h in self.staged

    def commit(self, pairs: list[tuple[bytes, int]], tenant: int = 0, *, cold: bool = False,
               staged: bool = False) -> None:  # fmt: skip
        """Publish slots whose data has been written (hash and tenant first, valid byte last).
        ``cold``: at the least recently used end (the first to make room), not the most recent.
        ``staged``: into the staging area (not resident; ``reserve`` adopts them)."""
        own = self.own_heads
        for h, slot in pairs:
            b = np.frombuffer(h, dtype=np.uint8)
            self._heads_np[slot, own] = b
            self._hashes_np[slot] = b
            self._tenant_np[slot] = tenant
            self._hash_of[slot] = h
            self._tenant_of[slot] = tenant
            if staged:
                self.staged[h] = slot
                continue
            self._valid_np[slot] = 1
            self.slot_of[h] = slot
            self.lru[slot] = None
            if cold:
                self.lru.move_to_end(slot, last=False)
                self.cold.add(slot)
        for h in self._renew:  # the batch's pages T1 did not hold before, in the batch's order
            slot = self.slot_of.get(h)
            if slot is not None:
                self.lru.move_to_end(slot)
        self._renew = []

    def verify(self, hashes: list[bytes], slots: list[int]) -> bool:
        """True when every slot holds exactly the page asked for in every KV head this process
        reads: checked against the per-head hashes in the file itself (which only this process's
        heads' writer sets), not this process's dict. Another process writing these heads (a
        second server on the file, a corrupted index) makes it False: a clean miss."""
        if not slots:
            return True
        want = np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(-1, 1, HASH_BYTES)
        return bool((self._heads_np[slots, self.own_heads] == want).all())

    def tenant_pages(self) -> dict:
        """Resident pages per tenant hash (what ``clear`` drops, by tenant)."""
        out: dict = {}
        tenant_of = self._tenant_of
        for s in self.lru:
            t = tenant_of.get(s)
            out[t] = out.get(t, 0) + 1
        return out

    def slots_of_tenant(self, tenant: int) -> list[int]:
        """Slots of a tenant's pages: resident, then staged."""
        tenant_of = self._tenant_of
        return [s for s in list(self.lru) + list(self.staged.values()) if tenant_of.get(s) == tenant]

    def abort(self, pairs: list[tuple[bytes, int]]) -> None:
        for _, slot in pairs:
            self.free.append(slot)
        for h in self._renew:  # pages adopted by the reserve stay resident, at the recent end
            slot = self.slot_of.get(h)
            if slot is not None:
                self.lru.move_to_end(slot)
        self._renew = []

    forget_listener = None  # fleet hint index: told each page hash T1 drops
    victim_listener = None  # T2: told (hash, slot, tenant) of each page ``reserve`` is about to reuse

    def _forget(self, slot: int) -> None:
        h = self._hash_of.pop(slot, None)
        self._tenant_of.pop(slot, None)
        if self.forget_listener is not None and h is not None:
            self.forget_listener(h)
        self._valid_np[slot] = 0
        self.cold.discard(slot)
        if h is not None and self.slot_of.get(h) == slot:
            del self.slot_of[h]
        self.free.append(slot)

    def drop_slots(self, slots) -> int:
        """Drop resident or staged slots. Returns the resident pages dropped."""
        n = 0
        for slot in slots:
            if slot in self.lru:
                del self.lru[slot]
                self._forget(slot)
                n += 1
            else:
                h = self._hash_of.get(slot)
                if h is not None and self.staged.get(h) == slot:
                    self._drop_staged(h)
        return n

    def drop(self, hashes) -> int:
        """Drop pages (resident or staged). Returns the resident pages dropped."""
        n = 0
        for h in list(hashes):
            slot = self.slot_of.get(h)
            if slot is not None:
                self.lru.pop(slot, None)
                self._forget(slot)
                n += 1
            elif h in self.staged:
                self._drop_staged(h)
        return n

    def clear(self) -> int:
        n = self.resident
        for slot in list(self.lru):
            self._forget(slot)
        self.lru.clear()
        for h in list(self.staged):
            self._drop_staged(h)
        return n

    def check_invariants(self) -> None:
        P = self.layout.num_pages
        assert len(self.free) + self.resident + len(self.staged) == P, (len(self.free), self.resident, len(self.staged))
        assert self.resident <= self.capacity and len(self.staged) <= self.staging
        assert len(self.lru) == self.resident and self.cold <= set(self.lru)
        assert len(set(self.free)) == len(self.free)
        held = set(self.slot_of.values())
        assert set(self.lru) == held, "the LRU list names other slots than the index"  # (review, session 19)
        assert not set(self.free) & held
        assert not set(self.staged.values()) & (held | set(self.free))
        assert not set(self.staged) & set(self.slot_of)
        assert {s: h for h, s in self.slot_of.items()} | {s: h for h, s in self.staged.items()} == self._hash_of
        assert set(self._tenant_of) == set(self._hash_of)
        # the file's index says what this process's records say: a resident slot's heads (those
        # this process writes) hold its page; where this process is the index's only writer (all
        # heads are its own: ranks of a shared T1 lag each other) a resident slot is also valid and
        # named in the index, and a free or staged one is not valid (a restart would attach it);
        # review, session 40
        resident = sorted(self.lru)
        own = [self._hash_of[s] for s in resident]
        assert self.verify(own, resident), "a resident slot's heads hold another page"
        if self.own_heads.indices(self.layout.kv_heads)[:2] == (0, self.layout.kv_heads):
            assert self._valid_np[resident].all(), "a resident slot is not valid in the index"
            other = sorted(set(self.free) | set(self.staged.values()))
            assert not self._valid_np[other].any(), "a free or staged slot is valid in the index"
            want = np.frombuffer(b"".join(own), dtype=np.uint8).reshape(-1, HASH_BYTES)
            assert (self._hashes_np[resident] == want).all(), "the index names another page than this process's records"

    def close(self, unlink: bool = False) -> None:
        if unlink and self.path is not None:
            self.path.unlink(missing_ok=True)
            _meta_path(self.name).unlink(missing_ok=True)
            _init_lock_path(self.name).unlink(missing_ok=True)
