"""`bench mask` without a GPU: the FlexAttention mask_mod and SDPA's dense mask that the bench
builds from a FlashMask tensor against cuflash.masks.to_dense for every family, the pair and FLOP
counts, the table and the plot on made-up rows, and a whole (small) run on PyTorch's CPU with
stand-ins for the CUDA timer and for cuflash's kernels (a float32 dense-mask attention).
"""
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs PyTorch (optional dependency)")
flex_attention = pytest.importorskip("torch.nn.attention.flex_attention", reason="needs FlexAttention")

from cuflash import bench, masks  # noqa: E402
from cuflash.__main__ import main  # noqa: E402

FAMILIES = ("causal",) + bench.MASK_FAMILIES


def _visible(fam, seqlen, nheads):
    """(indices, causal, True = visible (1, nheads, s, s) from cuflash.masks.to_dense)."""
    a, causal, _ = bench.mask_family(fam, seqlen, nheads)
    dense = ~masks.to_dense(a, seqlen, causal)
    return a, causal, np.broadcast_to(dense, (1, nheads) + dense.shape[2:])


@pytest.mark.parametrize("fam", FAMILIES)
def test_flex_mask_and_dense_mask_are_the_flashmask(fam):
    s, h = 1024, 2
    a, causal, want = _visible(fam, s, h)
    cols = bench._mask_columns(torch, torch.from_numpy(a), s, causal, h)
    assert all(c.shape == (1, h, s) and c.dtype == torch.int32 and c.is_contiguous() for c in cols)
    mod = bench._mask_mods(cols)[0 if causal else 1]
    flex = flex_attention.create_mask(mod, 1, h, s, s, device="cpu")
    np.testing.assert_array_equal(flex.numpy(), want)
    dense = bench._dense_visible(torch, cols, s, causal, a.shape[1])
    assert dense.shape == (1, a.shape[1], s, s)  # one head where the mask is every head's: SDPA broadcasts it
    np.testing.assert_array_equal(np.broadcast_to(dense.numpy(), want.shape), want)
    assert bench.mask_pairs(a, s, causal, h) == int(want.sum())
    assert want.any(axis=-1).all()  # every query sees a key: no row of SDPA's output is NaN


def test_mask_mods_read_the_columns_in_place():
    # the bench fills the same tensors for every mask of a length: the functions see the new mask
    s, h = 256, 2
    cols = [torch.empty((1, h, s), dtype=torch.int32) for _ in range(4)]
    causal_mod, full_mod = bench._mask_mods(cols)
    for fam in ("causal_document", "random_eviction", "document", "global_sliding_window"):
        a, causal, want = _visible(fam, s, h)
        for dst, src in zip(cols, bench._mask_columns(torch, torch.from_numpy(a), s, causal, h)):
            dst.copy_(src)
        got = flex_attention.create_mask(causal_mod if causal else full_mod, 1, h, s, s, device="cpu")
        np.testing.assert_array_equal(got.numpy(), want)


def test_families_at_the_bench_lengths():
    for s in (8192, 32768):
        for fam in FAMILIES:
            a, causal, desc = bench.mask_family(fam, s, 16)
            assert a.dtype == np.int32 and a.shape[2] == s and a.shape[1] == (16 if fam == "random_eviction" else 1)
            frac = bench.mask_pairs(a, s, causal, 16) / (16 * s * s)
            assert 0 < frac <= (0.5 + 0.5 / s if causal else 1), (fam, frac)
            assert desc
        a, _, desc = bench.mask_family("document", s, 16)
        assert a.shape[-1] == 2 and desc == f"{s // 2048} documents, mean 2048"
    np.testing.assert_array_equal(bench.mask_family("document", 8192)[0], bench.mask_family("document", 8192)[0])
    assert not np.array_equal(bench.mask_family("document", 8192)[0], bench.mask_family("document", 8192, seed=1)[0])
    with pytest.raises(ValueError, match="unknown mask family 'diagonal'"):
        bench.mask_family("diagonal", 1024)


def test_pair_and_flop_counts():
    s, h, d = 1024, 16, 128
    assert bench.mask_pairs(masks.causal(s), s, True, h) == h * s * (s + 1) // 2
    assert bench.mask_pairs(masks.full(s), s, False, h) == h * s * s
    assert bench.mask_pairs(masks.document([512, 512]), s, False, h) == h * 2 * 512 ** 2
    # causal with a lower interval: rows [LTS, LTE) of each column dropped from its causal rows
    assert bench.mask_pairs(masks.causal_document([512, 512]), s, True, h) == h * 2 * 512 * 513 // 2
    pairs = h * s * s // 2
    assert bench.mask_flops(pairs, d) == 4 * pairs * d == bench._flops(1, s, h, d, True)
    assert bench.mask_flops(pairs, d, backward=True) == 3.5 * 4 * pairs * d


def test_varlen_attn_packs_the_batch_documents(monkeypatch):
    """bench mask's varlen call: the batch's tokens as one packed sequence, each batch entry's
    documents in turn (cu_seqlens over batch * documents), K/V heads kept, output reshaped back."""
    import cuflash.torch as ct
    seen = []

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=False):
        seen.append((q.shape, k.shape, cu_q.tolist(), cu_k.tolist(), max_q, max_k, causal))
        return q * 2
    monkeypatch.setattr(ct, "attention_varlen", varlen)
    q, kv = torch.randn(2, 8, 4, 16), torch.randn(2, 8, 2, 16)
    out = bench._varlen_attn(torch, [3, 5], 2, True, "cpu")(q, kv, kv)
    assert seen == [((16, 4, 16), (16, 2, 16), [0, 3, 8, 11, 16], [0, 3, 8, 11, 16], 5, 5, True)]
    assert out.shape == q.shape and torch.equal(out, q * 2)


def _fake_rows():
    rows = []
    for s in (8192, 32768):
        for fam, frac in (("causal", 0.5), ("document", 0.25), ("random_eviction", 0.37)):
            for p in ("fwd", "fwd+bwd"):
                row = {"family": fam, "seqlen": s, "pass": p, "pairs_frac": frac, "errors": {},
                       "fwd_tile_fill": {"document": 0.9, "causal": 0.98}.get(fam)}
                for name, ms in (("cuflash", 2.0), ("flex", 3.0), ("sdpa", None if s == 32768 else 9.0),
                                 ("varlen", 1.6 if fam == "document" else None)):
                    row[f"{name}_ms"] = ms
                if fam == "random_eviction" and p == "fwd+bwd":
                    row["cuflash_ms"], row["errors"]["cuflash"] = None, "TypeError: no FlashMask backward"
                if row["sdpa_ms"] is None:
                    row["errors"]["sdpa"] = "OutOfMemoryError: CUDA out of memory"
                causal = 4e12 / 2.0 / 1e9 if fam != "causal" else None
                outs = {"cuflash": torch.zeros(2), "flex": torch.tensor([0.0, 0.25])} if row["cuflash_ms"] else {}
                bench._mask_summary(row, outs, 4e12 if fam == "causal" else 4e12 * frac / 0.5, causal, 0.98)
                rows.append(row)
    return rows


def test_summary_table_and_plot(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib")
    rows = _fake_rows()
    doc = rows[2]  # document, 8192, fwd: half the causal row's FLOPs in the same time
    assert doc["cuflash_tflops"] == pytest.approx(1000.0) and doc["flex_tflops"] == pytest.approx(2000 / 3)
    assert doc["ratio_flex"] == pytest.approx(1.5) and doc["ratio_sdpa"] == pytest.approx(4.5)
    assert doc["frac_causal"] == pytest.approx(0.5) and doc["max_diff_cuflash"] == 0.25
    assert doc["max_diff_sdpa"] is None and "error" not in doc
    assert doc["varlen_tflops"] == pytest.approx(1250.0) and doc["frac_varlen"] == pytest.approx(0.8)
    # counted on the computed tiles' elements: 50% of causal's rate, the tiles 90% kept against causal's 98%
    assert doc["frac_causal_tiles"] == pytest.approx(0.5 * 0.98 / 0.9)
    assert rows[4]["frac_causal_tiles"] is None  # random_eviction: no tile fill here
    assert rows[4]["varlen_tflops"] is None and rows[4]["frac_varlen"] is None  # random_eviction: no documents
    broken = [r for r in rows if r["family"] == "random_eviction" and r["pass"] == "fwd+bwd" and r["seqlen"] == 32768][0]
    assert broken["cuflash_tflops"] is None and broken["ratio_flex"] is None and broken["frac_causal"] is None
    assert broken["error"] == "cuflash: TypeError: no FlashMask backward; sdpa: OutOfMemoryError: CUDA out of memory"
    table = bench.format_table(rows, "mask").splitlines()
    cells = lambda line: [c.strip() for c in line.split("|")[1:-1]]  # noqa: E731
    assert cells(table[0]) == ["family", "s", "pass", "kept", "cuflash TF/s", "Flex TF/s", "SDPA TF/s", "xFlex",
                               "%causal", "varlen TF/s", "%varlen", "tile fill", "%causal tiles", "diff vs Flex",
                               "failed"]
    assert len(table) == 2 + len(rows) and len({len(line) for line in table}) == 1
    assert cells(table[2 + 2]) == ["document", "8192", "fwd", "25.0%", "1000.0", "666.7", "222.2", "1.50", "50%",
                                   "1250.0", "80%", "90%", "54%", "2.5e-01", "-"]
    assert cells(table[-1])[:5] == ["random_eviction", "32768", "fwd+bwd", "37.0%", "-"]
    assert cells(table[-1])[-1] == "cuflash,sdpa"
    # fwd+bwd results are (dq, dk, dv): the largest difference of the three
    row = {"errors": {}, "cuflash_ms": 1.0, "flex_ms": 1.0, "sdpa_ms": 1.0}
    grads = lambda *x: tuple(torch.tensor(v) for v in x)  # noqa: E731
    bench._mask_summary(row, {"cuflash": grads(1.0, 2.0, 3.0), "flex": grads(1.0, 2.5, 3.0),
                              "sdpa": grads(0.0, 2.0, 3.0)}, 1e9, None)
    assert row["max_diff_cuflash"] == 0.5 and row["max_diff_sdpa"] == 1.0 and row["frac_causal"] is None
    path = tmp_path / "mask.png"
    bench.plot(rows, "mask", path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _wall_clock(fn, inputs_list, warmup=1, reps=2, **kw):
    """time_cuda's stand-in on the CPU: median wall-clock ms."""
    fn(*inputs_list[0])
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(*inputs_list[i % len(inputs_list)])
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, **kw):
    """cuflash.torch.attention_varlen's stand-in: float32 attention per sequence, differentiable."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert max_seqlen_q == max(np.diff(cq)) and max_seqlen_k == max(np.diff(ck))
    outs = [_reference_attention(q[None, a:b], k[None, c:e], v[None, c:e], causal=causal)[0]
            for a, b, c, e in zip(cq, cq[1:], ck, ck[1:])]
    return torch.cat(outs)


def _reference_attention(q, k, v, causal=False, startend_row_indices=None, **kw):
    """cuflash's stand-in: float32 attention with the dense mask of cuflash.masks, differentiable."""
    s = q.shape[1]
    if startend_row_indices is None:
        keep = ~masks.to_dense(masks.causal(s), s, True) if causal else np.ones((1, 1, s, s), bool)
    else:
        keep = ~masks.to_dense(startend_row_indices.numpy(), s, causal)
    out = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2).float() for x in (q, k, v)), attn_mask=torch.from_numpy(keep))
    return out.transpose(1, 2).to(q.dtype)


@pytest.fixture
def cpu_bench(monkeypatch):
    """bench mask on the CPU: torch without CUDA, two small input sets, the wall clock, the
    reference attention as cuflash.torch.attention (startend_row_indices and autograd), and SDPA
    on whatever CPU kernel it picks (the CUDA backends that the bench asks for are recorded
    instead). Returns cuflash.torch and that record."""
    import contextlib
    import torch.nn.attention
    import cuflash.torch as ct
    asked = []

    def sdpa_kernel(backends):
        asked.append(backends)
        return contextlib.nullcontext()
    sdpa_kernel.__wrapped__ = torch.nn.attention.sdpa_kernel.__wrapped__  # torch._dynamo looks it up
    monkeypatch.setattr(torch.nn.attention, "sdpa_kernel", sdpa_kernel)
    monkeypatch.setattr(bench, "_torch", lambda: torch)
    monkeypatch.setattr(bench, "time_cuda", _wall_clock)
    gen = torch.Generator().manual_seed(0)
    monkeypatch.setattr(bench, "_make_sets", lambda torch_, shapes, dtype, min_sets=4, extra_bytes=0: [
        tuple(torch.randn(s, generator=gen, dtype=torch.float32).to(dtype) for s in shapes) for _ in range(2)])
    monkeypatch.setattr(ct, "attention", _reference_attention)
    monkeypatch.setattr(ct, "attention_varlen", _reference_varlen)
    return ct, asked


def _run(**kw):
    return bench.bench_mask(seqlens=(256,), families=("causal_document", "global_sliding_window", "random_eviction"),
                            nheads=2, d=16, reps=2, warmup=1, compile=False, verbose=False, **kw)


def test_small_run_on_the_cpu(cpu_bench):
    rows = _run()
    assert [(r["family"], r["pass"]) for r in rows] == [
        (f, p) for f in ("causal", "causal_document", "global_sliding_window", "random_eviction")
        for p in ("fwd", "fwd+bwd")]
    for r in rows:
        assert r["cuflash_api"] == "cuflash.torch.attention"
        assert r["fwd_tile_fill"] is None and r["frac_causal_tiles"] is None  # no GPU to plan for
        assert r["cuflash_ms"] > 0 and r["sdpa_ms"] > 0
        if r["family"] in bench.VARLEN_FAMILIES:  # the same documents through the varlen call
            assert r["varlen_ms"] > 0 and r["frac_varlen"] == pytest.approx(r["cuflash_tflops"] / r["varlen_tflops"])
        else:
            assert r["varlen_ms"] is None and r["frac_varlen"] is None and r["max_diff_varlen"] is None
        if r["pass"] == "fwd+bwd":  # Flex has no backward on the CPU: the row says so and the run goes on
            assert list(r["errors"]) == ["flex"] and "does not support backward on CPU" in r["errors"]["flex"]
            assert r["flex_ms"] is None and r["ratio_flex"] is None and r["max_diff_cuflash"] is None
            continue
        assert r["errors"] == {} and "error" not in r, r["errors"]
        assert all(r[f"{n}_ms"] > 0 and r[f"{n}_tflops"] > 0 for n in bench.MASK_IMPLS)
        # bf16 results of the same attention (Flex's and SDPA's on bf16 inputs, the stand-in's in float32)
        assert r["max_diff_cuflash"] < 0.05 and r["max_diff_sdpa"] < 0.05
        if r["family"] in bench.VARLEN_FAMILIES:
            assert r["max_diff_varlen"] < 0.05
        assert r["ratio_flex"] == pytest.approx(r["cuflash_tflops"] / r["flex_tflops"])
        want = bench.mask_flops(bench.mask_pairs(bench.mask_family(r["family"], 256, 2)[0], 256, r["causal"], 2),
                                16, r["pass"] == "fwd+bwd")
        assert r["cuflash_tflops"] == pytest.approx(want / r["cuflash_ms"] / 1e9)
    causal = {r["pass"]: r["cuflash_tflops"] for r in rows if r["family"] == "causal"}
    for r in rows:
        assert r["frac_causal"] == pytest.approx(r["cuflash_tflops"] / causal[r["pass"]])
    assert rows[0]["pairs_frac"] == pytest.approx(257 / 512) and rows[-1]["mask_heads"] == 2
    # SDPA's fused kernels only, never the math fallback that materialises the scores
    B = torch.nn.attention.SDPBackend
    fused = [B.EFFICIENT_ATTENTION, B.CUDNN_ATTENTION]
    assert cpu_bench[1] == [[B.FLASH_ATTENTION] + fused] * 2 + [fused] * 6


def test_cuflash_without_flashmask_gradients_is_reported(cpu_bench, monkeypatch):
    # a cuflash.torch.attention without startend_row_indices: the forward goes through
    # cuflash.attention (the same forward kernels), fwd+bwd fails, and the run goes on
    import cuflash

    def attention(q, k, v, causal=False, softmax_scale=None):
        return _reference_attention(q, k, v, causal=causal)
    monkeypatch.setattr(cpu_bench[0], "attention", attention)
    monkeypatch.setattr(cuflash, "attention", _reference_attention)
    rows = _run()
    for r in rows:
        masked, bwd = r["family"] != "causal", r["pass"] == "fwd+bwd"
        assert r["cuflash_api"] == ("cuflash.attention" if masked and not bwd else "cuflash.torch.attention")
        assert (r["cuflash_ms"] is None) == (masked and bwd) and r["sdpa_ms"] > 0
        if masked and bwd:
            assert r["frac_causal"] is None and r["max_diff_cuflash"] is None
            assert r["errors"]["cuflash"].startswith("TypeError: ") and "startend_row_indices" in r["errors"]["cuflash"]
        elif not bwd:
            assert r["errors"] == {} and r["max_diff_cuflash"] < 0.05


def test_cli_bench_mask_is_a_kind(capsys, monkeypatch):
    # the parser knows it; with no CUDA in PyTorch it stops with one line
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    try:
        main(["bench", "mask", "--quick", "--json", "unused.json", "--plot", "unused.png"])
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and err == "cuflash: error: bench needs PyTorch with CUDA\n"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # stops at the flags, before any GPU work
    with pytest.raises(SystemExit):
        main(["bench", "mask", "--dtype", "float16"])
    assert "--dtype and --head-dim apply to bench prefill, backward and jax, not mask" in capsys.readouterr().err


@pytest.mark.skipif(not __import__("shutil").which("g++"), reason="torch.compile on the CPU needs a C++ compiler")
def test_flex_compiles_once_per_length_and_causal_flag(cpu_bench):
    # the GPU run's Flex path on the CPU (forward only): torch.compile'd flex_attention and
    # create_block_mask(_compile=True); refilling the mask's tensors in place between masks must
    # neither recompile nor leave the compiled kernels reading an earlier mask
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    rows = bench.bench_mask(seqlens=(128,), families=("causal_document", "document", "random_eviction", "qk_sparse"),
                            nheads=2, d=16, reps=1, warmup=1, compile=True, verbose=False)
    # create_block_mask and flex forward, for the causal and the non-causal mask_mod; the fwd+bwd
    # passes fail before compiling (Flex has no CPU backward)
    assert counters["stats"]["unique_graphs"] - before <= 5  # 4, and the fwd+bwd trace that fails
    for r in rows:
        if r["pass"] == "fwd":
            assert r["errors"] == {} and r["flex_ms"] > 0 and r["max_diff_cuflash"] < 0.05, (r["family"], r["errors"])
        else:
            assert list(r["errors"]) == ["flex"]
    torch._dynamo.reset()


def test_cli_bench_mask_writes_table_json_and_plot(capsys, monkeypatch, tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib")
    import json
    monkeypatch.setattr(bench, "_torch", lambda: torch)
    asked = []
    monkeypatch.setattr(bench, "bench_mask", lambda **kw: asked.append(kw) or _fake_rows())
    main(["bench", "mask", "--quick", "--json", str(tmp_path / "m.json"), "--plot", str(tmp_path / "m.png")])
    out = capsys.readouterr().out.splitlines()
    assert asked == [{"quick": True}] and out[0].split("|")[1].strip() == "family" and len(out) == 2 + 12
    saved = json.loads((tmp_path / "m.json").read_text())
    assert saved["rows"][2]["family"] == "document" and saved["rows"][2]["ratio_flex"] == pytest.approx(1.5)
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("mask, causal, fill", [
    (masks.causal(256), True, (256 * 257 / 2) / (3 * 128 * 128)),    # two diagonal tiles half full, one whole
    (masks.document([128, 128]), False, 1.0),                          # documents on tile edges: whole tiles only
    (masks.document([100, 156]), False, (100 ** 2 + 156 ** 2) / (4 * 128 * 128)),  # every tile computed, 3 partly
])
def test_mask_tile_fill(mask, causal, fill):
    assert bench.mask_tile_fill(mask, 256, causal, 4, 128, 128) == pytest.approx(fill)
    assert bench.mask_tile_fill(mask, 256, causal, 4, 64, 64) >= fill  # smaller tiles waste no more
