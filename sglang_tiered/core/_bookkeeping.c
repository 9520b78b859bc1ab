/* Optional accelerator for the policy's per-request bookkeeping (issue #11, session 42): the
   admission duel's miniatures (core/miniature.py ``MiniCache``) and the TinyLFU frequency sketch
   (core/sketch.py ``FrequencySketch``); session 43: the safety duel's tree shadows
   (core/shadows.py ``TreeShadow``, SGLang's RadixCache replayed per fixed order); session 45: the
   safety duel's divergence (core/shadows.py ``Divergence``, lru's tree's pages against the real
   cache's).

   The pure-Python classes in those modules are the reference: this C does exactly what they do,
   decision for decision (same hits, same segment order and ticks, the same float ``age``, the
   same counters and aging points; the same splits, touches, evictions and track calls), and
   tests/test_bookkeeping_c.py, tests/test_tree_shadow_c.py and tests/test_divergence_c.py prove it
   on random streams.
   They are used where this extension is not built or SGLANG_TIERED_PURE_PYTHON=1.

   Floating point: ``age += 0.01 * (tick - t - age)`` and ``prot_tick + k * age`` are computed as
   Python computes them, one IEEE double operation at a time: each product goes through a
   volatile double, so no compiler can fuse it with the addition into an FMA (a different
   rounding) or keep it in extended precision.

   Keys are ``bytes`` (16-byte page hashes), stored as the objects themselves (a reference each,
   compared by content), never truncated (the tree shadow also takes any hashable key, compared
   by ``==``: tests and benchmarks replay small ints). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "structmember.h"
#include <stdint.h>
#include <string.h>

#define MAX_COUNT 15

/* ------------------------------------------------------------------ frequency sketch */

typedef struct {
    PyObject_HEAD
    Py_ssize_t width, mask, door_bits, sample_size;
    long long additions, resets;
    PyObject *rows[4]; /* bytearray(width) each */
    PyObject *door;    /* bytearray(width) (door_bits / 8 bytes) */
} SketchObject;

static PyTypeObject SketchType;

/* the rows' and doorkeeper's bytes; -1 (ValueError) if Python code resized one of them */
static int sk_ptrs(SketchObject *s, uint8_t **r, uint8_t **door)
{
    int i;
    if (s->door == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "FrequencySketch not initialized");
        return -1;
    }
    for (i = 0; i < 4; i++) {
        if (PyByteArray_GET_SIZE(s->rows[i]) != s->width) goto bad;
        r[i] = (uint8_t *)PyByteArray_AS_STRING(s->rows[i]);
    }
    if (PyByteArray_GET_SIZE(s->door) != s->door_bits / 8) goto bad;
    *door = (uint8_t *)PyByteArray_AS_STRING(s->door);
    return 0;
bad:
    PyErr_SetString(PyExc_ValueError, "a sketch row or the doorkeeper was resized");
    return -1;
}

/* int.from_bytes(key, "little"), its low 128 bits (all the bits the sketch reads: width <= 2**32) */
static int key_words(PyObject *key, uint64_t *lo, uint64_t *hi)
{
    uint8_t buf[16];
    Py_ssize_t n;
    int i;
    if (!PyBytes_Check(key)) {
        PyErr_Format(PyExc_TypeError, "page hashes are bytes, not %.100s", Py_TYPE(key)->tp_name);
        return -1;
    }
    n = PyBytes_GET_SIZE(key);
    memset(buf, 0, 16);
    memcpy(buf, PyBytes_AS_STRING(key), n < 16 ? n : 16);
    *lo = *hi = 0;
    for (i = 7; i >= 0; i--) {
        *lo = (*lo << 8) | buf[i];
        *hi = (*hi << 8) | buf[8 + i];
    }
    return 0;
}

static long sk_estimate_raw(SketchObject *s, PyObject *key)
{
    uint64_t lo, hi, m = (uint64_t)s->mask, n1 = (uint64_t)s->door_bits - 1, a, b;
    uint8_t *r[4], *door;
    uint8_t c, low;
    if (key_words(key, &lo, &hi) < 0 || sk_ptrs(s, r, &door) < 0) return -1;
    low = r[0][lo & m];
    c = r[1][((lo >> 32) | (hi << 32)) & m];
    if (c < low) low = c;
    c = r[2][hi & m];
    if (c < low) low = c;
    c = r[3][(hi >> 32) & m];
    if (c < low) low = c;
    a = ((lo >> 16) | (hi << 48)) & n1;
    b = (hi >> 16) & n1;
    return (long)low + ((door[a >> 3] & (1u << (a & 7))) && (door[b >> 3] & (1u << (b & 7))) ? 1 : 0);
}

static PyObject *sk_estimate(SketchObject *s, PyObject *key)
{
    long e = sk_estimate_raw(s, key);
    return e < 0 ? NULL : PyLong_FromLong(e);
}

static PyObject *new_bytearray(Py_ssize_t n)
{
    PyObject *b = PyByteArray_FromStringAndSize(NULL, n);
    if (b != NULL) memset(PyByteArray_AS_STRING(b), 0, n);
    return b;
}

/* FrequencySketch.age: every counter halved (new rows), the doorkeeper cleared, additions //= 2 */
static int sk_age_raw(SketchObject *s)
{
    PyObject *rows[4] = {NULL, NULL, NULL, NULL}, *door;
    Py_ssize_t i, j;
    uint8_t *r[4], *d;
    if (sk_ptrs(s, r, &d) < 0) return -1;
    for (i = 0; i < 4; i++) {
        rows[i] = new_bytearray(s->width);
        if (rows[i] == NULL) goto fail;
        uint8_t *dst = (uint8_t *)PyByteArray_AS_STRING(rows[i]);
        for (j = 0; j < s->width; j++) dst[j] = r[i][j] >> 1;
    }
    door = new_bytearray(s->door_bits / 8);
    if (door == NULL) goto fail;
    for (i = 0; i < 4; i++) Py_SETREF(s->rows[i], rows[i]);
    Py_SETREF(s->door, door);
    /* Python's floor division */
    s->additions = s->additions >= 0 ? s->additions / 2 : -((-s->additions + 1) / 2);
    s->resets += 1;
    return 0;
fail:
    for (i = 0; i < 4; i++) Py_XDECREF(rows[i]);
    return -1;
}

static PyObject *sk_age(SketchObject *s, PyObject *Py_UNUSED(ignored))
{
    if (sk_age_raw(s) < 0) return NULL;
    Py_RETURN_NONE;
}

/* count one key (FrequencySketch.increment_all's loop body); r and door are refreshed on aging */
static int sk_count(SketchObject *s, PyObject *key, uint8_t **r, uint8_t **door)
{
    uint64_t lo, hi, m = (uint64_t)s->mask, n1 = (uint64_t)s->door_bits - 1, a, b;
    uint8_t *d = *door, ba, bb;
    if (key_words(key, &lo, &hi) < 0) return -1;
    s->additions += 1;
    a = ((lo >> 16) | (hi << 48)) & n1;
    b = (hi >> 16) & n1;
    ba = (uint8_t)(1u << (a & 7));
    bb = (uint8_t)(1u << (b & 7));
    if (!((d[a >> 3] & ba) && (d[b >> 3] & bb))) {
        d[a >> 3] |= ba;
        d[b >> 3] |= bb;
    } else {
        uint64_t i0 = lo & m, i1 = ((lo >> 32) | (hi << 32)) & m, i2 = hi & m, i3 = (hi >> 32) & m;
        uint8_t c0 = r[0][i0], c1 = r[1][i1], c2 = r[2][i2], c3 = r[3][i3], low = c0;
        if (c1 < low) low = c1;
        if (c2 < low) low = c2;
        if (c3 < low) low = c3;
        if (low < MAX_COUNT) { /* conservative update: raise only the minimum counters */
            if (c0 == low) r[0][i0] = low + 1;
            if (c1 == low) r[1][i1] = low + 1;
            if (c2 == low) r[2][i2] = low + 1;
            if (c3 == low) r[3][i3] = low + 1;
        }
    }
    if (s->additions >= s->sample_size) {
        if (sk_age_raw(s) < 0 || sk_ptrs(s, r, door) < 0) return -1;
    }
    return 0;
}

static PyObject *sk_increment(SketchObject *s, PyObject *key)
{
    uint8_t *r[4], *door;
    if (sk_ptrs(s, r, &door) < 0 || sk_count(s, key, r, &door) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *sk_increment_all(SketchObject *s, PyObject *keys)
{
    uint8_t *r[4], *door;
    Py_ssize_t i, n;
    PyObject *seq = PySequence_Fast(keys, "increment_all takes an iterable of page hashes");
    if (seq == NULL) return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    if (sk_ptrs(s, r, &door) < 0) goto fail;
    for (i = 0; i < n; i++)
        if (sk_count(s, PySequence_Fast_GET_ITEM(seq, i), r, &door) < 0) goto fail;
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail:
    Py_DECREF(seq);
    return NULL;
}

static int first_byte(PyObject *h, long long *out)
{
    if (!PyBytes_Check(h)) {
        PyErr_Format(PyExc_TypeError, "page hashes are bytes, not %.100s", Py_TYPE(h)->tp_name);
        return -1;
    }
    if (PyBytes_GET_SIZE(h) < 1) {
        PyErr_SetString(PyExc_IndexError, "index out of range");
        return -1;
    }
    *out = (unsigned char)PyBytes_AS_STRING(h)[0];
    return 0;
}

/* FrequencySketch.increment_masked: the pages whose first byte & mask is 0, then the last page
   if it was not one of them (policy.observe's counting, one call) */
static PyObject *sk_increment_masked(SketchObject *s, PyObject *args)
{
    PyObject *pages, *seq;
    long long mask, b;
    uint8_t *r[4], *door;
    Py_ssize_t i, n;
    if (!PyArg_ParseTuple(args, "OL:increment_masked", &pages, &mask)) return NULL;
    seq = PySequence_Fast(pages, "increment_masked takes a sequence of page hashes");
    if (seq == NULL) return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    if (sk_ptrs(s, r, &door) < 0) goto fail;
    for (i = 0; i < n; i++) {
        PyObject *h = PySequence_Fast_GET_ITEM(seq, i);
        if (mask) {
            if (first_byte(h, &b) < 0) goto fail;
            if (b & mask) continue;
        }
        if (sk_count(s, h, r, &door) < 0) goto fail;
    }
    if (mask && n) {
        PyObject *h = PySequence_Fast_GET_ITEM(seq, n - 1);
        if (first_byte(h, &b) < 0) goto fail;
        if ((b & mask) && sk_count(s, h, r, &door) < 0) goto fail;
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail:
    Py_DECREF(seq);
    return NULL;
}

static int sk_init(SketchObject *s, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"capacity", "sample_factor", "sample_shift", NULL};
    Py_ssize_t capacity, factor = 10, shift = 0, width = 16, i, size;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n|nn:FrequencySketch", kwlist, &capacity, &factor, &shift))
        return -1;
    while (width < capacity) {
        if (width >= ((Py_ssize_t)1 << 32)) {
            PyErr_SetString(PyExc_OverflowError, "sketch width over 2**32 (use the Python sketch)");
            return -1;
        }
        width <<= 1;
    }
    if (shift < 0 || shift > 62 || factor < 0 || factor > ((Py_ssize_t)1 << 24)) {
        PyErr_SetString(PyExc_ValueError, "sample_factor or sample_shift out of range");
        return -1;
    }
    size = (factor * width) >> shift;
    s->width = width;
    s->mask = width - 1;
    s->door_bits = width * 8;
    s->sample_size = size > 64 ? size : 64;
    s->additions = 0;
    s->resets = 0;
    for (i = 0; i < 4; i++) {
        PyObject *row = new_bytearray(width);
        if (row == NULL) return -1;
        Py_XSETREF(s->rows[i], row);
    }
    {
        PyObject *door = new_bytearray(width);
        if (door == NULL) return -1;
        Py_XSETREF(s->door, door);
    }
    return 0;
}

static void sk_dealloc(SketchObject *s)
{
    int i;
    for (i = 0; i < 4; i++) Py_CLEAR(s->rows[i]);
    Py_CLEAR(s->door);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *sk_get_rows(SketchObject *s, void *closure)
{
    if (s->rows[0] == NULL) {
        PyErr_SetString(PyExc_AttributeError, "rows");
        return NULL;
    }
    return Py_BuildValue("[OOOO]", s->rows[0], s->rows[1], s->rows[2], s->rows[3]);
}

static PyObject *sk_get_door(SketchObject *s, void *closure)
{
    if (s->door == NULL) {
        PyErr_SetString(PyExc_AttributeError, "door");
        return NULL;
    }
    Py_INCREF(s->door);
    return s->door;
}

static PyMethodDef sk_methods[] = {
    {"estimate", (PyCFunction)sk_estimate, METH_O, "estimate(key) -> int: min(row counters) + doorkeeper"},
    {"increment", (PyCFunction)sk_increment, METH_O, "increment(key): count one key"},
    {"increment_all", (PyCFunction)sk_increment_all, METH_O, "increment_all(keys): count each key in turn"},
    {"increment_masked", (PyCFunction)sk_increment_masked, METH_VARARGS,
     "increment_masked(pages, mask): count the pages whose first byte & mask is 0, then the last page "
     "if it was not counted"},
    {"age", (PyCFunction)sk_age, METH_NOARGS, "age(): halve every counter, clear the doorkeeper"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef sk_members[] = {
    {"width", T_PYSSIZET, offsetof(SketchObject, width), READONLY, NULL},
    {"mask", T_PYSSIZET, offsetof(SketchObject, mask), READONLY, NULL},
    {"door_bits", T_PYSSIZET, offsetof(SketchObject, door_bits), READONLY, NULL},
    {"sample_size", T_PYSSIZET, offsetof(SketchObject, sample_size), READONLY, NULL},
    {"additions", T_LONGLONG, offsetof(SketchObject, additions), 0, NULL},
    {"resets", T_LONGLONG, offsetof(SketchObject, resets), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef sk_getset[] = {
    {"rows", (getter)sk_get_rows, NULL, "the four counter rows (the live bytearrays)", NULL},
    {"door", (getter)sk_get_door, NULL, "the doorkeeper's bits (the live bytearray)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SketchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "sglang_tiered.core._bookkeeping.FrequencySketch",
    .tp_basicsize = sizeof(SketchObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "C FrequencySketch (core/sketch.py's class is the reference)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)sk_init,
    .tp_dealloc = (destructor)sk_dealloc,
    .tp_methods = sk_methods,
    .tp_members = sk_members,
    .tp_getset = sk_getset,
};

/* ------------------------------------------------------------------ miniature */

typedef struct {
    PyObject *key; /* bytes, owned; NULL when free */
    uint64_t hash;
    long long tick;
    int32_t prev, next; /* within the segment (or the free list: next) */
    int32_t seg;        /* 0 probationary, 1 protected, -1 free */
} mc_entry;

typedef struct {
    PyObject_HEAD
    int tinylfu, busy;
    Py_ssize_t cap;
    double age;
    mc_entry *ent;
    int32_t nalloc;  /* entries allocated */
    int32_t *table;  /* open addressing (linear probing), entry index or -1 */
    uint64_t tmask;  /* table size - 1 (size >= 2 * nalloc) */
    int32_t head[2], tail[2], free_head;
    Py_ssize_t len[2];
} MiniObject;

static PyTypeObject MiniType;

/* Where a key goes in the table: Python's own hash of the bytes (SipHash, keyed by a secret per
   process unless PYTHONHASHSEED is set; cached in the bytes object), as the reference's
   OrderedDict places it. Review, session 42: a fixed mixer let a client search page hashes (its
   prompts' pages) that all took one slot, and linear probing went quadratic. bytes' own tp_hash
   is called (a subclass's __hash__ would run Python code mid-run); only the placement depends on
   it, never a decision. */
static uint64_t key_hash(PyObject *key)
{
    uint64_t h = (uint64_t)PyBytes_Type.tp_hash(key);
    return h ^ (h >> 32); /* (the table takes the low bits) */
}

static inline int key_eq(PyObject *a, PyObject *b)
{
    return a == b || (PyBytes_GET_SIZE(a) == PyBytes_GET_SIZE(b) &&
                      memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b), PyBytes_GET_SIZE(a)) == 0);
}

/* the table slot holding key (its entry: table[slot]), or the empty slot where it would go */
static uint64_t mc_slot(MiniObject *mc, PyObject *key, uint64_t hash)
{
    uint64_t i = hash & mc->tmask;
    int32_t e;
    while ((e = mc->table[i]) >= 0) {
        if (mc->ent[e].hash == hash && key_eq(mc->ent[e].key, key)) return i;
        i = (i + 1) & mc->tmask;
    }
    return i;
}

/* backward-shift deletion (no tombstones) */
static void mc_table_del(MiniObject *mc, uint64_t i)
{
    uint64_t j = i, k, mask = mc->tmask;
    mc->table[i] = -1;
    for (;;) {
        j = (j + 1) & mask;
        if (mc->table[j] < 0) return;
        k = mc->ent[mc->table[j]].hash & mask;
        /* the entry at j may move to i unless its home k lies cyclically in (i, j] */
        if (i <= j ? (i < k && k <= j) : (i < k || k <= j)) continue;
        mc->table[i] = mc->table[j];
        mc->table[j] = -1;
        i = j;
    }
}

static int mc_rebuild_table(MiniObject *mc, uint64_t size)
{
    int32_t *t = PyMem_Malloc(size * sizeof(int32_t)), i;
    if (t == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(t, 0xff, size * sizeof(int32_t));
    PyMem_Free(mc->table);
    mc->table = t;
    mc->tmask = size - 1;
    for (i = 0; i < mc->nalloc; i++) {
        if (mc->ent[i].seg < 0) continue;
        uint64_t s = mc->ent[i].hash & mc->tmask;
        while (t[s] >= 0) s = (s + 1) & mc->tmask;
        t[s] = i;
    }
    return 0;
}

/* a free entry (growing the pool and the table as needed), or -1 */
static int32_t mc_alloc(MiniObject *mc)
{
    int32_t e;
    if (mc->free_head < 0) {
        Py_ssize_t n = mc->nalloc ? (Py_ssize_t)mc->nalloc * 2 : 64, i;
        if (n > mc->cap) n = mc->cap;
        if (n <= mc->nalloc) { /* cannot happen: run never holds more than cap */
            PyErr_SetString(PyExc_RuntimeError, "miniature over capacity");
            return -1;
        }
        /* the table first (over the entries there are): were it left at its size when its
           growth failed after the pool's, the next pool's entries could fill it, and a probe for
           a key not in it would never find an empty slot */
        uint64_t size = 16;
        while (size < 2 * (uint64_t)n) size <<= 1;
        if (size > mc->tmask + 1 && mc_rebuild_table(mc, size) < 0) return -1;
        mc_entry *ent = PyMem_Realloc(mc->ent, (size_t)n * sizeof(mc_entry));
        if (ent == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        mc->ent = ent;
        for (i = n - 1; i >= mc->nalloc; i--) {
            ent[i].key = NULL;
            ent[i].seg = -1;
            ent[i].next = mc->free_head;
            mc->free_head = (int32_t)i;
        }
        mc->nalloc = (int32_t)n;
    }
    e = mc->free_head;
    mc->free_head = mc->ent[e].next;
    return e;
}

static void mc_link(MiniObject *mc, int32_t e, int seg)
{
    mc_entry *x = &mc->ent[e];
    x->seg = seg;
    x->next = -1;
    x->prev = mc->tail[seg];
    if (mc->tail[seg] >= 0)
        mc->ent[mc->tail[seg]].next = e;
    else
        mc->head[seg] = e;
    mc->tail[seg] = e;
    mc->len[seg] += 1;
}

static void mc_unlink(MiniObject *mc, int32_t e)
{
    mc_entry *x = &mc->ent[e];
    int seg = x->seg;
    if (x->prev >= 0)
        mc->ent[x->prev].next = x->next;
    else
        mc->head[seg] = x->next;
    if (x->next >= 0)
        mc->ent[x->next].prev = x->prev;
    else
        mc->tail[seg] = x->prev;
    mc->len[seg] -= 1;
}

static int mc_init(MiniObject *mc, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"tinylfu", "capacity", NULL};
    int tinylfu;
    Py_ssize_t cap;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "pn:MiniCache", kwlist, &tinylfu, &cap)) return -1;
    if (cap < 1 || cap > INT32_MAX / 2) {
        PyErr_Format(PyExc_ValueError, "miniature capacity %zd out of range", cap);
        return -1;
    }
    if (mc->table != NULL) { /* __init__ called again: start empty */
        PyErr_SetString(PyExc_RuntimeError, "MiniCache is initialized once");
        return -1;
    }
    mc->tinylfu = tinylfu;
    mc->cap = cap;
    mc->age = 0.0;
    mc->ent = NULL;
    mc->nalloc = 0;
    mc->head[0] = mc->head[1] = mc->tail[0] = mc->tail[1] = mc->free_head = -1;
    mc->len[0] = mc->len[1] = 0;
    return mc_rebuild_table(mc, 16);
}

static void mc_dealloc(MiniObject *mc)
{
    int32_t i;
    for (i = 0; i < mc->nalloc; i++) Py_XDECREF(mc->ent[i].key);
    PyMem_Free(mc->ent);
    PyMem_Free(mc->table);
    Py_TYPE(mc)->tp_free((PyObject *)mc);
}

static int mc_ready(MiniObject *mc)
{
    if (mc->table == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "MiniCache not initialized");
        return -1;
    }
    return 0;
}

/* est(key): a C sketch's estimate called directly, any other callable through Python */
static PyObject *call_est(PyObject *est, SketchObject *fast, PyObject *key)
{
    if (fast != NULL) return sk_estimate(fast, key);
    return PyObject_CallOneArg(est, key);
}

static inline void clear_ref(PyObject **p) { Py_CLEAR(*p); }

/* MiniCache.run: see core/miniature.py (the reference) */
static PyObject *mc_run(MiniObject *mc, PyObject *args)
{
    PyObject *pages, *est, *seq;
    long long tick;
    double k, age;
    Py_ssize_t i, hits = 0;
    int leading = 1, refusing = 0;
    SketchObject *fast = NULL;
    PyObject *h = NULL;
    if (!PyArg_ParseTuple(args, "OLdO:run", &pages, &tick, &k, &est)) return NULL;
    if (mc_ready(mc) < 0) return NULL;
    if (mc->busy) { /* est called back into this miniature */
        PyErr_SetString(PyExc_RuntimeError, "MiniCache.run is not re-entrant");
        return NULL;
    }
    if (PyCFunction_Check(est) && PyCFunction_GET_FUNCTION(est) == (PyCFunction)sk_estimate &&
        PyCFunction_GET_SELF(est) != NULL && Py_IS_TYPE(PyCFunction_GET_SELF(est), &SketchType))
        fast = (SketchObject *)PyCFunction_GET_SELF(est);
    seq = PySequence_Fast(pages, "run takes a sequence of page hashes");
    if (seq == NULL) return NULL;
    age = mc->age;
    mc->busy = 1;
    /* est (a Python callable) or its results' __le__ may change the list (seq is pages itself
       when it is a list): its length is read at each step, as the reference's ``for h in pages``
       does, and the page being placed is held (cleared at each step's end) */
    for (i = 0; i < PySequence_Fast_GET_SIZE(seq); i++, clear_ref(&h)) {
        uint64_t hash, slot;
        int32_t e;
        h = PySequence_Fast_GET_ITEM(seq, i);
        Py_INCREF(h);
        if (!PyBytes_Check(h)) {
            PyErr_Format(PyExc_TypeError, "page hashes are bytes, not %.100s", Py_TYPE(h)->tp_name);
            goto fail;
        }
        hash = key_hash(h);
        slot = mc_slot(mc, h, hash);
        e = mc->table[slot];
        if (e >= 0) { /* a hit: to the protected segment's tail, with this tick */
            mc_unlink(mc, e);
            mc_link(mc, e, 1);
            mc->ent[e].tick = tick;
            hits += leading;
            continue;
        }
        leading = 0;
        if (mc->len[0] + mc->len[1] >= mc->cap) {
            int32_t victim;
            if (mc->head[0] >= 0) {
                victim = mc->head[0];
                if (mc->head[1] >= 0) {
                    volatile double boost = k * age; /* one rounding, never fused */
                    double bound = (double)mc->ent[mc->head[1]].tick + boost;
                    if (!((double)mc->ent[victim].tick <= bound)) victim = mc->head[1];
                }
            } else
                victim = mc->head[1];
            if (mc->tinylfu) {
                if (!refusing && fast != NULL) { /* the C sketch's estimate, called in C */
                    long a = sk_estimate_raw(fast, h), b;
                    if (a < 0 || (b = sk_estimate_raw(fast, mc->ent[victim].key)) < 0) goto fail;
                    refusing = a <= b;
                } else if (!refusing) {
                    PyObject *a = call_est(est, fast, h), *b;
                    int le;
                    if (a == NULL) goto fail;
                    b = call_est(est, fast, mc->ent[victim].key);
                    if (b == NULL) {
                        Py_DECREF(a);
                        goto fail;
                    }
                    le = PyObject_RichCompareBool(a, b, Py_LE);
                    Py_DECREF(a);
                    Py_DECREF(b);
                    if (le < 0) goto fail;
                    refusing = le;
                }
                if (refusing) continue;
            }
            {
                mc_entry *v = &mc->ent[victim];
                volatile double step = 0.01 * ((double)(tick - v->tick) - age); /* never fused */
                age = age + step;
                mc_table_del(mc, mc_slot(mc, v->key, v->hash));
                mc_unlink(mc, victim);
                Py_CLEAR(v->key);
                v->seg = -1;
                v->next = mc->free_head;
                mc->free_head = victim;
            }
        }
        e = mc_alloc(mc);
        if (e < 0) goto fail;
        slot = mc_slot(mc, h, hash); /* (an eviction shifted the table, or alloc rebuilt it) */
        Py_INCREF(h);
        mc->ent[e].key = h;
        mc->ent[e].hash = hash;
        mc->ent[e].tick = tick;
        mc->table[slot] = e;
        mc_link(mc, e, 0);
    }
    Py_DECREF(seq);
    mc->busy = 0;
    mc->age = age; /* (as the reference: written back only when the whole request ran) */
    return PyLong_FromSsize_t(hits);
fail:
    Py_XDECREF(h);
    Py_DECREF(seq);
    mc->busy = 0;
    return NULL;
}

static PyObject *mc_full(MiniObject *mc, PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong((double)(mc->len[0] + mc->len[1]) >= 0.75 * (double)mc->cap);
}

static PyObject *mc_segment(MiniObject *mc, int seg)
{
    PyObject *od, *mod;
    int32_t e;
    if (mc_ready(mc) < 0) return NULL;
    mod = PyImport_ImportModule("collections");
    if (mod == NULL) return NULL;
    od = PyObject_CallMethod(mod, "OrderedDict", NULL);
    Py_DECREF(mod);
    if (od == NULL) return NULL;
    for (e = mc->head[seg]; e >= 0; e = mc->ent[e].next) {
        PyObject *t = PyLong_FromLongLong(mc->ent[e].tick);
        if (t == NULL || PyObject_SetItem(od, mc->ent[e].key, t) < 0) {
            Py_XDECREF(t);
            Py_DECREF(od);
            return NULL;
        }
        Py_DECREF(t);
    }
    return od;
}

static PyObject *mc_get_prob(MiniObject *mc, void *c) { return mc_segment(mc, 0); }
static PyObject *mc_get_prot(MiniObject *mc, void *c) { return mc_segment(mc, 1); }
static PyObject *mc_get_tinylfu(MiniObject *mc, void *c) { return PyBool_FromLong(mc->tinylfu); }

static PyObject *check_fail(const char *msg)
{
    PyErr_SetString(PyExc_AssertionError, msg);
    return NULL;
}

/* the invariants (I1 within capacity, I2 disjoint segments) and the structure's own consistency */
static PyObject *mc_check(MiniObject *mc, PyObject *Py_UNUSED(ignored))
{
    int seg;
    Py_ssize_t used = 0, free_n = 0, slots = 0;
    int32_t e;
    uint64_t i;
    if (mc_ready(mc) < 0) return NULL;
    if (mc->len[0] + mc->len[1] > mc->cap) return check_fail("miniature over capacity");
    for (seg = 0; seg < 2; seg++) {
        Py_ssize_t n = 0;
        int32_t prev = -1;
        for (e = mc->head[seg]; e >= 0; prev = e, e = mc->ent[e].next) {
            mc_entry *x = &mc->ent[e];
            if (x->seg != seg) return check_fail("miniature segments overlap");
            if (x->prev != prev || x->key == NULL) return check_fail("miniature list broken");
            if (mc->table[mc_slot(mc, x->key, x->hash)] != e) return check_fail("miniature segments overlap");
            if (++n > mc->nalloc) return check_fail("miniature list broken");
        }
        if (n != mc->len[seg] || mc->tail[seg] != prev) return check_fail("miniature list broken");
        used += n;
    }
    for (e = mc->free_head; e >= 0; e = mc->ent[e].next) {
        if (mc->ent[e].seg != -1 || ++free_n > mc->nalloc) return check_fail("miniature free list broken");
    }
    for (i = 0; i <= mc->tmask; i++) slots += mc->table[i] >= 0;
    if (used + free_n != mc->nalloc || slots != used) return check_fail("miniature table broken");
    Py_RETURN_NONE;
}

static PyMethodDef mc_methods[] = {
    {"run", (PyCFunction)mc_run, METH_VARARGS, "run(pages, tick, k, est) -> hits in the leading run"},
    {"full", (PyCFunction)mc_full, METH_NOARGS, "full() -> whether 3/4 of the capacity is used"},
    {"check", (PyCFunction)mc_check, METH_NOARGS, "check(): assert the invariants"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef mc_members[] = {
    {"cap", T_PYSSIZET, offsetof(MiniObject, cap), READONLY, NULL},
    {"age", T_DOUBLE, offsetof(MiniObject, age), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef mc_getset[] = {
    {"prob", (getter)mc_get_prob, NULL, "the probationary pages (a copy: OrderedDict page -> tick)", NULL},
    {"prot", (getter)mc_get_prot, NULL, "the protected pages (a copy: OrderedDict page -> tick)", NULL},
    {"tinylfu", (getter)mc_get_tinylfu, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject MiniType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "sglang_tiered.core._bookkeeping.MiniCache",
    .tp_basicsize = sizeof(MiniObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "C MiniCache (core/miniature.py's class is the reference)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)mc_init,
    .tp_dealloc = (destructor)mc_dealloc,
    .tp_methods = mc_methods,
    .tp_members = mc_members,
    .tp_getset = mc_getset,
};

/* ------------------------------------------------------------------ divergence */

/* core/shadows.py ``DivergencePy`` (the safety duel's pages of lru's tree, ``L``, against the real
   cache's, ``R``; while counting, ``only_l = |L - R|`` and ``only_r = |R - L|``), issue #11,
   session 45. The two sets are one open-addressing table (linear probing, at most half full,
   backward-shift deletion) of owned keys with their hash and two side bits; a key on neither side
   leaves the table. The counts are kept per side state (L alone, R alone, both), so ``only_l``
   and ``only_r`` are read, never counted, and every update is one lookup per page with no Python
   object made. Keys are any hashable compared as a set compares them (identity, then ``==``; exact
   ``bytes``, the page hashes, by content without calling Python): a key's ``__hash__`` or
   ``__eq__`` may run Python code, so a mutation from there (or from the sources, or a read's keys)
   is refused with RuntimeError, as TreeShadow's ``busy`` refuses re-entry. The lru TreeShadow's
   ``track`` calls reach ``dv_tell`` directly with the node's key array (no list, no method
   lookup: ``ts_tell``). ``L`` and ``R`` read as new sets and assign as the reference's
   attributes do (the other side and the counts' bookkeeping kept); ``only_l``, ``only_r`` and
   ``counting`` are read-only. */

#define DV_L 1
#define DV_R 2
#define DV_SEEN 4 /* a query's mark (a page counted once), cleared before it returns */

typedef struct {
    PyObject *key; /* owned; NULL: an empty slot */
    Py_hash_t hash;
    int side; /* DV_L, DV_R or both */
} dv_slot;

typedef struct {
    PyObject_HEAD
    dv_slot *tab;
    size_t mask;
    Py_ssize_t fill;
    Py_ssize_t n[4]; /* keys by side: n[DV_L] in L alone, n[DV_R] in R alone, n[DV_L | DV_R] in both */
    int counting, busy;
    PyObject *l_pages, *r_pages; /* the sources (callables), or NULL / None */
    struct dv_marks *marks; /* the marks of the query counting now (dv_count), or NULL */
} DivObject;

static PyTypeObject DivType;

#define DV_MIN 8

static inline size_t dv_home(size_t mask, Py_hash_t h)
{
    uint64_t x = (uint64_t)h * 0x9E3779B97F4A7C15ULL;
    return (size_t)(x ^ (x >> 29)) & mask;
}

static inline int dv_lazy(DivObject *d) { return d->l_pages != NULL && d->l_pages != Py_None; }

/* a new empty table of `size` slots (a power of two) in place of the old, returned to the caller
   (*old, *oldmask) to give back (dv_free_table) once the new state is in place */
static int dv_swap_table(DivObject *d, size_t size, dv_slot **old, size_t *oldmask)
{
    dv_slot *t = PyMem_Calloc(size, sizeof(dv_slot));
    if (t == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *old = d->tab;
    *oldmask = d->mask;
    d->tab = t;
    d->mask = size - 1;
    d->fill = 0;
    d->n[0] = d->n[1] = d->n[2] = d->n[3] = 0;
    return 0;
}

/* the keys of an old table given back (after the new state is in place: a key's last reference
   may run Python code, which then finds this divergence consistent) */
static void dv_free_table(dv_slot *t, size_t mask)
{
    size_t i;
    if (t == NULL) return;
    for (i = 0; i <= mask; i++) Py_XDECREF(t[i].key);
    PyMem_Free(t);
}

/* put an entry known absent (no comparisons): room reserved by the caller */
static inline void dv_put(DivObject *d, PyObject *key, Py_hash_t h, int side)
{
    size_t i = dv_home(d->mask, h);
    while (d->tab[i].key != NULL) i = (i + 1) & d->mask;
    d->tab[i].key = key;
    d->tab[i].hash = h;
    d->tab[i].side = side;
    d->fill++;
    d->n[side]++;
}

static int dv_grow(DivObject *d)
{
    dv_slot *old;
    size_t oldmask, i;
    if (dv_swap_table(d, 2 * (d->mask + 1), &old, &oldmask) < 0) return -1;
    for (i = 0; i <= oldmask; i++)
        if (old[i].key != NULL) dv_put(d, old[i].key, old[i].hash, old[i].side); /* (references move) */
    PyMem_Free(old);
    return 0;
}

/* the entries of one side dropped (those on the other kept, theirs alone), as a set's clear */
static int dv_drop_side(DivObject *d, int side)
{
    dv_slot *old;
    size_t oldmask, i, size = DV_MIN;
    int keep = (DV_L | DV_R) & ~side;
    Py_ssize_t left = d->n[keep] + d->n[DV_L | DV_R];
    while (2 * (size_t)left > size) size <<= 1;
    if (dv_swap_table(d, size, &old, &oldmask) < 0) return -1;
    for (i = 0; i <= oldmask; i++)
        if (old[i].key != NULL && (old[i].side & keep)) {
            dv_put(d, old[i].key, old[i].hash, keep);
            old[i].key = NULL;
        }
    dv_free_table(old, oldmask);
    return 0;
}

static void dv_del(DivObject *d, size_t i)
{
    size_t j = i, k, mask = d->mask;
    d->tab[i].key = NULL;
    d->fill--;
    for (;;) {
        j = (j + 1) & mask;
        if (d->tab[j].key == NULL) return;
        k = dv_home(mask, d->tab[j].hash);
        if (i <= j ? (i < k && k <= j) : (i < k || k <= j)) continue;
        d->tab[i] = d->tab[j];
        d->tab[j].key = NULL;
        i = j;
    }
}

/* the slot holding key (1), or the empty slot where it would go (0); -1 on error */
static int dv_find(DivObject *d, PyObject *key, Py_hash_t h, size_t *slot)
{
    size_t i = dv_home(d->mask, h);
    int bytes = PyBytes_CheckExact(key);
    dv_slot *s;
    while ((s = &d->tab[i])->key != NULL) {
        if (s->key == key) break;
        if (s->hash == h) {
            PyObject *k = s->key;
            int eq;
            if (bytes && PyBytes_CheckExact(k))
                eq = PyBytes_GET_SIZE(k) == PyBytes_GET_SIZE(key) &&
                     memcmp(PyBytes_AS_STRING(k), PyBytes_AS_STRING(key), PyBytes_GET_SIZE(k)) == 0;
            else {
                Py_INCREF(k);
                eq = PyObject_RichCompareBool(k, key, Py_EQ);
                Py_DECREF(k);
                if (eq < 0) return -1;
            }
            if (eq) break;
        }
        i = (i + 1) & d->mask;
    }
    *slot = i;
    return d->tab[i].key != NULL;
}

/* key added to (add) or removed from side `mine` */
static int dv_one(DivObject *d, PyObject *key, int mine, int add)
{
    Py_hash_t h = PyObject_Hash(key);
    size_t i;
    int r, s;
    if (h == -1) return -1;
    r = dv_find(d, key, h, &i);
    if (r < 0) return -1;
    if (r == 0) {
        if (!add) return 0;
        if (2 * (size_t)(d->fill + 1) > d->mask + 1) {
            if (dv_grow(d) < 0) return -1;
        }
        Py_INCREF(key);
        dv_put(d, key, h, mine);
        return 0;
    }
    s = d->tab[i].side;
    if (add ? (s & mine) : !(s & mine)) return 0;
    d->n[s]--;
    s ^= mine;
    if (s) {
        d->tab[i].side = s;
        d->n[s]++;
    } else {
        PyObject *k = d->tab[i].key;
        dv_del(d, i);
        Py_DECREF(k);
    }
    return 0;
}

static int dv_refuse(void)
{
    PyErr_SetString(PyExc_RuntimeError,
                    "Divergence is not changed from its keys' __hash__/__eq__, its sources or a read");
    return -1;
}

/* the pages of a node of the lru TreeShadow (its own array) added to / removed from L: track's
   l_add / l_remove without a list or a method call (ts_tell) */
static int dv_tell(DivObject *d, PyObject **keys, Py_ssize_t n, int add)
{
    Py_ssize_t i;
    int r = 0;
    if (!d->counting && dv_lazy(d)) return 0; /* (not kept: see the reference) */
    if (d->busy) return dv_refuse();
    d->busy = 1;
    for (i = 0; i < n && r == 0; i++) r = dv_one(d, keys[i], DV_L, add);
    d->busy = 0;
    return r;
}

/* every page of `pages` (any iterable) through dv_one (busy set by the caller) */
static int dv_each(DivObject *d, PyObject *pages, int mine, int add)
{
    Py_ssize_t i;
    int r = 0;
    if (PyList_CheckExact(pages)) { /* (a key's __eq__ may change the list: read it item by item) */
        for (i = 0; r == 0 && i < PyList_GET_SIZE(pages); i++) {
            PyObject *k = PyList_GET_ITEM(pages, i);
            Py_INCREF(k);
            r = dv_one(d, k, mine, add);
            Py_DECREF(k);
        }
        return r;
    }
    if (PyTuple_CheckExact(pages)) {
        for (i = 0; r == 0 && i < PyTuple_GET_SIZE(pages); i++) r = dv_one(d, PyTuple_GET_ITEM(pages, i), mine, add);
        return r;
    }
    pages = PySequence_Tuple(pages);
    if (pages == NULL) return -1;
    r = dv_each(d, pages, mine, add);
    Py_DECREF(pages);
    return r;
}

static PyObject *dv_update(DivObject *d, PyObject *pages, int mine, int add)
{
    int r;
    if (!d->counting && dv_lazy(d)) Py_RETURN_NONE; /* (ignored: the sides are read at start) */
    if (d->busy) return dv_refuse(), NULL;
    d->busy = 1;
    r = dv_each(d, pages, mine, add);
    d->busy = 0;
    if (r < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *dv_l_add(DivObject *d, PyObject *p) { return dv_update(d, p, DV_L, 1); }
static PyObject *dv_l_remove(DivObject *d, PyObject *p) { return dv_update(d, p, DV_L, 0); }
static PyObject *dv_r_add(DivObject *d, PyObject *p) { return dv_update(d, p, DV_R, 1); }
static PyObject *dv_r_remove(DivObject *d, PyObject *p) { return dv_update(d, p, DV_R, 0); }

/* both sides emptied (an empty table of the least size) */
static int dv_empty(DivObject *d)
{
    dv_slot *old;
    size_t oldmask;
    if (dv_swap_table(d, DV_MIN, &old, &oldmask) < 0) return -1;
    dv_free_table(old, oldmask);
    return 0;
}

/* start(): with sources, both sides read whole (L, then R; nothing changes if either fails) */
static PyObject *dv_start(DivObject *d, PyObject *Py_UNUSED(ignored))
{
    PyObject *a = NULL, *b = NULL;
    dv_slot *old = NULL;
    size_t oldmask = 0;
    int r = 0;
    if (d->counting) Py_RETURN_NONE;
    if (d->busy) return dv_refuse(), NULL;
    if (dv_lazy(d)) {
        PyObject *lp = d->l_pages, *rp = d->r_pages;
        if (rp == NULL || rp == Py_None) {
            PyErr_SetString(PyExc_AssertionError, "a lazy divergence needs both sources");
            return NULL;
        }
        Py_INCREF(lp);
        Py_INCREF(rp);
        d->busy = 1;
        a = PyObject_CallNoArgs(lp);
        if (a != NULL) {
            PyObject *t = PySequence_Tuple(a);
            Py_SETREF(a, t);
        }
        if (a != NULL) b = PyObject_CallNoArgs(rp);
        if (b != NULL) {
            PyObject *t = PySequence_Tuple(b);
            Py_SETREF(b, t);
        }
        Py_DECREF(lp);
        Py_DECREF(rp);
        if (b == NULL) goto fail;
        if (dv_swap_table(d, DV_MIN, &old, &oldmask) < 0) goto fail;
        r = dv_each(d, a, DV_L, 1);
        if (r == 0) r = dv_each(d, b, DV_R, 1);
        if (r < 0) { /* (the old sides back, as the reference's assignment never happened) */
            dv_slot *fresh = d->tab;
            size_t fmask = d->mask, i;
            d->tab = old;
            d->mask = oldmask;
            d->fill = 0;
            d->n[0] = d->n[1] = d->n[2] = d->n[3] = 0;
            for (i = 0; i <= oldmask; i++)
                if (old[i].key != NULL) {
                    d->fill++;
                    d->n[old[i].side]++;
                }
            old = NULL;
            dv_free_table(fresh, fmask);
            goto fail;
        }
        d->busy = 0;
        dv_free_table(old, oldmask);
        Py_DECREF(a);
        Py_DECREF(b);
    }
    d->counting = 1;
    Py_RETURN_NONE;
fail:
    d->busy = 0;
    Py_XDECREF(a);
    Py_XDECREF(b);
    return NULL;
}

static PyObject *dv_stop(DivObject *d, PyObject *Py_UNUSED(ignored))
{
    if (d->busy) return dv_refuse(), NULL;
    d->counting = 0;
    if (dv_lazy(d) && dv_empty(d) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *dv_r_clear(DivObject *d, PyObject *Py_UNUSED(ignored))
{
    if (d->busy) return dv_refuse(), NULL;
    if (dv_drop_side(d, DV_R) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *dv_held(DivObject *d, PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong(d->counting || !dv_lazy(d));
}

/* a side as a new set (a read: busy while its keys' __hash__ may run) */
static PyObject *dv_side_set(DivObject *d, int side)
{
    PyObject *out = PySet_New(NULL);
    size_t i;
    int was = d->busy;
    if (out == NULL) return NULL;
    d->busy = 1;
    for (i = 0; i <= d->mask; i++)
        if (d->tab[i].key != NULL && (d->tab[i].side & side) && PySet_Add(out, d->tab[i].key) < 0) {
            Py_CLEAR(out);
            break;
        }
    d->busy = was;
    return out;
}

static PyObject *dv_get_L(DivObject *d, void *Py_UNUSED(c)) { return dv_side_set(d, DV_L); }
static PyObject *dv_get_R(DivObject *d, void *Py_UNUSED(c)) { return dv_side_set(d, DV_R); }

/* ``dv.L = pages``: the side's pages now (the other side kept) */
static int dv_set_side(DivObject *d, PyObject *v, int side)
{
    PyObject *t;
    int r;
    if (v == NULL) {
        PyErr_SetString(PyExc_TypeError, "a Divergence side cannot be deleted");
        return -1;
    }
    if (d->busy) return dv_refuse();
    t = PySequence_Tuple(v);
    if (t == NULL) return -1;
    d->busy = 1;
    r = dv_drop_side(d, side);
    if (r == 0) r = dv_each(d, t, side, 1);
    d->busy = 0;
    Py_DECREF(t);
    return r;
}

static int dv_set_L(DivObject *d, PyObject *v, void *Py_UNUSED(c)) { return dv_set_side(d, v, DV_L); }
static int dv_set_R(DivObject *d, PyObject *v, void *Py_UNUSED(c)) { return dv_set_side(d, v, DV_R); }

static PyObject *dv_get_only_l(DivObject *d, void *Py_UNUSED(c)) { return PyLong_FromSsize_t(d->counting ? d->n[DV_L] : 0); }
static PyObject *dv_get_only_r(DivObject *d, void *Py_UNUSED(c)) { return PyLong_FromSsize_t(d->counting ? d->n[DV_R] : 0); }
static PyObject *dv_get_counting(DivObject *d, void *Py_UNUSED(c)) { return PyBool_FromLong(d->counting); }
static PyObject *dv_get_lazy(DivObject *d, void *Py_UNUSED(c)) { return PyBool_FromLong(dv_lazy(d)); }

/* The queries (the safety duel's reads of L and R, as the reference's methods): they walk `pages`
   (busy: a key's __eq__ may run Python code) and mark what they counted (DV_SEEN: a page listed
   twice counts once, as in a set), unmarked before they return. */
typedef struct dv_marks {
    size_t *slots, buf[64];
    Py_ssize_t n, alloc;
} dv_marks;

static int dv_mark(DivObject *d, dv_marks *m, size_t i)
{
    if (m->n == m->alloc) {
        Py_ssize_t na = m->alloc * 2;
        size_t *s = m->slots == m->buf ? PyMem_Malloc((size_t)na * sizeof(size_t))
                                       : PyMem_Realloc(m->slots, (size_t)na * sizeof(size_t));
        if (s == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        if (m->slots == m->buf) memcpy(s, m->buf, sizeof(m->buf));
        m->slots = s;
        m->alloc = na;
    }
    d->tab[i].side |= DV_SEEN;
    m->slots[m->n++] = i;
    return 0;
}

/* a query's marks set (on) or cleared (off); the table does not change while they are live */
static void dv_marks_set(DivObject *d, dv_marks *m, int on)
{
    Py_ssize_t j;
    for (j = 0; j < m->n; j++) {
        if (on)
            d->tab[m->slots[j]].side |= DV_SEEN;
        else
            d->tab[m->slots[j]].side &= ~DV_SEEN;
    }
}

static void dv_unmark(DivObject *d, dv_marks *m)
{
    dv_marks_set(d, m, 0);
    if (m->slots != m->buf) PyMem_Free(m->slots);
}

#define DV_COUNT_ALL 0   /* distinct pages in `want` (L), the count */
#define DV_COUNT_RUN 1   /* the leading run of pages in L */
#define DV_COUNT_FIRST 2 /* up to `limit` pages in L (repeats counted: islice of a filter) */

/* how many of `pages` have side bits `want` under `mask` (see the modes above); -1 on error */
static Py_ssize_t dv_count(DivObject *d, PyObject *pages, int mask, int want, int mode, Py_ssize_t limit)
{
    PyObject *seq = PySequence_Fast(pages, "the pages must be iterable");
    Py_ssize_t i, k = 0;
    dv_marks m, *outer;
    int was = d->busy, err = 0;
    if (seq == NULL) return -1;
    m.slots = m.buf;
    m.n = 0;
    m.alloc = 64;
    d->busy = 1;
    /* A query run from a key's __eq__/__hash__ during another (a read: allowed) would take the
       outer query's marks for its own and skip those pages: the outer's are lifted while it
       counts and put back after (mutations are refused meanwhile: the slots stay put). */
    outer = d->marks;
    if (outer != NULL) dv_marks_set(d, outer, 0);
    d->marks = &m;
    for (i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        Py_hash_t h;
        size_t s;
        int r, in;
        Py_INCREF(key);
        h = PyObject_Hash(key);
        r = h == -1 ? -1 : dv_find(d, key, h, &s);
        Py_DECREF(key);
        if (r < 0) {
            err = 1;
            break;
        }
        in = r && (d->tab[s].side & mask) == want;
        if (mode == DV_COUNT_RUN) {
            if (!in) break;
            k++;
        } else if (mode == DV_COUNT_FIRST) {
            if (in && ++k >= limit) break;
        } else if (in && !(d->tab[s].side & DV_SEEN)) {
            if (dv_mark(d, &m, s) < 0) {
                err = 1;
                break;
            }
            k++;
        }
    }
    dv_unmark(d, &m);
    d->marks = outer;
    if (outer != NULL) dv_marks_set(d, outer, 1);
    d->busy = was;
    Py_DECREF(seq);
    return err ? -1 : k;
}

static PyObject *dv_l_run(DivObject *d, PyObject *pages)
{
    Py_ssize_t k = dv_count(d, pages, DV_L, DV_L, DV_COUNT_RUN, 0);
    return k < 0 ? NULL : PyLong_FromSsize_t(k);
}

static PyObject *dv_l_count(DivObject *d, PyObject *pages)
{
    Py_ssize_t k = dv_count(d, pages, DV_L, DV_L, DV_COUNT_ALL, 0);
    return k < 0 ? NULL : PyLong_FromSsize_t(k);
}

/* l_only(pages): |set(pages) & L - R|, from the sources where the sets are not held */
static PyObject *dv_l_only(DivObject *d, PyObject *pages)
{
    PyObject *over, *x, *r, *src;
    Py_ssize_t k;
    if (d->counting || !dv_lazy(d)) {
        k = dv_count(d, pages, DV_L | DV_R, DV_L, DV_COUNT_ALL, 0);
        return k < 0 ? NULL : PyLong_FromSsize_t(k);
    }
    over = PySet_New(pages);
    if (over == NULL) return NULL;
    src = d->l_pages;
    Py_INCREF(src);
    x = PyObject_CallNoArgs(src);
    Py_DECREF(src);
    if (x != NULL) Py_SETREF(x, PySet_New(x));
    r = x == NULL ? NULL : PyNumber_InPlaceAnd(over, x);
    Py_XDECREF(x);
    if (r == NULL) goto fail;
    Py_DECREF(r);
    src = d->r_pages != NULL ? d->r_pages : Py_None;
    Py_INCREF(src);
    x = PyObject_CallNoArgs(src);
    Py_DECREF(src);
    if (x != NULL) Py_SETREF(x, PySet_New(x));
    r = x == NULL ? NULL : PyNumber_InPlaceSubtract(over, x);
    Py_XDECREF(x);
    if (r == NULL) goto fail;
    Py_DECREF(r);
    k = PySet_GET_SIZE(over);
    Py_DECREF(over);
    return PyLong_FromSsize_t(k);
fail:
    Py_DECREF(over);
    return NULL;
}

/* l_spared(pages, room): -1 where the pages in L are more than room (at least one with room < 0),
   else how many; past room they are not counted (see the reference) */
static PyObject *dv_l_spared(DivObject *d, PyObject *args)
{
    PyObject *pages, *room;
    Py_ssize_t n, k;
    double r = 0.0;
    long long v = 0;
    int is_int = 0, ovf = 0;
    if (!PyArg_ParseTuple(args, "OO:l_spared", &pages, &room)) return NULL;
    if (PyLong_Check(room)) {
        is_int = 1;
        v = PyLong_AsLongLongAndOverflow(room, &ovf);
        if (v == -1 && PyErr_Occurred()) return NULL;
    } else {
        r = PyFloat_AsDouble(room);
        if (r == -1.0 && PyErr_Occurred()) return NULL;
    }
    if (is_int ? (ovf < 0 || (!ovf && v < 0)) : r < 0) { /* any page in L spares the leaf */
        k = dv_count(d, pages, DV_L, DV_L, DV_COUNT_FIRST, 1);
        return k < 0 ? NULL : PyLong_FromLong(k ? -1 : 0);
    }
    n = PyObject_Length(pages);
    if (n < 0) return NULL;
    if (is_int ? (!ovf && v < n) : r < (double)n) {
        Py_ssize_t lim = is_int ? (Py_ssize_t)v : (Py_ssize_t)r; /* int(room): 0 <= it < n */
        k = dv_count(d, pages, DV_L, DV_L, DV_COUNT_FIRST, lim + 1);
        if (k < 0) return NULL;
        return PyLong_FromSsize_t((is_int ? k > lim : (double)k > r) ? -1 : k);
    }
    k = dv_count(d, pages, DV_L, DV_L, DV_COUNT_ALL, 0); /* (at most room; a NaN room: never held) */
    return k < 0 ? NULL : PyLong_FromSsize_t(k);
}

static PyObject *dv_check(DivObject *d, PyObject *Py_UNUSED(ignored))
{
    Py_ssize_t n[4] = {0, 0, 0, 0}, fill = 0;
    size_t i, j;
    for (i = 0; i <= d->mask; i++) {
        dv_slot *s = &d->tab[i];
        if (s->key == NULL) continue;
        if ((s->side & ~DV_SEEN) == 0 || (s->side & ~DV_SEEN) > 3) return check_fail("a divergence entry on no side");
        n[s->side & 3]++;
        fill++;
        for (j = dv_home(d->mask, s->hash); j != i; j = (j + 1) & d->mask)
            if (d->tab[j].key == NULL) return check_fail("a divergence entry off its probe run");
    }
    if (fill != d->fill || n[1] != d->n[1] || n[2] != d->n[2] || n[3] != d->n[3] || 2 * (size_t)fill > d->mask + 1)
        return check_fail("the divergence's counts");
    if (d->counting) {
        if (dv_lazy(d)) {
            int k, ok = 1;
            for (k = 0; k < 2 && ok == 1; k++) {
                PyObject *src = k ? d->r_pages : d->l_pages, *got, *want = NULL;
                if (src == NULL) src = Py_None;
                Py_INCREF(src);
                got = dv_side_set(d, k ? DV_R : DV_L);
                if (got != NULL) want = PyObject_CallNoArgs(src);
                if (want != NULL) Py_SETREF(want, PySet_New(want));
                ok = want == NULL ? -1 : PyObject_RichCompareBool(got, want, Py_EQ);
                Py_XDECREF(got);
                Py_XDECREF(want);
                Py_DECREF(src);
            }
            if (ok < 0) return NULL;
            if (!ok) return check_fail("stale sides");
        }
    } else if (dv_lazy(d) && fill)
        return check_fail("a lazy divergence keeps no sets while not counting");
    Py_RETURN_NONE;
}

static int dv_init(DivObject *d, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"l_pages", "r_pages", NULL};
    PyObject *lp = Py_None, *rp = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|OO:Divergence", kwlist, &lp, &rp)) return -1;
    if (d->busy) return dv_refuse();
    if ((lp == Py_None) != (rp == Py_None)) {
        PyErr_SetString(PyExc_AssertionError, "a lazy divergence needs both sources");
        return -1;
    }
    if (dv_empty(d) < 0) return -1;
    d->counting = 0;
    Py_INCREF(lp);
    Py_XSETREF(d->l_pages, lp);
    Py_INCREF(rp);
    Py_XSETREF(d->r_pages, rp);
    return 0;
}

static int dv_traverse(DivObject *d, visitproc visit, void *arg)
{
    size_t i;
    Py_VISIT(d->l_pages);
    Py_VISIT(d->r_pages);
    if (d->tab != NULL)
        for (i = 0; i <= d->mask; i++) Py_VISIT(d->tab[i].key);
    return 0;
}

static int dv_clear(DivObject *d)
{
    /* the sources (the cycle through lru's tree shadow's bound ``pages``), then the keys: a key
       may hold this divergence too, through an object with no tp_clear of its own (a tuple), a
       cycle only this can break (as a set's clear does). An empty table is put in place first,
       so a method called from a finalizer still finds one (no memory for it: the keys stay) */
    Py_CLEAR(d->l_pages);
    Py_CLEAR(d->r_pages);
    if (d->tab != NULL && d->fill > 0 && !d->busy) {
        dv_slot *old = d->tab, *t = PyMem_Calloc(DV_MIN, sizeof(dv_slot)); /* (no memory: kept) */
        size_t oldmask = d->mask;
        if (t != NULL) {
            d->tab = t;
            d->mask = DV_MIN - 1;
            d->fill = 0;
            d->n[0] = d->n[1] = d->n[2] = d->n[3] = 0;
            dv_free_table(old, oldmask);
        }
    }
    return 0;
}

static void dv_dealloc(DivObject *d)
{
    dv_slot *t = d->tab;
    PyObject_GC_UnTrack(d);
    Py_CLEAR(d->l_pages);
    Py_CLEAR(d->r_pages);
    d->tab = NULL;
    dv_free_table(t, d->mask);
    Py_TYPE(d)->tp_free((PyObject *)d);
}

static PyObject *dv_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    DivObject *d = (DivObject *)type->tp_alloc(type, 0);
    if (d == NULL) return NULL;
    d->tab = PyMem_Calloc(DV_MIN, sizeof(dv_slot));
    if (d->tab == NULL) {
        Py_DECREF(d);
        return PyErr_NoMemory();
    }
    d->mask = DV_MIN - 1;
    return (PyObject *)d;
}

static PyMethodDef dv_methods[] = {
    {"start", (PyCFunction)dv_start, METH_NOARGS, "start counting (with sources: both sides read whole)"},
    {"stop", (PyCFunction)dv_stop, METH_NOARGS, "stop counting (with sources: the sets dropped)"},
    {"l_add", (PyCFunction)dv_l_add, METH_O, "l_add(pages): lru's tree took them in"},
    {"l_remove", (PyCFunction)dv_l_remove, METH_O, "l_remove(pages): lru's tree dropped them"},
    {"r_add", (PyCFunction)dv_r_add, METH_O, "r_add(pages): the real cache stored them"},
    {"r_remove", (PyCFunction)dv_r_remove, METH_O, "r_remove(pages): the real cache dropped them"},
    {"r_clear", (PyCFunction)dv_r_clear, METH_NOARGS, "r_clear(): the real cache is empty"},
    {"held", (PyCFunction)dv_held, METH_NOARGS, "whether L and R are the two sides' pages now"},
    {"check", (PyCFunction)dv_check, METH_NOARGS, "check(): assert the invariants"},
    {"l_run", (PyCFunction)dv_l_run, METH_O, "l_run(pages) -> how many of pages, from the first, L holds"},
    {"l_count", (PyCFunction)dv_l_count, METH_O, "l_count(pages) -> |L & set(pages)|"},
    {"l_only", (PyCFunction)dv_l_only, METH_O, "l_only(pages) -> |set(pages) & L - R| (from the sources if not held)"},
    {"l_spared", (PyCFunction)dv_l_spared, METH_VARARGS, "l_spared(pages, room) -> -1 if more than room of pages are in L, else how many"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef dv_members[] = {
    {"l_pages", T_OBJECT, offsetof(DivObject, l_pages), 0, "lru's side now (a callable), or None"},
    {"r_pages", T_OBJECT, offsetof(DivObject, r_pages), 0, "the real cache's side now (a callable), or None"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef dv_getset[] = {
    {"L", (getter)dv_get_L, (setter)dv_set_L, "lru's tree's pages (a new set)", NULL},
    {"R", (getter)dv_get_R, (setter)dv_set_R, "the real cache's pages (a new set)", NULL},
    {"only_l", (getter)dv_get_only_l, NULL, "|L - R| while counting, else 0", NULL},
    {"only_r", (getter)dv_get_only_r, NULL, "|R - L| while counting, else 0", NULL},
    {"counting", (getter)dv_get_counting, NULL, "the counts are kept", NULL},
    {"lazy", (getter)dv_get_lazy, NULL, "with sources: the sets are kept only while counting", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject DivType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "sglang_tiered.core._bookkeeping.Divergence",
    .tp_basicsize = sizeof(DivObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "C Divergence (core/shadows.py's DivergencePy is the reference)",
    .tp_new = dv_new,
    .tp_init = (initproc)dv_init,
    .tp_dealloc = (destructor)dv_dealloc,
    .tp_traverse = (traverseproc)dv_traverse,
    .tp_clear = (inquiry)dv_clear,
    .tp_free = PyObject_GC_Del,
    .tp_methods = dv_methods,
    .tp_members = dv_members,
    .tp_getset = dv_getset,
};

/* ------------------------------------------------------------------ tree shadow */

/* core/shadows.py ``TreeShadowPy`` (SGLang's RadixCache replayed as metadata, per fixed order),
   step for step: the same walks, splits, touches, hit counts, locks, evictions and track calls in
   the same order, the same clock, seq and stamps. The reference's objects map as follows:

   - a ``_Node`` is a ``tnode`` from a pool owned by the shadow (chunks, never returned before the
     shadow goes: a stale heap entry may still point at a freed node, whose stamp is then -1 and
     can never equal an entry's stamp, as a gone node's never does in the reference);
   - ``node.key`` is an array of owned references (``track`` gets a new list of them);
   - every node's ``children`` dict is one table for the whole tree, keyed by (parent, first page)
     with the page's own hash and equality (bytes compared by content, other keys by ``==``), and
     a list of each node's children in the dict's insertion order (``lasts`` walks it as the
     reference walks the dicts: with repeated pages the later node's entry wins in both);
   - ``leaves`` is a flag per node and a count (the heap's rebuild rule reads ``len(leaves)``);
   - a heap entry ``(priority, seq, stamp, node)`` is four integers and the node: lru's priority
     ``last`` is (0, last), slru's ``(hits >= 2, last)`` and lfu's ``(hits, last)`` are the pair
     itself, so entries order as the tuples do. Any binary heap pops the same entries: all
     entries differ (stamps are unique), so the minimum is one entry, whatever the layout. */

typedef struct tnode {
    PyObject **keys; /* the node's pages (owned), len of them; NULL for the root and free nodes */
    Py_ssize_t len;
    struct tnode *parent, *first, *lastc, *prev, *next; /* children in insertion order; next: free list */
    Py_hash_t khash; /* hash(keys[0]) */
    long long last, hits, seq, stamp;
    Py_ssize_t lock;
    int leaf, live;
    unsigned long mark; /* check's live heap entries */
} tnode;

typedef struct {
    long long k1, k2, seq, stamp;
    tnode *node;
} hentry;

typedef struct {
    PyObject_HEAD
    Py_ssize_t cap, used, nleaves;
    int order; /* 0 lru, 1 slru, 2 lfu */
    int full, busy;
    long long clock, seq, stamps;
    tnode *root; /* NULL: not initialized (or cleared by the garbage collector) */
    PyObject *track;
    tnode **chunks;
    Py_ssize_t nchunks;
    tnode *free_nodes;
    tnode **table; /* (parent, first page) -> child: open addressing, linear probing */
    size_t tmask;
    Py_ssize_t tcount;
    hentry *heap;
    Py_ssize_t hlen, halloc;
    tnode **path; /* a walk's path (run's, then its insert's walk on) */
    Py_ssize_t plen, palloc;
    unsigned long epoch;
} TreeObject;

static PyTypeObject TreeType;
static PyObject *str_l_add, *str_l_remove;
static const char *const ORDERS[3] = {"lru", "slru", "lfu"};

#define TS_CHUNK 256

static tnode *ts_node_new(TreeObject *t)
{
    tnode *n;
    if (t->free_nodes == NULL) {
        tnode **chunks = PyMem_Realloc(t->chunks, (size_t)(t->nchunks + 1) * sizeof(tnode *));
        tnode *c;
        int i;
        if (chunks == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        t->chunks = chunks;
        c = PyMem_Calloc(TS_CHUNK, sizeof(tnode));
        if (c == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        t->chunks[t->nchunks++] = c;
        for (i = TS_CHUNK - 1; i >= 0; i--) {
            c[i].stamp = -1;
            c[i].next = t->free_nodes;
            t->free_nodes = &c[i];
        }
    }
    n = t->free_nodes;
    t->free_nodes = n->next;
    memset(n, 0, sizeof(tnode));
    n->stamp = -1;
    n->live = 1;
    return n;
}

/* back to the pool (stamp -1: any heap entry still pointing here is stale) */
static void ts_node_free(TreeObject *t, tnode *n)
{
    PyObject **keys = n->keys;
    Py_ssize_t i, len = n->len;
    n->keys = NULL;
    n->len = 0;
    n->live = n->leaf = 0;
    n->stamp = -1;
    n->parent = n->first = n->lastc = n->prev = NULL;
    n->next = t->free_nodes;
    t->free_nodes = n;
    for (i = 0; i < len; i++) Py_DECREF(keys[i]);
    PyMem_Free(keys);
}

static inline int ts_keq(PyObject *a, PyObject *b)
{
    if (a == b) return 1;
    if (PyBytes_CheckExact(a) && PyBytes_CheckExact(b))
        return PyBytes_GET_SIZE(a) == PyBytes_GET_SIZE(b) &&
               memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b), PyBytes_GET_SIZE(a)) == 0;
    return PyObject_RichCompareBool(a, b, Py_EQ);
}

/* where (parent, a page of hash h) goes in the table: the page's own hash (SipHash for bytes,
   keyed per process; see key_hash) mixed with its parent's address */
static inline size_t ts_home(TreeObject *t, tnode *parent, Py_hash_t h)
{
    uint64_t x = (uint64_t)h ^ ((uint64_t)(uintptr_t)parent * 0x9E3779B97F4A7C15ULL);
    x *= 0xBF58476D1CE4E5B9ULL;
    return (size_t)(x ^ (x >> 31)) & t->tmask;
}

/* the child of parent under page key (hash h): 1 and *out, 0 if none, -1 on error */
static int ts_find(TreeObject *t, tnode *parent, PyObject *key, Py_hash_t h, tnode **out)
{
    size_t i = ts_home(t, parent, h);
    tnode *n;
    while ((n = t->table[i]) != NULL) {
        if (n->parent == parent && n->khash == h) {
            int eq = ts_keq(n->keys[0], key);
            if (eq < 0) return -1;
            if (eq) {
                *out = n;
                return 1;
            }
        }
        i = (i + 1) & t->tmask;
    }
    *out = NULL;
    return 0;
}

static size_t ts_slot_of(TreeObject *t, tnode *n)
{
    size_t i = ts_home(t, n->parent, n->khash);
    while (t->table[i] != n) i = (i + 1) & t->tmask;
    return i;
}

/* room in the table for `more` entries (at most half full), rebuilt bigger if needed */
static int ts_table_reserve(TreeObject *t, Py_ssize_t more)
{
    size_t size = t->tmask + 1, i, old = size;
    tnode **tab, **prev = t->table;
    if (prev != NULL && 2 * (size_t)(t->tcount + more) <= size) return 0;
    if (prev == NULL) size = 64;
    while (2 * (size_t)(t->tcount + more) > size) size <<= 1;
    tab = PyMem_Calloc(size, sizeof(tnode *));
    if (tab == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->table = tab;
    t->tmask = size - 1;
    if (prev != NULL) {
        for (i = 0; i < old; i++) {
            tnode *n = prev[i];
            if (n == NULL) continue;
            size_t s = ts_home(t, n->parent, n->khash);
            while (tab[s] != NULL) s = (s + 1) & t->tmask;
            tab[s] = n;
        }
        PyMem_Free(prev);
    }
    return 0;
}

/* put n (parent and khash set) in the table: room reserved by the caller */
static void ts_table_put(TreeObject *t, tnode *n)
{
    size_t s = ts_home(t, n->parent, n->khash);
    while (t->table[s] != NULL) s = (s + 1) & t->tmask;
    t->table[s] = n;
    t->tcount++;
}

/* backward-shift deletion (no tombstones), as mc_table_del */
static void ts_table_del(TreeObject *t, size_t i)
{
    size_t j = i, k, mask = t->tmask;
    t->table[i] = NULL;
    t->tcount--;
    for (;;) {
        j = (j + 1) & mask;
        if (t->table[j] == NULL) return;
        k = ts_home(t, t->table[j]->parent, t->table[j]->khash);
        if (i <= j ? (i < k && k <= j) : (i < k || k <= j)) continue;
        t->table[i] = t->table[j];
        t->table[j] = NULL;
        i = j;
    }
}

static void ts_append_child(tnode *p, tnode *c)
{
    c->parent = p;
    c->next = NULL;
    c->prev = p->lastc;
    if (p->lastc != NULL)
        p->lastc->next = c;
    else
        p->first = c;
    p->lastc = c;
}

static void ts_unlink_child(tnode *c)
{
    tnode *p = c->parent;
    if (c->prev != NULL)
        c->prev->next = c->next;
    else
        p->first = c->next;
    if (c->next != NULL)
        c->next->prev = c->prev;
    else
        p->lastc = c->prev;
    c->prev = c->next = NULL;
}

static inline int he_lt(const hentry *a, const hentry *b)
{
    if (a->k1 != b->k1) return a->k1 < b->k1;
    if (a->k2 != b->k2) return a->k2 < b->k2;
    if (a->seq != b->seq) return a->seq < b->seq;
    return a->stamp < b->stamp;
}

static void ts_sift_down(hentry *h, Py_ssize_t n, Py_ssize_t i)
{
    hentry x = h[i];
    Py_ssize_t c;
    while ((c = 2 * i + 1) < n) {
        if (c + 1 < n && he_lt(&h[c + 1], &h[c])) c++;
        if (!he_lt(&h[c], &x)) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = x;
}

static hentry ts_heap_pop(TreeObject *t)
{
    hentry top = t->heap[0];
    t->hlen--;
    if (t->hlen > 0) {
        t->heap[0] = t->heap[t->hlen];
        ts_sift_down(t->heap, t->hlen, 0);
    }
    return top;
}

/* _push: (re)file evictable leaf n under its current priority (its older entries go stale);
   when the stale entries outnumber the live ones, only the live ones are kept */
static int ts_push(TreeObject *t, tnode *n)
{
    hentry e;
    Py_ssize_t i;
    if (t->hlen == t->halloc) {
        Py_ssize_t na = t->halloc ? 2 * t->halloc : 64;
        hentry *h = PyMem_Realloc(t->heap, (size_t)na * sizeof(hentry));
        if (h == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        t->heap = h;
        t->halloc = na;
    }
    t->stamps += 1;
    n->stamp = t->stamps;
    e.k1 = t->order == 0 ? 0 : t->order == 1 ? (n->hits >= 2) : n->hits;
    e.k2 = n->last;
    e.seq = n->seq;
    e.stamp = n->stamp;
    e.node = n;
    i = t->hlen++;
    while (i > 0) {
        Py_ssize_t up = (i - 1) / 2;
        if (!he_lt(&e, &t->heap[up])) break;
        t->heap[i] = t->heap[up];
        i = up;
    }
    t->heap[i] = e;
    if (t->hlen > 2 * t->nleaves + 64) { /* mostly stale: keep the live entries */
        Py_ssize_t j, k = 0;
        for (j = 0; j < t->hlen; j++) {
            tnode *x = t->heap[j].node;
            if (x->stamp == t->heap[j].stamp && x->leaf) t->heap[k++] = t->heap[j];
        }
        t->hlen = k;
        for (j = k / 2 - 1; j >= 0; j--) ts_sift_down(t->heap, k, j);
    }
    return 0;
}

static inline void ts_leaf_drop(TreeObject *t, tnode *n)
{
    if (n->leaf) {
        n->leaf = 0;
        t->nleaves--;
    }
}

static int ts_path_add(TreeObject *t, tnode *n)
{
    if (t->plen == t->palloc) {
        Py_ssize_t na = t->palloc ? 2 * t->palloc : 64;
        tnode **p = PyMem_Realloc(t->path, (size_t)na * sizeof(tnode *));
        if (p == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        t->path = p;
        t->palloc = na;
    }
    t->path[t->plen++] = n;
    return 0;
}

/* _split: a new parent of node holding node's first `at` pages (hit count and lock copied) */
static tnode *ts_split(TreeObject *t, tnode *node, Py_ssize_t at)
{
    Py_hash_t h = PyObject_Hash(node->keys[at]);
    PyObject **keys;
    tnode *top;
    size_t slot;
    if (h == -1) return NULL;
    if (ts_table_reserve(t, 1) < 0) return NULL;
    keys = PyMem_Malloc((size_t)at * sizeof(PyObject *));
    if (keys == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    top = ts_node_new(t);
    if (top == NULL) {
        PyMem_Free(keys);
        return NULL;
    }
    t->seq += 1;
    memcpy(keys, node->keys, (size_t)at * sizeof(PyObject *)); /* (the references move) */
    memmove(node->keys, node->keys + at, (size_t)(node->len - at) * sizeof(PyObject *));
    node->len -= at;
    top->keys = keys;
    top->len = at;
    top->last = node->last;
    top->hits = node->hits;
    top->lock = node->lock;
    top->seq = t->seq;
    top->khash = node->khash;
    /* parent.children[first page] = top: the same table slot and the same place in the order */
    slot = ts_slot_of(t, node);
    top->parent = node->parent;
    t->table[slot] = top;
    top->prev = node->prev;
    top->next = node->next;
    if (top->prev != NULL)
        top->prev->next = top;
    else
        top->parent->first = top;
    if (top->next != NULL)
        top->next->prev = top;
    else
        top->parent->lastc = top;
    node->prev = node->next = NULL;
    node->khash = h;
    ts_append_child(top, node);
    ts_table_put(t, node);
    return top;
}

/* _walk: match pages[i:n] below node (which holds pages[:i]), touching the path at tick and
   splitting a partly matched node; the path's nodes are appended to t->path. Returns the
   matched pages, or -1 on error. */
static Py_ssize_t ts_walk(TreeObject *t, PyObject **pages, Py_ssize_t n, long long tick, tnode *node,
                          Py_ssize_t i)
{
    node->last = tick;
    while (i < n) {
        tnode *child;
        Py_ssize_t lk, m, k = 1;
        Py_hash_t h = PyObject_Hash(pages[i]);
        int r;
        if (h == -1) return -1;
        r = ts_find(t, node, pages[i], h, &child);
        if (r < 0) return -1;
        if (r == 0) break;
        child->last = tick;
        lk = child->len;
        m = lk < n - i ? lk : n - i;
        while (k < m) {
            int eq = ts_keq(child->keys[k], pages[i + k]);
            if (eq < 0) return -1;
            if (!eq) break;
            k++;
        }
        if (k < m) {
            /* The reference's slices differ (compared as lists: identical items are equal); it
               then counts the matched pages with == alone, which an item unequal to itself (a
               NaN) stops: the identical items before the difference are asked again. (bytes,
               str and int are equal to themselves: page hashes never are asked.) */
            Py_ssize_t j = k;
            for (k = 1; k < j; k++) {
                PyObject *a = child->keys[k], *r;
                int eq;
                if (a != pages[i + k] || PyBytes_CheckExact(a) || PyUnicode_CheckExact(a) || PyLong_CheckExact(a))
                    continue;
                r = PyObject_RichCompare(a, a, Py_EQ);
                if (r == NULL) return -1;
                eq = PyObject_IsTrue(r);
                Py_DECREF(r);
                if (eq < 0) return -1;
                if (!eq) break;
            }
        }
        if (k < lk) {
            /* the lower part keeps the touch (SGLang touches, then splits) */
            if (child->leaf && ts_push(t, child) < 0) return -1;
            child = ts_split(t, child, k);
            if (child == NULL) return -1;
        }
        i += k;
        if (ts_path_add(t, child) < 0) return -1;
        node = child;
    }
    return i;
}

static int ts_set_lock(TreeObject *t, tnode *node, Py_ssize_t d)
{
    while (node != NULL) {
        node->lock += d;
        if (node->lock > 0)
            ts_leaf_drop(t, node);
        else if (node->first == NULL && !node->leaf) {
            node->leaf = 1;
            t->nleaves++;
            if (ts_push(t, node) < 0) return -1;
        }
        node = node->parent;
    }
    return 0;
}

/* track.<name>(node's pages as a new list), if track is set (a C Divergence: dv_tell) */
static int ts_tell(TreeObject *t, PyObject *name, tnode *n)
{
    PyObject *track = t->track, *lst, *r;
    Py_ssize_t i;
    if (track == NULL || track == Py_None) return 0;
    if (Py_TYPE(track) == &DivType) { /* the C Divergence: its update on the node's own pages */
        int err;
        Py_INCREF(track);
        err = dv_tell((DivObject *)track, n->keys, n->len, name == str_l_add);
        Py_DECREF(track);
        return err;
    }
    lst = PyList_New(n->len);
    if (lst == NULL) return -1;
    for (i = 0; i < n->len; i++) {
        Py_INCREF(n->keys[i]);
        PyList_SET_ITEM(lst, i, n->keys[i]);
    }
    Py_INCREF(track); /* (the callback may set another track) */
    r = PyObject_CallMethodOneArg(track, name, lst);
    Py_DECREF(track);
    Py_DECREF(lst);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

static int ts_evict(TreeObject *t, Py_ssize_t pages)
{
    Py_ssize_t freed = 0;
    t->full = 1;
    while (freed < pages && t->hlen > 0) {
        hentry e = ts_heap_pop(t);
        tnode *x = e.node, *p;
        int err;
        if (x->stamp != e.stamp || !x->leaf) continue; /* stale: re-filed since, locked, or gone */
        freed += x->len;
        t->used -= x->len;
        p = x->parent;
        ts_table_del(t, ts_slot_of(t, x));
        ts_unlink_child(x);
        ts_leaf_drop(t, x);
        x->stamp = -1;
        err = ts_tell(t, str_l_remove, x);
        ts_node_free(t, x);
        if (err < 0) return -1;
        if (p->first == NULL && p->lock == 0) {
            p->leaf = 1;
            t->nleaves++;
            if (ts_push(t, p) < 0) return -1;
        }
    }
    return 0;
}

/* _insert: SGLang's insert after run's match (t->path[:npath], ending at last, matched pages;
   capped: the match stopped short of them, the insert walks on) */
static int ts_insert(TreeObject *t, PyObject **pages, Py_ssize_t len, Py_ssize_t start, Py_ssize_t npath,
                     tnode *last, Py_ssize_t matched, int capped)
{
    long long tick;
    Py_ssize_t end = 0, j, inserted = matched;
    tnode *tip = last;
    t->clock += 2;
    tick = t->clock;
    t->root->last = tick;
    for (j = 0; j < npath; j++) {
        tnode *node = t->path[j];
        node->last = tick;
        end += node->len;
        if (end > start) node->hits += 1;
    }
    if (capped) { /* SGLang's insert walks on over what is cached past the match's limit */
        Py_ssize_t base = t->plen = npath;
        inserted = ts_walk(t, pages, len, tick, last, matched);
        if (inserted < 0) return -1;
        for (j = base; j < t->plen; j++) {
            tnode *node = t->path[j];
            end += node->len;
            if (end > start) node->hits += 1;
            if (node->leaf && ts_push(t, node) < 0) return -1;
        }
        if (t->plen > base) tip = t->path[t->plen - 1];
    }
    if (inserted < len) {
        Py_hash_t h = PyObject_Hash(pages[inserted]);
        PyObject **keys;
        tnode *leaf;
        Py_ssize_t n = len - inserted;
        if (h == -1 || ts_table_reserve(t, 1) < 0) return -1;
        keys = PyMem_Malloc((size_t)n * sizeof(PyObject *));
        if (keys == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        leaf = ts_node_new(t);
        if (leaf == NULL) {
            PyMem_Free(keys);
            return -1;
        }
        t->seq += 1;
        for (j = 0; j < n; j++) {
            keys[j] = pages[inserted + j];
            Py_INCREF(keys[j]);
        }
        leaf->keys = keys;
        leaf->len = n;
        leaf->last = tick;
        leaf->hits = len > start ? 1 : 0;
        leaf->seq = t->seq;
        leaf->khash = h;
        ts_leaf_drop(t, tip); /* (an unlocked node the insert walked to: no longer a leaf) */
        ts_append_child(tip, leaf);
        ts_table_put(t, leaf);
        t->used += n;
        if (ts_tell(t, str_l_add, leaf) < 0) return -1;
        if (t->used >= t->cap) t->full = 1;
        leaf->leaf = 1;
        t->nleaves++;
        if (ts_push(t, leaf) < 0) return -1;
    }
    return 0;
}

static inline Py_ssize_t py_mod(Py_ssize_t a, Py_ssize_t b)
{
    Py_ssize_t r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

static inline Py_ssize_t py_div(Py_ssize_t a, Py_ssize_t b)
{
    Py_ssize_t q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

/* _decoded: the release of a request that decoded `steps` tokens after its n-token prompt */
static Py_ssize_t ts_decoded(TreeObject *t, PyObject **pages, Py_ssize_t len, Py_ssize_t start, Py_ssize_t n,
                             Py_ssize_t steps, Py_ssize_t page)
{
    Py_ssize_t ns = start >= 0 ? (start < len ? start : len) : (len + start > 0 ? len + start : 0);
    Py_ssize_t matched, npath, held, pos, end;
    tnode *last;
    t->clock += 1;
    t->plen = 0;
    matched = ts_walk(t, pages, ns, t->clock, t->root, 0);
    if (matched < 0) return -1;
    npath = t->plen;
    last = npath ? t->path[npath - 1] : t->root;
    if (ts_set_lock(t, last, 1) < 0) return -1;
    held = py_mod(n, page) > 0;
    /* each step evicts until a page is free, then takes one at a page boundary; only the first
       step, each boundary and the step after it are visited (as the reference) */
    pos = n;
    end = n + steps;
    while (pos < end) {
        Py_ssize_t free = t->cap - t->used - held;
        if (free < 1 && ts_evict(t, 1 - free) < 0) return -1;
        if (py_mod(pos, page) == 0) {
            held += 1;
            pos += 1;
        } else {
            Py_ssize_t b = (py_div(pos, page) + 1) * page;
            pos = b < end ? b : end;
        }
    }
    if (matched == start && ts_insert(t, pages, len, start, npath, last, matched, 1) < 0) return -1;
    if (ts_set_lock(t, last, -1) < 0) return -1;
    return 0;
}

static Py_ssize_t ts_run_impl(TreeObject *t, PyObject **pages, Py_ssize_t len, Py_ssize_t tail, Py_ssize_t start,
                              PyObject *limit, Py_ssize_t reserve)
{
    Py_ssize_t lim = 0, matched, npath, need, want;
    int capped = 0, fits, locked;
    tnode *last;
    if (limit != Py_None) {
        lim = PyNumber_AsSsize_t(limit, PyExc_OverflowError);
        if (lim == -1 && PyErr_Occurred()) return -1;
        capped = lim < len;
    }
    t->clock += 1;
    t->plen = 0;
    matched = ts_walk(t, pages, capped ? lim : len, t->clock, t->root, 0);
    if (matched < 0) return -1;
    npath = t->plen;
    last = npath ? t->path[npath - 1] : t->root;
    need = len - matched + tail;
    /* SGLang takes a request only when it fits the free and evictable pages; the lock only keeps
       the path from the eviction (see the reference's comments) */
    fits = len + tail <= t->cap;
    want = need ? need + reserve : 0;
    locked = fits && want > t->cap - t->used;
    if (locked) {
        if (ts_set_lock(t, last, 1) < 0 || ts_evict(t, want - (t->cap - t->used)) < 0) return -1;
    }
    if (fits && need <= t->cap - t->used && ts_insert(t, pages, len, start, npath, last, matched, capped) < 0)
        return -1;
    if (locked) {
        if (ts_set_lock(t, last, -1) < 0) return -1;
    } else if (last->leaf && ts_push(t, last) < 0)
        return -1;
    return matched - start > 0 ? matched - start : 0;
}

static int ts_ready(TreeObject *t)
{
    if (t->root == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "TreeShadow not initialized");
        return -1;
    }
    return 0;
}

static int ts_enter(TreeObject *t)
{
    if (ts_ready(t) < 0) return -1;
    if (t->busy) { /* track, or a page's __eq__ or __hash__, called back into this shadow */
        PyErr_SetString(PyExc_RuntimeError, "TreeShadow.run and touch are not re-entrant (nor run by a read's key)");
        return -1;
    }
    return 0;
}

/* the pages as a tuple: a callback (track) cannot change them under the walk */
static PyObject *ts_pages_arg(PyObject *pages)
{
    if (PyTuple_CheckExact(pages)) {
        Py_INCREF(pages);
        return pages;
    }
    return PySequence_Tuple(pages);
}

/* run's counts (tail, start, reserve, decode's tokens, steps and page size) are at most an eighth
   of Py_ssize_t's range either way, so that the reference's sums and differences of them and of
   page counts (len + tail, len - matched + tail + reserve, matched - start, n + steps, a page
   boundary past n + steps) cannot overflow: past it the C would decide otherwise than the
   reference's unbounded ints (a tail of sys.maxsize "fit" and was inserted), or loop forever */
static inline int ts_out_of_range(Py_ssize_t v) { return v > PY_SSIZE_T_MAX / 8 || v < -(PY_SSIZE_T_MAX / 8); }

static PyObject *ts_range_error(void)
{
    PyErr_SetString(PyExc_OverflowError, "TreeShadow.run: a count beyond +-(sys.maxsize // 8)");
    return NULL;
}

static PyObject *ts_run(TreeObject *t, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"pages", "tail", "start", "limit", "reserve", "decode", NULL};
    PyObject *pages, *limit = Py_None, *decode = Py_None, *tup;
    Py_ssize_t tail = 0, start = 0, reserve = 0, r;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|nnOnO:run", kwlist, &pages, &tail, &start, &limit, &reserve,
                                     &decode))
        return NULL;
    if (ts_enter(t) < 0) return NULL;
    if (ts_out_of_range(tail) || ts_out_of_range(start) || ts_out_of_range(reserve)) return ts_range_error();
    tup = ts_pages_arg(pages);
    if (tup == NULL) return NULL;
    t->busy = 1;
    if (decode != Py_None) {
        Py_ssize_t n, steps, page;
        PyObject *d = PySequence_Tuple(decode);
        if (d == NULL || !PyArg_ParseTuple(d, "nnn:decode", &n, &steps, &page))
            r = -1;
        else if (page < 1) {
            PyErr_SetString(PyExc_ValueError, "decode's page size must be positive");
            r = -1;
        } else if (ts_out_of_range(n) || ts_out_of_range(steps) || ts_out_of_range(page)) {
            ts_range_error();
            r = -1;
        } else
            r = ts_decoded(t, &PyTuple_GET_ITEM(tup, 0), PyTuple_GET_SIZE(tup), start, n, steps, page);
        Py_XDECREF(d);
    } else
        r = ts_run_impl(t, &PyTuple_GET_ITEM(tup, 0), PyTuple_GET_SIZE(tup), tail, start, limit, reserve);
    t->busy = 0;
    Py_DECREF(tup);
    return r < 0 ? NULL : PyLong_FromSsize_t(r);
}

static PyObject *ts_touch(TreeObject *t, PyObject *pages)
{
    PyObject *tup;
    Py_ssize_t matched;
    if (ts_enter(t) < 0) return NULL;
    tup = ts_pages_arg(pages);
    if (tup == NULL) return NULL;
    t->busy = 1;
    t->clock += 1;
    t->plen = 0;
    matched = ts_walk(t, &PyTuple_GET_ITEM(tup, 0), PyTuple_GET_SIZE(tup), t->clock, t->root, 0);
    /* (a touched leaf's priority moved; the walk leaves that to its caller) */
    if (matched >= 0 && t->plen && t->path[t->plen - 1]->leaf && ts_push(t, t->path[t->plen - 1]) < 0)
        matched = -1;
    t->busy = 0;
    Py_DECREF(tup);
    return matched < 0 ? NULL : PyLong_FromSsize_t(matched);
}

/* every node back to the pool's memory, the pool, table, heap and path freed; root NULL. The
   shadow is emptied before the first key is given back: a key's last reference can run Python
   code (a __del__) that calls this shadow, which then finds it uninitialized, not half freed. */
static void ts_release(TreeObject *t)
{
    tnode **chunks = t->chunks;
    Py_ssize_t c, nchunks = t->nchunks;
    int i;
    PyMem_Free(t->table);
    PyMem_Free(t->heap);
    PyMem_Free(t->path);
    t->chunks = NULL;
    t->nchunks = 0;
    t->free_nodes = NULL;
    t->table = NULL;
    t->tmask = 0;
    t->tcount = 0;
    t->heap = NULL;
    t->hlen = t->halloc = 0;
    t->path = NULL;
    t->plen = t->palloc = 0;
    t->root = NULL;
    t->used = t->nleaves = 0;
    for (c = 0; c < nchunks; c++) {
        for (i = 0; i < TS_CHUNK; i++) {
            tnode *n = &chunks[c][i];
            PyObject **keys = n->keys;
            Py_ssize_t j, len = n->len;
            if (!n->live) continue;
            n->live = 0;
            n->keys = NULL;
            n->len = 0;
            for (j = 0; j < len; j++) Py_DECREF(keys[j]);
            PyMem_Free(keys);
        }
    }
    for (c = 0; c < nchunks; c++) PyMem_Free(chunks[c]);
    PyMem_Free(chunks);
}

static int ts_order_of(PyObject *order)
{
    int i;
    if (PyUnicode_Check(order))
        for (i = 0; i < 3; i++)
            if (PyUnicode_CompareWithASCIIString(order, ORDERS[i]) == 0) return i;
    PyErr_Format(PyExc_ValueError, "order must be one of ('lru', 'slru', 'lfu'), got %R", order);
    return -1;
}

static int ts_init(TreeObject *t, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"capacity", "order", NULL};
    Py_ssize_t capacity;
    PyObject *order = NULL;
    int o = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n|O:TreeShadow", kwlist, &capacity, &order)) return -1;
    if (order != NULL && (o = ts_order_of(order)) < 0) return -1;
    if (t->busy) {
        PyErr_SetString(PyExc_RuntimeError, "TreeShadow re-initialized during a run or a read");
        return -1;
    }
    ts_release(t);
    t->cap = capacity > 1 ? capacity : 1;
    t->order = o;
    t->full = 0;
    t->clock = t->seq = t->stamps = 0;
    if (ts_table_reserve(t, 1) < 0) return -1;
    t->root = ts_node_new(t);
    if (t->root == NULL) return -1;
    t->root->lock = 1; /* as SGLang's root: never evictable */
    t->root->seq = 0;
    Py_CLEAR(t->track);
    return 0;
}

static int ts_traverse(TreeObject *t, visitproc visit, void *arg)
{
    Py_ssize_t c, j;
    int i;
    Py_VISIT(t->track); /* (a lazy Divergence holds the shadow's bound ``pages``: a cycle) */
    for (c = 0; c < t->nchunks; c++)
        for (i = 0; i < TS_CHUNK; i++) {
            tnode *n = &t->chunks[c][i];
            if (n->live)
                for (j = 0; j < n->len; j++) Py_VISIT(n->keys[j]);
        }
    return 0;
}

static int ts_clear(TreeObject *t)
{
    Py_CLEAR(t->track);
    if (!t->busy) ts_release(t);
    return 0;
}

static void ts_dealloc(TreeObject *t)
{
    PyObject_GC_UnTrack(t);
    Py_CLEAR(t->track);
    ts_release(t);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static int ts_cmp_seq(const void *a, const void *b)
{
    long long x = (*(tnode *const *)a)->seq, y = (*(tnode *const *)b)->seq;
    return (x > y) - (x < y);
}

/* fork(order): a copy of this tree (between requests: nothing locked), evicting by order from now on */
static PyObject *ts_fork(TreeObject *t, PyObject *order)
{
    TreeObject *f;
    tnode **stack = NULL, **leaves = NULL;
    Py_ssize_t sp = 0, nl = 0, nodes = t->tcount, i;
    if (ts_ready(t) < 0) return NULL;
    f = (TreeObject *)PyObject_CallFunction((PyObject *)Py_TYPE(t), "nO", t->cap, order);
    if (f == NULL) return NULL;
    f->used = t->used;
    f->clock = t->clock;
    f->seq = t->seq;
    f->full = t->full;
    f->root->last = t->root->last;
    f->root->hits = t->root->hits;
    stack = PyMem_Malloc((size_t)(2 * nodes + 2) * sizeof(tnode *));
    leaves = PyMem_Malloc((size_t)(nodes + 1) * sizeof(tnode *));
    if (stack == NULL || leaves == NULL || ts_table_reserve(f, nodes) < 0) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto fail;
    }
    stack[sp++] = t->root;
    stack[sp++] = f->root;
    while (sp > 0) {
        tnode *dst = stack[--sp], *src = stack[--sp], *c;
        for (c = src->first; c != NULL; c = c->next) {
            tnode *n = ts_node_new(f);
            PyObject **keys;
            if (n == NULL) goto fail;
            keys = PyMem_Malloc((size_t)c->len * sizeof(PyObject *));
            if (keys == NULL) {
                ts_node_free(f, n);
                PyErr_NoMemory();
                goto fail;
            }
            for (i = 0; i < c->len; i++) {
                keys[i] = c->keys[i];
                Py_INCREF(keys[i]);
            }
            n->keys = keys;
            n->len = c->len;
            n->last = c->last;
            n->hits = c->hits;
            n->seq = c->seq;
            n->khash = c->khash;
            ts_append_child(dst, n);
            ts_table_put(f, n);
            if (c->first != NULL) {
                stack[sp++] = c;
                stack[sp++] = n;
            } else {
                n->leaf = 1;
                f->nleaves++;
                leaves[nl++] = n;
            }
        }
    }
    /* filed in creation order, as the reference's sorted(leaves, key=seq) */
    qsort(leaves, (size_t)nl, sizeof(tnode *), ts_cmp_seq);
    for (i = 0; i < nl; i++)
        if (ts_push(f, leaves[i]) < 0) goto fail;
    PyMem_Free(stack);
    PyMem_Free(leaves);
    return (PyObject *)f;
fail:
    PyMem_Free(stack);
    PyMem_Free(leaves);
    Py_DECREF(f);
    return NULL;
}

/* pages(): every page the tree holds. The reads (pages, lasts, bounds, check) hold the shadow busy
   while they walk its nodes: a page's __hash__ or __eq__ (PySet_Add, PyDict_SetItem, the table)
   can run Python code, and a run, touch or __init__ from there would free the nodes under the
   walk; it is refused instead (RuntimeError), as from a run's callbacks. (A read from a run's
   callback is allowed: track's Divergence reads pages.) */
static PyObject *ts_pages(TreeObject *t, PyObject *Py_UNUSED(ignored))
{
    PyObject *out;
    Py_ssize_t c, j;
    int i, was = t->busy;
    if (ts_ready(t) < 0) return NULL;
    out = PySet_New(NULL);
    if (out == NULL) return NULL;
    t->busy = 1;
    for (c = 0; c < t->nchunks; c++)
        for (i = 0; i < TS_CHUNK; i++) {
            tnode *n = &t->chunks[c][i];
            if (n->live)
                for (j = 0; j < n->len; j++)
                    if (PySet_Add(out, n->keys[j]) < 0) {
                        t->busy = was;
                        Py_DECREF(out);
                        return NULL;
                    }
        }
    t->busy = was;
    return out;
}

/* lasts(): the last page of every node -> (its last touch, its creation order), the nodes visited
   in the reference's order (a stack of the children dicts' values) */
static PyObject *ts_lasts(TreeObject *t, PyObject *Py_UNUSED(ignored))
{
    PyObject *out;
    tnode **stack, *c;
    Py_ssize_t sp = 0;
    int was = t->busy;
    if (ts_ready(t) < 0) return NULL;
    stack = PyMem_Malloc((size_t)(t->tcount + 1) * sizeof(tnode *));
    if (stack == NULL) return PyErr_NoMemory();
    t->busy = 1; /* (see ts_pages) */
    out = PyDict_New();
    if (out == NULL) goto fail;
    for (c = t->root->first; c != NULL; c = c->next) stack[sp++] = c;
    while (sp > 0) {
        tnode *n = stack[--sp];
        PyObject *v = Py_BuildValue("(LL)", n->last, n->seq);
        if (v == NULL || PyDict_SetItem(out, n->keys[n->len - 1], v) < 0) {
            Py_XDECREF(v);
            goto fail;
        }
        Py_DECREF(v);
        for (c = n->first; c != NULL; c = c->next) stack[sp++] = c;
    }
    t->busy = was;
    PyMem_Free(stack);
    return out;
fail:
    t->busy = was;
    PyMem_Free(stack);
    Py_XDECREF(out);
    return NULL;
}

static PyObject *ts_bounds(TreeObject *t, PyObject *Py_UNUSED(ignored))
{
    PyObject *d = ts_lasts(t, NULL), *s;
    if (d == NULL) return NULL;
    s = PySet_New(d);
    Py_DECREF(d);
    return s;
}

/* check(): the reference's invariants (the pages held are the tree's, within capacity; the
   evictable leaves are the unlocked childless nodes, each with a live heap entry; nothing
   locked between requests; the track's L is the tree's pages) and the C structure's own links */
static PyObject *ts_check(TreeObject *t, PyObject *Py_UNUSED(ignored))
{
    tnode **stack, *c;
    Py_ssize_t sp = 0, seen = 0, nodes = 0, leaves = 0, j;
    const char *bad = NULL;
    int was = t->busy;
    if (ts_ready(t) < 0) return NULL;
    t->epoch += 1;
    for (j = 0; j < t->hlen; j++)
        if (t->heap[j].node->stamp == t->heap[j].stamp) t->heap[j].node->mark = t->epoch;
    stack = PyMem_Malloc((size_t)(t->tcount + 1) * sizeof(tnode *));
    if (stack == NULL) return PyErr_NoMemory();
    stack[sp++] = t->root;
    t->busy = 1; /* (see ts_pages: the table's keys' __eq__) */
    while (sp > 0 && bad == NULL) {
        tnode *n = stack[--sp], *prev = NULL;
        int want_leaf = n != t->root && n->first == NULL;
        seen += n->len;
        if (n != t->root && n->lock != 0) bad = "a node stayed locked";
        else if (n->leaf != want_leaf) bad = "evictable leaves";
        else if (n->leaf && n->mark != t->epoch) bad = "an evictable leaf without a live heap entry";
        leaves += n->leaf;
        for (c = n->first; c != NULL && bad == NULL; prev = c, c = c->next) {
            tnode *found;
            if (++nodes > t->tcount) bad = "tree links";
            else if (c->parent != n || c->prev != prev || c->len < 1 || !c->live) bad = "tree links";
            else if (ts_find(t, n, c->keys[0], c->khash, &found) < 0) {
                t->busy = was;
                PyMem_Free(stack);
                return NULL;
            } else if (found != c)
                bad = "tree links";
            else
                stack[sp++] = c;
        }
        if (bad == NULL && n->lastc != prev) bad = "tree links";
    }
    t->busy = was;
    PyMem_Free(stack);
    if (bad == NULL && (nodes != t->tcount || leaves != t->nleaves)) bad = "tree links";
    if (bad != NULL) return check_fail(bad);
    if (!(seen == t->used && t->used <= t->cap)) {
        PyErr_Format(PyExc_AssertionError, "(%zd, %zd, %zd)", seen, t->used, t->cap);
        return NULL;
    }
    if (t->track != NULL && t->track != Py_None) {
        PyObject *track = t->track, *r;
        int ok = 1;
        Py_INCREF(track);
        r = PyObject_CallMethod(track, "held", NULL);
        if (r != NULL) {
            ok = PyObject_IsTrue(r);
            Py_DECREF(r);
            if (ok == 1) {
                PyObject *L = PyObject_GetAttrString(track, "L"), *mine = ts_pages(t, NULL);
                ok = (L == NULL || mine == NULL) ? -1 : PyObject_RichCompareBool(L, mine, Py_EQ);
                Py_XDECREF(L);
                Py_XDECREF(mine);
                if (ok == 0) PyErr_SetString(PyExc_AssertionError, "the divergence's L is not the tree's pages");
                ok = ok == 1 ? 1 : -1;
            } else
                ok = ok == 0 ? 1 : -1;
        } else
            ok = -1;
        if (ok == 1) {
            r = PyObject_CallMethod(track, "check", NULL);
            if (r == NULL)
                ok = -1;
            else
                Py_DECREF(r);
        }
        Py_DECREF(track);
        if (ok < 0) return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *ts_get_track(TreeObject *t, void *Py_UNUSED(c))
{
    PyObject *r = t->track != NULL ? t->track : Py_None;
    Py_INCREF(r);
    return r;
}

static int ts_set_track(TreeObject *t, PyObject *v, void *Py_UNUSED(c))
{
    if (v == NULL) v = Py_None;
    Py_INCREF(v);
    Py_XSETREF(t->track, v);
    return 0;
}

static PyObject *ts_get_order(TreeObject *t, void *Py_UNUSED(c)) { return PyUnicode_FromString(ORDERS[t->order]); }
static PyObject *ts_get_full(TreeObject *t, void *Py_UNUSED(c)) { return PyBool_FromLong(t->full); }

static PyMethodDef ts_methods[] = {
    {"run", (PyCFunction)(void (*)(void))ts_run, METH_VARARGS | METH_KEYWORDS,
     "run(pages, tail=0, start=0, limit=None, reserve=0, decode=None) -> pages of pages[start:] hit"},
    {"touch", (PyCFunction)ts_touch, METH_O, "touch(pages) -> pages matched (a match never inserted)"},
    {"fork", (PyCFunction)ts_fork, METH_O, "fork(order) -> a copy evicting by order from now on"},
    {"pages", (PyCFunction)ts_pages, METH_NOARGS, "pages() -> set of every page held"},
    {"bounds", (PyCFunction)ts_bounds, METH_NOARGS, "bounds() -> set of every node's last page"},
    {"lasts", (PyCFunction)ts_lasts, METH_NOARGS, "lasts() -> {node's last page: (last touch, creation order)}"},
    {"check", (PyCFunction)ts_check, METH_NOARGS, "check(): assert the invariants"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef ts_members[] = {
    {"cap", T_PYSSIZET, offsetof(TreeObject, cap), READONLY, NULL},
    {"used", T_PYSSIZET, offsetof(TreeObject, used), READONLY, NULL},
    {"clock", T_LONGLONG, offsetof(TreeObject, clock), READONLY, NULL},
    {"seq", T_LONGLONG, offsetof(TreeObject, seq), READONLY, NULL},
    {"stamps", T_LONGLONG, offsetof(TreeObject, stamps), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef ts_getset[] = {
    {"track", (getter)ts_get_track, (setter)ts_set_track, "told of every page this tree takes in or drops", NULL},
    {"order", (getter)ts_get_order, NULL, "lru, slru or lfu", NULL},
    {"full", (getter)ts_get_full, NULL, "it held its capacity or had to evict", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject TreeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "sglang_tiered.core._bookkeeping.TreeShadow",
    .tp_basicsize = sizeof(TreeObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "C TreeShadow (core/shadows.py's TreeShadowPy is the reference)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ts_init,
    .tp_dealloc = (destructor)ts_dealloc,
    .tp_traverse = (traverseproc)ts_traverse,
    .tp_clear = (inquiry)ts_clear,
    .tp_free = PyObject_GC_Del,
    .tp_methods = ts_methods,
    .tp_members = ts_members,
    .tp_getset = ts_getset,
};

/* ------------------------------------------------------------------ module */

/* select(pages, mask) -> [h for h in pages if not h[0] & mask] */
static PyObject *bk_select(PyObject *self, PyObject *args)
{
    PyObject *pages, *seq, *out;
    long long mask, b;
    Py_ssize_t i, n;
    if (!PyArg_ParseTuple(args, "OL:select", &pages, &mask)) return NULL;
    seq = PySequence_Fast(pages, "select takes a sequence of page hashes");
    if (seq == NULL) return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    out = PyList_New(0);
    if (out == NULL) goto fail;
    for (i = 0; i < n; i++) {
        PyObject *h = PySequence_Fast_GET_ITEM(seq, i);
        if (first_byte(h, &b) < 0) goto fail;
        if (!(b & mask) && PyList_Append(out, h) < 0) goto fail;
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

static PyMethodDef bk_methods[] = {
    {"select", bk_select, METH_VARARGS, "select(pages, mask) -> the pages whose first byte & mask is 0"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef bk_module = {
    PyModuleDef_HEAD_INIT, "_bookkeeping",
    "C miniatures, frequency sketch, tree shadow and divergence (optional; core/miniature.py, core/sketch.py and "
    "core/shadows.py are the reference).", -1,
    bk_methods,
};

PyMODINIT_FUNC PyInit__bookkeeping(void)
{
    PyObject *m;
    if (PyType_Ready(&SketchType) < 0 || PyType_Ready(&MiniType) < 0 || PyType_Ready(&TreeType) < 0 ||
        PyType_Ready(&DivType) < 0)
        return NULL;
    if (str_l_add == NULL && (str_l_add = PyUnicode_InternFromString("l_add")) == NULL) return NULL;
    if (str_l_remove == NULL && (str_l_remove = PyUnicode_InternFromString("l_remove")) == NULL) return NULL;
    m = PyModule_Create(&bk_module);
    if (m == NULL) return NULL;
    Py_INCREF(&SketchType);
    if (PyModule_AddObject(m, "FrequencySketch", (PyObject *)&SketchType) < 0) goto fail;
    Py_INCREF(&MiniType);
    if (PyModule_AddObject(m, "MiniCache", (PyObject *)&MiniType) < 0) goto fail;
    Py_INCREF(&TreeType);
    if (PyModule_AddObject(m, "TreeShadow", (PyObject *)&TreeType) < 0) goto fail;
    Py_INCREF(&DivType);
    if (PyModule_AddObject(m, "Divergence", (PyObject *)&DivType) < 0) goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
