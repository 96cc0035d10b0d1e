/* PlanTable.find of signature.py in C: the part of a cached ditops call that runs on every
 * call and costs most in Python (a dict lookup, then per plan under the key the tensor guard,
 * each tensor's data pointer and its alignment class). Same entries, same answer; signature.py
 * holds the Python twin, used where this module was not built, and the tests run both.
 *
 * find(by_key, key, arguments) -> (plan, pointers) or None
 *   by_key: dict key -> tuple of entries
 *     (positions, tensors_of, check, aligned, low_bits, plan):
 *     positions: tuple of the tensor arguments' indices; tensors_of: the same as an itemgetter
 *     (the Python twin's); check(*tensors) -> bool (TensorGuards.check); aligned: whether every
 *     pointer was a multiple of 16 bytes; low_bits: tuple of each pointer modulo 16.
 *   pointers: tuple of the tensors' data pointers (ints), in argument order.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define LOW_BITS 15u      /* MAX_ALIGNMENT - 1 (features.py) */
#define MAX_TENSORS 32    /* an op has at most 15 tensor arguments */

static PyObject *data_ptr_name;

/* The first entry whose guard and alignment class accept ``arguments``: (plan, pointers),
 * None, or NULL with an exception set. */
static PyObject *search(PyObject *entries, PyObject *arguments) {
    Py_ssize_t argument_count = PyTuple_GET_SIZE(arguments);
    for (Py_ssize_t e = 0; e < PyTuple_GET_SIZE(entries); e++) {
        PyObject *entry = PyTuple_GET_ITEM(entries, e);
        PyObject *positions = PyTuple_GET_ITEM(entry, 0);
        PyObject *check = PyTuple_GET_ITEM(entry, 2);
        int aligned = PyTuple_GET_ITEM(entry, 3) == Py_True;
        PyObject *low_bits = PyTuple_GET_ITEM(entry, 4);
        Py_ssize_t count = PyTuple_GET_SIZE(positions);
        if (count > MAX_TENSORS) {
            PyErr_SetString(PyExc_ValueError, "plan_lookup.find: more tensor arguments than it holds");
            return NULL;
        }
        PyObject *tensors[MAX_TENSORS + 1];
        for (Py_ssize_t i = 0; i < count; i++) {
            Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(positions, i));
            if (at < 0 || at >= argument_count) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "plan_lookup.find: argument position");
                return NULL;
            }
            tensors[i + 1] = PyTuple_GET_ITEM(arguments, at); /* borrowed; [0] is vectorcall's spare slot */
        }
        PyObject *verdict = PyObject_Vectorcall(check, tensors + 1, count | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (verdict == NULL) return NULL;
        int same = PyObject_IsTrue(verdict);
        Py_DECREF(verdict);
        if (same < 0) return NULL;
        if (!same) continue;
        PyObject *pointers = PyTuple_New(count);
        if (pointers == NULL) return NULL;
        unsigned long long any_low = 0;
        for (Py_ssize_t i = 0; i < count; i++) {
            PyObject *pointer = PyObject_VectorcallMethod(data_ptr_name, tensors + 1 + i,
                                                          1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
            if (pointer == NULL) { Py_DECREF(pointers); return NULL; }
            PyTuple_SET_ITEM(pointers, i, pointer); /* steals */
            unsigned long long value = PyLong_AsUnsignedLongLong(pointer);
            if (value == (unsigned long long)-1 && PyErr_Occurred()) { Py_DECREF(pointers); return NULL; }
            any_low |= value & LOW_BITS;
        }
        int match = aligned && !any_low;
        if (any_low) { /* some pointer is off 16 bytes: its class must be the plan's */
            match = 1;
            for (Py_ssize_t i = 0; i < count && match; i++) {
                unsigned long long value = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(pointers, i));
                long wanted = PyLong_AsLong(PyTuple_GET_ITEM(low_bits, i));
                match = (long)(value & LOW_BITS) == wanted;
            }
        }
        if (match) {
            PyObject *found = PyTuple_Pack(2, PyTuple_GET_ITEM(entry, 5), pointers);
            Py_DECREF(pointers);
            return found;
        }
        Py_DECREF(pointers);
    }
    Py_RETURN_NONE;
}


static PyObject *find(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyDict_Check(args[0]) || !PyTuple_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "find(by_key: dict, key, arguments: tuple)");
        return NULL;
    }
    PyObject *entries = PyDict_GetItemWithError(args[0], args[1]);
    if (entries == NULL) {
        if (PyErr_Occurred()) return NULL; /* an unhashable key: the caller builds a plan */
        Py_RETURN_NONE;
    }
    /* Held while searching: the calls below may run Python code (a tensor subclass's
     * data_ptr), where another thread's PlanTable.add may replace this key's entries. */
    Py_INCREF(entries);
    PyObject *found = search(entries, args[2]);
    Py_DECREF(entries);
    return found;
}

static PyMethodDef methods[] = {
    {"find", (PyCFunction)(void (*)(void))find, METH_FASTCALL,
     "find(by_key, key, arguments) -> (plan, pointers) or None: PlanTable.find (signature.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_plan_lookup", NULL, -1, methods};

PyMODINIT_FUNC PyInit__plan_lookup(void) {
    data_ptr_name = PyUnicode_InternFromString("data_ptr");
    if (data_ptr_name == NULL) return NULL;
    return PyModule_Create(&module);
}
