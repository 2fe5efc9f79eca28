/* moet_cache._preads: strided reads of a file without the GIL (optional; load/reads.py falls back to Python).
 *
 * pread_runs(fd, dst, offset, piece, stride, skip) -> bytes read
 *   Fills dst (writable C-contiguous bytes) with pieces of the file read one after another: the first
 *   piece_bytes - skip bytes at offset + skip, then `piece` bytes at offset + stride, offset + 2 * stride,
 *   ... until dst is full. Returns how many bytes it read: fewer than len(dst) only where the file ended.
 *   An OS error raises OSError. A rank's share of a tensor (load/shard.py) is such a run: under tensor
 *   parallelism w2's columns are a piece of a few hundred bytes in every row, one pread each, which a Python
 *   loop would spend microseconds a piece on.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <unistd.h>

static PyObject *pread_runs(PyObject *self, PyObject *args)
{
    int fd;
    PyObject *dst_obj;
    long long offset, piece, stride, skip;
    Py_buffer dst;
    (void)self;
    if (!PyArg_ParseTuple(args, "iOLLLL:pread_runs", &fd, &dst_obj, &offset, &piece, &stride, &skip))
        return NULL;
    if (offset < 0 || piece < 1 || stride < piece || skip < 0 || skip >= piece) {
        PyErr_SetString(PyExc_ValueError, "need offset >= 0, 1 <= piece <= stride and 0 <= skip < piece");
        return NULL;
    }
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return NULL;
    char *out = (char *)dst.buf;
    long long left = dst.len, done = 0, at = offset + skip, in_piece = piece - skip;
    int err = 0, ended = 0;
    Py_BEGIN_ALLOW_THREADS
    while (left > 0 && !err && !ended) {
        long long want = in_piece < left ? in_piece : left, got = 0;
        while (got < want) {
            ssize_t n = pread(fd, out + done + got, (size_t)(want - got), (off_t)(at + got));
            if (n < 0) {
                if (errno == EINTR)
                    continue;
                err = errno;
                break;
            }
            if (n == 0) {
                ended = 1;
                break;
            }
            got += n;
        }
        done += got;
        left -= got;
        at = at - (piece - in_piece) + stride;  /* the next piece's first byte */
        in_piece = piece;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLongLong(done);
}

static PyMethodDef methods[] = {
    {"pread_runs", pread_runs, METH_VARARGS,
     "pread_runs(fd, dst, offset, piece, stride, skip) -> bytes read\n\n"
     "dst filled from pieces of the file: piece - skip bytes at offset + skip, then piece bytes every\n"
     "stride bytes after offset. Releases the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "moet_cache._preads",
    "Strided reads of a file without the GIL (optional; moet_cache.load.reads falls back to Python).", -1, methods,
};

PyMODINIT_FUNC PyInit__preads(void)
{
    return PyModule_Create(&module);
}
