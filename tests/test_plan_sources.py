"""cuflash.plan for packed sequences and KV caches (varlen=, kv_cache=, page_size=, cache_leftpad=):
the plan the call would launch (compared with what attention_varlen and attention_with_kvcache
hand to launch.prepare, on hand-made device views), the reasons it gives, the CLI's explain
flags, and clear errors for combinations no call has. No GPU needed."""
import pytest

import cuflash
from cuflash import __main__ as cli
from test_varlen_validation import (B, D, H, HK, MAX_K, MAX_Q, OUT_PTR, Q, REACHED, call_varlen, dev, i32,  # noqa: F401
                                    launches, paged, varlen_args, views)

GPU = dict(num_sms=132, arch=90)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kw", [dict(), dict(window_size=(3, 0), softcap=20.0)])
def test_varlen_plan_is_the_launched_one(launches, causal, kw):
    with pytest.raises(AssertionError, match=REACHED):
        call_varlen(varlen_args(causal=causal, out=dev(Q, ptr=OUT_PTR), **kw))  # out given: nothing to allocate
    (launched, _), = launches
    p = cuflash.plan((B, MAX_Q, H, D), (B, MAX_K, HK, D), (B, MAX_K, HK, D), causal=causal, varlen=True,
                     dtype="float16", **GPU, **kw)
    assert p.problem == launched.problem and p.kernels == launched.kernels


def test_paged_varlen_plan_is_the_launched_one(launches):
    with pytest.raises(AssertionError, match=REACHED):
        call_varlen(varlen_args(causal=True, out=dev(Q, ptr=OUT_PTR), **paged()))
    (launched, _), = launches
    p = cuflash.plan((B, MAX_Q, H, D), (B, MAX_K, HK, D), (B, MAX_K, HK, D), causal=True, varlen=True,
                     kv_cache="paged", page_size=16, dtype="float16", **GPU)
    assert p.problem == launched.problem and p.kernels == launched.kernels


@pytest.mark.parametrize("leftpad", [False, True])
def test_kvcache_plan_is_the_launched_one(launches, leftpad):
    q, kc = dev((B, 40, H, D)), dev((B + 1, 300, HK, D))
    extra = dict(cache_leftpad=i32((B,))) if leftpad else {}
    with pytest.raises(AssertionError, match=REACHED):
        cuflash.attention_with_kvcache(q, kc, kc, cache_seqlens=i32((B,)), cache_batch_idx=i32((B,)), causal=True,
                                       out=dev((B, 40, H, D), ptr=OUT_PTR), **extra)
    (launched, _), = launches
    p = cuflash.plan((B, 40, H, D), (B + 1, 300, HK, D), (B + 1, 300, HK, D), causal=True, dtype="float16",
                     kv_cache="contiguous", cache_leftpad=leftpad, **GPU)
    assert p.problem == launched.problem and p.kernels == launched.kernels


def test_reasons_on_hopper():
    """A 2k-token chunk over caches and packed sequences runs the warp-specialised forward on
    sm_90, saying how it finds the keys; a paged cache whose pages neither hold nor divide its
    tiles keeps the wgmma kernel and says why."""
    q, k = (4, 2048, 16, 128), (4, 6144, 4, 128)
    for kw, kernel, why in (
            (dict(varlen=True), "fwd_ws_d128_bf16_causal_varlen_", "Packed sequences"),
            (dict(kv_cache="contiguous"), "fwd_ws_d128_bf16_causal_cache_", "the K/V tensor maps are the cache's"),
            (dict(kv_cache="contiguous", cache_leftpad=True), "fwd_ws_d128_bf16_causal_cache_leftpad_",
             "first key row (cache_leftpad)"),
            (dict(kv_cache="paged", page_size=256), "fwd_ws_d128_bf16_causal_paged_", "pages of 256 rows"),
            (dict(kv_cache="paged", page_size=64), "fwd_ws_d128_bf16_causal_paged_m",
             "each K/V tile spans 2 pages of 64 rows"),
            (dict(kv_cache="paged", page_size=16), "fwd_ws_d128_bf16_causal_paged_gather_",
             "gather each K/V tile's rows from pages of 16 rows"),
            (dict(kv_cache="paged", page_size=48), "fwd_ws_d128_bf16_causal_paged_gather_",
             "gather each K/V tile's rows from pages of 48 rows"),
            (dict(varlen=True, kv_cache="paged", page_size=256), "fwd_d128_bf16_causal_wgmma_paged_",
             "no packed sequences over a paged cache")):
        p = cuflash.plan(q, k, k, causal=True, **GPU, **kw)
        assert p.kernels[0].startswith(kernel) and why in p.reason, (kw, p.kernels, p.reason)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(kv_cache="cache"), ValueError, "kv_cache must be None, 'contiguous' or 'paged', got 'cache'"),
    (dict(kv_cache=True), ValueError, "kv_cache must be None, 'contiguous' or 'paged', got True"),
    (dict(kv_cache="paged"), ValueError, "page_size must be a positive int with kv_cache='paged', got None"),
    (dict(kv_cache="paged", page_size=0), ValueError, "page_size must be a positive int"),
    (dict(kv_cache="paged", page_size=2.0), ValueError, "page_size must be a positive int"),
    (dict(page_size=256), ValueError, "page_size goes with kv_cache='paged', got page_size=256 and kv_cache=None"),
    (dict(cache_leftpad=True), ValueError, "cache_leftpad goes with kv_cache='contiguous' or 'paged' and varlen=False, "
                                           "got kv_cache=None"),
    (dict(cache_leftpad=True, kv_cache="paged", page_size=16, varlen=True), ValueError,
     "cache_leftpad goes with kv_cache='contiguous' or 'paged' and varlen=False, got kv_cache='paged', varlen=True"),
    (dict(varlen=True, kv_cache="contiguous"), ValueError, "varlen=True cannot be combined with kv_cache='contiguous'"),
    (dict(kv_cache="contiguous", backward=True), ValueError, "backward=True has no KV cache"),
    (dict(varlen=1), TypeError, "varlen"),
])
def test_bad_sources_are_refused(kw, exc, match):
    with pytest.raises(exc, match=match):
        cuflash.plan((2, 128, 8, 64), (2, 128, 8, 64), (2, 128, 8, 64), **GPU, **kw)


def test_explain_takes_the_sources(capsys):
    cli.main(["explain", "--batch", "4", "--seqlen-q", "2048", "--seqlen-k", "6144", "--nheads", "16",
              "--nheads-k", "4", "--kv-cache", "paged", "--page-size", "256"])
    out = capsys.readouterr().out
    assert "fwd_ws_d128_bf16_causal_paged_" in out and "Paged KV cache" in out
    cli.main(["explain", "--batch", "4", "--seqlen-q", "2048", "--seqlen-k", "2048", "--nheads", "16", "--varlen"])
    assert "Packed sequences" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["explain", "--kv-cache", "paged"])
    assert "page_size must be a positive int" in capsys.readouterr().err
