/* A cached ditops call in C: Op.run of ops.py for a call whose launch plan exists (the
 * common case: every call of a model's forward after the first), where Python's frames and
 * attribute reads were most of the host time above the kernel launch.
 *
 * cached_call(op, arguments, backend) -> the op's outputs, or NotImplemented: the call
 *   signature's key (selector.signature_key; not built where one of the op's last signatures
 *   found here, PlanTable.last, holds the call's plan), the plan (find below), the plan's per-call
 *   checks (an in-place op's aliasing check on its spans here, the Python check where they
 *   may overlap or there is more to check), the outputs (ops._LikeX: allocated here), and the
 *   launch: a Triton launch bound by kernel_launch.bind is issued from here (the plan's
 *   ``direct``), any other through the plan's Python launcher.
 *   NotImplemented (an override in force, no plan yet, an argument the key cannot hold)
 *   sends the call down ops.py's Python path, which builds the plan or raises.
 * find(by_key, key, arguments) -> (plan, pointers) or None: PlanTable.find of signature.py.
 *   by_key: dict key -> tuple of entries (positions, tensors_of, check, aligned, low_bits, plan):
 *     positions: tuple of the tensor arguments' indices; tensors_of: the same as an itemgetter
 *     (the Python twin's); check(*tensors) -> bool (TensorGuards.check); aligned: whether every
 *     pointer was a multiple of 16 bytes; low_bits: tuple of each pointer modulo 16.
 *   pointers: tuple of the tensors' data pointers (ints), in argument order.
 * Both have Python twins (Op.run, PlanTable.find_in_python) that run where this module was
 * not built; the tests check that they agree. What this file reads of the Python side (the
 * selector's module globals, ops.Plan's fields, Op's attributes) is named where it is read.
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
            PyErr_SetString(PyExc_ValueError, "find: more tensor arguments than it holds");
            return NULL;
        }
        PyObject *tensors[MAX_TENSORS + 1];
        for (Py_ssize_t i = 0; i < count; i++) {
            Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(positions, i));
            if (at < 0 || at >= argument_count) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "find: argument position");
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


/* cached_call(op, arguments, backend) -> the op's outputs, or NotImplemented: Op.run of
 * ops.py for a call whose plan exists, with no override in force (no backend=, no
 * use_backend scope, no DITOPS_BACKEND). The same key as selector.signature_key, the same
 * search, then the plan's per-call checks, the outputs and the launch: a Triton launch bound
 * by kernel_launch.bind is issued from here (its ``direct`` attribute), any other through the
 * plan's Python launcher. NotImplemented (no plan yet, an override, an argument the key
 * cannot hold) sends the call down ops.py's path, which builds the plan or raises. */
static PyObject *selector_globals, *simulation, *grad_enabled, *current_device, *current_stream, /* configure */
    *empty_like, *contiguous_format;
static PyObject *n_scopes, *n_stack, *n_dispatcher, *n_env_forced, *n_plans, *n_by_key, *n_device,
    *n_name, *n_scalars, *n_outputs, *n_shape, *n_calls, *n_enter_hook, *n_exit_hook, *n_count, *n_last,
    *memory_format_kwnames;

#define NOT_HERE do { PyErr_Clear(); result = Py_NewRef(Py_NotImplemented); goto done; } while (0)

/* Whether a Triton launch hook would run: a HookChain with calls (kernel_launch._hooked). */
static int hooked(PyObject *hook) {
    if (hook == Py_None) return 0;
    PyObject *calls = PyObject_GetAttr(hook, n_calls);
    if (calls == NULL) { PyErr_Clear(); return 1; }
    int any = PyObject_IsTrue(calls);
    Py_DECREF(calls);
    return any != 0;
}

/* The bound Triton launch of kernel_launch.bind, issued from C: 1 launched, 0 not this way
 * (another device is current, or a launch hook is set: the Python launcher handles those),
 * -1 error. direct = (c_launcher, device index, template: the launcher's argument tuple with
 * None for the stream (at 3) and the pointers, places: ((place in template, index in
 * pointers), ...), runtime knobs, whether other devices are visible (else this one is current)). */
#define STREAM_PLACE 3
static int launch_direct(PyObject *direct, PyObject *pointers) {
    PyObject *device_index = PyTuple_GET_ITEM(direct, 1);
    if (PyTuple_GET_ITEM(direct, 5) != Py_False) {
        PyObject *current = PyObject_CallNoArgs(current_device);
        if (current == NULL) return -1;
        int same = PyObject_RichCompareBool(current, device_index, Py_EQ);
        Py_DECREF(current);
        if (same <= 0) return same;
    }
    PyObject *knobs = PyTuple_GET_ITEM(direct, 4);
    PyObject *enter = PyObject_GetAttr(knobs, n_enter_hook);
    PyObject *exit_ = PyObject_GetAttr(knobs, n_exit_hook);
    int any_hook = enter == NULL || exit_ == NULL || hooked(enter) || hooked(exit_);
    Py_XDECREF(enter); Py_XDECREF(exit_);
    PyErr_Clear();
    if (any_hook) return 0;
    PyObject *template = PyTuple_GET_ITEM(direct, 2), *places = PyTuple_GET_ITEM(direct, 3);
    Py_ssize_t size = PyTuple_GET_SIZE(template), pointer_count = PyTuple_GET_SIZE(pointers);
    if (size <= STREAM_PLACE) {
        PyErr_SetString(PyExc_IndexError, "cached_call: a bound launch's template is too short");
        return -1;
    }
    PyObject *call = PyTuple_New(size);
    if (call == NULL) return -1;
    for (Py_ssize_t i = 0; i < size; i++) PyTuple_SET_ITEM(call, i, Py_NewRef(PyTuple_GET_ITEM(template, i)));
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(places); i++) {
        PyObject *place = PyTuple_GET_ITEM(places, i);
        Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(place, 0)), index = PyLong_AsSsize_t(PyTuple_GET_ITEM(place, 1));
        if (at <= STREAM_PLACE || at >= size || index < 0 || index >= pointer_count) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "cached_call: a bound launch's pointer place");
            Py_DECREF(call);
            return -1;
        }
        Py_SETREF(((PyTupleObject *)call)->ob_item[at], Py_NewRef(PyTuple_GET_ITEM(pointers, index)));
    }
    PyObject *stream = PyObject_CallOneArg(current_stream, device_index);
    if (stream == NULL) { Py_DECREF(call); return -1; }
    Py_SETREF(((PyTupleObject *)call)->ob_item[STREAM_PLACE], stream);
    PyObject *launched = PyObject_Call(PyTuple_GET_ITEM(direct, 0), call, NULL);
    Py_DECREF(call);
    if (launched == NULL) return -1;
    Py_DECREF(launched);
    return 1;
}

/* validation.InPlaceAliasing.check on its spans (ops.Plan.spans): 1 when nothing written is
 * shared with anything else, 0 when something may be (the Python check decides, and names the
 * argument in its ValueError), -1 on error. spans = (q span, k span, row window (q row bytes,
 * k row bytes, row stride) or None, ((index in pointers, span), ...)). */
static long long pointer_at(PyObject *pointers, Py_ssize_t index) {
    return PyLong_AsLongLong(PyTuple_GET_ITEM(pointers, index));
}

static int spans_clear(PyObject *spans, PyObject *pointers) {
    long long q_span = PyLong_AsLongLong(PyTuple_GET_ITEM(spans, 0));
    long long k_span = PyLong_AsLongLong(PyTuple_GET_ITEM(spans, 1));
    if (q_span == 0) return PyErr_Occurred() ? -1 : 1;
    long long q = pointer_at(pointers, 0), k = q;
    if (k_span) {
        k = pointer_at(pointers, 1);
        long long offset = k - q;
        if (-k_span < offset && offset < q_span) {
            PyObject *window = PyTuple_GET_ITEM(spans, 2);
            if (window == Py_None) return 0;
            long long q_row = PyLong_AsLongLong(PyTuple_GET_ITEM(window, 0));
            long long k_row = PyLong_AsLongLong(PyTuple_GET_ITEM(window, 1));
            long long stride = PyLong_AsLongLong(PyTuple_GET_ITEM(window, 2));
            int disjoint = offset >= 0 ? offset >= q_row && offset + k_row <= stride
                                       : -offset >= k_row && -offset + q_row <= stride;
            if (!disjoint) return 0;
        }
    }
    PyObject *reads = PyTuple_GET_ITEM(spans, 3);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(reads); i++) {
        PyObject *read = PyTuple_GET_ITEM(reads, i);
        long long start = pointer_at(pointers, PyLong_AsSsize_t(PyTuple_GET_ITEM(read, 0)));
        long long end = start + PyLong_AsLongLong(PyTuple_GET_ITEM(read, 1));
        if ((start < q + q_span && q < end) || (k_span && start < k + k_span && k < end)) return 0;
    }
    return PyErr_Occurred() ? -1 : 1;
}

/* The op's outputs: op.outputs.count (ops._LikeX) new tensors empty_like(x, memory_format=
 * contiguous_format), as its __call__ makes them; any other outputs callable is called. */
static PyObject *new_outputs(PyObject *op, PyObject *arguments) {
    PyObject *outputs_of = PyObject_GetAttr(op, n_outputs);
    if (outputs_of == NULL) return NULL;
    PyObject *count_of = PyObject_GetAttr(outputs_of, n_count), *outputs = NULL;
    Py_ssize_t count = count_of != NULL && PyLong_Check(count_of) ? PyLong_AsSsize_t(count_of) : -1;
    Py_XDECREF(count_of);
    PyErr_Clear();
    if (count < 0 || empty_like == NULL) {
        outputs = PyObject_Call(outputs_of, arguments, NULL);
    } else if ((outputs = PyTuple_New(count)) != NULL) {
        PyObject *call[2] = {PyTuple_GET_ITEM(arguments, 0), contiguous_format};
        for (Py_ssize_t i = 0; i < count; i++) {
            PyObject *output = PyObject_Vectorcall(empty_like, call, 1, memory_format_kwnames);
            if (output == NULL) { Py_CLEAR(outputs); break; }
            PyTuple_SET_ITEM(outputs, i, output);
        }
    }
    Py_DECREF(outputs_of);
    return outputs;
}

/* Whether a call's key (selector.signature_key) would equal ``key`` but for its last item, the
 * first argument's shape: the same grad mode, simulated device, argument types and non-tensor
 * values (compared as the key's dict lookup compares them). 1, 0, or -1 on error. */
static int same_but_shape(PyObject *key, PyObject *grad, PyObject *device, PyObject *types, PyObject *scalars) {
    if (PyTuple_GET_ITEM(key, 2) != grad) return 0;
    int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(key, 3), device, Py_EQ);
    if (same > 0) same = PyObject_RichCompareBool(PyTuple_GET_ITEM(key, 4), types, Py_EQ);
    if (same > 0) same = PyObject_RichCompareBool(PyTuple_GET_ITEM(key, 5), scalars, Py_EQ);
    return same;
}

/* PlanTable.last[name] = ((key, entries), then the older signatures but one with this key),
 * at most MEMO_SIGNATURES. 0, or -1 on error. */
#define MEMO_SIGNATURES 4
static int remember(PyObject *last, PyObject *name, PyObject *memo, PyObject *key, PyObject *entries) {
    PyObject *newest = PyTuple_Pack(2, key, entries), *kept[MEMO_SIGNATURES];
    if (newest == NULL) return -1;
    Py_ssize_t count = 0;
    kept[count++] = newest;
    for (Py_ssize_t i = 0; memo != NULL && i < PyTuple_GET_SIZE(memo) && count < MEMO_SIGNATURES; i++) {
        PyObject *older = PyTuple_GET_ITEM(memo, i);
        int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(older, 0), key, Py_EQ);
        if (same < 0) { Py_DECREF(newest); return -1; }
        if (!same) kept[count++] = older;
    }
    PyObject *signatures = PyTuple_New(count);
    if (signatures == NULL) { Py_DECREF(newest); return -1; }
    PyTuple_SET_ITEM(signatures, 0, newest); /* steals */
    for (Py_ssize_t i = 1; i < count; i++) PyTuple_SET_ITEM(signatures, i, Py_NewRef(kept[i]));
    int status = PyDict_SetItem(last, name, signatures);
    Py_DECREF(signatures);
    return status;
}

static PyObject *cached_call(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyTuple_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "cached_call(op, arguments: tuple, backend)");
        return NULL;
    }
    if (selector_globals == NULL) return Py_NewRef(Py_NotImplemented);
    PyObject *op = args[0], *arguments = args[1];
    PyObject *result = NULL, *stack = NULL, *state = NULL, *flag = NULL, *grad = NULL, *device = NULL,
             *name = NULL, *scalars_of = NULL, *scalars = NULL, *types = NULL, *shape = NULL, *key = NULL,
             *plans = NULL, *by_key = NULL, *last = NULL, *memo = NULL, *entries = NULL, *found = NULL,
             *outputs = NULL, *values = NULL, *pointers = NULL, *done_launch = NULL, *direct = NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(arguments);
    if (args[2] != Py_None || count == 0) NOT_HERE;

    PyObject *scopes = PyDict_GetItemWithError(selector_globals, n_scopes); /* borrowed */
    if (scopes == NULL || (stack = PyObject_GetAttr(scopes, n_stack)) == NULL) NOT_HERE;
    if (PyObject_Length(stack) != 0) NOT_HERE;
    state = Py_XNewRef(PyDict_GetItemWithError(selector_globals, n_dispatcher));
    if (state == NULL || state == Py_None) NOT_HERE;
    if ((flag = PyObject_GetAttr(state, n_env_forced)) == NULL || PyObject_IsTrue(flag) != 0) NOT_HERE;

    if ((grad = PyObject_CallNoArgs(grad_enabled)) == NULL) goto done;
    if ((device = PyObject_GetAttr(simulation, n_device)) == NULL) NOT_HERE;
    if ((name = PyObject_GetAttr(op, n_name)) == NULL || (scalars_of = PyObject_GetAttr(op, n_scalars)) == NULL)
        goto done;
    if ((scalars = PyObject_CallOneArg(scalars_of, arguments)) == NULL) NOT_HERE;
    if ((types = PyTuple_New(count)) == NULL) goto done;
    for (Py_ssize_t i = 0; i < count; i++)
        PyTuple_SET_ITEM(types, i, Py_NewRef((PyObject *)Py_TYPE(PyTuple_GET_ITEM(arguments, i))));
    if ((plans = PyObject_GetAttr(state, n_plans)) == NULL || (by_key = PyObject_GetAttr(plans, n_by_key)) == NULL ||
        (last = PyObject_GetAttr(plans, n_last)) == NULL)
        goto done;
    /* The op's last signatures found here (PlanTable.last), newest first: where this call's
     * key would equal one but for the shape, which every entry's guard checks, that one's
     * entries are searched, and building, hashing and comparing the key (a third of this
     * function's time) is skipped. Several, for a model that alternates shapes (FLUX's image
     * and text streams); a hit leaves their order as it is (reordering costs every call). */
    memo = Py_XNewRef(PyDict_GetItemWithError(last, name)); /* held: comparing may run Python code */
    if (memo == NULL && PyErr_Occurred()) goto done;
    for (Py_ssize_t i = 0; memo != NULL && found == NULL && i < PyTuple_GET_SIZE(memo); i++) {
        PyObject *remembered = PyTuple_GET_ITEM(memo, i); /* (key, entries) */
        int same = same_but_shape(PyTuple_GET_ITEM(remembered, 0), grad, device, types, scalars);
        if (same < 0) NOT_HERE;
        if (same && (found = search(PyTuple_GET_ITEM(remembered, 1), arguments)) == NULL) NOT_HERE;
        if (found == Py_None) Py_CLEAR(found); /* another shape, say */
    }
    if (found == NULL) {
        if ((shape = PyObject_GetAttr(PyTuple_GET_ITEM(arguments, 0), n_shape)) == NULL) NOT_HERE;
        /* selector.signature_key: (op, forced backend, grad mode, simulated device, types, scalars, shape) */
        if ((key = PyTuple_Pack(7, name, Py_None, grad, device, types, scalars, shape)) == NULL) goto done;
        entries = Py_XNewRef(PyDict_GetItemWithError(by_key, key));
        if (entries == NULL) NOT_HERE; /* no plan, or an unhashable scalar */
        if ((found = search(entries, arguments)) == NULL) NOT_HERE; /* ops.py's path catches these too */
        if (found == Py_None) NOT_HERE;
        if (remember(last, name, memo, key, entries) < 0) goto done;
    }

    /* ops.Plan is (implementation, launch, check_values, direct, spans); found is (plan, pointers) */
    PyObject *plan = PyTuple_GET_ITEM(found, 0), *read = PyTuple_GET_ITEM(found, 1);
    PyObject *check = PyTuple_GET_ITEM(plan, 2), *launch = PyTuple_GET_ITEM(plan, 1);
    PyObject *spans = PyTuple_GET_ITEM(plan, 4);
    int clear = spans != Py_None ? spans_clear(spans, read) : 0;
    if (clear < 0) goto done;
    if (check != Py_None && !clear) {
        PyObject *checked = PyObject_CallFunctionObjArgs(check, arguments, read, NULL);
        if (checked == NULL) goto done; /* a ValueError of the per-call checks */
        Py_DECREF(checked);
    }
    if ((outputs = new_outputs(op, arguments)) == NULL) goto done;
    if (!PyTuple_Check(outputs)) {
        PyErr_SetString(PyExc_TypeError, "cached_call: an op's outputs(...) must return a tuple");
        goto done;
    }
    Py_ssize_t read_count = PyTuple_GET_SIZE(read), output_count = PyTuple_GET_SIZE(outputs);
    if (output_count == 0) {
        pointers = Py_NewRef(read); /* an in-place op: its arguments' pointers are all */
    } else {
        if ((pointers = PyTuple_New(read_count + output_count)) == NULL) goto done;
        for (Py_ssize_t i = 0; i < read_count; i++) PyTuple_SET_ITEM(pointers, i, Py_NewRef(PyTuple_GET_ITEM(read, i)));
        for (Py_ssize_t i = 0; i < output_count; i++) {
            PyObject *output = PyTuple_GET_ITEM(outputs, i);
            PyObject *pointer = PyObject_VectorcallMethod(data_ptr_name, &output, 1, NULL);
            if (pointer == NULL) goto done;
            PyTuple_SET_ITEM(pointers, read_count + i, pointer);
        }
    }
    direct = Py_NewRef(PyTuple_GET_ITEM(plan, 3));
    int launched = direct != Py_None ? launch_direct(direct, pointers) : 0;
    if (launched < 0) goto done;
    if (!launched) {
        if ((values = PySequence_Concat(arguments, outputs)) == NULL) goto done;
        if ((done_launch = PyObject_CallFunctionObjArgs(launch, values, pointers, NULL)) == NULL) goto done;
    }
    result = Py_NewRef(outputs);
done:
    Py_XDECREF(stack); Py_XDECREF(state); Py_XDECREF(flag); Py_XDECREF(grad); Py_XDECREF(device);
    Py_XDECREF(name); Py_XDECREF(scalars_of); Py_XDECREF(scalars); Py_XDECREF(types); Py_XDECREF(shape);
    Py_XDECREF(key); Py_XDECREF(plans); Py_XDECREF(by_key); Py_XDECREF(last); Py_XDECREF(memo); Py_XDECREF(entries); Py_XDECREF(found);
    Py_XDECREF(outputs); Py_XDECREF(values); Py_XDECREF(pointers);
    Py_XDECREF(done_launch); Py_XDECREF(direct);
    return result;
}

/* configure_cached_call(selector module globals, device._simulation, torch.is_grad_enabled,
 * the current device's index getter, the current raw stream getter) */
static PyObject *configure(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 || !PyDict_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "configure_cached_call(selector globals: dict, simulation, "
                        "is_grad_enabled, current_device, current_stream, empty_like, contiguous_format)");
        return NULL;
    }
    Py_XSETREF(selector_globals, Py_NewRef(args[0]));
    Py_XSETREF(simulation, Py_NewRef(args[1]));
    Py_XSETREF(grad_enabled, Py_NewRef(args[2]));
    Py_XSETREF(current_device, Py_NewRef(args[3]));
    Py_XSETREF(current_stream, Py_NewRef(args[4]));
    Py_XSETREF(empty_like, Py_NewRef(args[5]));
    Py_XSETREF(contiguous_format, Py_NewRef(args[6]));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"find", (PyCFunction)(void (*)(void))find, METH_FASTCALL,
     "find(by_key, key, arguments) -> (plan, pointers) or None: PlanTable.find (signature.py)."},
    {"cached_call", (PyCFunction)(void (*)(void))cached_call, METH_FASTCALL,
     "cached_call(op, arguments, backend) -> outputs or NotImplemented: Op.run (ops.py) of a planned call."},
    {"configure_cached_call", (PyCFunction)(void (*)(void))configure, METH_FASTCALL,
     "configure_cached_call(selector globals, simulation, is_grad_enabled, current_device, current_stream, "
     "empty_like, contiguous_format)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cached_call", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cached_call(void) {
    data_ptr_name = PyUnicode_InternFromString("data_ptr");
    if (data_ptr_name == NULL) return NULL;
    PyObject **names[] = {&n_scopes, &n_stack, &n_dispatcher, &n_env_forced, &n_plans, &n_by_key, &n_device,
                          &n_name, &n_scalars, &n_outputs, &n_shape, &n_calls, &n_enter_hook, &n_exit_hook, &n_count, &n_last};
    const char *texts[] = {"_scopes", "stack", "_dispatcher", "env_forced", "plans", "_by_key", "device",
                           "name", "scalars", "outputs", "shape", "calls", "launch_enter_hook", "launch_exit_hook",
                           "count", "last"};
    for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++)
        if ((*names[i] = PyUnicode_InternFromString(texts[i])) == NULL) return NULL;
    if ((memory_format_kwnames = Py_BuildValue("(s)", "memory_format")) == NULL) return NULL;
    return PyModule_Create(&module);
}
