"""flash-attn's ``flash_attn.layers.rotary`` (2.8.x): ``apply_rotary_emb``, the in-place
``apply_rotary_emb_qkv_`` / ``apply_rotary_emb_kv_`` and the ``RotaryEmbedding`` module, in PyTorch.

flash-attn runs it as a Triton kernel; here it is a few elementwise torch operations (float32
arithmetic, the result in x's dtype, differentiable through autograd). The kernels of
:func:`cuflash.attention_with_kvcache` apply the same rotation to q and the new keys themselves
(``rotary_cos`` / ``rotary_sin``); this function is for rotating tensors outside attention, and
for references.
"""
import torch

__all__ = ["apply_rotary_emb", "apply_rotary_emb_func", "rotate_half", "apply_rotary_emb_torch", "apply_rotary_emb_qkv_",
           "apply_rotary_emb_kv_", "RotaryEmbedding"]


def _positions(x, seqlen_offsets, cu_seqlens, max_seqlen, seqlen_ro):
    """Each row's rotary position, (batch, seqlen) or (total,), int64 on x's device."""
    dev = x.device
    if cu_seqlens is None:
        batch, seqlen = x.shape[0], x.shape[1]
        pos = torch.arange(seqlen, device=dev).expand(batch, seqlen)
        if isinstance(seqlen_offsets, torch.Tensor):
            return pos + seqlen_offsets.to(device=dev, dtype=torch.int64)[:, None]
        if seqlen_offsets + seqlen > seqlen_ro:
            raise ValueError(f"seqlen_offsets + seqlen ({seqlen_offsets} + {seqlen}) exceeds the "
                             f"{seqlen_ro} rows of cos and sin")
        return pos + seqlen_offsets
    if max_seqlen is None:
        raise ValueError("max_seqlen is needed with cu_seqlens")
    cu = cu_seqlens.to(device=dev, dtype=torch.int64)
    total = x.shape[0]
    seq = torch.searchsorted(cu, torch.arange(total, device=dev), right=True) - 1  # row -> sequence
    pos = torch.arange(total, device=dev) - cu[seq.clamp(0, cu.numel() - 2)]
    if isinstance(seqlen_offsets, torch.Tensor):
        return pos + seqlen_offsets.to(device=dev, dtype=torch.int64)[seq.clamp(0, cu.numel() - 2)]
    return pos + seqlen_offsets


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """Rotate the first ``rotary_dim = 2 * cos.shape[-1]`` features of x by the angles whose
    cosines and sines are ``cos`` / ``sin`` (seqlen_ro, rotary_dim / 2), row ``p`` for a token at
    position ``p``: pairs (i, i + rotary_dim / 2) (GPT-NeoX), or (2i, 2i + 1) with
    ``interleaved=True`` (GPT-J). The other features are copied.

    x: (batch, seqlen, nheads, headdim), or (total, nheads, headdim) with ``cu_seqlens`` (batch +
    1,) and ``max_seqlen``. A token's position is its index in its sequence plus
    ``seqlen_offsets`` (an int, or a (batch,) integer tensor); positions past cos's rows are not
    rotated, as in flash-attn. ``inplace=True`` writes the result into x and returns x."""
    if cos.shape != sin.shape or cos.dim() != 2:
        raise ValueError(f"cos and sin must have one shape (seqlen_ro, rotary_dim / 2), got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    half = cos.shape[1]
    rotary_dim, headdim = 2 * half, x.shape[-1]
    if rotary_dim > headdim:
        raise ValueError(f"rotary_dim (2 * cos.shape[1] = {rotary_dim}) must be at most headdim ({headdim})")
    if x.dim() != (3 if cu_seqlens is not None else 4):
        raise ValueError(f"x must be (batch, seqlen, nheads, headdim), or (total, nheads, headdim) "
                         f"with cu_seqlens, got shape {tuple(x.shape)}")
    if isinstance(seqlen_offsets, torch.Tensor) and seqlen_offsets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"seqlen_offsets must be an int or an int32/int64 tensor, got {seqlen_offsets.dtype}")
    pos = _positions(x, seqlen_offsets, cu_seqlens, max_seqlen, cos.shape[0])
    inside = (pos < cos.shape[0])[..., None]  # positions past the table keep cos 1, sin 0
    idx = pos.clamp(max=cos.shape[0] - 1)
    c = torch.where(inside, cos.float()[idx], 1.0).unsqueeze(-2)  # (..., 1, half): every head
    s = torch.where(inside, sin.float()[idx], 0.0).unsqueeze(-2)
    xr = x[..., :rotary_dim].float()
    if interleaved:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    else:
        x0, x1 = xr[..., :half], xr[..., half:]
        rot = torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    if inplace:
        x[..., :rotary_dim] = rot.to(x.dtype)
        return x
    return torch.cat((rot.to(x.dtype), x[..., rotary_dim:]), dim=-1)


apply_rotary_emb_func = apply_rotary_emb  # (flash-attn's other name for it)


def rotate_half(x, interleaved=False):
    """flash-attn's reference helper: (x1, x2) -> (-x2, x1) for the halves of the last dim, or
    for its (even, odd) pairs with ``interleaved=True``."""
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def apply_rotary_emb_torch(x, cos, sin, interleaved=False):
    """flash-attn's PyTorch reference: x (batch, seqlen, nheads, headdim) rotated at positions
    0 ... seqlen - 1 by cos, sin (seqlen, rotary_dim / 2) or (batch, seqlen, rotary_dim / 2), in
    the operands' own dtypes (x is not upcast, as in flash-attn's reference: float32 cos with
    float16 x gives float32); the features past rotary_dim copied."""
    ro_dim = cos.shape[-1] * 2
    if ro_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim (2 * cos.shape[-1] = {ro_dim}) must be at most headdim ({x.shape[-1]})")
    spread = (lambda t: t.repeat_interleave(2, dim=-1)) if interleaved else (lambda t: torch.cat((t, t), dim=-1))
    c, s = (spread(t).unsqueeze(-2) for t in (cos, sin))  # (..., seqlen, 1, rotary_dim): every head
    xr = x[..., :ro_dim]
    return torch.cat((xr * c + rotate_half(xr, interleaved) * s, x[..., ro_dim:]), dim=-1)


def _qk(qkv, num_heads_q):
    """Views of qkv's q and k: (batch, seqlen, 3, nheads, headdim), or (batch, seqlen,
    num_heads_q + 2 * num_heads_k, headdim) with ``num_heads_q``."""
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"qkv must be (batch, seqlen, 3, nheads, headdim), got shape {tuple(qkv.shape)}")
        return qkv[:, :, 0], qkv[:, :, 1]
    if qkv.dim() != 4 or num_heads_q is None:
        raise ValueError(f"qkv must be (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, num_heads_q + "
                         f"2 * num_heads_k, headdim) with num_heads_q, got shape {tuple(qkv.shape)} and "
                         f"num_heads_q={num_heads_q}")
    hk = (qkv.shape[2] - num_heads_q) // 2
    if hk < 1 or qkv.shape[2] != num_heads_q + 2 * hk:
        raise ValueError(f"qkv's {qkv.shape[2]} heads are not num_heads_q ({num_heads_q}) + 2 * num_heads_k")
    return qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q:num_heads_q + hk]


def _rotate_in_place(pairs, interleaved, seqlen_offsets, conjugate):
    """Each (x, cos, sin) of ``pairs`` rotated in place (by the negative angles with ``conjugate``:
    the backward of a rotation), outside autograd."""
    with torch.no_grad():
        for x, cos, sin in pairs:
            apply_rotary_emb(x, cos, -sin if conjugate else sin, interleaved, True, seqlen_offsets)


class _RotaryInPlace(torch.autograd.Function):
    """``views(t)`` -> [(x, cos, sin), ...] of tensor t rotated in place; the gradient rotated
    back by the same angles (the transpose of a rotation)."""

    @staticmethod
    def forward(ctx, t, views, interleaved, seqlen_offsets):
        _rotate_in_place(views(t), interleaved, seqlen_offsets, False)
        ctx.mark_dirty(t)
        ctx.views, ctx.interleaved, ctx.seqlen_offsets = views, interleaved, seqlen_offsets
        return t

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        _rotate_in_place(ctx.views(grad), ctx.interleaved, ctx.seqlen_offsets, True)
        return grad, None, None, None


def apply_rotary_emb_qkv_(qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False, seqlen_offsets=0,
                          num_heads_q=None):
    """flash-attn's in-place rotation of packed qkv's q and k (its first rotary_dim = 2 *
    cos.shape[1] features): qkv (batch, seqlen, 3, nheads, headdim), or (batch, seqlen,
    num_heads_q + 2 * num_heads_k, headdim) with ``num_heads_q``; k by ``cos_k`` / ``sin_k`` when
    given (XPos), else by cos / sin. Returns qkv; differentiable (qkv must not be a leaf that
    requires grad, as for any in-place operation)."""
    cos_k, sin_k = cos if cos_k is None else cos_k, sin if sin_k is None else sin_k

    def views(t):
        q, k = _qk(t, num_heads_q)
        return [(q, cos, sin), (k, cos_k, sin_k)]
    views(qkv)  # (its shape checked before anything is written)
    return _RotaryInPlace.apply(qkv, views, interleaved, seqlen_offsets)


def apply_rotary_emb_kv_(kv, cos, sin, interleaved=False, seqlen_offsets=0):
    """flash-attn's in-place rotation of packed kv's k: kv (batch, seqlen, 2, nheads, headdim).
    Returns kv; differentiable as :func:`apply_rotary_emb_qkv_`."""
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv must be (batch, seqlen, 2, nheads, headdim), got shape {tuple(kv.shape)}")
    return _RotaryInPlace.apply(kv, lambda t: [(t[:, :, 0], cos, sin)], interleaved, seqlen_offsets)


class RotaryEmbedding(torch.nn.Module):
    """flash-attn's rotary position embedding module (RoFormer; XPos with ``scale_base``): cos
    and sin tables of the positions, kept and grown as longer sequences come, in the inputs'
    dtype and device (computed in float32), applied in place.

    ``dim``: the rotary dim (even, at most headdim); ``base``: the frequencies' base;
    ``interleaved``: pairs (2i, 2i + 1) (GPT-J) rather than (i, i + dim / 2) (GPT-NeoX);
    ``scale_base``: XPos, q scaled by scale ** (position - seqlen // 2) / scale_base and k by its
    inverse, with scale = (2i + 0.4 dim) / (1.4 dim)."""

    def __init__(self, dim: int, base=10000.0, interleaved=False, scale_base=None, pos_idx_in_fp32=True,
                 device=None):
        super().__init__()
        self.pos_idx_in_fp32 = pos_idx_in_fp32  # (flash-attn's argument; the positions are float32 here always)
        self.dim, self.base = dim, float(base)
        self.register_buffer("inv_freq", self._compute_inv_freq(device), persistent=False)
        self.interleaved, self.scale_base = interleaved, scale_base
        scale = None if scale_base is None else \
            (torch.arange(0, dim, 2, device=device, dtype=torch.float32) + 0.4 * dim) / (1.4 * dim)
        self.register_buffer("scale", scale, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = self._sin_cached = self._cos_k_cached = self._sin_k_cached = None

    def _compute_inv_freq(self, device=None):
        return 1.0 / self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim)

    def _update_cos_sin_cache(self, seqlen, device=None, dtype=None):
        """The tables for ``seqlen`` positions, rebuilt when longer ones are asked for, on a new
        device or dtype, or in training after being built under inference mode."""
        cached = self._cos_cached
        if not (seqlen > self._seq_len_cached or cached is None or cached.device != device or cached.dtype != dtype
                or (self.training and cached.is_inference())):
            return
        self._seq_len_cached = seqlen
        inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float32 else self._compute_inv_freq(device)
        angles = torch.outer(torch.arange(seqlen, device=device, dtype=torch.float32), inv_freq.to(device))
        cos, sin = torch.cos(angles), torch.sin(angles)  # (float32: positions times frequencies are large)
        if self.scale is None:
            self._cos_cached, self._sin_cached = cos.to(dtype), sin.to(dtype)
            return
        power = (torch.arange(seqlen, dtype=torch.float32, device=device) - seqlen // 2) / self.scale_base
        scale = self.scale.to(device)[None, :] ** power[:, None]
        self._cos_cached, self._sin_cached = (cos * scale).to(dtype), (sin * scale).to(dtype)
        self._cos_k_cached, self._sin_k_cached = (cos / scale).to(dtype), (sin / scale).to(dtype)

    def forward(self, qkv, kv=None, seqlen_offset=0, max_seqlen=None, num_heads_q=None):
        """Rotate in place: packed ``qkv`` (see :func:`apply_rotary_emb_qkv_`) when ``kv`` is None,
        else q = ``qkv`` (batch, seqlen, nheads, headdim) and ``kv`` (batch, seqlen, 2, nheads_k,
        headdim), returning (q, kv). ``seqlen_offset``: an int or a (batch,) tensor of each
        sequence's first position; with a tensor, ``max_seqlen`` sizes the tables."""
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
        xpos = self.scale is not None
        cos_k = self._cos_k_cached if xpos else self._cos_cached
        sin_k = self._sin_k_cached if xpos else self._sin_cached
        if kv is None:
            return apply_rotary_emb_qkv_(qkv, self._cos_cached, self._sin_cached, cos_k if xpos else None,
                                         sin_k if xpos else None, interleaved=self.interleaved,
                                         seqlen_offsets=seqlen_offset, num_heads_q=num_heads_q)
        q = apply_rotary_emb(qkv, self._cos_cached, self._sin_cached, interleaved=self.interleaved, inplace=True,
                             seqlen_offsets=seqlen_offset)
        return q, apply_rotary_emb_kv_(kv, cos_k, sin_k, interleaved=self.interleaved, seqlen_offsets=seqlen_offset)
