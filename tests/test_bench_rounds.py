"""bench.rotated_rounds: every timer runs once per round, the order rotates, and the result is
each timer's median (None where it never ran)."""
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


def test_cli_rounds(capsys, monkeypatch):
    """--rounds passes through to bench prefill, backward and jax, and is refused elsewhere."""
    from test_hardening import run_cli
    seen = {}
    monkeypatch.setattr(bench, "_torch", lambda: None)
    monkeypatch.setattr(bench, "_jax", lambda: None)
    for kind in ("prefill", "backward", "jax"):
        monkeypatch.setattr(bench, f"bench_{kind}", lambda **kw: seen.update(kw) or [])
    monkeypatch.setattr(bench, "format_table", lambda rows, kind: "")
    for kind in ("prefill", "backward", "jax"):
        seen.clear()
        code, _, _ = run_cli(capsys, "bench", kind, "--rounds", "5")
        assert code == 0 and seen["rounds"] == 5, kind
    seen.clear()
    code, _, _ = run_cli(capsys, "bench", "prefill")
    assert code == 0 and "rounds" not in seen  # the sweep's default
    code, _, err = run_cli(capsys, "bench", "overhead", "--rounds", "2")
    assert code != 0 and "--rounds applies to bench prefill, backward and jax, not overhead" in err
    code, _, err = run_cli(capsys, "bench", "prefill", "--rounds", "0")
    assert code != 0 and "--rounds" in err


def test_noting_error_records_and_gives_none():
    row = {}
    assert bench._noting_error(row, lambda: 2.5)() == 2.5 and row == {}
    assert bench._noting_error(row, lambda: 1 / 0)() is None and row["error"].startswith("ZeroDivisionError")
