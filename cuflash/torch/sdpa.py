"""cuflash behind ``torch.nn.functional.scaled_dot_product_attention``: :func:`activate_sdpa` and
:func:`restore_sdpa`.

Activation overrides the CUDA kernels of SDPA's flash-attention ops,
``aten::_scaled_dot_product_flash_attention`` and ``..._backward``, through ``torch.library``
(as PyTorch's own FA3 and FA4 adapters in ``torch/nn/attention/_fa3.py`` / ``_fa4.py`` do), so
SDPA's flash path runs cuflash's kernels under autograd, ``torch.compile`` and CUDA graphs alike.
Calls cuflash cannot serve (the debug mask, other dtypes, ...) go to PyTorch's own kernel,
fetched with ``torch.library.get_kernel`` before the override. The forward's autograd kernel is
overridden too: an eager call that needs gradients runs cuflash's own autograd Function, whose
backward is a Python node of one gradient rather than the flash backward op reached through
autograd's boxing of its 15 arguments (host time); every other call takes PyTorch's autograd
kernel, and so the CUDA kernels above. Attention dropout is PyTorch's unless activation asks for
cuflash's (``activate_sdpa(dropout=True)``), and then served on the autograd key alone, in eager
calls that need gradients (_with_dropout): the flash ops' rng_state is PyTorch's Philox state,
which cuflash's mask does not follow, so the CUDA kernels above leave every call with dropout,
forward and backward, to PyTorch's. On PyTorch >= 2.11 cuflash is also
in SDPA's registry: ``torch.nn.attention.activate_flash_attention_impl("cuflash")`` and
``restore_flash_attention_impl()`` do the same as these two functions.

The flash ops under these two, ``aten::_flash_attention_forward`` and ``..._backward``, which
``torch.nn.attention.varlen.varlen_attn`` and SDPA on nested (jagged) tensors call on
(batch, seqlen, nheads, headdim) tensors or on packed sequences with cum_seq_q / cum_seq_k, are
overridden the same way (their autograd stays PyTorch's).

The SDPA flash ops take (batch, nheads, seqlen, headdim) tensors, transposed views of cuflash's
(batch, seqlen, nheads, headdim) layout, so they are passed as views, never copied. Their LSE is
cuflash's: float32 (batch, nheads, seqlen_q), natural log. ``is_causal`` on these ops is aligned to
the bottom-right corner, as in cuflash (SDPA itself only sends causal calls with seqlen_q ==
seqlen_k to them; ``torch.nn.attention.bias.causal_lower_right`` sends the others). K/V may have
fewer heads than Q (SDPA's ``enable_gqa``).

PyTorch's context parallelism (``torch.distributed.tensor.experimental.context_parallel``) calls
these same ops once per block of its ring, on each rank's local tensors: ``is_causal`` only on
square diagonal blocks, then non-causal blocks of half the queries or half the keys, whose
backward gets the merged output and LSE as views. Every such call is one cuflash serves (see
docs/torch.md, "Context parallelism").
"""
import functools
import warnings

import torch
import torch.nn.attention

from cuflash import arrays, validate
from cuflash.plan import cached_on_plans

from . import ops

NAME = "cuflash"
_FWD = "aten::_scaled_dot_product_flash_attention"
_BWD = "aten::_scaled_dot_product_flash_attention_backward"
# The flash ops on (batch, seqlen, nheads, d) or packed (total, nheads, d) tensors, which
# torch.nn.attention.varlen.varlen_attn and SDPA on nested (jagged) tensors call.
_VFWD = "aten::_flash_attention_forward"
_VBWD = "aten::_flash_attention_backward"
_FLASH = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)

_active = None  # the _Activation while cuflash serves SDPA


# ---------------------------------------------------------------------------------------------
# Which calls cuflash serves

def _unsupported(query, key, value, dropout_p, scale):
    """Why cuflash cannot serve a flash-attention call on these operands, or None if it can."""
    if dropout_p != 0:
        return f"dropout_p={dropout_p}"
    if query.dtype not in (torch.float16, torch.bfloat16) or not query.dtype == key.dtype == value.dtype:
        return f"dtypes {query.dtype}, {key.dtype}, {value.dtype}"
    if not query.dim() == key.dim() == value.dim() == 4:
        return "operands that are not 4-dim"
    b, h, sq, d = query.shape
    hk, sk = key.shape[1], key.shape[2]
    if key.shape != value.shape or key.shape[0] != b or key.shape[3] != d:
        return f"shapes q {tuple(query.shape)}, k {tuple(key.shape)}, v {tuple(value.shape)}"
    if not 1 <= d <= 256 or hk == 0 or h % hk or 0 in (b, sq, sk):
        return f"head dim {d}, heads {h}/{hk}, seqlens {sq}/{sk}"
    if max(b, h, sq, sk, b * h * sq) > validate.MAX_SIZE:
        return "sizes past cuflash's limits"
    if any(x.shape[-1] > 1 and x.stride(-1) != 1 for x in (query, key, value)):
        return "a last dim that is not contiguous"
    try:
        validate.scale(scale, d)
    except (TypeError, ValueError):
        return f"scale={scale}"
    return _device_problem(query, key, value)


def _unsupported_backward(grad_out, query, out, logsumexp, lse_shape=None):
    """The backward's own operands, or None where cuflash can take them; ``lse_shape``: the LSE's
    (default SDPA's (batch, nheads, seqlen_q) of a (batch, nheads, seqlen_q, d) query)."""
    if grad_out.shape != query.shape or out.shape != query.shape or not (
            grad_out.dtype == out.dtype == query.dtype):
        return "grad_out or out unlike query"
    if out.shape[-1] > 1 and out.stride(-1) != 1:
        return "out's last dim is not contiguous"
    if logsumexp.dtype != torch.float32 or tuple(logsumexp.shape) != tuple(lse_shape or query.shape[:3]):
        return f"logsumexp {logsumexp.dtype} {tuple(logsumexp.shape)}"
    return _device_problem(grad_out, query, out, logsumexp)


def _device_problem(*xs):
    dev = xs[0].device
    if dev.type != "cuda" or any(x.device != dev for x in xs):
        return "operands not on one CUDA device"
    if _capability(dev.index) < (8, 0):
        return "a GPU older than sm_80"
    return None


@functools.lru_cache(maxsize=None)
def _capability(index):
    return torch.cuda.get_device_capability(index)


# ---------------------------------------------------------------------------------------------
# The kernels registered for the CUDA key

_bshd = ops._bshd
_placeholders: dict = {}  # (device, dtype) -> the eager Function's (rng_state, unused, debug_attn_mask)


def _new_placeholders(query):
    """The flash op's (rng_state, unused, debug_attn_mask) of a call without dropout: never read."""
    return (torch.empty(2, dtype=torch.uint64, device=query.device),
            torch.empty((), dtype=torch.uint64, device=query.device), query.new_empty(0))


def _result(query, key, out, lse, held=None):
    """The flash op's tuple (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state,
    unused, debug_attn_mask) around cuflash's output and LSE; ``held``: the last three, else new."""
    return (out, lse, None, None, query.shape[2], key.shape[2]) + (held or _new_placeholders(query))


def _held_placeholders(query):
    """The eager Function's (rng_state, unused, debug_attn_mask): nothing reads them (its
    backward is cuflash's, which takes none of them), so each device and dtype keeps
    one set rather than allocating three tensors per call; not during a CUDA graph capture,
    whose private pool must not hold tensors kept here."""
    key = (query.device, query.dtype)
    held = _placeholders.get(key)
    if held is None:
        held = _new_placeholders(query)
        if query.is_cuda and torch.cuda.is_current_stream_capturing():
            return held
        _placeholders[key] = held
    return held


def _forward(query, key, value, is_causal, scale):
    """cuflash's forward as the flash op's tuple; output has query's layout."""
    out = torch.empty_like(query)
    _, lse = ops._forward_kernel(*_bshd(query, key, value, out), is_causal, scale, -1, -1, 0.0,
                                 None, True)
    return _result(query, key, out, lse)


def _backward(grad_out, query, key, value, out, logsumexp, is_causal, scale):
    """cuflash's backward: (grad_query, grad_key, grad_value), each with its input's layout."""
    grads = tuple(torch.empty_like(x) for x in (query, key, value))
    views = _bshd(*grads)
    res = ops._backward_kernel(*_bshd(ops._last_dim_contiguous(grad_out), query, key, value, out),
                               logsumexp, *views, is_causal, scale, -1, -1, 0.0, None,
                               torch.are_deterministic_algorithms_enabled())
    ops._into(views, res)
    return grads


def _forward_impl(keyset, query, key, value, dropout_p=0.0, is_causal=False,
                  return_debug_mask=False, *, scale=None):
    why = "return_debug_mask=True" if return_debug_mask else _unsupported(query, key, value,
                                                                          dropout_p, scale)
    if why:
        return _pytorch(_FWD, why, keyset, query, key, value, dropout_p, is_causal,
                        return_debug_mask, scale=scale)
    return _forward(query, key, value, is_causal, scale)


def _backward_impl(keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                   max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    if dropout_p != 0 and any(philox_seed is held[0] for held in _placeholders.values()):
        raise ValueError("philox_seed: this rng_state comes from a forward that cuflash served with its own "
                         "dropout (activate_sdpa(dropout=True)), whose mask PyTorch's backward cannot "
                         "regenerate; take that forward's gradients through autograd (out.backward(...))")
    why = (_unsupported(query, key, value, dropout_p, scale)
           or _unsupported_backward(grad_out, query, out, logsumexp))
    if why:
        return _pytorch(_BWD, why, keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q,
                        cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset,
                        scale=scale)
    return _backward(grad_out, query, key, value, out, logsumexp, is_causal, scale)


# ---------------------------------------------------------------------------------------------
# The flash ops under SDPA's: dense (batch, seqlen, nheads, d), or packed sequences (total,
# nheads, d) with cum_seq_q / cum_seq_k (varlen_attn, nested tensors). Their autograd is
# PyTorch's (derivatives.yaml, or varlen_attn's own), which calls the backward op below.

_FLASH_OPTIONS = ("scale", "window_size_left", "window_size_right")  # keyword arguments cuflash takes


def _unsupported_flash(query, key, value, cum_seq_q, cum_seq_k, dropout_p, extra, kwargs):
    """Why cuflash cannot serve a call of the flash ops below, or None: the checks of
    _unsupported on (batch, nheads, seqlen, d) views, packed sequences as one batch of them;
    keyword arguments beyond scale and the window (seqused_k, alibi_slopes, a block table, out,
    num_splits, and any a later PyTorch adds) given, or extra positional ones, go to PyTorch."""
    given = [n for n, x in kwargs.items() if n not in _FLASH_OPTIONS and x is not None]
    if extra or given:
        return f"arguments {given or 'beyond the op schema cuflash knows'}"
    if any(kwargs.get(n) is not None and not isinstance(kwargs[n], int) for n in _FLASH_OPTIONS[1:]):
        return "a window that is not ints"
    if (cum_seq_q is None) != (cum_seq_k is None):
        return "cum_seq_q and cum_seq_k not given together"
    if cum_seq_q is None:
        if not query.dim() == key.dim() == value.dim() == 4:
            return "dense operands that are not 4-dim"
        return _unsupported(*_bshd(query, key, value), dropout_p, kwargs.get("scale"))
    if not query.dim() == key.dim() == value.dim() == 3:
        return "packed operands that are not 3-dim"
    for cu in (cum_seq_q, cum_seq_k):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.device != query.device:
            return f"cum_seq {cu.dtype} {tuple(cu.shape)} on {cu.device}"
    if cum_seq_q.shape != cum_seq_k.shape or cum_seq_q.shape[0] < 2:
        return "cum_seq_q and cum_seq_k of different or no sequences"
    return _unsupported(*(x.unsqueeze(0).transpose(1, 2) for x in (query, key, value)), dropout_p,
                        kwargs.get("scale"))


def _window_of(kwargs):
    """(left, right) of the flash ops' window_size_left / window_size_right (None or negative:
    unbounded, as in PyTorch's kernel)."""
    left, right = kwargs.get("window_size_left"), kwargs.get("window_size_right")
    return (-1 if left is None or left < 0 else left), (-1 if right is None or right < 0 else right)


def _flash_forward_impl(keyset, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                        return_debug_mask, *extra, **kwargs):
    """aten::_flash_attention_forward: (output, logsumexp, rng_state, unused, debug_attn_mask),
    the LSE (batch, nheads, seqlen_q), or (nheads, total_q) for packed sequences."""
    why = "return_debug_mask=True" if return_debug_mask else _unsupported_flash(
        query, key, value, cum_seq_q, cum_seq_k, dropout_p, extra, kwargs)
    if why:
        return _pytorch(_VFWD, why, keyset, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                        is_causal, return_debug_mask, *extra, **kwargs)
    left, right = _window_of(kwargs)
    out = torch.empty_like(query)  # (query's layout, as PyTorch's kernel and the op's meta function give it)
    if cum_seq_q is None:
        _, lse = ops._forward_kernel(query, key, value, out, is_causal, kwargs.get("scale"), left, right, 0.0, None,
                                     True)
    else:
        _, lse = ops._varlen_forward_kernel(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, out, is_causal,
                                            kwargs.get("scale"), left, right, 0.0, None, None, True)
    return (out, lse) + _new_placeholders(query)


def _flash_backward_impl(keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                         dropout_p, is_causal, rng_state, unused, *extra, **kwargs):
    """aten::_flash_attention_backward: (grad_query, grad_key, grad_value), each with its input's
    layout."""
    lse_shape = (query.shape[0], query.shape[2], query.shape[1]) if cum_seq_q is None else query.shape[1::-1]
    why = (_unsupported_flash(query, key, value, cum_seq_q, cum_seq_k, dropout_p, extra, kwargs)
           or _unsupported_backward(grad_out, query, out, logsumexp, lse_shape))
    if why:
        return _pytorch(_VBWD, why, keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                        max_k, dropout_p, is_causal, rng_state, unused, *extra, **kwargs)
    left, right = _window_of(kwargs)
    grads = tuple(torch.empty_like(x) for x in (query, key, value))
    dout, det = ops._last_dim_contiguous(grad_out), torch.are_deterministic_algorithms_enabled()
    if cum_seq_q is None:
        res = ops._backward_kernel(dout, query, key, value, out, logsumexp, *grads, is_causal, kwargs.get("scale"),
                                   left, right, 0.0, None, det)
    else:
        res = ops._varlen_backward_kernel(dout, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                                          *grads, is_causal, kwargs.get("scale"), left, right, 0.0, None, det)
    return ops._into(grads, res)


# ---------------------------------------------------------------------------------------------
# The forward's autograd kernel (the key above CUDA)

_served: dict = cached_on_plans({})  # repeat signature of a forward's operands and options -> ops._Prepared or None


def _autograd_impl(keyset, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                   *, scale=None):
    """SDPA's flash forward above autograd. A call that needs gradients and that cuflash serves
    runs cuflash's eager Function (ops._prepared_apply): its backward node takes the output's
    gradient alone, where the aten op's own node would call the flash backward op with 15 boxed
    arguments (about half of a step's host time: BENCHMARKS.md); from a layout's third such call,
    node.cpp's fast_forward runs that forward whole in C++ where it covers the layout (_keep_fast).
    Eager calls with dropout are cuflash's where activation asked for it and _with_dropout
    serves them. Every other call (no gradient, torch.compile's fake tensors, torch.func) takes
    PyTorch's autograd kernel, which records that node and calls the CUDA kernels above."""
    if dropout_p != 0 and _active.dropout and not return_debug_mask:
        res = _with_dropout(query, key, value, dropout_p, is_causal, scale)
        if res is not None:
            return _result(query, key, res[0], res[1], _held_placeholders(query))
    plain = not return_debug_mask and dropout_p == 0
    if plain and _fast is not None and ops._plain_autograd():  # a layout node.cpp runs whole (node.keep_forward)
        res = _fast(query, key, value, is_causal, scale)
        if res is not None:
            return _result(query, key, res[0], res[1], _held_placeholders(query))
    p = _eager(query, key, value, is_causal, scale) if plain else None
    if p is None:
        return _active.autograd.call_boxed(keyset, query, key, value, dropout_p, is_causal, return_debug_mask,
                                           scale=scale)
    out, lse = ops._prepared_apply(query, key, value, p)  # (SDPA's layout in and out: p.sdpa)
    if p.fast is None and p.program:
        _keep_fast(p, query, key, value)
    return _result(query, key, out, lse, _held_placeholders(query))


def _with_dropout(query, key, value, dropout_p, is_causal, scale):
    """(out, lse) of an eager call with attention dropout that needs gradients, or None where
    cuflash does not serve it. cuflash's dropout has flash-attn's semantics (cuflash.torch.attention's
    ``dropout_p``): the mask is drawn from the device's default CUDA generator (its seed, and
    its offset, which this call advances), so ``torch.manual_seed`` repeats it; the call runs
    cuflash's eager Function, whose backward regenerates the mask from the saved seed and offset.
    Calls without gradients are not served: the forward of a compiled graph runs without them and
    hands its rng_state to the flash backward op, which must then be PyTorch's (the CUDA kernels
    above leave dropout to PyTorch). Nor is a reentrant checkpoint's recompute, whose forward ran
    without gradients (_recomputing_without_hooks); nor under a CUDA graph capture (PyTorch's
    kernels draw a new mask on each replay, cuflash's would replay the captured one),
    forward-mode AD or a __torch_dispatch__ mode; nor for a dropout_p cuflash refuses (1.0:
    PyTorch decides); nor where _eager, whose checks of the layout (an eager call that needs
    gradients on transposed (batch, seqlen, nheads, d) tensors cuflash serves) it shares, answers
    None."""
    if (not 0.0 < dropout_p < 1.0 or not ops._plain_autograd() or _eager(query, key, value, is_causal, scale) is None
            or query.is_cuda and torch.cuda.is_current_stream_capturing() or _recomputing_without_hooks()):
        return None
    dropout = ops._dropout_state(float(dropout_p), None, None, query.device, query.shape[0], query.shape[1])
    out, lse = ops._EagerAttention.apply(*_bshd(query, key, value), bool(is_causal), scale, -1, -1, 0.0, None,
                                         torch.are_deterministic_algorithms_enabled(), None, None, *dropout)
    return out.transpose(1, 2), lse


def _recomputing_without_hooks() -> bool:
    """Whether this call runs inside a backward pass without saved-tensor hooks: the recompute of
    a reentrant checkpoint (torch.utils.checkpoint(use_reentrant=True), and the checkpoints of
    other libraries built the same way), whose forward ran without gradients and so took
    PyTorch's dropout. A non-reentrant checkpoint recomputes under its own hooks, and its forward
    was served as the recompute is (the same generator state, so the same mask)."""
    if torch._C._current_graph_task_id() == -1:
        return False
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    except (AttributeError, TypeError):  # (a PyTorch without this query: not served)
        return True


_fast = None  # node.cpp's fast_forward, once a layout has been handed to it


def _keep_fast(p, query, key, value):
    """Hands the layout's prepared forward and C++ backward to node.cpp (node.keep_forward), so
    that its later calls run their forward in C++ too, without this module's Python."""
    global _fast
    from . import node
    try:
        p.fast = node.keep_forward(p, query, key, value)
    except Exception as e:  # (a bug: said once; the layout keeps the Python forward)
        p.fast = False
        warnings.warn(f"cuflash: SDPA's forward could not be handed to the C++ node ({type(e).__name__}: {e})",
                      RuntimeWarning, stacklevel=2)
    if p.fast:
        _fast = node.module().fast_forward


def _eager(query, key, value, is_causal, scale):
    """The prepared eager call (ops._Prepared) of a forward without dropout that needs gradients,
    or None where cuflash does not serve it, it is not an eager call on real CUDA tensors, a
    __torch_dispatch__ mode is active (FLOP counters, selective checkpointing: they must see the
    aten ops), or an operand is not a transposed (batch, seqlen, nheads, d) tensor: in that layout
    the Function's prepared launches take SDPA's tensors as they are (ops._Prepared.sdpa), and its
    output and gradients are laid out as PyTorch's kernels lay them out (as their inputs). The
    checks run once per layout and options (the repeat signature)."""
    if ops._route(query, key, value) != "autograd" or torch._C._len_torch_dispatch_stack():
        return None
    det = torch.are_deterministic_algorithms_enabled()
    sig = arrays.repeat_signature((query, key, value), (-1, -1), (is_causal, scale, det))
    if sig is None:
        return None
    p = _served.get(sig, _served)
    if p is _served:  # (a layout not seen yet)
        views = _bshd(query, key, value)
        p = None if (_unsupported(query, key, value, 0.0, scale) or not all(x.is_contiguous() for x in views)
                     or not ops._plain_scale(scale)) \
            else ops._Prepared(is_causal, scale, (-1, -1), 0.0, det, sdpa=True)
        arrays.repeat_keep(_served, sig, p)
    return p


def _pytorch(op, why, keyset, *args, **kwargs):
    """PyTorch's own kernel for a call cuflash cannot serve."""
    kernel = _active.kernels.get(op) if _active is not None else None
    if kernel is None:
        raise NotImplementedError(f"cuflash cannot serve this {op} call ({why}) and this PyTorch "
                                  "build has no CUDA kernel of its own for it")
    return kernel.call_boxed(keyset, *args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Activation

class _Activation:
    """What activation changed, undone by :meth:`remove` (the registry's handle protocol): the
    library holding the overrides, PyTorch's kernels behind them, SDPA's backend order;
    ``dropout``: whether eager calls with dropout run cuflash's (activate_sdpa)."""

    def __init__(self):
        self.dropout = False
        if not hasattr(torch.library, "get_kernel"):
            raise NotImplementedError("cuflash behind scaled_dot_product_attention needs PyTorch "
                                      f">= 2.9 (torch.library.get_kernel); this is {torch.__version__}")
        self.kernels = {op: _kernel(op, "CUDA") for op in (_FWD, _BWD, _VFWD, _VBWD)}
        self.autograd = _kernel(_FWD, "AutogradCUDA")
        self.order = _flash_first()
        self.library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "(?s).*Overriding a previously registered kernel")
            for op, fn in ((_FWD, _forward_impl), (_BWD, _backward_impl), (_VFWD, _flash_forward_impl),
                           (_VBWD, _flash_backward_impl)):
                if op in (_FWD, _BWD) or _has_op(op):
                    self.library.impl(op.split("::")[1], fn, "CUDA", with_keyset=True)
            if self.autograd is not None:
                self.library.impl(_FWD.split("::")[1], _autograd_impl, "AutogradCUDA", with_keyset=True)

    def remove(self):
        global _active
        if self.library is not None:
            self.library._destroy()
            self.library = None
            torch._C._set_sdp_priority_order(self.order)
        if _active is self:
            _active = None


def _has_op(op):
    """Whether this PyTorch has the aten op ``op``."""
    return hasattr(torch.ops.aten, op.split("::")[1])


def _kernel(op, key):
    """PyTorch's kernel of ``op`` for dispatch key ``key`` as it is now, or None where this build
    has none."""
    try:
        return torch.library.get_kernel(op, key)
    except RuntimeError:
        return None


def _flash_first():
    """Put SDPA's flash backend first among its backends and return the previous order. PyTorch
    picks cuDNN before flash on sm_90 and sm_100 with cuDNN newer than 9.15 (PyTorch 2.11's own
    wheels), setting that order on its first choice: one choice is made first, so it cannot
    overwrite this one later."""
    if torch.cuda.is_available():
        x = torch.empty(1, 1, 1, 8, dtype=torch.float16, device="cuda")
        try:
            torch._fused_sdp_choice(x, x, x)
        except RuntimeError:  # every backend disabled: nothing is chosen, nothing to do
            pass
    before = torch._C._get_sdp_priority_order()
    torch._C._set_sdp_priority_order([_FLASH] + [b for b in before if b != _FLASH])
    return before


def _register():
    """The registry's ``register_fn``: activates (once) and returns the handle."""
    global _active
    if _active is None:
        _active = _Activation()
    return _active


def _registry():
    """torch.nn.attention when its flash-attention registry can restore (PyTorch >= 2.11)."""
    att = torch.nn.attention
    return att if hasattr(att, "restore_flash_attention_impl") else None


def activate_sdpa(dropout: bool = False):
    """Run SDPA's flash-attention path on cuflash from now on (forward and backward, eager,
    ``torch.compile`` and CUDA graphs), with SDPA's flash backend moved first in its priority
    order. Calls cuflash cannot serve run PyTorch's own kernels. Undone by :func:`restore_sdpa`.

    ``dropout=True``: eager calls with ``dropout_p > 0`` that need gradients run cuflash's
    attention dropout too (flash-attn's semantics, cuflash's masks, drawn from the default CUDA
    generator; docs/torch.md). Off by default: cuflash's dropout runs on its standard kernels,
    not the warp-specialised ones, slower on Hopper than PyTorch's own flash kernel with dropout
    (BENCHMARKS.md). Calling this again while active changes only this choice."""
    if not isinstance(dropout, bool):
        raise TypeError(f"dropout must be a bool, got {type(dropout).__name__}")
    if _registry() is not None:
        if _registry().current_flash_attention_impl() != NAME or _active is None:
            _registry().activate_flash_attention_impl(NAME)  # undoes any other impl first
    else:
        _register()
    _active.dropout = dropout


def restore_sdpa():
    """Give SDPA's flash path, and its backend order, back to PyTorch."""
    reg = _registry()
    if reg is not None and reg.current_flash_attention_impl() == NAME:
        reg.restore_flash_attention_impl()
    elif _active is not None:
        _active.remove()


def sdpa_active() -> bool:
    """Whether cuflash serves SDPA's flash path now."""
    return _active is not None


if _registry() is not None:
    _registry().register_flash_attention_impl(NAME, register_fn=_register)
