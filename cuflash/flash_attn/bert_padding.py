"""flash-attn's padding helpers (``flash_attn.bert_padding``, 2.8.x), for moving between padded
(batch, seqlen, ...) tensors and the packed (total, ...) layout of the varlen functions:

    x_u, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, attention_mask)
    out_u = flash_attn_varlen_func(q_u, k_u, v_u, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    out = pad_input(out_u, indices, batch, seqlen)

Plain PyTorch indexing, so gradients flow through autograd. Masks are read as booleans (nonzero
= kept).
"""
import torch

from cuflash.torch.hf import _unpad_data

__all__ = ["index_first_axis", "index_put_first_axis", "unpad_input", "pad_input",
           "unpad_input_for_concatenated_sequences"]


def index_first_axis(input, indices):
    """Rows ``indices`` of ``input`` along its first axis: (n, ...) -> (len(indices), ...)."""
    return input[indices]


def index_put_first_axis(values, indices, first_axis_dim):
    """A zero tensor (first_axis_dim, ...) holding ``values`` at rows ``indices``."""
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return out.index_put((indices,), values)


def index_first_axis_residual(input, indices):
    """(rows ``indices`` of ``input``, ``input`` itself): flash-attn's variant that hands the whole
    input on beside the rows (gradients reach it through both)."""
    return input[indices], input


class IndexFirstAxis:
    """flash-attn's autograd Function for :func:`index_first_axis`, for callers of ``.apply``."""
    apply = staticmethod(index_first_axis)


class IndexPutFirstAxis:
    """flash-attn's autograd Function for :func:`index_put_first_axis`, for callers of ``.apply``."""
    apply = staticmethod(index_put_first_axis)


class IndexFirstAxisResidual:
    """flash-attn's autograd Function for :func:`index_first_axis_residual`, for callers of ``.apply``."""
    apply = staticmethod(index_first_axis_residual)


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """hidden_states (batch, seqlen, ...) and attention_mask (batch, seqlen) -> (hidden_states
    of the kept tokens (total, ...), their flat indices (total,) int64, cu_seqlens (batch + 1,)
    int32, max_seqlen_in_batch (an int, read on the host), seqused (batch,) int32).

    ``unused_mask`` (batch, seqlen) marks tokens that are allocated but unused: they are kept and
    counted in cu_seqlens, while ``seqused`` counts the ``attention_mask`` tokens only.
    """
    used = attention_mask.bool()
    kept = used if unused_mask is None else used | unused_mask.bool()
    indices, cu_seqlens, max_seqlen = _unpad_data(kept)
    seqused = used.sum(dim=-1, dtype=torch.int32)
    return (index_first_axis(hidden_states.flatten(0, 1), indices), indices, cu_seqlens,
            max_seqlen, seqused)


def pad_input(hidden_states, indices, batch, seqlen):
    """The inverse of :func:`unpad_input`: hidden_states (total, ...) at flat ``indices`` ->
    (batch, seqlen, ...), zeros at the positions not in ``indices``."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.unflatten(0, (batch, seqlen))


def unpad_input_for_concatenated_sequences(hidden_states, attention_mask_in_length):
    """Several sequences concatenated in each row: ``attention_mask_in_length`` (batch, seqlen)
    holds each row's sequence lengths first, then zeros (e.g. [2, 3, 0, 0, 0, 0] for sequences of
    2 and 3 tokens). Returns (hidden_states of those tokens (total, ...), their flat indices,
    cu_seqlens (sequences + 1,) int32 over every sequence of every row, max_seqlen (an int))."""
    lengths = attention_mask_in_length
    seqlen = lengths.shape[-1]
    kept = torch.arange(seqlen, device=lengths.device) < lengths.sum(dim=-1, keepdim=True)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    seqlens = lengths.flatten()[lengths.flatten() != 0].to(torch.int32)
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return index_first_axis(hidden_states.flatten(0, 1), indices), indices, cu_seqlens, max_seqlen
