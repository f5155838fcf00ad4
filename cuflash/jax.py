"""cuflash under ``jax.jit`` and ``jax.grad``, through ``jax.experimental.buffer_callback``.

Each pass is one ``buffer_callback``: XLA calls a Python function with its CUDA stream and the
device buffers of the inputs and outputs, and that function launches cuflash's kernels on the
stream, into the output buffers. Nothing waits for the GPU, nothing is copied, and nothing is
allocated in the callback: split-KV partials, FlashMask's per-block bounds, the backward's fp32
rows and the forward's counters (the persistent blocks' tile counter, the split-KV merge's; zeroed
on the stream before the launch) are extra outputs that XLA allocates. Arguments are checked
(cuflash's messages, naming the argument) and the plans made at trace time, from the static
shapes, for the first of JAX's GPUs; the kernels are compiled and loaded then too, so the
callback can be traced into XLA's command buffers (CUDA graphs; ``CUFLASH_JAX_COMMAND_BUFFER=0``
keeps it out of them). A ``jax.custom_vjp`` saves (q, k, v, out, lse) and runs cuflash's backward
kernels.

    import cuflash.jax
    out = cuflash.jax.attention(q, k, v, causal=True)      # under jax.jit, jax.grad, jax.checkpoint
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

try:
    from jax.experimental.buffer_callback import buffer_callback
except ImportError as e:  # JAX before 0.6.1
    raise ImportError(f"cuflash.jax needs JAX 0.6.1 or newer (jax.experimental.buffer_callback), "
                      f"this is JAX {jax.__version__}") from e

from cuflash import api, arrays, backward, compiler, launch, validate
from cuflash.plan import Problem, chunk_piece_bounds, chunk_pieces, make_backward_plan, make_plan

__all__ = ["attention", "attention_varlen"]

COMMAND_BUFFER = os.environ.get("CUFLASH_JAX_COMMAND_BUFFER", "1") != "0"
# The forward's programmatic early launch (launch.EARLY_LAUNCH: the kernel starts while the
# stream's previous one finishes and waits for it before touching memory) inside XLA's execution;
# off unless CUFLASH_JAX_EARLY_LAUNCH=1 (not yet run inside XLA's command buffers).
EARLY_LAUNCH = os.environ.get("CUFLASH_JAX_EARLY_LAUNCH", "0") == "1"
_DLPACK_CUDA = 2


class _Call(NamedTuple):
    """A checked call: what its plans and launches depend on, all but the data (static)."""
    batch: int
    seqlen_q: int            # max_seqlen_q for packed sequences
    seqlen_k: int            # max_seqlen_k for packed sequences
    nheads: int
    nheads_k: int
    head_dim: int            # as the kernels see it: padded to a multiple of 8
    dtype: str               # "fp16" | "bf16"
    causal: bool
    scale: float
    window: tuple[int, int]
    softcap: float
    alibi_sb: int | None     # None without ALiBi, else the slopes' batch stride
    total_q: int | None      # packed sequences: q's rows; None for dense batches
    deterministic: bool
    flashmask: int = 0       # FlashMask: startend_row_indices' bound columns per key (0: none)
    flashmask_heads: int = 0  # and its heads


# ---------------------------------------------------------------------------------------------
# Entry points

def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, deterministic=False, attention_chunk=0, startend_row_indices=None):
    """:func:`cuflash.attention` for JAX arrays, usable under ``jax.jit``, ``jax.grad``
    (a ``jax.custom_vjp`` running cuflash's backward kernels), ``jax.checkpoint`` and ``jax.vmap``.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim), float16 or
    bfloat16 on a CUDA GPU. The options are static Python values, with cuflash.attention's
    meaning; ``alibi_slopes`` is a float32 array (nheads,) or (batch, nheads) and gets no
    gradient; ``deterministic=True`` makes the backward bitwise repeatable. ``attention_chunk``
    (a static int, cuflash.attention's chunked attention) runs, forward and backward, as packed
    sequences: each sequence cut at its chunks' first keys with the queries of each chunk
    (cuflash.plan.chunk_pieces; the same attention). ``startend_row_indices``: a FlashMask mask
    (cuflash.masks; :func:`cuflash.attention`'s), an int32 array (batch, 1 or nheads_k or nheads,
    seqlen_k, n) that may be a traced value, read in place by the kernels, forward and backward
    (its contents are the caller's contract, as for device arrays there); no gradient. Returns
    out, shaped like q.
    """
    _static(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
            deterministic=deterministic, attention_chunk=attention_chunk)
    qs, ks, vs = _shapes((q, "q"), (k, "k"), (v, "v"))
    validate.operands(qs, ks, vs)
    b, sq, h, d = qs.shape
    sk, hk = ks.shape[1], ks.shape[2]
    call = _check(qs, b, sq, sk, h, hk, causal, softmax_scale, window_size, softcap, alibi_slopes,
                  deterministic, None)
    chunk = validate.attention_chunk(attention_chunk)
    if startend_row_indices is not None:
        validate.chunk_alone(chunk, startend_row_indices=True)
        x = startend_row_indices  # NumPy's values are checked too, as cuflash.attention checks them
        x = x if isinstance(x, np.ndarray) else _shapes((x, "startend_row_indices"))[0]
        fm = validate.check_startend_row_indices(x, b, h, sq, sk, call.causal, nheads_k=hk, window=call.window,
                                                 alibi=alibi_slopes is not None)
        call = call._replace(flashmask=fm.shape[3], flashmask_heads=fm.shape[1])
    if 0 in (b, sq, h, sk):
        return jnp.zeros(q.shape, q.dtype)
    if chunk and not sq <= sk <= chunk:  # (a chunk that holds every key is no mask)
        steps = jnp.arange(b + 1, dtype=jnp.int32)
        out = _chunked((q, k, v), (steps * sq, steps * sk, sq, sk), max(0, sq - sk), chunk, alibi_slopes,
                       dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                            deterministic=deterministic))
        return out.reshape(q.shape)
    return _run(call, d, q, k, v, (() if alibi_slopes is None else (alibi_slopes,))
                + (() if startend_row_indices is None else (startend_row_indices,)))


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                     deterministic=False, attention_chunk=0):
    """:func:`cuflash.attention_varlen` (dense K/V) for JAX arrays, usable under ``jax.jit`` and
    ``jax.grad`` like :func:`attention`.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim); ``cu_seqlens_q``,
    ``cu_seqlens_k``: int32 arrays (batch + 1,), read by the kernels on the device (they may be
    traced values); ``max_seqlen_q``, ``max_seqlen_k``: static ints that size the grid. As in
    flash-attn, well-formed offsets under the maxima, ending at total_q and total_k, are the
    caller's contract. ``attention_chunk``: chunked attention per sequence (as :func:`attention`);
    passing the same array object as both cu_seqlens (inside the traced function: two arguments
    of a jitted function are two tracers) tells it that no sequence has more queries than keys,
    which keeps its pieces small.
    Returns out (total_q, nheads, headdim).
    """
    _static(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
            window_size=window_size, softcap=softcap, deterministic=deterministic, attention_chunk=attention_chunk)
    qs, ks, vs, cq, ck = _shapes((q, "q"), (k, "k"), (v, "v"), (cu_seqlens_q, "cu_seqlens_q"),
                                 (cu_seqlens_k, "cu_seqlens_k"))
    qs, ks, _, _, _, _, batch, max_sq, max_sk = validate.varlen(qs, ks, vs, cq, ck, max_seqlen_q, max_seqlen_k,
                                                                paged_ok=False)
    total_q, h, d = qs.shape
    validate.sizes((f"total_q + {backward.VARLEN_ROW_GAP} * batch (the backward's padded rows)",
                    total_q + backward.VARLEN_ROW_GAP * batch))
    call = _check(qs, batch, max_sq, max_sk, h, ks.shape[1], causal, softmax_scale, window_size, softcap,
                  alibi_slopes, deterministic, total_q)
    chunk = validate.attention_chunk(attention_chunk)
    if 0 in (batch, total_q, h, max_sq, max_sk):
        return jnp.zeros(q.shape, q.dtype)
    if chunk:  # (queries before a sequence's first key: none where one cu_seqlens serves both)
        lead = 0 if cu_seqlens_q is cu_seqlens_k and max_sq == max_sk else max_sq
        return _chunked((q, k, v), (cu_seqlens_q, cu_seqlens_k, max_sq, max_sk), lead, chunk, alibi_slopes,
                        dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                             deterministic=deterministic))
    extra = (() if alibi_slopes is None else (alibi_slopes,)) + (cu_seqlens_q, cu_seqlens_k)
    return _run(call, d, q, k, v, extra)


def _chunked(qkv, varlen, lead, chunk, alibi_slopes, kw):
    """Chunked attention as packed sequences through attention_varlen, forward and backward: the
    pieces of cuflash.plan.chunk_pieces, their cu_seqlens computed on the device from ``varlen``
    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k; q, k, v flattened to rows)."""
    q, k, v = (x.reshape(-1, *x.shape[-2:]) for x in qkv)
    cu_q, cu_k, max_sq, max_sk = varlen
    c, per_seq, max_q, max_k = chunk_pieces(cu_q.shape[0] - 1, max_sq, max_sk, chunk, lead, q.shape[1])
    ends = jnp.arange(per_seq, dtype=jnp.int32) * c  # (at most max_seqlen_k + c: within int32)
    pieces_q, pieces_k = chunk_piece_bounds(jnp, jnp.asarray(cu_q, jnp.int32), jnp.asarray(cu_k, jnp.int32), ends)
    if alibi_slopes is not None and alibi_slopes.ndim == 2:  # (batch, nheads): each piece its sequence's
        alibi_slopes = jnp.repeat(alibi_slopes, per_seq, axis=0)
    return attention_varlen(q, k, v, pieces_q, pieces_k, max_q, max_k, alibi_slopes=alibi_slopes, **kw)


def _static(**options):
    """TypeError for an option that is a traced value: the plans and kernels depend on it."""
    for name, value in options.items():
        if any(isinstance(x, jax.core.Tracer) for x in (value if isinstance(value, (tuple, list)) else (value,))):
            raise TypeError(f"{name} must be a static Python value under jax.jit (the kernels are chosen from it: "
                            f"pass it through static_argnames or close over it), got a traced value")


def _shapes(*named):
    """Shape stand-ins (cuflash.validate.Shape) of JAX arrays or tracers, whose shapes and dtypes
    are static under jit."""
    out = []
    for x, name in named:
        if not isinstance(x, (jax.Array, np.ndarray)):
            raise TypeError(f"{name} must be a JAX array, got {type(x).__name__}")
        out.append(validate.Shape(x.shape, np.dtype(x.dtype).name, name))
    return out


def _check(qs, batch, sq, sk, h, hk, causal, softmax_scale, window_size, softcap, alibi_slopes, deterministic,
           total_q) -> _Call:
    d = qs.shape[-1]
    scale = validate.scale(softmax_scale, d)
    causal = validate.boolean(causal, "causal")
    deterministic = validate.boolean(deterministic, "deterministic")
    alibi = None if alibi_slopes is None else _shapes((alibi_slopes, "alibi_slopes"))[0]
    window, cap, alibi, alibi_sb = validate.mods(window_size, softcap, alibi, batch, h, qs, scale)
    return _Call(batch, sq, sk, h, hk, -(-d // 8) * 8, arrays.DTYPE_NAMES[qs.dtype], causal, scale, window,
                 cap, None if alibi is None else alibi_sb, total_q, deterministic)


def _run(call: _Call, d: int, q, k, v, extra):
    """The differentiable call on head dims padded to a multiple of 8 (zero columns change no
    score and no gradient), sliced back to ``d``. Inside ``shard_map`` every operand is first
    typed as varying over the manual axes any of them varies over (an operand replicated over
    such an axis then gets its gradient summed over it, the transpose of that cast)."""
    if call.head_dim != d:
        pad = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, call.head_dim - d)])  # noqa: E731
        q, k, v = pad(q), pad(k), pad(v)
    axes = _varying(q, k, v, *extra)
    if axes:
        q, k, v = (_to_varying(x, axes) for x in (q, k, v))
        extra = [_to_varying(x, axes) for x in extra]
    out = _differentiable(call)(q, k, v, tuple(extra))
    return out if call.head_dim == d else out[..., :d]


def _varying(*xs) -> tuple:
    """The shard_map manual axes that any of ``xs`` varies over (its type's; none outside
    shard_map). A callback's results are typed as varying over none, so they are cast to these."""
    axes = set()
    for x in xs if hasattr(jax, "typeof") else ():
        aval = jax.typeof(x)
        kind = getattr(aval, "manual_axis_type", None)  # (JAX 0.10; ``vma`` before)
        axes.update(getattr(kind, "varying", None) or getattr(aval, "vma", None) or ())
    return tuple(sorted(axes))


def _to_varying(x, axes):
    """``x`` typed as varying over ``axes`` too (no data moves)."""
    missing = tuple(a for a in axes if a not in _varying(x))
    if not missing:
        return x
    return jax.lax.pcast(x, missing, to="varying") if hasattr(jax.lax, "pcast") else jax.lax.pvary(x, missing)


@functools.lru_cache(maxsize=256)
def _differentiable(call: _Call):
    @jax.custom_vjp
    def f(q, k, v, extra):
        return _forward(call, q, k, v, extra)[0]

    def f_fwd(q, k, v, extra):
        out, lse = _forward(call, q, k, v, extra)
        return out, (q, k, v, out, lse, extra)

    def f_bwd(res, dout):
        q, k, v, out, lse, extra = res
        return (*_backward(call, dout, q, k, v, out, lse, extra), tuple(None for _ in extra))

    f.defvjp(f_fwd, f_bwd)
    return f


# ---------------------------------------------------------------------------------------------
# Trace time: plans, scratch outputs, the callbacks

def _target():
    """(DeviceFacts, CUDA ordinals) of JAX's local GPUs; plans are made for the first."""
    try:
        devices = jax.local_devices(backend="gpu")
    except RuntimeError:  # no GPU backend in this JAX
        devices = []
    ordinals = tuple(d.local_hardware_id if d.local_hardware_id is not None else d.id for d in devices)
    if not ordinals:
        raise RuntimeError(f"cuflash.jax needs JAX with a CUDA GPU backend (jax[cuda12] or jax[cuda13]); this JAX "
                           f"runs on {jax.default_backend()} only")
    return api.device_facts(ordinals[0]), ordinals


def _problem(call: _Call) -> Problem:
    return Problem(call.batch, call.seqlen_q, call.seqlen_k, call.nheads, call.nheads_k, call.head_dim, call.dtype,
                   call.causal, return_lse=True, window=call.window, softcap=call.softcap > 0,
                   alibi=call.alibi_sb is not None, varlen=call.total_q is not None,
                   deterministic=call.deterministic, flashmask=call.flashmask, flashmask_heads=call.flashmask_heads)


def _load(plan, ordinals):
    """Compile and load the plan's kernels now (trace time), not inside a command-buffer capture."""
    for dev in ordinals:
        for launch_ in plan.launches:
            compiler.get_kernel(launch_.variant, dev)


def _callback(fn, result_types):
    """``fn(ctx, outs, *ins)`` as an op: XLA's stream in ``ctx``, its buffers in ``outs``/``ins``."""
    return buffer_callback(fn, tuple(result_types), vmap_method="sequential",
                           command_buffer_compatible=COMMAND_BUFFER)


def _forward(call: _Call, q, k, v, extra):
    """(out, lse): lse float32 (batch, nheads, seqlen_q), or (nheads, total_q) when packed."""
    facts, ordinals = _target()
    plan = make_plan(_problem(call), facts)
    _load(plan, ordinals)
    lse_shape = (call.batch, call.nheads, call.seqlen_q) if call.total_q is None else (call.nheads, call.total_q)
    types = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(lse_shape, jnp.float32)]
    if plan.workspace_bytes:  # split-KV partial outputs and LSEs, or FlashMask's int32 block bounds
        types.append(jax.ShapeDtypeStruct((plan.workspace_bytes // 4,), jnp.int32 if call.flashmask else jnp.float32))
    counters = _counters(plan)
    if counters:  # the persistent blocks' tile counter, or the split kernel's merge counters
        types.append(jax.ShapeDtypeStruct((counters,), jnp.int32))
    early = EARLY_LAUNCH  # read at trace time, as COMMAND_BUFFER is
    recipes = {}  # this callback's launch recipes (see _run_forward)
    res = _callback(lambda ctx, outs, *ins: _run_forward(call, plan, ctx, outs, ins, early, recipes), types)(
        q, k, v, *extra)
    axes = _varying(q, k, v, *extra)
    return _to_varying(res[0], axes), _to_varying(res[1], axes)


def _counters(plan) -> int:
    """The int32 counters the forward plan's main launch takes, zeroed, from its last output: one
    for persistent blocks (their tile counter), one per (batch, head, query block) for a split-KV
    launch that merges its splits itself (launch.FUSED_COMBINE: the last split of a query block
    merges them, counted in its counter; no combine kernel), else none."""
    if _persistent(plan):
        return 1
    return launch.merge_counters(plan) if launch.FUSED_COMBINE else 0


def _persistent(plan) -> bool:
    """Whether the forward plan runs persistent blocks, which take tiles from a counter."""
    return getattr(plan.launches[0].variant, "persistent", False)


def _backward(call: _Call, dout, q, k, v, out, lse, extra):
    facts, ordinals = _target()
    plan = make_backward_plan(_problem(call), facts)
    _load(plan, ordinals)
    types = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    types.append(jax.ShapeDtypeStruct((backward.workspace_floats(plan, call.total_q),), jnp.float32))
    prepared = {}  # this callback's prepared launches (see _run_backward)
    run = lambda ctx, outs, *ins: _run_backward(call, plan, ctx, outs, ins, prepared)  # noqa: E731
    dq, dk, dv, _ = _callback(run, types)(dout, q, k, v, out, lse, *extra)
    return tuple(_to_varying(g, _varying(x)) for g, x in ((dq, q), (dk, k), (dv, v)))


# ---------------------------------------------------------------------------------------------
# Run time (inside XLA's execution): views of XLA's buffers, launches on XLA's stream

def _device(buf) -> int:
    kind, ordinal = buf.__dlpack_device__()
    if int(kind) != _DLPACK_CUDA:
        raise RuntimeError(f"cuflash.jax runs on CUDA GPUs; this computation runs on DLPack device type {kind} "
                           "(put the arrays on a GPU)")
    return int(ordinal)


def _ptr(buf) -> int:
    """An XLA buffer's device address, checked for the 16-byte alignment the kernels read at."""
    ptr = buf.__cuda_array_interface__["data"][0]
    if ptr % 16:
        raise RuntimeError(f"cuflash.jax: XLA gave a buffer at {ptr:#x}, not 16-byte aligned")
    return ptr


def _view(buf, device: int) -> arrays.View:
    """A view of an XLA buffer: dense and row-major, so its strides follow from its shape."""
    shape = tuple(buf.shape)
    return arrays.View(_ptr(buf), shape, arrays.contiguous_strides(shape), np.dtype(buf.dtype).name, device,
                       "xla", buf)


def _extras(call: _Call, extra, device: int):
    """(ALiBi slopes view or None, (cu_seqlens_q, cu_seqlens_k) views or None, FlashMask's
    startend_row_indices view or None)."""
    views = [_view(x, device) for x in extra]
    alibi = views.pop(0) if call.alibi_sb is not None else None
    fm = views.pop() if call.flashmask else None
    return alibi, (tuple(views) if call.total_q is not None else None), fm


def _run_forward(call: _Call, plan, ctx, outs, ins, early: bool, recipes: dict):
    """Launch the forward on XLA's stream. The launch's recipe (launch.prepare: kernel, grid,
    parameters but the data pointers) is made once per device and kept in ``recipes``, the
    callback's own, with the extra inputs' pointers it holds (ALiBi slopes, cu_seqlens,
    startend_row_indices and FlashMask's workspace output; re-pointed when those differ): the
    shapes are static, so later calls only encode the tensor maps of their pointers and launch.
    outs[2] is the plan's workspace where it has one (split-KV partials, FlashMask's bounds)."""
    dev = _device(ins[0])
    has_ws = bool(plan.workspace_bytes)
    extra = tuple(_ptr(x) for x in ins[3:]) + ((_ptr(outs[2]),) if call.flashmask and has_ws else ())
    held = recipes.get(dev)
    if held is None:
        held = recipes[dev] = (extra, _forward_recipe(call, plan, outs, ins, dev, early))
    elif held[0] != extra and call.flashmask:  # other indices or workspace (FlashMask takes no slopes, cu_seqlens)
        assert has_ws, "a FlashMask plan keeps its prep kernel's bounds in the workspace"
        held = recipes[dev] = (extra, launch.with_flashmask(held[1], *extra))
    elif held[0] != extra:  # other slopes or cu_seqlens arrays: the recipe re-pointed at them
        names = ("alibi_slopes",) * (call.alibi_sb is not None) + ("cu_seqlens_q", "cu_seqlens_k") * (
            call.total_q is not None)
        held = recipes[dev] = (extra, launch.with_pointers(held[1], **dict(zip(names, extra))))
    r = held[1]
    q, k, v, o, lse = (_ptr(x) for x in (*ins[:3], *outs[:2]))
    stream = ctx.stream
    with arrays.on_device(dev):
        ws = None
        if r.split:
            w = _ptr(outs[2])
            ws = (w, w + 4 * r.ws_lse)
        counter = 0
        if len(outs) > 2 + has_ws:  # the tile or merge counters (XLA's last output), zeroed
            counter = _ptr(outs[-1])
            launch.zero_async(counter, 4 * outs[-1].shape[0], stream)
        # fused=False: no per-stream counter buffer is made; without counters here the combine
        # kernel merges the splits and persistent blocks run as one block per tile
        launch.fire(r, dev, stream, q, k, v, o, lse, ws, fused=False, counter=counter)


def _forward_recipe(call: _Call, plan, outs, ins, dev: int, early: bool):
    q, k, v, o = (_view(x, dev) for x in (*ins[:3], outs[0]))
    alibi, cu, fm = _extras(call, ins[3:], dev)
    kw = dict(softcap=call.softcap, alibi=(alibi.ptr, call.alibi_sb) if alibi is not None else (0, 0))
    if fm is not None:  # the prep kernel's per-key-block bounds go to XLA's workspace output
        kw["flashmask"] = (fm.ptr, fm.strides, fm.shape[1], _ptr(outs[2]))
    if cu is not None:  # packed views as (batch, max_seqlen, nheads, d) with token batch strides
        kw["varlen"] = (cu[0].ptr, cu[1].ptr, call.total_q, k.shape[0])
        q, o = (validate.batched(x, call.batch, call.seqlen_q) for x in (q, o))
        k, v = (validate.batched(x, call.batch, call.seqlen_k) for x in (k, v))
    with arrays.on_device(dev):
        r = launch.prepare(plan, q, k, v, o, call.scale, dev, **kw)
    # Plain launches (no programmatic stream serialisation) unless early: XLA may nest the
    # capture of this callback in its own CUDA graph.
    r = r if early else r._replace(early=False)
    if r.split:
        w = _view(outs[2], dev)
        assert w.shape[0] >= r.ws_floats, (w.shape, r.ws_floats)
        assert len(outs) == 3 or outs[3].shape[0] >= r.n_counters, (outs[3].shape, r.n_counters)
    return r


def _run_backward(call: _Call, plan, ctx, outs, ins, prepared: dict):
    """Launch the backward on XLA's stream. backward.run's prepared launches hold every pointer
    but the ALiBi slopes' as a role, so they are made once per device (again when the slopes are
    another array) and kept in ``prepared``, the callback's own; later calls fire them for their
    pointers."""
    dev = _device(ins[0])
    alibi = call.alibi_sb is not None
    slopes_ptr = _ptr(ins[6]) if alibi else 0
    held = prepared.get(dev)
    if held is None or held[0] != slopes_ptr:
        dout, q, k, v, o, lse = (_view(x, dev) for x in ins[:6])
        slopes, cu, fm = _extras(call, ins[6:], dev)
        grads = [_view(x, dev) for x in outs[:3]]
        mods = (call.window, call.softcap, slopes, call.alibi_sb or 0)
        with arrays.on_device(dev):
            prepared[dev] = (slopes_ptr, backward.run(plan, (q, k, v, dout, o), lse, grads, _ptr(outs[3]),
                                                      call.scale, mods, ctx.stream, dev, cu, fm))
        return
    launches = held[1]
    dout, q, k, v, o, lse = (_ptr(x) for x in ins[:6])
    dq, dk, dv, ws = (_ptr(x) for x in outs[:4])
    ptrs = dict(q=q, k=k, v=v, dout=dout, out=o, lse=lse, dq=dq, dk=dk, dv=dv, ws=ws,
                fm=_ptr(ins[6]) if call.flashmask else None)
    if call.total_q is not None:
        ptrs["cu_q"], ptrs["cu_k"] = (_ptr(x) for x in ins[6 + alibi:8 + alibi])
    with arrays.on_device(dev):
        backward.fire(launches, ptrs, ctx.stream)
