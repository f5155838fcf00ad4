"""cuflash: FlashAttention for Python, compiled just in time from Jinja2 templates with NVRTC.

    import cuflash
    out = cuflash.attention(q, k, v, causal=True)      # PyTorch, CuPy, JAX or NumPy arrays
    print(cuflash.plan(q, k, v, causal=True))          # which kernels would run, and why
"""
__version__ = "0.1.0"

from . import masks, reference  # noqa: E402
from .api import attention, attention_varlen, attention_with_kvcache, plan  # noqa: E402
from . import kernels  # noqa: E402
from .kernels.fwd import FwdVariant  # noqa: E402
from .compiler import compile_variant  # noqa: E402

__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "plan", "masks", "reference", "kernels", "FwdVariant", "compile_variant", "__version__"]
