"""Warp stall samples per CUDA source line of one kernel, from Nsight Compute's SASS source page.

    ncu --section SourceCounters -k regex:NAME -c 1 ... -o report python3 CASE.py   # built with -lineinfo
    ncu -i report.ncu-rep --page source --csv --print-source sass > report.csv
    python scripts/ncu_lines.py report.csv KERNEL.cubin KERNEL.cu [--top 40] [--body FIRST PRODUCER CONSUMER]

KERNEL.cubin is the kernel's cubin (a cuflash cache entry is read too: its header is skipped) built
with NVRTC's ``-lineinfo`` (e.g. ``cuflash.compiler.NVRTC_OPTIONS`` extended before the first
compile, with its own ``CUFLASH_CACHE_DIR``), KERNEL.cu its rendered source
(``cuflash.codegen.render(variant)``). ``nvdisasm --print-line-info`` maps each SASS address to
its line (``NVDISASM`` names the program; else PATH, then Triton's copy). Prints the lines with the
most samples, each with its three largest stall reasons and executed warp instructions; with
``--body``, the samples by region of the kernel's body (setup, producer, consumer: the lines
where each begins), an inlined helper's instructions counted in the region of the body line
before them.
"""
import argparse
import collections
import csv
import os
import re
import shutil
import subprocess
import sys

STALL = "Warp Stall Sampling (All Samples)"


def nvdisasm() -> str:
    found = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if found:
        return found
    try:
        import triton
        return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    except ImportError:
        sys.exit("nvdisasm not found: set NVDISASM")


def cubin_bytes(path) -> bytes:
    data = open(path, "rb").read()
    if not data.startswith(b"\x7fELF"):  # a cuflash cache entry: magic, sha256, then the cubin
        from cuflash import compiler
        data = data[len(compiler._MAGIC) + 32:]
    return data


def line_of_address(cubin: bytes) -> dict:
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([nvdisasm(), "--print-line-info", "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    line, lines = None, {}
    for row in text.splitlines():
        m = re.search(r"## File .*line (\d+)", row)
        if m:
            line = int(m.group(1))
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/", row)
        if m:
            lines[int(m.group(1), 16)] = line
    return lines


def instructions(path):
    """(offset from the kernel's first instruction, SASS, samples, {stall reason: samples},
    warp instructions executed) per row of the CSV."""
    rows = list(csv.reader(open(path)))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    col = {h: i for i, h in enumerate(rows[head])}
    reasons = [h for h in col if h.startswith("stall_") and "(Not Issued)" not in h]
    body = []
    for r in rows[head + 1:]:  # the first profiled kernel's rows (a report of one launch: -c 1)
        if r and r[0] in ("Kernel Name", "Address"):
            break
        if len(r) == len(col) and r[0].startswith("0x"):
            body.append(r)
    base = int(body[0][0], 16)
    num = lambda r, h: int(r[col[h]] or 0) if r[col[h]] not in ("-", "") else 0  # noqa: E731
    for r in body:
        yield (int(r[0], 16) - base, r[1].strip(), num(r, STALL), {h[6:]: num(r, h) for h in reasons},
               num(r, "Instructions Executed"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("cubin")
    ap.add_argument("source")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--body", type=int, nargs=3, metavar=("FIRST", "PRODUCER", "CONSUMER"))
    a = ap.parse_args(argv)
    where = line_of_address(cubin_bytes(a.cubin))
    src = open(a.source).read().splitlines()
    per_line, why, executed = collections.Counter(), collections.defaultdict(collections.Counter), collections.Counter()
    region, regions = "setup", collections.defaultdict(collections.Counter)
    for off, sass, n, stalls, ex in instructions(a.csv):
        line = where.get(off)
        per_line[line] += n
        executed[line] += ex
        why[line].update(stalls)
        if a.body and line is not None and line >= a.body[0]:
            region = "setup" if line < a.body[1] else "producer" if line < a.body[2] else "consumer"
        regions[region].update(stalls)
        regions[region]["(samples)"] += n
        regions[region]["(HGMMA executed)"] += ex if "HGMMA" in sass else 0
    total = sum(per_line.values())
    print(f"{total} samples, {sum(executed.values())} warp instructions executed")
    for line, n in per_line.most_common(a.top):
        top = ", ".join(f"{k} {v}" for k, v in why[line].most_common(3) if v)
        text = src[line - 1].strip()[:90] if line and line <= len(src) else "(no such line in the source)"
        print(f"{n:7d} {100 * n / max(1, total):5.1f}%  inst {executed[line]:10d}  L{line}: {text}   [{top}]")
    if a.body:
        for name in ("setup", "producer", "consumer"):
            r = regions[name]
            n = r.pop("(samples)", 0)
            gmma = r.pop("(HGMMA executed)", 0)
            share = ", ".join(f"{k} {100 * v / max(1, n):.1f}%" for k, v in r.most_common(8) if v)
            print(f"{name:9s} {n:7d} samples ({100 * n / max(1, total):4.1f}%), HGMMA executed {gmma}: {share}")


if __name__ == "__main__":
    main()
