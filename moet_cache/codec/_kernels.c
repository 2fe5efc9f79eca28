/* moet_cache.codec._kernels: the FP4 plane kernels in one pass (optional; planes.py falls back to numpy).
 *
 * split_measure(packed, scales, base_out, delta_out) -> (counts, weighted)
 *   packed:    C-contiguous bytes, n packed FP4 bytes (two codes each, the even element in the low
 *              nibble); n a multiple of 8, so every 8 bytes are one block of 16 codes.
 *   scales:    C-contiguous float32, n/8 values: the scale of each block, in order.
 *   base_out, delta_out: writable C-contiguous bytes, n/2 each: the planes, bit order as
 *              planes.split_planes (element 4k+j in bits 2j..2j+1 of byte k; code = base<<2 | delta).
 *   counts:    tuple of 16 ints, the exact histogram of the 2n codes.
 *   weighted:  tuple of 16 floats, for each code the sum over its occurrences of (double)scale^2.
 * The loop runs without the GIL. Plain CPython C API and the buffer protocol; no numpy headers.
 *
 * split(packed, base_out, delta_out): the planes alone, the same bit order, no statistics.
 *
 * split_measure_e4m3(packed, scale_bytes, base_out, delta_out) -> (counts, weighted)
 *   The same results from the raw float8_e4m3fn block scales (n/8 bytes), a little faster: a block scale
 *   takes one of 256 byte values, so the pass only counts (scale byte, packed byte) pairs in
 *   integers and the scale^2 weighting is applied once per pair at the end (exact products; the
 *   float sums differ from split_measure's only in rounding order).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <math.h>

#if defined(__BYTE_ORDER__) && defined(__ORDER_BIG_ENDIAN__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define MOET_BIG_ENDIAN 1
#endif

static inline uint64_t load_le64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
#ifdef MOET_BIG_ENDIAN
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline void store_le32(uint8_t *p, uint32_t v)
{
#ifdef MOET_BIG_ENDIAN
    v = __builtin_bswap32(v);
#endif
    memcpy(p, &v, 4);
}

/* x holds 2-bit fields at bits 0, 4, 8, 12 of each 16-bit lane: gather the 16 fields into 32 bits. */
static inline uint32_t compact(uint64_t x)
{
    x = (x | (x >> 2)) & 0x0F0F0F0F0F0F0F0FULL;  /* nibbles at bits 0 and 8 of each lane */
    x = (x | (x >> 4)) & 0x00FF00FF00FF00FFULL;  /* a byte in the low half of each lane */
    x = (x | (x >> 8)) & 0x0000FFFF0000FFFFULL;
    x = (x | (x >> 16));
    return (uint32_t)x;
}

#ifndef NCOPY
#define NCOPY 4  /* histogram copies, so repeated bytes do not chain on one bin */
#endif

/* A bin per byte value: the scale^2 sum and the count, side by side (the count as a double: exact
 * below 2^53 codes), so that one 16-byte add updates both where the compiler has vector types. */
#if defined(__GNUC__) || defined(__clang__)
typedef double v2d __attribute__((vector_size(16)));
typedef union {
    v2d v;
    double d[2];
} bin_t;
#define BIN_ADD(b, s2) ((b)->v += (v2d){(s2), 1.0})
#else
typedef struct {
    double d[2];
} bin_t;
#define BIN_ADD(b, s2) ((b)->d[0] += (s2), (b)->d[1] += 1.0)
#endif

/* The split of blocks [0, nblocks) alone: no scatter in this loop, so the compiler vectorises it. */
static void split_loop(const uint8_t *src, Py_ssize_t nblocks, uint8_t *base, uint8_t *delta)
{
    const uint64_t m33 = 0x3333333333333333ULL;
    for (Py_ssize_t i = 0; i < nblocks; i++) {
        uint64_t w = load_le64(src + 8 * i);
        store_le32(base + 4 * i, compact((w >> 2) & m33));
        store_le32(delta + 4 * i, compact(w & m33));
    }
}

static void split_measure_loop(const uint8_t *src, const float *scales, Py_ssize_t nblocks,
                               uint8_t *base, uint8_t *delta, bin_t (*bins)[256])
{
    split_loop(src, nblocks, base, delta);
    for (Py_ssize_t i = 0; i < nblocks; i++) {
        uint64_t w = load_le64(src + 8 * i);
        double s = (double)scales[i];
        double s2 = s * s;
        for (int j = 0; j < 8; j++) {
            bin_t *b = &bins[j & (NCOPY - 1)][(w >> (8 * j)) & 0xFF];
            BIN_ADD(b, s2);
        }
    }
}

static int get_buffer(PyObject *obj, Py_buffer *view, int flags, const char *name)
{
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous buffer%s", name,
                     (flags & PyBUF_WRITABLE) ? " (writable)" : "");
        return -1;
    }
    return 0;
}

/* (counts, weighted) as two tuples of 16; NULL with an exception set on failure. */
static PyObject *histogram_pair(const uint64_t *c16, const double *w16)
{
    PyObject *result = NULL, *counts = PyTuple_New(16), *weighted = PyTuple_New(16);
    if (!counts || !weighted)
        goto done;
    for (int c = 0; c < 16; c++) {
        PyObject *ci = PyLong_FromUnsignedLongLong(c16[c]);
        if (!ci)
            goto done;
        PyTuple_SET_ITEM(counts, c, ci);
        PyObject *wf = PyFloat_FromDouble(w16[c]);
        if (!wf)
            goto done;
        PyTuple_SET_ITEM(weighted, c, wf);
    }
    result = PyTuple_Pack(2, counts, weighted);
done:
    Py_XDECREF(counts);
    Py_XDECREF(weighted);
    return result;
}

/* The four buffers of a split kernel, taken together and released together. */
typedef struct {
    Py_buffer packed, scales, base, delta;
} split_buffers;

/* The buffers of objs[0..n): 0, or -1 with an exception set and none of them held. */
static int get_buffers(PyObject *const *objs, Py_buffer *const *views, const int *flags, const char *const *names,
                       int n)
{
    for (int i = 0; i < n; i++) {
        if (get_buffer(objs[i], views[i], flags[i], names[i]) < 0) {
            while (i--)
                PyBuffer_Release(views[i]);
            return -1;
        }
    }
    return 0;
}

/* Parse (packed, scales, base_out, delta_out): 0, or -1 with an exception set and nothing held. */
static int get_split_buffers(PyObject *args, const char *format, int scale_flags, const char *scale_name,
                             split_buffers *sb)
{
    PyObject *o[4];
    if (!PyArg_ParseTuple(args, format, &o[0], &o[1], &o[2], &o[3]))
        return -1;
    Py_buffer *views[4] = {&sb->packed, &sb->scales, &sb->base, &sb->delta};
    const int flags[4] = {PyBUF_C_CONTIGUOUS, PyBUF_C_CONTIGUOUS | scale_flags,
                          PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE};
    const char *names[4] = {"packed", scale_name, "base_out", "delta_out"};
    return get_buffers(o, views, flags, names, 4);
}

static void release_split_buffers(split_buffers *sb)
{
    PyBuffer_Release(&sb->delta);
    PyBuffer_Release(&sb->base);
    PyBuffer_Release(&sb->scales);
    PyBuffer_Release(&sb->packed);
}

static PyObject *split_measure(PyObject *self, PyObject *args)
{
    split_buffers sb;
    PyObject *result = NULL;
    (void)self;

    if (get_split_buffers(args, "OOOO:split_measure", PyBUF_FORMAT, "scales", &sb) < 0)
        return NULL;

    Py_ssize_t n = sb.packed.len;
    const char *fmt = sb.scales.format ? sb.scales.format : "B";
    if (sb.scales.itemsize != 4 || !(strcmp(fmt, "f") == 0 || strcmp(fmt, "<f") == 0
                                  || strcmp(fmt, "=f") == 0)) {
        PyErr_SetString(PyExc_TypeError, "scales must be float32");
        goto release_all;
    }
    if (n % 8 || sb.scales.len != (n / 8) * 4 || sb.base.len != n / 2 || sb.delta.len != n / 2) {
        PyErr_SetString(PyExc_ValueError,
                        "sizes must be: packed n bytes (n % 8 == 0), scales n/8 float32, "
                        "base_out and delta_out n/2 bytes each");
        goto release_all;
    }

    bin_t (*bins)[256] = PyMem_RawCalloc(NCOPY, sizeof(bin_t[256]));
    if (!bins) {
        PyErr_NoMemory();
        goto release_all;
    }
    Py_BEGIN_ALLOW_THREADS
    split_measure_loop((const uint8_t *)sb.packed.buf, (const float *)sb.scales.buf, n / 8,
                       (uint8_t *)sb.base.buf, (uint8_t *)sb.delta.buf, bins);
    Py_END_ALLOW_THREADS

    /* Fold the byte bins into code bins: a byte holds the codes (b & 15) and (b >> 4). */
    uint64_t c16[16] = {0};
    double w16[16] = {0};
    for (int k = 0; k < NCOPY; k++) {
        for (int b = 0; b < 256; b++) {
            uint64_t c = (uint64_t)bins[k][b].d[1];
            c16[b & 15] += c;
            c16[b >> 4] += c;
            w16[b & 15] += bins[k][b].d[0];
            w16[b >> 4] += bins[k][b].d[0];
        }
    }
    PyMem_RawFree(bins);

    result = histogram_pair(c16, w16);
release_all:
    release_split_buffers(&sb);
    return result;
}

/* float8_e4m3fn -> double: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities,
 * S.1111.111 is NaN; exponent 0 is subnormal (m/8 * 2^-6). */
static double e4m3_value(unsigned v)
{
    unsigned e = (v >> 3) & 15, m = v & 7;
    double mag;
    if (e == 15 && m == 7)
        return (double)NAN;
    if (e == 0)
        mag = ldexp((double)m / 8.0, -6);
    else
        mag = ldexp(1.0 + (double)m / 8.0, (int)e - 7);
    return (v & 0x80) ? -mag : mag;
}

#define E4M3_CHUNK 2048  /* blocks per pass: the planes of a chunk stay in L1 between the two loops */
#define E4M3_FLUSH (1 << 28)  /* blocks between flushes of the uint32 pair counts (8 per block < 2^32) */

/* pairs[s][b]: how many packed bytes of value b sit in blocks whose scale byte is s. A row is
 * zeroed when first used (seen[s]): a tensor's scales take few values, so most rows stay untouched. */
static void split_count_loop(const uint8_t *src, const uint8_t *scales, Py_ssize_t nblocks,
                             uint8_t *base, uint8_t *delta, uint32_t (*pairs)[256], uint8_t *seen)
{
    for (Py_ssize_t i0 = 0; i0 < nblocks; i0 += E4M3_CHUNK) {
        Py_ssize_t i1 = i0 + E4M3_CHUNK < nblocks ? i0 + E4M3_CHUNK : nblocks;
        split_loop(src + 8 * i0, i1 - i0, base + 4 * i0, delta + 4 * i0);  /* the split first: it vectorises */
        for (Py_ssize_t i = i0; i < i1; i++) {
            uint64_t w = load_le64(src + 8 * i);
            uint32_t *row = pairs[scales[i]];
            if (!seen[scales[i]]) {
                memset(row, 0, sizeof(pairs[0]));
                seen[scales[i]] = 1;
            }
            /* one integer increment per packed byte (two codes), in the row of the block's scale */
            row[w & 0xFF]++;
            row[(w >> 8) & 0xFF]++;
            row[(w >> 16) & 0xFF]++;
            row[(w >> 24) & 0xFF]++;
            row[(w >> 32) & 0xFF]++;
            row[(w >> 40) & 0xFF]++;
            row[(w >> 48) & 0xFF]++;
            row[w >> 56]++;
        }
    }
}

static PyObject *split_measure_e4m3(PyObject *self, PyObject *args)
{
    split_buffers sb;
    PyObject *result = NULL;
    (void)self;

    if (get_split_buffers(args, "OOOO:split_measure_e4m3", 0, "scale_bytes", &sb) < 0)
        return NULL;

    Py_ssize_t n = sb.packed.len;
    if (n % 8 || sb.scales.len != n / 8 || sb.base.len != n / 2 || sb.delta.len != n / 2) {
        PyErr_SetString(PyExc_ValueError,
                        "sizes must be: packed n bytes (n % 8 == 0), scale_bytes n/8 bytes, "
                        "base_out and delta_out n/2 bytes each");
        goto release_all;
    }
    uint32_t (*pairs)[256] = PyMem_RawMalloc(sizeof(uint32_t[256][256]));  /* rows zeroed on first use */
    uint64_t (*codes)[16] = PyMem_RawCalloc(256, sizeof(uint64_t[16]));   /* [scale byte][code] */
    if (!pairs || !codes) {
        PyMem_RawFree(pairs);
        PyMem_RawFree(codes);
        PyErr_NoMemory();
        goto release_all;
    }
    Py_BEGIN_ALLOW_THREADS
    const uint8_t *src = (const uint8_t *)sb.packed.buf, *sc = (const uint8_t *)sb.scales.buf;
    for (Py_ssize_t i = 0; i < n / 8; i += E4M3_FLUSH) {
        Py_ssize_t k = n / 8 - i < E4M3_FLUSH ? n / 8 - i : E4M3_FLUSH;
        uint8_t seen[256] = {0};
        split_count_loop(src + 8 * i, sc + i, k, (uint8_t *)sb.base.buf + 4 * i, (uint8_t *)sb.delta.buf + 4 * i,
                         pairs, seen);
        /* a byte holds the codes (b & 15) and (b >> 4) */
        for (int s = 0; s < 256; s++)
            for (int b = 0; seen[s] && b < 256; b++) {
                codes[s][b & 15] += pairs[s][b];
                codes[s][b >> 4] += pairs[s][b];
            }
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(pairs);

    /* The code counts, and the code counts weighted by scale^2 (exact products, summed by scale byte). */
    uint64_t c16[16] = {0};
    double w16[16] = {0};
    for (int s = 0; s < 256; s++) {
        const uint64_t *cs = codes[s];
        int any = 0;
        for (int c = 0; c < 16; c++)
            any |= cs[c] != 0;
        if (!any)
            continue;
        double v = e4m3_value((unsigned)s), s2 = v * v;
        for (int c = 0; c < 16; c++) {
            if (cs[c]) {  /* skip absent codes: 0 * NaN must not poison a code no NaN block holds */
                c16[c] += cs[c];
                w16[c] += s2 * (double)cs[c];
            }
        }
    }
    PyMem_RawFree(codes);

    result = histogram_pair(c16, w16);
release_all:
    release_split_buffers(&sb);
    return result;
}

static PyObject *split(PyObject *self, PyObject *args)
{
    PyObject *o[3];
    Py_buffer v[3];
    Py_buffer *views[3] = {&v[0], &v[1], &v[2]};
    const int flags[3] = {PyBUF_C_CONTIGUOUS, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE,
                          PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE};
    const char *names[3] = {"packed", "base_out", "delta_out"};
    (void)self;
    if (!PyArg_ParseTuple(args, "OOO:split", &o[0], &o[1], &o[2]) || get_buffers(o, views, flags, names, 3) < 0)
        return NULL;
    Py_ssize_t n = v[0].len;
    PyObject *result = NULL;
    if (n % 8 || v[1].len != n / 2 || v[2].len != n / 2) {
        PyErr_SetString(PyExc_ValueError, "sizes must be: packed n bytes (n % 8 == 0), base_out and delta_out n/2 each");
    } else {
        Py_BEGIN_ALLOW_THREADS
        split_loop((const uint8_t *)v[0].buf, n / 8, (uint8_t *)v[1].buf, (uint8_t *)v[2].buf);
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
    for (int i = 3; i--;)
        PyBuffer_Release(&v[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"split", split, METH_VARARGS,
     "split(packed, base_out, delta_out) -> None\n\n"
     "The planes alone (as planes.split_planes) of n packed FP4 bytes (n % 8 == 0) into base_out and\n"
     "delta_out (n/2 bytes each). Releases the GIL."},
    {"split_measure", split_measure, METH_VARARGS,
     "split_measure(packed, scales, base_out, delta_out) -> (counts[16], weighted[16])\n\n"
     "One pass over packed FP4 bytes (n % 8 == 0) with float32 block scales (n/8): writes the base\n"
     "and delta planes (n/2 bytes each) and returns the exact code histogram and the histogram\n"
     "weighted by scale^2 (float64). Releases the GIL while it runs."},
    {"split_measure_e4m3", split_measure_e4m3, METH_VARARGS,
     "split_measure_e4m3(packed, scale_bytes, base_out, delta_out) -> (counts[16], weighted[16])\n\n"
     "split_measure with the raw float8_e4m3fn block scales (n/8 bytes) instead of float32 ones:\n"
     "the same planes and counts; weighted equal up to float rounding order. Releases the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "moet_cache.codec._kernels",
    "One-pass FP4 plane kernels (optional; moet_cache.codec.planes falls back to numpy).", -1, methods,
};

PyMODINIT_FUNC PyInit__kernels(void)
{
    return PyModule_Create(&module);
}
