"""flash-attn's ``flash_attn.ops.triton``: ``rotary.apply_rotary`` (in PyTorch, not Triton)."""
