"""Persistent blocks in the warp-specialised backward (BwdWsVariant(persistent=True)): a block per
SM at most, each taking units (key block, KV head, batch) in the one-block-per-unit launch order.
CPU: which variants accept it, the grid, the parameter struct, the render, the offline compile.
GPU (sm_90): dK and dV bitwise those of one block per unit (the same steps in the same order), dQ
within the reordering of its atomic adds, and the float64 reference check, on grids capped to a
few blocks so that each block takes many units (empty walks among them: windows, FlashMask's
fully masked key blocks, keys past the last query)."""
from dataclasses import replace

import numpy as np
import pytest

from conftest import module_compiled, requires_sm90, requires_torch
from cuflash import codegen
from cuflash.kernels import bwd_ws
from cuflash.kernels.bwd_ws import BwdWsVariant
from test_bwd_ws import _backward, _check, _inputs

# The planned atomic variants at d = 64 and 128 (d = 128: dq_t; without softcap, ALiBi, packed
# sequences) and FlashMask's, each with persistent blocks
PERSISTENT = [replace(v, persistent=True) for v in bwd_ws.variants(90)
              if v.family == "bwd_ws" and v.dq_writer and not (v.dq_ordered or v.varlen or v.softcap or v.alibi)
              and (v.head_dim == 64 or v.dq_t) and v.dtype == "bf16"]


def test_variants_accept_it_where_the_staging_fits():
    ok = bwd_ws.planned(128, "bf16", True, False, False)
    assert ok.dq_t and replace(ok, persistent=True).name.endswith("_persistent_m80n128_sm90")
    for bad in (bwd_ws.planned(128, "bf16", True, False, True),  # ordered dQ
                bwd_ws.planned(64, "bf16", True, False, False, varlen=True),
                bwd_ws.planned(256, "bf16", False, False, False),
                replace(ok, dq_t=False),  # 64-query steps: no room for dK and dV over the dS^T tiles
                bwd_ws.planned(128, "bf16", False, False, True, flashmask=2)):  # dK and dV only
        with pytest.raises(ValueError, match="persistent"):
            replace(bad, persistent=True)
    assert {(v.head_dim, v.causal, v.local, v.flashmask > 0, v.lpt, v.rotate) for v in PERSISTENT} >= {
        (64, False, False, False, False, True), (64, True, False, True, False, False),
        (128, True, False, False, True, True), (128, False, False, False, False, False),
        (128, False, True, False, False, True), (128, False, False, True, False, False)}


def test_grid_and_fields():
    v = replace(bwd_ws.planned(128, "bf16", True, False, False), persistent=True)
    assert v.grid(2, 1000, 3000, 16, 4, 132) == (132, 1, 1)  # 24 key blocks x 4 KV heads x 2
    assert v.grid(1, 100, 300, 4, 2, 132) == (6, 1, 1)
    with pytest.raises(ValueError, match="SM count"):
        v.grid(1, 100, 300, 4, 2)
    assert v.params.names[-1] == "batch" and "batch" not in replace(v, persistent=False).params.names
    assert v.smem_bytes == replace(v, persistent=False).smem_bytes + 16 <= 227 * 1024


def test_render():
    for v in PERSISTENT:
        src = codegen.render(v)
        assert "constexpr bool kPersistent = true;" in src and "set_unit(u);" in src
        assert "info[kInfoUnmasked]" not in src  # (each role keeps its unit's values)
        assert "kPersistent = false;" in codegen.render(replace(v, persistent=False))


@pytest.fixture(scope="module")
def compiled(compile_variants):
    return module_compiled(compile_variants, PERSISTENT)


@pytest.mark.parametrize("v", PERSISTENT, ids=lambda v: v.name)
def test_compiles(compiled, v):
    assert compiled[v].cubin


@pytest.fixture
def few_blocks(monkeypatch):
    """Caps the persistent grids at n blocks (set through the returned function), so that each
    block takes many units."""
    grid = BwdWsVariant.grid
    cap = {"n": 0}

    def capped(self, *a, **k):
        g = grid(self, *a, **k)
        return (min(g[0], cap["n"]), 1, 1) if self.persistent and cap["n"] else g
    monkeypatch.setattr(BwdWsVariant, "grid", capped)

    def set_cap(n):
        cap["n"] = n
    return set_cap


def _same_steps(grads, plain):
    """dK and dV bitwise; dQ (atomic adds in another order) within fp32 reordering."""
    import torch
    assert torch.equal(grads[1], plain[1]) and torch.equal(grads[2], plain[2])
    assert torch.isfinite(grads[0]).all()
    err = (grads[0].float() - plain[0].float()).abs().max().item()
    assert err <= 1e-2 * plain[0].float().abs().max().item() + 1e-6, err


@requires_sm90
@requires_torch
@pytest.mark.parametrize("blocks", [0, 3])  # 0: one per SM
@pytest.mark.parametrize("mask", ["full", "causal", "local"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("case", [(2, 300, 700, 8, 2), (3, 1, 520, 4, 1), (2, 700, 300, 4, 4), (2, 1100, 2100, 8, 4)],
                         ids=str)
def test_gpu_against_one_block_per_unit(rng, few_blocks, case, d, mask, blocks):
    b, sq, sk, h, hk = case
    q, k, v, dout = _inputs(rng, b, sq, sk, h, hk, d, "bfloat16")
    mods = dict(causal=mask == "causal", window_size=(250, 30) if mask == "local" else (-1, -1))
    few_blocks(blocks)
    grads = _backward(q, k, v, dout, flags=dict(persistent=True), **mods)
    _same_steps(grads, _backward(q, k, v, dout, **mods))
    if sq * sk <= 700 * 700:
        _check(grads, q, k, v, dout, **mods)


@requires_sm90
@requires_torch
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name", ["causal_document", "share_question", "global_sliding_window", "prefix_lm_document",
                                  "random_eviction", "qk_sparse", "document"])
def test_gpu_flashmask(rng, few_blocks, name, d):
    """FlashMask's walks (fully masked key blocks leave a unit without a step) on 5 blocks and on
    one per SM: the reference check, and the same steps as one block per unit."""
    import torch
    import test_flashmask_backward as fb
    from cuflash.plan import forget_plans
    from test_flashmask_kernels import _builders
    _, causal, x = next(bld for bld in _builders(1100) if bld[0] == name)
    x = np.concatenate([x, x])
    seed = int(rng.integers(1 << 30))
    plain = fb._check(np.random.default_rng(seed), 2, 1100, 1100, 8, 4, d, "bfloat16", causal, x)
    planned = bwd_ws.planned
    try:
        bwd_ws.planned = lambda *a, **k: replace(planned(*a, **k), persistent=True)
        for blocks in (5, 0):
            few_blocks(blocks)
            forget_plans()
            grads = fb._check(np.random.default_rng(seed), 2, 1100, 1100, 8, 4, d, "bfloat16", causal, x)
            _same_steps(grads, plain)
    finally:
        bwd_ws.planned = planned
        forget_plans()
    assert torch.isfinite(plain[0]).all()
