"""flash-attn's ``flash_attn.ops.triton.rotary.apply_rotary``, which some code imports directly,
on :func:`cuflash.flash_attn.layers.rotary.apply_rotary_emb` (PyTorch operations)."""
from ...layers.rotary import apply_rotary_emb

__all__ = ["apply_rotary"]


def apply_rotary(x, cos, sin, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None, interleaved=False,
                 inplace=False, conjugate=False):
    """x rotated by the angles of cos / sin (seqlen_ro, rotary_dim / 2), or by their negatives
    with ``conjugate=True`` (the backward of a rotation); the other arguments as
    :func:`apply_rotary_emb`'s."""
    return apply_rotary_emb(x, cos, -sin if conjugate else sin, interleaved, inplace, seqlen_offsets, cu_seqlens,
                            max_seqlen)
