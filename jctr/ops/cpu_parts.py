"""A native CPU kernel's parts on helper threads, beside XLA's.

XLA:CPU runs a step's operations on a pool of threads, one a core; a custom call runs on
one of them. In a training step the sparse kernels are often the only work ready (the
lookup before everything, the bag before the interaction, the row update at the end), so the
pool's other threads wait while one thread walks the batch (``docs/performance.md``: on a
CPU with AMX the 10-hot bfloat16 step spent half its time in such single-thread kernels).

A kernel built on this module splits its work into parts. Its handler makes a job record
(``malloc``; the kernel's operands in words after a header), asks XLA for a future (the call
frame's ``future``: XLA keeps the operands alive and holds back whatever reads the results
until the future is set), hands the record to helper threads and takes parts itself; a helper
takes parts while any are left. Whoever finishes the last part sets the future; the last one
to leave frees the record. No thread waits for another: a helper that wakes late finds no
part left and leaves, so where every core is busy the kernel runs on its own thread as before,
less a few atomic operations.

The helpers are jctr's own threads (``JCTR_KERNEL_THREADS``, default: the cores this process
may use, less one), started at the first kernel call and asleep on a semaphore between jobs.
XLA's own pool would be the natural home, but its FFI ``ThreadPool_Schedule`` enqueues a
task without waking a sleeping thread, so the task waited until the kernel was over
(measured). Where the API lacks futures (an older XLA), in a process forked after the helpers
started, or with one part, the handler runs every part itself before it returns.

A kernel whose parts are followed by a serial end on the calling thread uses
:func:`run_and_wait` instead (no future: the call returns when every part is done, and the
end runs there; a future would let XLA's thread start other work that the end then competes
with for the cores). A kernel whose serial work follows each part in order (a pipeline: the
training lookup's pass over a piece once its probes are done, the helpers probing the pieces
after it) uses :func:`run_in_order`.

Each part must write what no other part reads or writes (the kernels split by ranges of
positions, segments or rows), so the results are the same bits however the parts are spread.

Example (inside a numba handler; ``_part(job, p)`` reads its operands with
``load(job, HEADER + i)``; a ``void(void*)`` cfunc calling ``work(address_of(data), _part)``
is registered under the name first, with :func:`register_task`)::

    job = begin(frame, 3, parts)  # 3 words of operands
    store(job, HEADER, values_address)
    run(job, frame, symbol("jctr_task_mine"), _part)
"""

from __future__ import annotations

import ctypes
import os
import threading

import numba
import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from jctr.ops import kernel_cache

_I8P = ir.IntType(8).as_pointer()
_I64 = ir.IntType(64)

# the job record's header (int64 words): references, the API, the future, the task, the
# next part to take, the parts done, the parts, where each part's done flag is (a word of
# the record; 0: none kept, see run_in_order); the kernel's words follow
_REFS, _API, _FUTURE, _TASK, _NEXT, _DONE, _PARTS, _FLAGS = 0, 1, 2, 3, 4, 5, 6, 7
HEADER = 8  # a whole line: the counters apart from the operands the parts read

# XLA_FFI_Api (xla/ffi/api/c_api.h): struct_size, extension, api_version (24 bytes),
# internal_api, then the functions in order
_ERROR_DESTROY, _POOL_SCHEDULE, _POOL_THREADS = 64, 136, 144
_FUTURE_CREATE, _FUTURE_SET_AVAILABLE = 152, 160
_API_WITH_FUTURES = _FUTURE_SET_AVAILABLE + 8  # the struct_size an API needs for them
# XLA_FFI_CallFrame: struct_size, extension, api, ctx, stage, args (40), rets (40),
# attrs (48), future. The frame's struct_size stops at attrs (the header's traits end
# there) though XLA reads ``future`` after the call: an API with the future functions
# has the field (they came together).
_FRAME_API, _FRAME_CTX, _FRAME_FUTURE = 16, 24, 168

# the helpers' pool (int64 words): a sem_t (32 bytes), the queue's lock, head and tail, how
# many helpers run, the process they run in, then a ring of job records
_LOCK, _HEAD, _TAIL, _HELPERS, _PID, _QUEUE = 4, 5, 6, 7, 8, 16
_RING = 64
MOST_PARTS = 64  # a kernel's parts at most
MOST_HELPERS = MOST_PARTS - 1  # more could never all have a part
_POOL = np.zeros(_QUEUE + _RING, np.int64)  # lives as long as the process
_POOL_SYMBOL = "jctr_parts_pool"


@intrinsic
def atomic_add(typingctx, address, value):
    """The int64 at ``address`` plus ``value``, atomically (sequentially consistent);
    returns the value before."""
    def codegen(context, builder, signature, args):
        return builder.atomic_rmw("add", builder.inttoptr(args[0], _I64.as_pointer()),
                                  args[1], "seq_cst")
    return types.int64(types.int64, types.int64), codegen


@intrinsic
def atomic_swap(typingctx, address, value):
    """Store ``value`` at ``address`` atomically; returns the value before."""
    def codegen(context, builder, signature, args):
        return builder.atomic_rmw("xchg", builder.inttoptr(args[0], _I64.as_pointer()),
                                  args[1], "seq_cst")
    return types.int64(types.int64, types.int64), codegen


def _libc_call(name, result, *params):
    """An intrinsic calling the C library's ``name`` with int64 arguments taken as
    pointers where ``params`` says ``p`` (``i``: int32)."""
    kinds = {"p": _I8P, "i": ir.IntType(32)}
    returns = kinds[result] if result else ir.VoidType()

    def typer(typingctx, *args):
        def codegen(context, builder, signature, values):
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(returns, [kinds[k] for k in params]), name)
            passed = [builder.inttoptr(v, _I8P) if k == "p" else builder.trunc(v, kinds[k])
                      for k, v in zip(params, values)]
            out = builder.call(fn, passed)
            if result == "p":
                return builder.ptrtoint(out, _I64)
            if result == "i":
                return builder.sext(out, _I64)
            return out if result else context.get_dummy_value()
        kind = types.int64 if result else types.void
        return kind(*[types.int64] * len(params)), codegen
    return typer


@intrinsic
def _malloc(typingctx, size):
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I8P, [_I64]),
                                            "malloc")
        return builder.ptrtoint(builder.call(fn, [args[0]]), _I64)
    return types.int64(types.int64), codegen


@intrinsic
def _free(typingctx, address):
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [_I8P]), "free")
        builder.call(fn, [builder.inttoptr(args[0], _I8P)])
        return context.get_dummy_value()
    return types.void(types.int64), codegen


@intrinsic
def _sem_wait(typingctx, address):
    return _libc_call("sem_wait", "i", "p")(typingctx, address)


@intrinsic
def _sem_post(typingctx, address):
    return _libc_call("sem_post", "i", "p")(typingctx, address)


@intrinsic
def _sched_yield(typingctx):
    return _libc_call("sched_yield", "i")(typingctx)


@intrinsic
def _getpid(typingctx):
    return _libc_call("getpid", "i")(typingctx)


@intrinsic
def _pool_address(typingctx):
    """The helpers' pool, by its symbol (resolved when the code is loaded)."""
    def codegen(context, builder, signature, args):
        pool = builder.module.globals.get(_POOL_SYMBOL)
        if pool is None:
            pool = ir.GlobalVariable(builder.module, _I64, _POOL_SYMBOL)
            pool.linkage = "external"
        return builder.ptrtoint(pool, _I64)
    return types.int64(), codegen


@intrinsic
def _address(typingctx, pointer):
    def codegen(context, builder, signature, args):
        return builder.ptrtoint(args[0], _I64)
    return types.int64(types.voidptr), codegen


@intrinsic
def _call_task(typingctx, task, job):
    """``task(job)``: a job's task function."""
    def codegen(context, builder, signature, args):
        kind = ir.FunctionType(ir.VoidType(), [_I8P])
        builder.call(builder.inttoptr(args[0], kind.as_pointer()),
                     [builder.inttoptr(args[1], _I8P)])
        return context.get_dummy_value()
    return types.void(types.int64, types.int64), codegen


@intrinsic
def symbol(typingctx, name):
    """The address of the task function registered under ``name`` (a string literal) by
    :func:`register_task`: resolved when the code is loaded, so numba's on-disk cache holds no
    address of this process."""
    if not isinstance(name, types.StringLiteral):
        return None
    label = name.literal_value

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [_I8P]), label)
        return builder.ptrtoint(fn, _I64)
    return types.int64(name), codegen


@intrinsic
def _call(typingctx, function, argument):
    """``function(argument)`` for an XLA API function (``XLA_FFI_Error* f(Args*)``): the
    error's address, 0 for success."""
    def codegen(context, builder, signature, args):
        kind = ir.FunctionType(_I8P, [_I8P])
        result = builder.call(builder.inttoptr(args[0], kind.as_pointer()),
                              [builder.inttoptr(args[1], _I8P)])
        return builder.ptrtoint(result, _I64)
    return types.int64(types.int64, types.int64), codegen


@intrinsic
def _load(typingctx, address):
    def codegen(context, builder, signature, args):
        return builder.load(builder.inttoptr(args[0], _I64.as_pointer()))
    return types.int64(types.int64), codegen


@intrinsic
def _store(typingctx, address, value):
    def codegen(context, builder, signature, args):
        builder.store(args[1], builder.inttoptr(args[0], _I64.as_pointer()))
        return context.get_dummy_value()
    return types.void(types.int64, types.int64), codegen


@numba.njit(inline="always")
def load(job, word):
    """Word ``word`` of the job record."""
    return _load(job + 8 * word)


@numba.njit(inline="always")
def store(job, word, value):
    """Set word ``word`` of the job record."""
    _store(job + 8 * word, np.int64(value))


@numba.njit(inline="always")
def _api_call(api, offset, words):
    """API function at ``offset`` with an Args struct of ``words`` (its struct_size set);
    True on success (an error is destroyed)."""
    words[0] = 8 * words.shape[0]
    error = _call(_load(api + offset), words.ctypes.data)
    if error == 0:
        return True
    destroy = np.zeros(3, np.int64)
    destroy[0] = 24
    destroy[2] = error
    _call(_load(api + _ERROR_DESTROY), destroy.ctypes.data)
    return False


@numba.njit(inline="always")
def begin(frame, words, parts):
    """A job record of ``parts`` parts with ``words`` words of operands after the header."""
    job = _malloc(8 * (HEADER + words))
    for w in range(HEADER):
        store(job, w, 0)
    store(job, _REFS, 1)
    store(job, _API, _load(frame + _FRAME_API))
    store(job, _PARTS, max(parts, 1))
    return job


@numba.njit(inline="always")
def part_count(job):
    """The parts of the record."""
    return load(job, _PARTS)


@numba.njit(inline="always")
def part_range(job, p, n):
    """[lo, hi) of part ``p`` when the record's parts split ``n`` items evenly."""
    parts = load(job, _PARTS)
    return p * n // parts, (p + 1) * n // parts


@numba.njit(inline="always")
def _leave(job):
    if atomic_add(job + 8 * _REFS, -1) == 1:
        _free(job)


@numba.njit(inline="always")
def _take_parts(job, part):
    """Run parts (``part(job, p)``) while any are left; True if this thread finished the
    last of them."""
    parts = load(job, _PARTS)
    last = False
    while True:
        p = atomic_add(job + 8 * _NEXT, 1)
        if p >= parts:
            break
        last |= _run_part(job, part, p)
    return last


@numba.njit(inline="always")
def _run_part(job, part, p):
    """Part ``p`` run and counted done (its done flag set where :func:`run_in_order` keeps
    them); True if it was the last part done."""
    part(job, p)
    flags = load(job, _FLAGS)
    if flags != 0:
        atomic_swap(job + 8 * (flags + p), 1)
    return atomic_add(job + 8 * _DONE, 1) == load(job, _PARTS) - 1


@numba.njit(inline="always")
def work(job, part):
    """Take parts (``part(job, p)``) while any are left; the last part done sets the
    future; the last one to leave frees the record. A task calls this."""
    if _take_parts(job, part):
        future = load(job, _FUTURE)
        if future != 0:
            args = np.zeros(3, np.int64)
            args[2] = future
            _api_call(load(job, _API), _FUTURE_SET_AVAILABLE, args)
    _leave(job)


@numba.njit(inline="always")
def threads(frame):
    """The threads a job of this call can run on: the helpers and this one (1 where the
    helpers cannot be used)."""
    pool = _pool_address()
    if _load(_load(frame + _FRAME_API)) < _API_WITH_FUTURES \
            or _load(pool + 8 * _PID) != _getpid():
        return 1
    return 1 + _load(pool + 8 * _HELPERS)


@numba.njit(inline="always")
def _lock(pool):
    while atomic_swap(pool + 8 * _LOCK, 1) != 0:
        pass


@numba.njit(inline="always")
def _unlock(pool):
    atomic_swap(pool + 8 * _LOCK, 0)


@numba.njit(inline="always")
def _wake(job, wanted):
    """Queue the record for up to ``wanted`` helpers (as many as run at most) and wake them;
    each holds a reference until it leaves."""
    pool = _pool_address()
    helpers = min(_load(pool + 8 * _HELPERS), wanted)
    if helpers <= 0:
        return
    atomic_add(job + 8 * _REFS, helpers)
    _lock(pool)
    queued = 0
    for _ in range(helpers):
        tail = _load(pool + 8 * _TAIL)
        if tail - _load(pool + 8 * _HEAD) >= _RING:
            break  # the queue full (helpers far behind): fewer of them
        _store(pool + 8 * (_QUEUE + tail % _RING), job)
        _store(pool + 8 * _TAIL, tail + 1)
        queued += 1
    _unlock(pool)
    atomic_add(job + 8 * _REFS, queued - helpers)
    for _ in range(queued):
        _sem_post(pool)


@numba.njit(inline="always")
def run(job, frame, task, part):
    """Hand the record to the helpers (each runs ``task``, a ``void(void*)`` function given
    the record), with a future XLA waits on, then take parts here. Every part is done when
    this returns only if no helper could be used."""
    if threads(frame) > 1 and load(job, _PARTS) > 1:
        made = np.zeros(3, np.int64)
        if _api_call(load(job, _API), _FUTURE_CREATE, made) and made[2] != 0:
            store(job, _TASK, task)
            store(job, _FUTURE, made[2])
            _store(frame + _FRAME_FUTURE, made[2])
            _wake(job, load(job, _PARTS) - 1)
    work(job, part)


@numba.njit(inline="always")
def run_and_wait(job, frame, task, part):
    """Take parts here beside the helpers (each runs ``task``, calling :func:`work`), as
    :func:`run` does but with no future: return once every part is done, waiting for a
    helper's last part if need be. For a job whose end must run serially on the calling
    thread (XLA's: a future would free it for other work, and that end would compete with
    it for the cores). The caller keeps the record until :func:`release`."""
    parts = load(job, _PARTS)
    if threads(frame) > 1 and parts > 1:
        store(job, _TASK, task)
        _wake(job, parts - 1)
    _take_parts(job, part)
    while atomic_add(job + 8 * _DONE, 0) < parts:  # a helper's part under way
        _sched_yield()


@numba.njit(inline="always")
def run_in_order(job, frame, task, part, after, flags):
    """:func:`run_and_wait` with a serial step after each part: ``after(job, p)`` runs on
    this thread for p = 0, 1, ... in order, each as soon as part ``p`` is done (on any
    thread), while the helpers take the parts after it; this thread takes a part itself
    only while the next step waits for its part. ``flags``: the word of the record from
    which ``parts`` words (zeroed here) keep each part's done flag. The parts (taken in
    order) may read what earlier steps write: a pipeline whose steps find the lines their
    part touched still in cache. Returns when every part and step is done; the caller keeps
    the record until :func:`release`."""
    parts = load(job, _PARTS)
    for p in range(parts):
        store(job, flags + p, 0)
    store(job, _FLAGS, flags)
    if threads(frame) > 1 and parts > 1:
        store(job, _TASK, task)
        _wake(job, parts - 1)
    for step in range(parts):
        while atomic_add(job + 8 * (flags + step), 0) == 0:
            p = atomic_add(job + 8 * _NEXT, 1)
            if p < parts:
                _run_part(job, part, p)
            else:  # the step's part under way on a helper
                _sched_yield()
        after(job, step)
    while atomic_add(job + 8 * _DONE, 0) < parts:
        _sched_yield()


@numba.njit(inline="always")
def release(job):
    """The caller's hold on a record of :func:`run_and_wait` given up."""
    _leave(job)


def _helper(pool_pointer):
    """A helper thread: wait for a job, run its task, forever."""
    pool = _address(pool_pointer)
    while True:
        if _sem_wait(pool) != 0:
            continue  # interrupted by a signal
        _lock(pool)
        job = 0
        head = _load(pool + 8 * _HEAD)
        if head < _load(pool + 8 * _TAIL):
            job = _load(pool + 8 * (_QUEUE + head % _RING))
            _store(pool + 8 * _HEAD, head + 1)
        _unlock(pool)
        if job != 0:
            _call_task(load(job, _TASK), job)


def register_task(name: str, task) -> None:
    """Make the cfunc ``task`` the address :func:`symbol` resolves ``name`` to (before any
    code using the name is compiled or loaded)."""
    llvm.add_symbol(name, task.address)


llvm.add_symbol(_POOL_SYMBOL, _POOL.ctypes.data)
_libc = ctypes.CDLL(None, use_errno=True)
_helper_function = None
_starting = threading.Lock()


def helper_count() -> int:
    """The helper threads kernels may use: ``JCTR_KERNEL_THREADS``, else the cores this
    process may run on less one."""
    told = os.environ.get("JCTR_KERNEL_THREADS", "").strip()
    if told:
        try:
            count = int(told)
        except ValueError:
            raise ValueError(f"JCTR_KERNEL_THREADS={told!r}: expected a whole number of "
                             "helper threads (0: the kernels on one thread)") from None
    else:
        count = len(os.sched_getaffinity(0)) - 1
    return min(max(0, count), MOST_HELPERS)


def start_helpers(count: int | None = None) -> int:
    """Start the helper threads (once a process: a child forked after they started runs the
    kernels on one thread until it calls this). Returns how many run."""
    with _starting:  # two threads tracing their first steps at once start one pool
        return _start_helpers(count)


def _start_helpers(count: int | None) -> int:
    global _helper_function
    count = helper_count() if count is None else count
    if _POOL[_PID] == os.getpid() or count == 0:
        return int(_POOL[_HELPERS]) if _POOL[_PID] == os.getpid() else 0
    if _helper_function is None:
        _helper_function = cfunc(_helper, types.voidptr(types.voidptr))
    _POOL[:] = 0
    if _libc.sem_init(ctypes.c_void_p(_POOL.ctypes.data), 0, 0) != 0:
        return 0
    started = 0
    for _ in range(count):
        thread = ctypes.c_ulong()
        if _libc.pthread_create(ctypes.byref(thread), None,
                                ctypes.c_void_p(_helper_function.address),
                                ctypes.c_void_p(_POOL.ctypes.data)) != 0:
            break
        _libc.pthread_detach(thread)
        started += 1
    _POOL[_PID] = os.getpid()
    _POOL[_HELPERS] = started
    return started


def cfunc(fn, signature):
    """``fn`` compiled as a C function of ``signature``."""
    kernel_cache.install()  # the cache follows the modules the kernel inlines from
    try:  # compiled once, then loaded from numba's on-disk cache
        return numba.cfunc(signature, nopython=True, cache=True)(fn)
    except RuntimeError:  # no writable cache location (a read-only install)
        return numba.cfunc(signature, nopython=True)(fn)
