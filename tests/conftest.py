import os
import sys

XDIST = "PYTEST_XDIST_WORKER" in os.environ  # this process is a pytest-xdist worker

# Each pytest-xdist worker computes float64 references with NumPy (and runs PyTorch on the CPU):
# one BLAS/OpenMP thread per worker, or 16 workers on 16 cores start 256 threads (a GPU suite ran
# ~10x slower that way). A plugin may import NumPy in a worker before this file, when the
# variables are read already, so the controller also sets them before it starts the workers
# (pytest_configure below) and they inherit them.
ONE_THREAD = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _one_thread_per_process():
    for var in ONE_THREAD:
        os.environ.setdefault(var, "1")


if XDIST:
    _one_thread_per_process()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gpu_problem():
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return None
        return "no CUDA device is visible"
    except Exception as e:  # no driver / no CuPy
        return f"no usable CUDA GPU ({type(e).__name__}: {e})"


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and not XDIST:  # the controller of `-n N`
        _one_thread_per_process()
    # The run's seed of the rng fixture: fresh per run, shown in the header, the same in every
    # xdist worker (they inherit the variable); CUFLASH_TEST_SEED=N draws a failed run's inputs again.
    os.environ.setdefault(SEED_VAR, str(int.from_bytes(os.urandom(4), "little")))


SEED_VAR = "CUFLASH_TEST_SEED"


def pytest_report_header(config):
    return f"random inputs: {SEED_VAR}={os.environ.get(SEED_VAR)}"


def pytest_terminal_summary(terminalreporter, exitstatus):
    if exitstatus:  # (the header is not printed under -q)
        terminalreporter.write_line(f"random inputs of this run: {SEED_VAR}={os.environ.get(SEED_VAR)}")


def shard_index(nodeid: str, shards: int) -> int:
    """The shard (0 .. shards - 1) of a test: a CRC of its node id, the same in every process."""
    import zlib
    return zlib.crc32(nodeid.encode()) % shards


def pytest_collection_modifyitems(config, items):
    """CUFLASH_TEST_SHARD=i/n keeps the i-th of n shards (1 <= i <= n) of the collected tests, so
    that a long GPU suite can run in parts (each `pytest -n 16 tests` call with one shard)."""
    spec = os.environ.get("CUFLASH_TEST_SHARD")
    if not spec:
        return
    try:
        i, n = (int(x) for x in spec.split("/"))
        if not 1 <= i <= n:
            raise ValueError
    except ValueError:
        raise pytest.UsageError(f"CUFLASH_TEST_SHARD must be i/n with 1 <= i <= n, got {spec!r}") from None
    kept, dropped = [], []
    for t in items:
        (kept if shard_index(t.nodeid, n) == i - 1 else dropped).append(t)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def warm(variants) -> None:
    """Compile ``variants`` into the disk cache in parallel before a module's tests, in a single
    pytest process. Under pytest-xdist every worker would compile all of them at once (each with
    a thread per core), so there the tests compile what they use when they first use it."""
    if not XDIST:
        from cuflash.compiler import warmup
        warmup(variants)


GPU_PROBLEM = _gpu_problem()
requires_gpu = pytest.mark.skipif(GPU_PROBLEM is not None, reason=f"needs a CUDA GPU: {GPU_PROBLEM}")


def _sm90_problem():
    if GPU_PROBLEM is not None:
        return f"needs a CUDA GPU: {GPU_PROBLEM}"
    import cupy
    cc = int(cupy.cuda.Device().compute_capability)
    return None if cc == 90 else f"needs an sm_90 GPU (H100/H200) for the warp-specialised kernels, this one is sm_{cc}"


SM90_PROBLEM = _sm90_problem()
requires_sm90 = pytest.mark.skipif(SM90_PROBLEM is not None, reason=str(SM90_PROBLEM))


def _has(mod):
    try:
        __import__(mod)
        return True
    except Exception:
        return False


requires_torch = pytest.mark.skipif(not _has("torch"), reason="needs PyTorch (optional dependency)")


def render_without_flag(v, flag):
    """Variant v's source rendered by its template given no ``flag`` at all (Jinja's default,
    lenient undefined), checked to be codegen's (which passes ``flag=False``): the flag adds
    nothing to variants without it. Returns the source."""
    import jinja2
    from cuflash import codegen
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(codegen.templates_dir())), keep_trailing_newline=True)
    consts = v.constants()
    assert consts.pop(flag) is False
    src = env.get_template(v.template).render(name=v.name, params_name=v.params.struct_name,
                                              params_struct=v.params.cuda(), params_unpack=v.params.unpack(), **consts)
    assert src == codegen.render(v)
    return src


def assert_compiled_clean(c, v):
    """A cubin of ``v`` for its arch whose ptxas report shows no spills, no stack and at most 255
    registers; returns the report."""
    assert c.cubin[:4] == b"\x7fELF"
    assert f"entry function '{v.name}'" in c.log and f"for 'sm_{v.target}'" in c.log
    r = c.resources
    assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0), f"{v.name}: {r}\n{c.log}"
    assert 0 < r.registers <= 255, r
    return r


def assert_warp_specialised_clean(c, v):
    """assert_compiled_clean for a warp-specialised kernel (fwd_ws, bwd_ws): __launch_bounds__(384
    or 512, 1) caps the launch at 168 registers (128 with 512 threads), which setmaxnreg then
    splits between producer and consumers; ptxas neither ignored setmaxnreg (C7508) nor
    serialized a wgmma nor warned; no static shared memory. Returns the report."""
    r = assert_compiled_clean(c, v)
    assert r.registers <= 168 and r.static_smem == 0, r
    assert "C7508" not in c.log and "serialized" not in c.log and "warning" not in c.log.lower(), c.log
    return r


@pytest.fixture(scope="session")
def compile_variants():
    """``compile_variants(variants)`` -> {variant: Compiled}: each variant compiled offline (NVRTC,
    no GPU; in parallel through cuflash.compiler.compile_all, the first alone) once per test
    session, however many modules ask for it."""
    from cuflash import compiler
    done = {}

    def compile_variants(variants):
        variants = list(dict.fromkeys(variants))
        todo = [v for v in variants if v not in done]
        if todo:
            done.update(compiler.compile_all(todo))
        return {v: done[v] for v in variants}
    return compile_variants


class _Compiled(dict):
    """Variant -> Compiled; a variant not compiled yet is compiled on first use. In a single
    pytest process ``variants`` are compiled together up front, in parallel; under pytest-xdist
    each test compiles its own when it first asks for it, since every worker would otherwise
    compile all of them (16 workers: 16 times the module's sample, each with a thread per core)."""

    def __init__(self, compile_variants, variants):
        super().__init__({} if XDIST else compile_variants(variants))
        self._compile = compile_variants

    def __missing__(self, v):
        self[v] = self._compile([v])[v]
        return self[v]


@pytest.fixture(scope="module")
def compiled(compile_variants, request):
    """{variant: Compiled} for a module's tests parametrized by a variant ``v``: in one process the
    variants of its selected tests (all of them, or the few that ``-k`` picks) compiled together,
    in parallel, before the first of those tests runs (through the session's compile_variants);
    under pytest-xdist each test's own variant, when it asks for it (_Compiled)."""
    params = [getattr(getattr(item, "callspec", None), "params", {}) for item in request.session.items
              if item.module is request.module]
    return _Compiled(compile_variants, [p["v"] for p in params if "v" in p])


ALL_TWINS = os.environ.get("CUFLASH_TEST_ALL_VARIANTS") == "1"


def bf16_or_alone(variants):
    """The variants whose offline compile checks run: with CUFLASH_TEST_ALL_VARIANTS=1 all of
    them, else all but the fp16 ones whose bf16 twin (the same name with bf16) is in the list. A
    twin's source differs only in its conversions (cvt to f16x2 rather than bf16x2); the planner
    runs both, the GPU tests run both, and test_compile's covering sample compiles every kernel
    kind in both dtypes. (This keeps CI, two cores, within its time.)"""
    variants = list(variants)
    if ALL_TWINS:
        return variants
    names = {v.name for v in variants}
    return [v for v in variants if not (v.dtype == "fp16" and v.name.replace("_fp16_", "_bf16_", 1) in names)]


def module_compiled(compile_variants, variants):
    """{variant: Compiled} for a module fixture that names its variants itself (as ``compiled``
    does for a module's parametrized ``v``): up front in one process, on use under xdist."""
    return _Compiled(compile_variants, variants)


@pytest.fixture
def rng(request):
    """A test-specific stream of random numbers: the run's seed (see pytest_configure) and a CRC of
    the test's id, so that a failure's inputs come back with the seed the header printed."""
    import zlib
    return np.random.default_rng([int(os.environ[SEED_VAR]), zlib.crc32(request.node.nodeid.encode())])


def record_launches(monkeypatch, early_ok=True):
    """Kernels recorded instead of run: compiler.get_kernel returns stand-ins whose launches
    append (kernel name, stream, {field: value}) to the returned list, after checking that every
    value fits its field. ``early_ok=False``: an early (programmatic) launch fails the test."""
    from cuflash import compiler
    launched = []

    class Kernel:
        def __init__(self, variant):
            self.name, self.table = variant.name, variant.params

        def launch(self, grid, block, smem, stream, values, early=False):
            self.table.layout.pack(*values)  # every value fits its field
            assert early_ok or not early
            launched.append((self.name, stream, dict(zip(self.table.names, values))))

        def __call__(self, grid, block, stream, shared_mem=0, **values):
            self.launch(grid, block, shared_mem, stream, self.table.values(**values))

    monkeypatch.setattr(compiler, "get_kernel", lambda variant, device: Kernel(variant))
    return launched


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


# ---------------------------------------------------------------------------------------------
# Checks of the reference gradients (cuflash.reference.attention_backward)

def finite_diff(loss, xs, eps=1e-6):
    """Central differences of ``loss()`` (a float) with respect to every element of each array in
    ``xs``, which are perturbed in place and restored."""
    grads = []
    for x in xs:
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + eps
            up = loss()
            x[idx] = old - eps
            down = loss()
            x[idx] = old
            g[idx] = (up - down) / (2 * eps)
        grads.append(g)
    return grads


def naive_backward(dout, q, k, v, scale, left=-1, right=-1, softcap=0.0, slopes=None):
    """Gradients (dq, dk, dv) one query row at a time, with the softmax Jacobian and the softcap
    derivative written out (independent of the blocked reference). Window (left, right) as
    launched (-1 = unbounded; causal is right = 0); slopes: (batch, nheads) or None."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for bi in range(b):
        for hi in range(h):
            g = hi // (h // hk)
            for i in range(sq):
                c = i + sk - sq
                keys = [j for j in range(sk) if (left < 0 or j >= c - left) and (right < 0 or j <= c + right)]
                if not keys:
                    continue
                raw = np.array([scale * q[bi, i, hi] @ k[bi, j, g] for j in keys])
                s, dcap = raw, np.ones(len(keys))
                if softcap > 0:
                    s = softcap * np.tanh(raw / softcap)
                    dcap = 1 - np.tanh(raw / softcap) ** 2
                if slopes is not None:
                    s = s - slopes[bi, hi] * np.abs(c - np.array(keys))
                p = np.exp(s - s.max())
                p /= p.sum()
                jac = np.diag(p) - np.outer(p, p)  # d softmax / d s
                dp = np.array([dout[bi, i, hi] @ v[bi, j, g] for j in keys])
                ds = (jac @ dp) * dcap
                for n, j in enumerate(keys):
                    dv[bi, j, g] += p[n] * dout[bi, i, hi]
                    dq[bi, i, hi] += scale * ds[n] * k[bi, j, g]
                    dk[bi, j, g] += scale * ds[n] * q[bi, i, hi]
    return dq, dk, dv


def check_same_precision(low, ref, dt):
    """The same-precision reference rounds to ``dt`` and stays close to the float64 one."""
    from cuflash import reference
    tol = 0.05 if dt == np.float16 else 0.2
    for lo, r in zip(low, ref):
        assert lo.dtype == np.dtype(dt) and r.dtype == np.float64
        err = reference.max_abs_err(lo, r)
        assert 0 < err < tol * max(1.0, np.abs(r).max()), err


def paged_cache(rng, rnd, b, per_seq, page, hk, d, spare):
    """A paged K/V cache for GPU tests: ``b * per_seq + spare`` pages of ``page`` rows made by
    ``rnd(*shape)``, a block table (int32 CUDA, (b, per_seq)) of distinct shuffled pages, and
    ``rows(cache, i, n)``, sequence i's first n rows read through the table. Returns (k_cache,
    v_cache, block_table, rows)."""
    import torch
    n_pages = b * per_seq + spare
    k_cache, v_cache = rnd(n_pages, page, hk, d), rnd(n_pages, page, hk, d)
    table = torch.from_numpy(rng.permutation(n_pages)[:b * per_seq].reshape(b, per_seq).astype(np.int32)).cuda()

    def rows(c, i, n):
        j = torch.arange(n, device="cuda")
        return c[table[i][j // page].long(), j % page]
    return k_cache, v_cache, table, rows
