"""CUFLASH_TEST_SHARD=i/n (tests/conftest.py): the n shards of a collection are disjoint and cover
it, the same in every process; a malformed value is a usage error naming the variable."""
import os
import subprocess
import sys

import pytest

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
