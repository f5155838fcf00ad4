"""cuflash's attention backward as a C++ autograd node (node.cpp), used where it can be built;
``CUFLASH_CPP_NODE=0`` (or ``false``, ``off``, ``no``) turns it off.

An eager call that needs gradients would otherwise record a Python ``torch.autograd.Function``
node, whose backward the autograd engine runs through the Python interpreter (tens of µs of
host time per call). With the C++ node, the forward still runs in Python and the backward runs
in C++: it fills the backward's prepared launches (the kernels, their parameter structs and
grids, made by the first call of a layout) with the call's pointers and launches them, calling
the Python backward only for what the prepared launches do not cover. SDPA's calls with cuflash
active also run their forward in C++ (node.cpp's ``fast_forward``, :func:`keep_forward`).

The node is built from node.cpp by ``torch.utils.cpp_extension`` (a C++ compiler and ninja;
about 30 s, once per PyTorch version, Python version and machine type, kept under cuflash's
cache directory in ``torch-node/``; later processes import the built library without a
compiler), at the second call of a layout that needs gradients, or ahead by ``python -m cuflash
warmup``; where it cannot be built the Python node stays, and :func:`why_not` says why.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from cuflash import compiler
from cuflash.plan import on_forget_plans
from cuflash.kernels import fwd_ws

ROLES = ("q", "k", "v", "dout", "out", "lse", "dq", "dk", "dv", "ws", "counter")  # node.cpp's Role order
_SOURCE = Path(__file__).with_name("node.cpp")
_state: dict = {}  # "module": the built extension or None; "why": why there is none
_lock = threading.Lock()
STALE_LOCK_S = 600  # a build lock older than this was left by a killed build (a build takes about 30 s)


def enabled() -> bool:
    """Whether calls may take the C++ node: unless ``CUFLASH_CPP_NODE`` is 0, false, off or no."""
    return os.environ.get("CUFLASH_CPP_NODE", "1").strip().lower() not in ("0", "false", "off", "no")


def module():
    """The extension, or None (then :func:`why_not` says why): imported where it was built,
    else built (about 30 s) on first use."""
    if "module" not in _state:
        with _lock:
            if "module" not in _state:
                mod, _state["why"] = _load()
                if mod is not None:  # (fast_forward's layouts are derived from plans)
                    on_forget_plans(mod.fast_clear)
                _state["module"] = mod
    return _state["module"]


def why_not() -> str | None:
    """Why the C++ node is not in use, or None where it is (imports or builds it: see module)."""
    if not enabled():
        return f"turned off (CUFLASH_CPP_NODE={os.environ.get('CUFLASH_CPP_NODE')})"
    module()
    return _state["why"]


def _load():
    """(module, None) or (None, why)."""
    try:
        problem = compiler.cache_dir_problem()
        if problem:
            return None, f"cuflash's cache directory {compiler.cache_dir()} is refused: {problem}"
        key = hashlib.sha256(_SOURCE.read_bytes() + torch.__version__.encode() + sys.version.encode()
                             + platform.machine().encode()).hexdigest()[:16]
        name = f"cuflash_node_{key}"
        where = compiler.cache_dir() / "torch-node" / key
        where.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # (as the cache directory: this user's alone)
        where.mkdir(mode=0o700, exist_ok=True)
        for d in (where.parent, where):
            why = compiler._untrusted(os.stat(d))
            if why:
                return None, f"{d} is refused: {why}"
        from torch.utils import cpp_extension
        built, lock = where / f"{name}.so", where / "lock"  # (the lock: torch's, while it builds)
        os_lock = getattr(cpp_extension, "FileLock", None)  # newer PyTorch: a lock the OS releases with its holder
        if os_lock is None:  # older PyTorch: a lock file whose existence blocks, left behind by a killed build
            try:
                lock_age = time.time() - lock.stat().st_mtime
            except FileNotFoundError:
                lock_age = None
            if lock_age is not None and lock_age > STALE_LOCK_S:  # (torch would wait on it without end)
                lock.unlink(missing_ok=True)
                lock_age = None
        if built.exists() and not compiler._untrusted(os.stat(built)):
            if os_lock is not None:
                with os_lock(str(lock)):  # (waits for a build under way)
                    mod = _import(name, built)
            else:
                mod = None if lock_age is not None else _import(name, built)  # (a build under way: load waits)
            if mod is not None:
                return mod, None
        cpp_extension.verify_ninja_availability()
        print(f"cuflash: building the C++ autograd node in {where} (once per PyTorch and Python version, about 30 s; "
              "CUFLASH_CPP_NODE=0 turns it off)", file=sys.stderr, flush=True)
        return cpp_extension.load(name, sources=[str(_SOURCE)], extra_cflags=["-O3"], build_directory=str(where),
                                  verbose=False), None
    except Exception as e:  # no compiler, no ninja, no headers, an unreadable directory: the Python node stays
        return None, f"the C++ node could not be loaded or built: {type(e).__name__}: {str(e).strip()[-400:]}"


def _import(name, path):
    """The built extension at ``path``, imported as it is (no compiler, ninja or build), or None
    where it cannot be (a build cut short)."""
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    except ImportError:
        return None


def program_for(bwd, strides):
    """:func:`program` where the C++ node is on and built, else None (a failure to make it is
    warned about, and the call keeps the Python node). The gradients are allocated
    as ``bwd`` allocates them (contiguous) or as the Python backward gives them to it (like
    their inputs: SDPA's layout)."""
    try:
        if not enabled() or module() is None:
            return None
        return program(bwd, strides, bwd.allocate)
    except Exception as e:  # (a bug: said once, and this layout keeps the Python node)
        warnings.warn(f"cuflash: the C++ node's program for a layout could not be made ({type(e).__name__}: {e}); "
                      "that layout keeps the Python node", RuntimeWarning, stacklevel=2)
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
            patches.append(_map_patch(offset, x.role, x.shape, x.strides, x.dtype, x.rows))
        launches.append((la.kernel.ptr, tuple(la.grid), tuple(la.block), la.smem,
                         la.kernel.layout.pack(*la.values), patches))
    return module().make_program(launches, bwd.ws_floats, list(contiguous), [list(s) for s in strides])


def _map_patch(offset, role, shape, strides, dtype, rows):
    """node.cpp's patch of a tensor-map field (see ``parse_launch``): encoded when the launch fires
    with fwd_ws.tensor_map's arguments for role's pointer."""
    code, dims, byte_strides, box, elem, l2 = fwd_ws._encode_args(tuple(shape), tuple(strides), dtype, rows, 256)
    return (offset, ROLES.index(role), code, len(dims), list(dims), list(byte_strides), list(box), list(elem), l2)


def keep_forward(p, q, k, v) -> bool | None:
    """Hands an SDPA call's prepared forward and backward (``p``, an ops._Prepared whose C++
    backward program exists) to node.cpp's ``fast_forward``, which then runs the forwards of calls
    on q, k, v's layout with ``p``'s options in C++, the output's history recorded with the C++
    node; whether it could (not for the prepared forwards that :func:`forward_launch` does not
    cover), None where ``p`` has no prepared forward yet. Forgotten with the plans
    (cuflash.plan.forget_plans), and when node.cpp's table is full (``p.fast`` is then None again)."""
    if p.fwd is None:  # (the layout's forward has not been prepared yet: later)
        return None
    launch = forward_launch(p.fwd)
    if launch is None or not p.program:
        return False
    module().fast_keep(launch[0], launch[1], q, k, v, p.causal, p.scale, p.deterministic, list(p.fwd.lse_shape),
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
        patches.append(_map_patch(table.offset(name), role, shape, strides, dtype, rows))
    patches += [(table.offset("o"), ROLES.index("out"), 0), (table.offset("lse"), ROLES.index("lse"), 0)]
    persistent = r.tiles is not None
    if persistent:  # (the recipe's last field, 0 until a stream's counter is given)
        patches.append((table.offset("tile_counter"), ROLES.index("counter"), 0))
    blank = bytes(fwd_ws.TENSOR_MAP_BYTES)
    params = r.kernel.layout.pack(blank, blank, blank, 0, 0, *r.mid)
    early = compiler._PROGRAMMATIC_STREAM_SERIALIZATION if r.early else 0
    return (r.kernel.ptr, tuple(r.grid), tuple(r.block), r.smem, params, patches, early), persistent
