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
