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


def assert_compiled_clean(c, v):
    """A cubin of ``v`` for its arch whose ptxas report shows no spills, no stack and at most 255
    registers; returns the report."""
    assert c.cubin[:4] == b"\x7fELF"
    assert f"entry function '{v.name}'" in c.log and f"for 'sm_{v.target}'" in c.log
    r = c.resources
    assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0), f"{v.name}: {r}\n{c.log}"
    assert 0 < r.registers <= 255, r
    return r


@pytest.fixture
def rng(request):
    # a fresh, test-specific stream of random numbers
    return np.random.default_rng(abs(hash(request.node.nodeid)) % (2**32))


def fake_view(device, shape, dtype="float16", strides=None, ptr=1 << 20):
    """A hand-made device array description (cuflash.arrays.View) for validation tests."""
    import math
    from cuflash.arrays import View
    strides = strides or tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return View(ptr, tuple(shape), tuple(strides), dtype, device, "cupy", None)


@pytest.fixture
def fake_views(monkeypatch):
    """cuflash takes hand-made Views as arrays; nothing may be allocated, written or launched."""
    from cuflash import api, arrays
    from cuflash.arrays import View
    real = arrays.view
    monkeypatch.setattr(arrays, "view", lambda x, name: x if isinstance(x, View) else real(x, name))

    def boom(*a, **k):
        raise AssertionError("validation passed: allocation or launch reached")
    monkeypatch.setattr(arrays, "empty_like_framework", boom)
    monkeypatch.setattr(api.launch, "run", boom)
    monkeypatch.setattr(api.launch, "append_kv", boom)
