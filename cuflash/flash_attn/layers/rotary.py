"""flash-attn's ``apply_rotary_emb`` (``flash_attn.layers.rotary``, 2.8.x) in PyTorch.

flash-attn runs it as a Triton kernel; here it is a few elementwise torch operations (float32
arithmetic, the result in x's dtype, differentiable through autograd). The kernels of
:func:`cuflash.attention_with_kvcache` apply the same rotation to q and the new keys themselves
(``rotary_cos`` / ``rotary_sin``); this function is for rotating tensors outside attention, and
for references.
"""
import torch

__all__ = ["apply_rotary_emb", "apply_rotary_emb_func", "rotate_half", "apply_rotary_emb_torch"]


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
