"""CUFLASH_TEST_SHARD=i/n (tests/conftest.py): the n shards of a collection are disjoint and cover
it, the same in every process; a malformed value is a usage error naming the variable. And
under pytest-xdist every worker starts with one BLAS/OpenMP thread."""
import os
import subprocess
import sys

import pytest

from conftest import ONE_THREAD

HERE = os.path.dirname(os.path.abspath(__file__))


def _collect(shard=None):
    env = dict(os.environ)
    env.pop("CUFLASH_TEST_SHARD", None)
    if shard:
        env["CUFLASH_TEST_SHARD"] = shard
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                        os.path.join(HERE, "test_plan.py")], capture_output=True, text=True, env=env, cwd=HERE)
    return r.returncode, [line for line in r.stdout.splitlines() if "::" in line], r.stdout + r.stderr


def test_shards_are_disjoint_and_cover_the_collection():
    rc, everything, out = _collect()
    assert rc == 0 and len(everything) > 50, out
    shards = []
    for i in (1, 2, 3):
        rc, ids, out = _collect(f"{i}/3")
        assert rc == 0 and ids, out
        shards.append(set(ids))
    assert sum(map(len, shards)) == len(everything) and set().union(*shards) == set(everything)
    assert _collect("2/3")[1] == sorted(shards[1], key=everything.index)  # the same in another process


@pytest.mark.parametrize("spec", ["4/3", "0/2", "1", "a/b"])
def test_bad_shard_is_a_usage_error(spec):
    rc, _, out = _collect(spec)
    assert rc == 4 and "CUFLASH_TEST_SHARD must be i/n with 1 <= i <= n" in out and repr(spec) in out



def test_xdist_workers_start_with_one_blas_thread():
    """Under ``pytest -n N`` each worker process starts with one BLAS/OpenMP thread in its
    environment: inherited from the controller (read here from /proc/self/environ, the
    environment the process began with), so that a plugin importing NumPy in a worker before
    tests/conftest.py runs still gets one thread, not one per core in each of N workers. Outside
    a worker this runs itself in one under ``-n 2``."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        pytest.importorskip("xdist", reason="needs pytest-xdist (pip install pytest-xdist)")
        env = {k: v for k, v in os.environ.items() if k not in ONE_THREAD and k != "CUFLASH_TEST_SHARD"}
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
                            f"{__file__}::test_xdist_workers_start_with_one_blas_thread"],
                           capture_output=True, text=True, env=env, cwd=HERE)
        assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout + r.stderr
        return
    if not os.path.exists("/proc/self/environ"):
        pytest.skip("needs /proc/self/environ (Linux) to read the environment the worker started with")
    with open("/proc/self/environ", "rb") as f:
        started = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
    assert all(started.get(v.encode()) == b"1" for v in ONE_THREAD), {v: started.get(v.encode()) for v in ONE_THREAD}
