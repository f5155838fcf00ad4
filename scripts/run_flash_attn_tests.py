"""Run flash-attn's own test file against cuflash.flash_attn, with only its imports changed.

    python scripts/run_flash_attn_tests.py PATH/TO/flash-attention/tests/test_flash_attn.py \
        [--per-test 120] [--seed 0] [-n 16] [-- extra pytest arguments]
    python scripts/run_flash_attn_tests.py PATH/TO/flash-attention/hopper/test_flash_attn.py ...

The file is copied into a temporary directory with every ``from flash_attn`` / ``import
flash_attn`` line pointed at ``cuflash.flash_attn`` and every ``flash_attn_interface`` import
(FlashAttention-3's module, which ``hopper/test_flash_attn.py`` tests) at ``cuflash.flash_attn3``,
and nothing else changed; the modules beside it that it imports by name (``hopper/``'s
``padding.py`` and ``test_util.py``) are copied the same way. flash-attn's file
parametrises about half a million cases (2.8.3), so a seeded sample of at most ``--per-test``
cases of each test function runs (all of a function with fewer; ``--per-test 0`` runs them all).
The sample is split over ``-n`` pytest processes (shard k runs the sample's cases k, k + n, ...):
each collects the file once, which pytest-xdist would follow by shipping half a million test ids
from every worker to its controller. Prints the sample per test function, each shard's summary
line and failures, and the totals; exits non-zero if a case failed.
Needs a CUDA GPU, PyTorch and einops (flash-attn's tests import it).
"""
import argparse
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Deterministic sampling, then this process's shard of the sample.
CONFTEST = '''
import collections, os, random

PER_TEST, SEED = {per_test}, {seed}


def pytest_collection_modifyitems(config, items):
    groups = collections.defaultdict(list)
    for i, item in enumerate(items):
        groups[item.originalname or item.name].append(i)
    keep = set()
    for name in sorted(groups):
        idx = groups[name]
        full = PER_TEST <= 0 or len(idx) <= PER_TEST
        keep.update(idx if full else random.Random(f"{{SEED}}:{{name}}").sample(idx, PER_TEST))
    sample = sorted(keep)
    if os.environ.get("CUFLASH_FA_SHARD") == "0":
        counts = collections.Counter(items[i].originalname or items[i].name for i in sample)
        print("\\nsample: " + ", ".join(f"{{n}} {{k}} of {{len(groups[k])}}" for k, n in sorted(counts.items())))
    shard, shards = (int(x) for x in os.environ.get("CUFLASH_FA_SHARDS", "0/1").split("/"))
    mine = set(sample[shard::shards])
    config.hook.pytest_deselected(items=[it for i, it in enumerate(items) if i not in mine])
    items[:] = [items[i] for i in sorted(mine)]
'''


def rewrite(source: str) -> str:
    """flash-attn's imports -> cuflash.flash_attn's, FlashAttention-3's flash_attn_interface ->
    cuflash.flash_attn3; every other line unchanged."""
    # (a bare module import keeps its name: ``import flash_attn_interface`` binds the same name)
    source = re.sub(r"^(\s*)import (flash_attn_interface|flash_attn)\s*$",
                    lambda m: f"{m[1]}import cuflash.{'flash_attn3' if m[2] == 'flash_attn_interface' else m[2]} as {m[2]}",
                    source, flags=re.M)
    source = re.sub(r"^(\s*)(from|import) flash_attn_interface\b", r"\1\2 cuflash.flash_attn3", source, flags=re.M)
    return re.sub(r"^(\s*)(from|import) flash_attn\b", r"\1\2 cuflash.flash_attn", source, flags=re.M)


def copy_with_siblings(test_file: pathlib.Path, dest: pathlib.Path):
    """The test file, rewritten, into dest, with the modules beside it that it (or they) import
    by name, rewritten the same way."""
    todo, done = [test_file], set()
    while todo:
        f = todo.pop()
        if f.name in done:
            continue
        done.add(f.name)
        text = rewrite(f.read_text())
        (dest / f.name).write_text(text)
        for name in re.findall(r"^\s*(?:from|import) (\w+)\b", text, flags=re.M):
            if (f.parent / f"{name}.py").is_file():
                todo.append(f.parent / f"{name}.py")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("test_file", type=pathlib.Path,
                    help="flash-attn's tests/test_flash_attn.py or hopper/test_flash_attn.py")
    ap.add_argument("--per-test", type=int, default=120, help="cases per test function (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", type=pathlib.Path, help="keep each shard's pytest log here (shardK.log)")
    ap.add_argument("-n", "--shards", type=int, default=min(16, os.cpu_count() or 1),
                    help="pytest processes (default: CPU cores, at most 16)")
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []  # more pytest arguments
    a = ap.parse_args(argv[:len(argv) - len(extra) - (1 if "--" in argv else 0)])
    if not a.test_file.is_file():
        ap.error(f"no such file: {a.test_file}")
    if a.shards < 1:
        ap.error(f"-n must be at least 1, got {a.shards}")
    if a.log_dir:
        a.log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cuflash-fa-tests-") as d:
        d = pathlib.Path(d)
        copy_with_siblings(a.test_file, d)
        (d / "conftest.py").write_text(CONFTEST.format(per_test=a.per_test, seed=a.seed))
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        procs = []
        for k in range(a.shards):
            env = dict(os.environ, PYTHONPATH=path, CUFLASH_FA_SHARD=str(k), CUFLASH_FA_SHARDS=f"{k}/{a.shards}")
            log = open((a.log_dir or d) / f"shard{k}.log", "w+")
            cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-p", "no:xdist",
                   a.test_file.name, *extra]
            procs.append((subprocess.Popen(cmd, cwd=d, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        totals, failed = {}, False
        try:
            for k, (p, log) in enumerate(procs):
                failed |= p.wait() not in (0, 5)  # 5: this shard got no case
                log.seek(0)
                text = log.read()
                if k == 0:
                    print(next((ln for ln in text.splitlines() if ln.startswith("sample: ")), "sample: none"))
                lines = text.splitlines()
                print(f"shard {k}: {lines[-1] if lines else '(no output)'}")
                for ln in lines:
                    if ln.startswith(("FAILED ", "ERROR ")):
                        print("  " + ln)
                for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", lines[-1] if lines else ""):
                    totals[what] = totals.get(what, 0) + int(n)
        finally:
            for p, log in procs:  # on Ctrl-C or an error, no shard outlives the run
                if p.poll() is None:
                    p.kill()
                log.close()
    print("total: " + ", ".join(f"{n} {w}" for w, n in totals.items()) + f" in {time.perf_counter() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
