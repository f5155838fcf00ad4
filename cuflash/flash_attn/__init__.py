"""flash-attn 2.8's Python API on cuflash's kernels, for switching by changing an import:

    from flash_attn import flash_attn_func, flash_attn_varlen_func      # before
    from cuflash.flash_attn import flash_attn_func, flash_attn_varlen_func  # after
    from cuflash.flash_attn.bert_padding import pad_input, unpad_input
    from cuflash.flash_attn.layers.rotary import apply_rotary_emb

The modules mirror flash-attn's: ``flash_attn_interface`` (the functions, documented there),
``bert_padding``, ``layers.rotary`` (``apply_rotary_emb``, the in-place ``apply_rotary_emb_qkv_``
/ ``apply_rotary_emb_kv_``, the ``RotaryEmbedding`` module) and ``ops.triton.rotary``
(``apply_rotary``). flash-attn's other modules (``modules``, ``ops``' layer norms, ``losses``,
``models``) are not offered: importing them is a ModuleNotFoundError.
"""
from . import flash_attn_interface
from .flash_attn_interface import *  # noqa: F401,F403 (the seven functions of its __all__)

__version__ = "2.8.3"  # the flash-attn release whose API this follows (version checks read it)
__all__ = flash_attn_interface.__all__
