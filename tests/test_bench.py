"""cuflash.bench without a GPU: the FLOP count and the row arithmetic, the `bench jax` command, and
the JAX benchmark's rows on JAX's CPU backend, where cuDNN and cuflash.jax's kernels are really
unavailable (the row must say so and go on) and XLA runs; with the NumPy reference standing in
for the kernels (test_jax's fixture), cuflash.jax's row is timed and compared with XLA's output.
"""
import os
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="needs JAX (optional dependency: pip install 'cuflash[jax]')")
jnp = jax.numpy

from cuflash import bench  # noqa: E402
from cuflash.__main__ import main  # noqa: E402
from test_jax import numpy_kernels  # noqa: E402,F401  (fixture: the NumPy reference as the kernels)


def _jax_has_gpu():
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


cpu_only_jax = pytest.mark.skipif(_jax_has_gpu(), reason="checks what a JAX without a GPU backend reports")


def run_cli(capsys, *argv):
    """(exit code, stdout, stderr) of ``python -m cuflash argv`` run in-process."""
    try:
        main(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def test_flop_count():
    # b=2, s=1024, h=16, d=64: 4 * 2 * 1024^2 * 16 * 64 = 2^33; causal attention does half
    assert bench._flops(2, 1024, 16, 64, False) == 2 ** 33
    assert bench._flops(2, 1024, 16, 64, True) == 2 ** 32
    assert bench.BACKWARD_FLOPS == 2.5  # bench backward's convention, which bench jax follows


def test_summary_arithmetic():
    row = {"errors": {"cudnn": "RuntimeError: refused"}, "cuflash_jax_ms": 2.0, "cudnn_ms": None,
           "xla_ms": 8.0, "cuflash_torch_ms": 2.5}
    bench._jax_summary(row, {}, 3.5 * 2 ** 33)  # forward + backward of the shape above
    assert row["cuflash_jax_tflops"] == pytest.approx(15.032385536)  # 3.5 * 2^33 FLOP in 2 ms
    assert row["xla_tflops"] == pytest.approx(15.032385536 / 4)
    assert row["cudnn_tflops"] is None and row["ratio_cudnn"] is None
    assert row["ratio_xla"] == pytest.approx(4.0)
    assert row["ratio_cuflash_torch"] == pytest.approx(1.25)
    assert row["diff_ref"] is None and row["max_diff_cuflash_jax"] is None  # no output to compare
    assert row["error"] == "cudnn: RuntimeError: refused"


@cpu_only_jax
def test_cli_bench_jax_needs_jax_on_a_gpu(capsys, monkeypatch):
    # PyTorch sees a GPU (a stand-in), JAX none: `bench jax` is a kind the parser knows, and it
    # stops with one line, after telling XLA not to take the GPU's memory
    fake = type(sys)("torch")
    fake.cuda = type(sys)("torch.cuda")
    fake.cuda.is_available = lambda: True
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    code, out, err = run_cli(capsys, "bench", "jax", "--quick", "--json", "unused.json")
    assert code == 1 and out == ""
    assert err.startswith("cuflash: error: bench jax needs JAX with a CUDA GPU backend: ") and err.count("\n") == 1
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"


def _sets(rng, n=2, shape=(1, 32, 2, 16)):
    mk = lambda: jnp.asarray(rng.standard_normal(shape, dtype=np.float32), jnp.bfloat16)  # noqa: E731
    return [tuple(mk() for _ in range(4)) for _ in range(n)]


def _row(sets, backward, causal=True):
    b, s, h, d = sets[0][0].shape
    row = {"dtype": "bfloat16", "d": d, "causal": causal, "batch": b, "seqlen": s, "nheads": h,
           "pass": "fwd+bwd" if backward else "fwd", "errors": {}}
    outs = bench._jax_row(row, sets, causal, d ** -0.5, backward, warmup=1, reps=2)
    bench._jax_summary(row, outs, (1 + bench.BACKWARD_FLOPS if backward else 1) * bench._flops(b, s, h, d, causal))
    return row, outs


@cpu_only_jax
@pytest.mark.parametrize("backward", [False, True])
def test_unavailable_implementations_are_reported(rng, backward):
    row, outs = _row(_sets(rng), backward)
    assert set(outs) == {"xla"}
    assert row["errors"]["cudnn"].startswith("RuntimeError: ") and "cuDNN" in row["errors"]["cudnn"]
    assert "cuflash.jax needs JAX with a CUDA GPU backend" in row["errors"]["cuflash_jax"]
    assert row["cudnn_ms"] is None and row["cuflash_jax_ms"] is None
    assert row["cudnn_tflops"] is None and row["cuflash_jax_tflops"] is None and row["cuflash_torch_tflops"] is None
    assert row["xla_ms"] > 0 and row["xla_tflops"] > 0
    assert row["ratio_xla"] is None and row["max_diff_cuflash_jax"] is None and row["diff_ref"] == "xla"
    assert row["error"].startswith("cuflash_jax: RuntimeError: cuflash.jax needs")
    line = bench.format_table([row], "jax").splitlines()[-1]
    assert line.rstrip(" |").endswith("cuflash_jax,cudnn") and ("fwd+bwd" in line) == backward


@pytest.mark.parametrize("backward", [False, True])
def test_cuflash_jax_row_against_xla(numpy_kernels, rng, backward):
    sets = _sets(rng)
    row, outs = _row(sets, backward)
    assert set(outs) == {"cuflash_jax", "xla"} and set(row["errors"]) == {"cudnn"}
    assert row["cuflash_jax_ms"] > 0 and row["ratio_xla"] > 0 and row["diff_ref"] == "xla"
    got = outs["cuflash_jax"] if backward else (outs["cuflash_jax"],)
    ref = outs["xla"] if backward else (outs["xla"],)
    assert len(got) == len(ref) == (3 if backward else 1)
    want = max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max() for a, b in zip(got, ref))
    assert row["max_diff_cuflash_jax"] == pytest.approx(float(want))
    assert 0 < row["max_diff_cuflash_jax"] < 0.05  # two bf16 roundings of the same attention
    assert numpy_kernels["fwd"] > 0 and (numpy_kernels["bwd"] > 0) == backward


def test_grid_flags(capsys, monkeypatch):
    """--dtype / --head-dim narrow the prefill, backward and jax grids (passed through to the
    sweep), --deterministic selects cuflash's deterministic backward; elsewhere they are refused."""
    seen = {}
    monkeypatch.setattr(bench, "_torch", lambda: None)
    monkeypatch.setattr(bench, "bench_backward", lambda **kw: seen.update(kw) or [])
    monkeypatch.setattr(bench, "format_table", lambda rows, kind: "")
    code, _, _ = run_cli(capsys, "bench", "backward", "--dtype", "float16", "--head-dim", "256", "--deterministic")
    assert code == 0 and seen == dict(quick=False, dtypes=("float16",), head_dims=(256,), deterministic=True)
    code, _, err = run_cli(capsys, "bench", "decode", "--dtype", "bfloat16")
    assert code != 0 and "--dtype and --head-dim apply to bench prefill, backward and jax, not decode" in err
    code, _, err = run_cli(capsys, "bench", "prefill", "--deterministic")
    assert code != 0 and "--deterministic applies to bench backward, not prefill" in err
