"""cuflash's attention backward as a C++ autograd node (node.cpp), used where it can be built;
``CUFLASH_CPP_NODE=0`` turns it off.

An eager call that needs gradients would otherwise record a Python ``torch.autograd.Function``
node, whose backward the autograd engine runs through the Python interpreter (tens of µs of
host time per call). With the C++ node, the forward still runs in Python and the backward runs
in C++: it fills the backward's prepared launches (the kernels, their parameter structs and
grids, made by the first call of a layout) with the call's pointers and launches them, calling
the Python backward only for what the prepared launches do not cover. The node is built from
node.cpp by ``torch.utils.cpp_extension`` (a C++ compiler and ninja; about 30 s, once per
PyTorch and Python version, kept under cuflash's cache directory; ``python -m cuflash warmup``
builds it ahead), at the second call of a layout that needs gradients; where it cannot be built
the Python node stays, and :func:`why_not` says why.
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import torch

from cuflash import compiler, plan
from cuflash.kernels import fwd_ws

ROLES = ("q", "k", "v", "dout", "out", "lse", "dq", "dk", "dv", "ws", "counter")  # node.cpp's Role order
_SOURCE = Path(__file__).with_name("node.cpp")
_state: dict = {}  # "module": the built extension or None; "why": why there is none


def enabled() -> bool:
    """Whether calls may take the C++ node: unless ``CUFLASH_CPP_NODE=0``."""
    return os.environ.get("CUFLASH_CPP_NODE", "1") != "0"


def module():
    """The built extension, or None (then :func:`why_not` says why). Builds it on first use."""
    if "module" not in _state:
        _state["module"], _state["why"] = _build()
    return _state["module"]


def why_not() -> str | None:
    """Why the C++ node is not in use, or None where it is."""
    if not enabled():
        return "turned off (CUFLASH_CPP_NODE=0)"
    module()
    return _state["why"]


def _build():
    problem = compiler.cache_dir_problem()
    if problem:
        return None, f"cuflash's cache directory {compiler.cache_dir()} is refused: {problem}"
    src = _SOURCE.read_bytes()
    key = hashlib.sha256(src + torch.__version__.encode() + sys.version.encode()).hexdigest()[:16]
    where = compiler.cache_dir() / "torch-node" / key
    failed = where / "failed.txt"  # a failed build's reason: later processes do not try again
    if failed.exists():
        return None, f"{failed.read_text().strip()} (remove {failed} to build again)"
    try:
        where.mkdir(mode=0o700, parents=True, exist_ok=True)
        from torch.utils.cpp_extension import load
        if not (where / f"cuflash_node_{key}.so").exists():
            print(f"cuflash: building the C++ autograd node in {where} (once per PyTorch and Python version, "
                  "about 30 s; CUFLASH_CPP_NODE=0 turns it off)", file=sys.stderr, flush=True)
        return load(f"cuflash_node_{key}", sources=[str(_SOURCE)], extra_cflags=["-O3"],
                    build_directory=str(where), verbose=False), None
    except Exception as e:  # no compiler, no ninja, no headers: the Python node stays
        why = f"building {_SOURCE.name} failed: {type(e).__name__}: {str(e).strip()[-400:]}"
        try:
            failed.write_text(why + "\n")
        except OSError:
            pass
        return None, why


def program_for(bwd, strides):
    """:func:`program` where the C++ node is asked for and built, else None (a failure to make
    it goes to :func:`why_not`, and the call keeps the Python node). The gradients are allocated
    as ``bwd`` allocates them (contiguous) or as the Python backward gives them to it (like
    their inputs: SDPA's layout)."""
    if not enabled() or module() is None:
        return None
    try:
        return program(bwd, strides, bwd.allocate)
    except Exception as e:
        _state["why"] = f"making a program failed: {type(e).__name__}: {e}"
        return None


def program(bwd, strides, contiguous):
    """node.cpp's Program for a prepared backward ``bwd`` (cuflash.backward's repeat object, whose
    launches take pointers by role), made for saved (q, k, v, out, lse) of ``strides`` and
    allocating the gradient of q, k, v contiguous where ``contiguous`` says so (else like its
    input). None where a launch needs a role the node does not fill (packed sequences, FlashMask).
    The program holds the kernels' CUfunction handles; each node that holds it also holds the
    Python backward (its fallback), and so ``bwd`` and its kernels' modules, which stay loaded."""
    from cuflash.backward import _Map, _Ptr
    launches = []
    for la in bwd.launches:
        table = la.kernel.table
        patches = []
        for i, x in la.slots:
            if x.role not in ROLES:
                return None
            offset = table.offset(table.names[i])
            if x.__class__ is _Ptr:
                assert table.fields[i][1].endswith("*"), (table.struct_name, table.names[i])  # 8 bytes written
                patches.append((offset, ROLES.index(x.role), x.offset))
                continue
            assert x.__class__ is _Map
            code, dims, byte_strides, box, elem, l2 = fwd_ws._encode_args(
                tuple(x.shape), tuple(x.strides), x.dtype, x.rows, 256)  # fwd_ws.tensor_map's arguments
            patches.append((offset, ROLES.index(x.role), code, len(dims), list(dims), list(byte_strides), list(box),
                            list(elem), l2))
        launches.append((la.kernel.ptr, tuple(la.grid), tuple(la.block), la.smem,
                         la.kernel.layout.pack(*la.values), patches))
    return module().make_program(launches, bwd.ws_floats, list(contiguous), [list(s) for s in strides])


def keep_forward(p, q, k, v) -> bool:
    """Hands an SDPA call's prepared forward and backward (``p``, an ops._Prepared whose C++
    backward program exists) to node.cpp's ``fast_forward``, which then runs the forwards of calls
    on q, k, v's layout with ``p``'s options in C++, the output's history recorded with the C++
    node; whether it could (not for the prepared forwards that :func:`forward_launch` does not
    cover). Forgotten with the plans (cuflash.plan.forget_plans)."""
    launch = forward_launch(p.fwd)
    if launch is None or not p.program:
        return False
    m = module()
    if not _state.get("forgets"):
        plan.on_forget_plans(m.fast_clear)
        _state["forgets"] = True
    m.fast_keep(launch[0], launch[1], q, k, v, p.causal, p.scale, p.deterministic, list(p.fwd.lse_shape),
                p.program, p.fallback, p)
    return True


def forward_launch(rep):
    """(launch, persistent): node.cpp's launch (see ``parse_launch``) of a prepared forward
    (cuflash.api's repeat object) of one fwd_ws kernel, whose tensor maps, output, LSE and (where
    ``persistent``) tile counter are filled in per call; None for the forwards it does not cover:
    split-KV, FlashMask, gathered pages, packed sequences, no LSE, the mma.sync kernels."""
    r = rep.recipe
    if (r.maps is None or r.split or r.prep is not None or rep.packed is not None or rep.fm_ints
            or rep.lse_shape is None or r.maps[2] is None):
        return None
    dtype, *maps = r.maps
    table = r.kernel.table
    patches = []
    for name, role, (shape, strides, rows) in zip(("tma_q", "tma_k", "tma_v"), ("q", "k", "v"), maps):
        code, dims, byte_strides, box, elem, l2 = fwd_ws._encode_args(tuple(shape), tuple(strides), dtype, rows, 256)
        patches.append((table.offset(name), ROLES.index(role), code, len(dims), list(dims), list(byte_strides),
                        list(box), list(elem), l2))
    patches += [(table.offset("o"), ROLES.index("out"), 0), (table.offset("lse"), ROLES.index("lse"), 0)]
    persistent = r.tiles is not None
    if persistent:  # (the recipe's last field, 0 until a stream's counter is given)
        patches.append((table.offset("tile_counter"), ROLES.index("counter"), 0))
    blank = bytes(fwd_ws.TENSOR_MAP_BYTES)
    params = r.kernel.layout.pack(blank, blank, blank, 0, 0, *r.mid)
    early = compiler._PROGRAMMATIC_STREAM_SERIALIZATION if r.early else 0
    return (r.kernel.ptr, tuple(r.grid), tuple(r.block), r.smem, params, patches, early), persistent
