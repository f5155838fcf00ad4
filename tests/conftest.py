import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gpu_problem():
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return None
        return "no CUDA device is visible"
    except Exception as e:  # no driver / no CuPy
        return f"no usable CUDA GPU ({type(e).__name__}: {e})"


GPU_PROBLEM = _gpu_problem()
requires_gpu = pytest.mark.skipif(GPU_PROBLEM is not None, reason=f"needs a CUDA GPU: {GPU_PROBLEM}")


def _has(mod):
    try:
        __import__(mod)
        return True
    except Exception:
        return False


requires_torch = pytest.mark.skipif(not _has("torch"), reason="needs PyTorch (optional dependency)")


@pytest.fixture
def rng(request):
    # a fresh, test-specific stream of random numbers
    return np.random.default_rng(abs(hash(request.node.nodeid)) % (2**32))
