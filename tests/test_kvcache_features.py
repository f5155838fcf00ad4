"""flash-attn's KV-cache features in cuflash.attention_with_kvcache and the drop-in
flash_attn_with_kvcache: window_size forms, out-of-capacity checks, cache_leftpad, rotary
embeddings fused into the append, paged caches with any head dim.

CPU tests (argument forms, validation before any launch, the reference, rendering and offline
compilation) always run; the GPU tests (names containing ``gpu``) skip with the reason printed.
"""
import numpy as np
import pytest

import cuflash
from cuflash import validate


# ---------------------------------------------------------------------------------------------
# window_size: any pair of ints, host arrays included

@pytest.mark.parametrize("window,want", [
    ((3, 0), (3, 0)), ([5, -1], (5, -1)), (np.array([4, 0]), (4, 0)), (np.array([7, 2], dtype=np.uint8), (7, 2)),
    ((np.int64(9), np.array(2)), (9, 2)), ("torch", (9, 2)), ("torch0d", (9, 2)),
])
def test_window_forms(window, want):
    if isinstance(window, str):
        torch = pytest.importorskip("torch", reason="needs PyTorch (optional dependency)")
        window = torch.tensor([9, 2]) if window == "torch" else (torch.tensor(9), torch.tensor(2))
    assert validate.window(window) == want
    plan = cuflash.plan((1, 4, 2, 64), (1, 64, 2, 64), (1, 64, 2, 64), window_size=window, num_sms=132, arch=90)
    assert plan.problem.window == want


@pytest.mark.parametrize("window", [np.array([1.0, 0.0]), np.array([1, 0, 2]), np.array([[1, 0]]), (np.array([1]), 0),
                                    (1.0, 0), (True, 0), np.array([True, False])])
def test_window_bad_forms_are_type_errors(window):
    with pytest.raises(TypeError, match=r"window_size must be a pair of ints \(left, right\), got "):
        validate.window(window)


def test_window_device_tensor_is_a_type_error():
    """A tensor off the host would have to be read with a device synchronisation: refused."""
    torch = pytest.importorskip("torch", reason="needs PyTorch (optional dependency)")
    from cuflash.flash_attn import _window
    for w in (torch.tensor([3, 0], device="meta"), (torch.tensor(3, device="meta"), 0)):
        with pytest.raises(TypeError, match="window_size must be in host memory .* got a tensor on meta"):
            validate.window(w)
        with pytest.raises(TypeError, match="window_size must be in host memory"):
            _window(w)


def test_window_dropin_maps_negatives_to_unbounded():
    torch = pytest.importorskip("torch", reason="needs PyTorch (optional dependency)")
    from cuflash.flash_attn import _window
    assert _window(torch.tensor([-5, 3])) == (-1, 3)
    assert _window(np.array([4, -100])) == (4, -1)
    assert _window((np.int32(-2), torch.tensor(0))) == (-1, 0)
