/* Optional accelerator for the policy's per-request bookkeeping (issue #11, session 42): the
   admission duel's miniatures (core/miniature.py ``MiniCache``) and the TinyLFU frequency sketch
   (core/sketch.py ``FrequencySketch``).

   The pure-Python classes in those modules are the reference: this C does exactly what they do,
   decision for decision (same hits, same segment order and ticks, the same float ``age``, the
   same counters and aging points), and tests/test_bookkeeping_c.py proves it on random streams.
   They are used where this extension is not built or SGLANG_TIERED_PURE_PYTHON=1.

   Floating point: ``age += 0.01 * (tick - t - age)`` and ``prot_tick + k * age`` are computed as
   Python computes them, one IEEE double operation at a time: each product goes through a
   volatile double, so no compiler can fuse it with the addition into an FMA (a different
   rounding) or keep it in extended precision.

   Keys are ``bytes`` (16-byte page hashes), stored as the objects themselves (a reference each,
   compared by content), never truncated. */

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
    "C miniatures and frequency sketch (optional; core/miniature.py and core/sketch.py are the reference).", -1,
    bk_methods,
};

PyMODINIT_FUNC PyInit__bookkeeping(void)
{
    PyObject *m;
    if (PyType_Ready(&SketchType) < 0 || PyType_Ready(&MiniType) < 0) return NULL;
    m = PyModule_Create(&bk_module);
    if (m == NULL) return NULL;
    Py_INCREF(&SketchType);
    if (PyModule_AddObject(m, "FrequencySketch", (PyObject *)&SketchType) < 0) goto fail;
    Py_INCREF(&MiniType);
    if (PyModule_AddObject(m, "MiniCache", (PyObject *)&MiniType) < 0) goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
