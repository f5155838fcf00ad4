"""flash-attn's ``flash_attn.ops`` as far as cuflash offers it: ``triton.rotary.apply_rotary``."""
