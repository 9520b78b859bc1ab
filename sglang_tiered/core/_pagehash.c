/* Optional accelerator for sglang_tiered.core.keys.chain_page_hashes (issue #11, session 41).

   chain(prev, data, page_size, overlap) -> list[bytes]

   ``data`` is the token run packed as little-endian int64 (keys._token_bytes). With
   step = 8 * page_size and width = step + 8 * overlap, page i (i < n, n = max(0, (len(data) -
   8 * overlap) // step)) hashes as

       h[i] = BLAKE2b-128(h[i-1] || data[i*step : i*step + width]),   h[-1] = prev

   which is exactly the pure-Python loop in keys.py (the reference; tests/test_review41_pagehash.py
   proves them equal). A trailing partial page is not hashed.

   keys(prev, data, page_size, overlap) and keys_list (session 46) chain the policy page keys the
   same way (keys.chain_page_keys, page_key below; tests/test_policy_keys.py).

   BLAKE2b (RFC 7693), unkeyed, 16-byte digest, written after the public-domain (CC0) reference
   implementation blake2b-ref.c; no OpenSSL. Byte order is handled with explicit shifts, so the
   result does not depend on the host's endianness. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define B2B_BLOCK 128
#define OUTLEN 16

typedef struct {
    uint64_t h[8];
    uint64_t t[2];
    uint64_t f[2];
    uint8_t buf[B2B_BLOCK];
    size_t buflen;
} b2b_state;

static const uint64_t b2b_iv[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t b2b_sigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t load64(const uint8_t *p)
{
    return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16) | ((uint64_t)p[3] << 24) |
           ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40) | ((uint64_t)p[6] << 48) | ((uint64_t)p[7] << 56);
}

static inline uint64_t rotr64(uint64_t w, unsigned c) { return (w >> c) | (w << (64 - c)); }

#define G(r, i, a, b, c, d)                          \
    do {                                             \
        a = a + b + m[b2b_sigma[r][2 * i + 0]];      \
        d = rotr64(d ^ a, 32);                       \
        c = c + d;                                   \
        b = rotr64(b ^ c, 24);                       \
        a = a + b + m[b2b_sigma[r][2 * i + 1]];      \
        d = rotr64(d ^ a, 16);                       \
        c = c + d;                                   \
        b = rotr64(b ^ c, 63);                       \
    } while (0)

static void b2b_compress(b2b_state *S, const uint8_t *block)
{
    uint64_t m[16], v[16];
    int i;
    for (i = 0; i < 16; i++) m[i] = load64(block + 8 * i);
    for (i = 0; i < 8; i++) v[i] = S->h[i];
    v[8] = b2b_iv[0];
    v[9] = b2b_iv[1];
    v[10] = b2b_iv[2];
    v[11] = b2b_iv[3];
    v[12] = b2b_iv[4] ^ S->t[0];
    v[13] = b2b_iv[5] ^ S->t[1];
    v[14] = b2b_iv[6] ^ S->f[0];
    v[15] = b2b_iv[7] ^ S->f[1];
    /* the rounds spelled out: constant sigma indices (message words in registers), ~1.5x the loop */
#define ROUND(r)                              \
    do {                                      \
        G(r, 0, v[0], v[4], v[8], v[12]);     \
        G(r, 1, v[1], v[5], v[9], v[13]);     \
        G(r, 2, v[2], v[6], v[10], v[14]);    \
        G(r, 3, v[3], v[7], v[11], v[15]);    \
        G(r, 4, v[0], v[5], v[10], v[15]);    \
        G(r, 5, v[1], v[6], v[11], v[12]);    \
        G(r, 6, v[2], v[7], v[8], v[13]);     \
        G(r, 7, v[3], v[4], v[9], v[14]);     \
    } while (0)
    ROUND(0); ROUND(1); ROUND(2); ROUND(3); ROUND(4); ROUND(5);
    ROUND(6); ROUND(7); ROUND(8); ROUND(9); ROUND(10); ROUND(11);
#undef ROUND
    for (i = 0; i < 8; i++) S->h[i] ^= v[i] ^ v[i + 8];
}

static inline void b2b_count(b2b_state *S, uint64_t inc)
{
    S->t[0] += inc;
    S->t[1] += (S->t[0] < inc);
}

/* unkeyed, digest length OUTLEN, fanout 1, depth 1 (parameter block word 0) */
static void b2b_init(b2b_state *S)
{
    memset(S, 0, sizeof(*S));
    memcpy(S->h, b2b_iv, sizeof(S->h));
    S->h[0] ^= 0x01010000ULL ^ (uint64_t)OUTLEN;
}

static void b2b_update(b2b_state *S, const uint8_t *in, size_t inlen)
{
    if (inlen == 0) return;
    size_t left = S->buflen, fill = B2B_BLOCK - left;
    if (inlen > fill) { /* the last block is kept back for final (it gets the final flag) */
        S->buflen = 0;
        memcpy(S->buf + left, in, fill);
        b2b_count(S, B2B_BLOCK);
        b2b_compress(S, S->buf);
        in += fill;
        inlen -= fill;
        while (inlen > B2B_BLOCK) {
            b2b_count(S, B2B_BLOCK);
            b2b_compress(S, in);
            in += B2B_BLOCK;
            inlen -= B2B_BLOCK;
        }
    }
    memcpy(S->buf + S->buflen, in, inlen);
    S->buflen += inlen;
}

static void b2b_final(b2b_state *S, uint8_t out[OUTLEN])
{
    int i, j;
    b2b_count(S, S->buflen);
    S->f[0] = ~(uint64_t)0;
    memset(S->buf + S->buflen, 0, B2B_BLOCK - S->buflen);
    b2b_compress(S, S->buf);
    for (i = 0; i < OUTLEN / 8; i++)
        for (j = 0; j < 8; j++) out[8 * i + j] = (uint8_t)(S->h[i] >> (8 * j));
}

/* Policy page keys (keys.chain_page_keys): not an identity. Per page, the 128-bit state (h1, h2)
   starts as the previous key (little-endian u64 lanes; the chain's seed for the first page) and
   takes the page's ``width`` bytes through MurmurHash3_x64_128's block, tail and finalization
   steps (Austin Appleby, public domain), the state standing in for the seed. The mixing is a
   small fraction of BLAKE2b's two compressions a page (~45 against ~370 ns a page, the bytes
   object included); not collision resistant (a collision costs the policy an
   estimate, never a wrong page: nothing identifies KV by these keys). */
#define MM_C1 0x87c37b91114253d5ULL
#define MM_C2 0x4cf5ad432745937fULL

static inline uint64_t rotl64(uint64_t w, unsigned c) { return (w << c) | (w >> (64 - c)); }

static inline uint64_t fmix64(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

static void page_key(const uint8_t prev[OUTLEN], const uint8_t *p, Py_ssize_t width, uint8_t out[OUTLEN])
{
    uint64_t h1 = load64(prev), h2 = load64(prev + 8), k1, k2;
    Py_ssize_t off;
    int j;
    for (off = 0; off + 16 <= width; off += 16) {
        k1 = load64(p + off);
        k2 = load64(p + off + 8);
        k1 *= MM_C1; k1 = rotl64(k1, 31); k1 *= MM_C2; h1 ^= k1;
        h1 = rotl64(h1, 27); h1 += h2; h1 = h1 * 5 + 0x52dce729;
        k2 *= MM_C2; k2 = rotl64(k2, 33); k2 *= MM_C1; h2 ^= k2;
        h2 = rotl64(h2, 31); h2 += h1; h2 = h2 * 5 + 0x38495ab5;
    }
    if (off < width) { /* one word left (width is a multiple of 8) */
        k1 = load64(p + off);
        k1 *= MM_C1; k1 = rotl64(k1, 31); k1 *= MM_C2; h1 ^= k1;
    }
    h1 ^= (uint64_t)width;
    h2 ^= (uint64_t)width;
    h1 += h2;
    h2 += h1;
    h1 = fmix64(h1);
    h2 = fmix64(h2);
    h1 += h2;
    h2 += h1;
    for (j = 0; j < 8; j++) {
        out[j] = (uint8_t)(h1 >> (8 * j));
        out[8 + j] = (uint8_t)(h2 >> (8 * j));
    }
}

/* the chained hashes (``keys`` 0: BLAKE2b-128, the identity) or policy keys (``keys`` 1:
   page_key) of the full pages of ``len`` bytes at ``base`` (packed int64 tokens), seeded by
   ``prev`` (16 bytes for keys): a new list, or NULL with an exception set */
static PyObject *chain_packed(const uint8_t *prev, Py_ssize_t prev_len, const uint8_t *base, Py_ssize_t len,
                              int page_size, int overlap, int keys)
{
    Py_ssize_t step = (Py_ssize_t)page_size * 8, width = step + (Py_ssize_t)overlap * 8;
    Py_ssize_t avail = len - (Py_ssize_t)overlap * 8;
    Py_ssize_t n = avail > 0 ? avail / step : 0, i;
    uint8_t h[OUTLEN];
    b2b_state init, S;
    PyObject *out;
    if (keys && prev_len != OUTLEN) {
        PyErr_Format(PyExc_ValueError, "a page key chain's seed is %d bytes, not %zd", OUTLEN, prev_len);
        return NULL;
    }
    b2b_init(&init);
    out = PyList_New(n);
    if (out == NULL) return NULL;
    for (i = 0; i < n; i++) {
        /* bounds: i*step + width <= (n-1)*step + step + 8*overlap <= avail + 8*overlap = len */
        if (keys) {
            page_key(i == 0 ? prev : h, base + i * step, width, h);
        } else {
            memcpy(&S, &init, sizeof(S));
            if (i == 0)
                b2b_update(&S, prev, (size_t)prev_len);
            else
                b2b_update(&S, h, OUTLEN);
            b2b_update(&S, base + i * step, (size_t)width);
            b2b_final(&S, h);
        }
        PyObject *b = PyBytes_FromStringAndSize((const char *)h, OUTLEN);
        if (b == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, b);
    }
    return out;
}

static int check_shape(int page_size, int overlap)
{
    if (page_size < 1) {
        PyErr_Format(PyExc_ValueError, "page_size must be >= 1, not %d", page_size);
        return -1;
    }
    if (overlap != 0 && overlap != 1) {
        PyErr_Format(PyExc_ValueError, "overlap must be 0 or 1, not %d", overlap);
        return -1;
    }
    return 0;
}

static PyObject *chain_impl(PyObject *args, int keys)
{
    Py_buffer prev, data;
    int page_size, overlap;
    PyObject *out = NULL;
    if (!PyArg_ParseTuple(args, keys ? "y*y*ii:keys" : "y*y*ii:chain", &prev, &data, &page_size, &overlap)) return NULL;
    if (data.len % 8 != 0) {
        PyErr_Format(PyExc_ValueError, "data length %zd is not a multiple of 8 (packed int64 tokens)", data.len);
        goto done;
    }
    if (check_shape(page_size, overlap) < 0) goto done;
    out = chain_packed((const uint8_t *)prev.buf, prev.len, (const uint8_t *)data.buf, data.len, page_size, overlap, keys);
done:
    PyBuffer_Release(&prev);
    PyBuffer_Release(&data);
    return out;
}

static PyObject *pagehash_chain(PyObject *self, PyObject *args) { return chain_impl(args, 0); }

static PyObject *pagehash_keys(PyObject *self, PyObject *args) { return chain_impl(args, 1); }

/* chain_list(prev, tokens: list[int], page_size, overlap): ``chain(prev, pack(tokens), ...)``
   without the packing in Python (struct.pack of the whole list cost a quarter of the hashing:
   session 44). Every token must be an int (bool and int subclasses included: their values are
   read without calling Python code): one outside int64 raises OverflowError, any other object
   TypeError before its ``__index__`` runs, and keys.py then packs the list in Python, which
   raises the reference's struct.error or hashes what the reference hashes. So no Python code
   runs here at all: a token whose ``__index__`` mutated the list (struct.pack reads a snapshot
   of it) made this path hash a different run than the reference (review, session 44). */
static PyObject *chain_list_impl(PyObject *args, int keys)
{
    Py_buffer prev;
    PyObject *tokens, *out = NULL;
    int page_size, overlap;
    uint8_t *buf = NULL;
    Py_ssize_t i, m;
    if (!PyArg_ParseTuple(args, keys ? "y*O!ii:keys_list" : "y*O!ii:chain_list", &prev, &PyList_Type, &tokens,
                          &page_size, &overlap))
        return NULL;
    if (check_shape(page_size, overlap) < 0) goto done;
    m = PyList_GET_SIZE(tokens);
    buf = (uint8_t *)PyMem_Malloc(m > 0 ? (size_t)m * 8 : 1);
    if (buf == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (i = 0; i < m; i++) {
        PyObject *t = PyList_GET_ITEM(tokens, i);
        if (!PyLong_Check(t)) { /* (its __index__ could run Python code: keys.py packs it instead) */
            PyErr_Format(PyExc_TypeError, "chain_list: token %zd is a %.100s, not an int", i, Py_TYPE(t)->tp_name);
            goto done;
        }
        long long v = PyLong_AsLongLong(t); /* (an int: no Python code runs, the list stays as it is) */
        if (v == -1 && PyErr_Occurred()) goto done;
        uint64_t u = (uint64_t)v;
        int j;
        for (j = 0; j < 8; j++) buf[8 * i + j] = (uint8_t)(u >> (8 * j));
    }
    out = chain_packed((const uint8_t *)prev.buf, prev.len, buf, m * 8, page_size, overlap, keys);
done:
    PyMem_Free(buf);
    PyBuffer_Release(&prev);
    return out;
}

static PyObject *pagehash_chain_list(PyObject *self, PyObject *args) { return chain_list_impl(args, 0); }

static PyObject *pagehash_keys_list(PyObject *self, PyObject *args) { return chain_list_impl(args, 1); }

static PyMethodDef pagehash_methods[] = {
    {"chain", pagehash_chain, METH_VARARGS,
     "chain(prev, data, page_size, overlap) -> list[bytes]: the chained BLAKE2b-128 hashes of the "
     "full pages of data (little-endian int64 tokens), seeded by prev; see keys.chain_page_hashes."},
    {"chain_list", pagehash_chain_list, METH_VARARGS,
     "chain_list(prev, tokens, page_size, overlap) -> list[bytes]: chain() of a list of int tokens, "
     "packed as little-endian int64 in C."},
    {"keys", pagehash_keys, METH_VARARGS,
     "keys(prev, data, page_size, overlap) -> list[bytes]: the chained 16-byte policy page keys (not an "
     "identity) of the full pages of data, seeded by prev (16 bytes); see keys.chain_page_keys."},
    {"keys_list", pagehash_keys_list, METH_VARARGS,
     "keys_list(prev, tokens, page_size, overlap) -> list[bytes]: keys() of a list of int tokens."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef pagehash_module = {
    PyModuleDef_HEAD_INIT, "_pagehash", "C chained page hashes (optional; keys.py falls back to Python).", -1,
    pagehash_methods,
};

PyMODINIT_FUNC PyInit__pagehash(void) { return PyModule_Create(&pagehash_module); }
