"""bench.rotated_rounds and bench.time_interleaved: every timer (implementation) runs once per
round (pass), the order rotates, and the result is each one's median (None where it never ran)."""
import pytest

from cuflash import bench


def test_rotated_rounds_order_and_medians():
    calls = []
    times = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 7.0, 6.0])}

    def timer(name):
        def run():
            calls.append(name)
            return next(times[name]) if name in times else None
        return run
    got = bench.rotated_rounds({n: timer(n) for n in ("a", "b", "c")}, 3)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert got == {"a": 2.0, "b": 6.0, "c": None}


def _recording_sweeps(monkeypatch, kinds):
    """bench's sweeps of ``kinds`` replaced by one that records its keyword arguments into the
    dict returned (no GPU, no table)."""
    seen = {}
    monkeypatch.setattr(bench, "_torch", lambda: None)
    monkeypatch.setattr(bench, "_jax", lambda: None)
    for kind in kinds:
        monkeypatch.setattr(bench, f"bench_{kind}", lambda **kw: seen.update(kw) or [])
    monkeypatch.setattr(bench, "format_table", lambda rows, kind: "")
    return seen


def _passes_through(capsys, seen, kinds, option, value, key, parsed):
    """``bench KIND option value`` runs and hands the sweep ``key=parsed``, for every kind."""
    from test_hardening import run_cli
    for kind in kinds:
        seen.clear()
        code, _, _ = run_cli(capsys, "bench", kind, option, value)
        assert code == 0 and seen[key] == parsed, kind


def test_cli_rounds(capsys, monkeypatch):
    """--rounds passes through to bench prefill, backward and jax, and is refused elsewhere."""
    from test_hardening import run_cli
    kinds = ("prefill", "backward", "jax")
    seen = _recording_sweeps(monkeypatch, kinds)
    _passes_through(capsys, seen, kinds, "--rounds", "5", "rounds", 5)
    seen.clear()
    code, _, _ = run_cli(capsys, "bench", "prefill")
    assert code == 0 and "rounds" not in seen  # the sweep's default
    code, _, err = run_cli(capsys, "bench", "overhead", "--rounds", "2")
    assert code != 0 and "--rounds applies to bench prefill, backward and jax, not overhead" in err
    code, _, err = run_cli(capsys, "bench", "prefill", "--rounds", "0")
    assert code != 0 and "--rounds" in err


class _ClockCuda:
    """torch.cuda for time_interleaved without a GPU: an event records a clock, which
    each call advances by that implementation's next duration."""

    def __init__(self):
        self.now = 0.0
        cuda = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self):
                self.t = cuda.now

            def elapsed_time(self, end):
                return end.t - self.t
        self.Event = Event

    def synchronize(self):
        pass


def test_time_interleaved_rotates_and_takes_medians(monkeypatch):
    """One timed call of each per pass, the order rotated by one every pass; warm-up calls are
    not timed; an implementation that raises in its first call gives None and its error."""
    fake = _ClockCuda()
    monkeypatch.setattr(bench, "_torch", lambda: type("T", (), {"cuda": fake})())
    calls, durations = [], {"a": iter([9.0, 9.0, 1.0, 3.0, 2.0]), "b": iter([9.0, 9.0, 5.0, 7.0, 6.0])}

    def impl(name):
        def fn(x):
            calls.append((name, x))
            fake.now += next(durations[name])
        return fn

    def broken(x):
        raise RuntimeError("no kernel for this shape")
    errors = {}
    got = bench.time_interleaved({"a": (impl("a"), [(0,), (1,)]), "c": (broken, [(0,)]),
                                  "b": (impl("b"), [(0,), (1,)])}, warmup=1, reps=3, errors=errors)
    assert got == {"a": 2.0, "c": None, "b": 6.0}
    assert isinstance(errors["c"], RuntimeError) and set(errors) == {"c"}
    timed = [n for n, _ in calls[4:]]
    assert calls[:4] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert timed == ["a", "b", "b", "a", "a", "b"]
    # a timed call that raises drops that implementation, not the others
    calls.clear()
    n = iter(range(100))

    def flaky(x):
        if next(n) == 3:
            raise RuntimeError("launch failed")
        fake.now += 1.0
    errors = {}
    durations["a"] = iter([4.0] * 10)
    got = bench.time_interleaved({"a": (impl("a"), [(0,)]), "f": (flaky, [(0,)])}, warmup=1, reps=4, errors=errors)
    assert got == {"a": 4.0, "f": None} and str(errors["f"]) == "launch failed"


def test_cli_settle(capsys, monkeypatch):
    """--settle passes seconds through to bench prefill and backward, is refused elsewhere and
    outside 0 to 60."""
    from test_hardening import run_cli
    kinds = ("prefill", "backward")
    seen = _recording_sweeps(monkeypatch, kinds)
    _passes_through(capsys, seen, kinds, "--settle", "1.5", "settle", 1.5)
    seen.clear()
    code, _, _ = run_cli(capsys, "bench", "prefill")
    assert code == 0 and "settle" not in seen
    code, _, err = run_cli(capsys, "bench", "overhead", "--settle", "1")
    assert code != 0 and "--settle applies to bench prefill and backward, not overhead" in err
    for bad in ("-1", "61", "nan", "soon"):
        code, _, err = run_cli(capsys, "bench", "prefill", "--settle", bad)
        assert code != 0 and "--settle" in err, bad


def test_cli_gqa(capsys, monkeypatch):
    """--gqa passes query heads per KV head through to bench prefill and backward, is refused
    elsewhere and where it does not divide a head dim's query heads (2048 // d)."""
    from test_hardening import run_cli
    kinds = ("prefill", "backward")
    seen = _recording_sweeps(monkeypatch, kinds)
    _passes_through(capsys, seen, kinds, "--gqa", "4", "gqa", 4)
    code, _, err = run_cli(capsys, "bench", "backward", "--gqa", "16")
    assert code != 0 and "--gqa 16 does not divide" in err and "head dim 256" in err
    code, _, _ = run_cli(capsys, "bench", "backward", "--gqa", "16", "--head-dim", "64", "128")
    assert code == 0 and seen["gqa"] == 16
    code, _, err = run_cli(capsys, "bench", "overhead", "--gqa", "2")
    assert code != 0 and "--gqa applies to bench prefill and backward, not overhead" in err
    code, _, err = run_cli(capsys, "bench", "prefill", "--gqa", "0")
    assert code != 0 and "--gqa" in err


def test_prefill_grid_gqa():
    """The grid's K/V shapes have nheads // gqa heads; a gqa that does not divide them is refused."""
    rows = list(bench._prefill_grid(("bfloat16",), (128,), (True,), ((2, 512),), 2048, False, gqa=4))
    assert rows == [("bfloat16", 128, True, 2, 512, 16, (2, 512, 16, 128), (2, 512, 4, 128))]
    with pytest.raises(ValueError, match="gqa"):
        list(bench._prefill_grid(("bfloat16",), (256,), (True,), ((2, 512),), 2048, False, gqa=16))


class _FakeCuda:
    """torch.cuda's stand-in for time_cuda: synchronize counts, events give 1 ms per sample."""

    def __init__(self):
        self.syncs = 0

    def synchronize(self):
        self.syncs += 1

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            pass

        def elapsed_time(self, end):
            return 1.0


def test_time_cuda_settles_before_its_samples(monkeypatch):
    """settle_s: calls run back to back for that long after the warm-up and before the timed
    samples; settle_s=0 adds no call."""
    import time
    import types
    fake = types.SimpleNamespace(cuda=_FakeCuda())
    monkeypatch.setattr(bench, "_torch", lambda: fake)
    calls = []

    def fn(x):
        calls.append(time.perf_counter())
        time.sleep(0.001)

    assert bench.time_cuda(fn, [(1,), (2,)], warmup=2, reps=3) == 1.0
    assert len(calls) == 1 + 2 + 3  # first call, warm-up, samples
    calls.clear()
    t0 = time.perf_counter()
    bench.time_cuda(fn, [(1,), (2,)], warmup=2, reps=3, settle_s=0.05)
    assert time.perf_counter() - t0 >= 0.05
    settled = len(calls) - (1 + 2 + 3)
    assert settled >= 8 and settled % 8 == 0  # whole groups of 8 between clock checks
    assert calls[-1] - calls[2] >= 0.05  # the settling came before the last samples


@pytest.mark.parametrize("host_ms, per_call_ms, fixed_ms", [
    (0.1, 0.4, 3.1),   # GPU-bound: a call adds its 0.4 ms of GPU work; a batch waits for its first issue and 3 ms
    (0.5, 0.5, 3.4),   # host-bound: a call adds its 0.5 ms of host time; the GPU lags the last issue by 0.4 ms
])
def test_time_steady_separates_per_call_and_per_batch_costs(monkeypatch, host_ms, per_call_ms, fixed_ms):
    """On a virtual clock where a call takes host_ms of host time and 0.4 ms of GPU work queued
    behind the previous call's, and each sync waits for the queue and then a fixed 3 ms."""
    import types
    clock = types.SimpleNamespace(now=0.0, queued=0.0)
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock.now)

    def fn(x):
        clock.now += host_ms * 1e-3
        clock.queued = max(clock.queued, clock.now) + 0.4e-3
        return x

    def sync(out):
        clock.now = max(clock.now, clock.queued) + 3e-3
    per_call, fixed = bench.time_steady(fn, [(1,), (2,)], sync, warmup=3, reps=5, sample_ms=20.0)
    assert per_call == pytest.approx(per_call_ms) and fixed == pytest.approx(fixed_ms)


def test_time_steady_refuses_a_noisy_difference(monkeypatch):
    """Long batches that take no longer than short ones (noise on a loaded machine) give an
    error, which bench notes on the row, not a zero or negative time per call."""
    import types
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock.now)

    def sync(out):  # every wait takes 5 ms, every call nothing
        clock.now += 5e-3
    with pytest.raises(RuntimeError, match="too noisy to time"):
        bench.time_steady(lambda x: x, [(1,)], sync, warmup=2, reps=3)
