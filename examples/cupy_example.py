"""cuflash with CuPy: float16 attention with its log-sum-exp, checked against the NumPy reference.

    python examples/cupy_example.py
"""
import os
import sys

try:
    import cupy
    if cupy.cuda.runtime.getDeviceCount() == 0:
        raise RuntimeError("no CUDA device is visible")
except Exception as e:  # CuPy missing, no driver or no device
    sys.exit(f"This example needs CuPy and a CUDA GPU ({type(e).__name__}: {e}).")
try:
    import cuflash
except ImportError:  # running from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import cuflash
import numpy as np

b, sq, sk, h, hk, d = 2, 300, 500, 8, 2, 64
rnd = lambda *shape: cupy.random.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)
q, k, v = rnd(b, sq, h, d), rnd(b, sk, hk, d), rnd(b, sk, hk, d)

out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)  # CuPy in, CuPy out
print(type(out).__name__, out.dtype, out.shape, "| lse", lse.dtype, lse.shape)  # lse: (b, h, sq) fp32

qh, kh, vh = (cupy.asnumpy(x) for x in (q, k, v))
ok, err, bound = cuflash.reference.check_close(cupy.asnumpy(out), qh, kh, vh, causal=True)
_, lse_ref = cuflash.reference.attention(qh, kh, vh, causal=True, return_lse=True)
lse_err = np.abs(cupy.asnumpy(lse) - lse_ref).max()
print(f"max |out - float64 reference| = {err:.2e} (bound {bound:.2e}): {'OK' if ok else 'FAILED'}")
print(f"max |lse - reference lse| = {lse_err:.2e}")
sys.exit(0 if ok else 1)
