"""The C++ autograd node of cuflash.torch (cuflash/torch/node.cpp; on unless CUFLASH_CPP_NODE=0).

CPU tests build the extension (they skip where it cannot be built: no PyTorch, C++ compiler or
ninja) and check the node's bookkeeping with a program of no launches on CPU tensors: the history
it records, its gradients' layouts, when it calls the Python backward instead, saved-tensor hooks,
the graph's release; and the program that node.py makes from a prepared backward. GPU tests
compare its gradients with the Python node's, bit for bit.
"""
import pytest

pytest.importorskip("torch", reason="needs PyTorch (optional dependency)")

from conftest import requires_gpu  # noqa: E402

import torch  # noqa: E402


@pytest.fixture(scope="module")
def ext():
    from cuflash.torch import node
    m = node.module()
    if m is None:
        pytest.skip(f"the C++ node cannot be built here: {node._state['why']}")
    return m


def _operands(sq=6, sk=5, h=2, d=8, strided_q=False):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, h, sq, d, generator=g).transpose(1, 2) if strided_q else torch.randn(1, sq, h, d, generator=g)
    k, v = (torch.randn(1, sk, h, d, generator=g) for _ in range(2))
    for x in (q, k, v):
        x.requires_grad_()
    out, lse = torch.randn(1, sq, h, d, generator=g), torch.zeros(1, h, sq)
    return q, k, v, out, lse


def _strides(*xs):
    return [list(x.stride()) for x in xs]


class _Fallback:
    """A Python backward that records its calls and returns gradients of ones."""
    def __init__(self):
        self.calls = []

    def __call__(self, dout, q, k, v, out, lse):
        self.calls.append((dout, q, k, v, out, lse, torch.is_grad_enabled()))
        return tuple(torch.ones_like(x) for x in (q, k, v))


def test_node_records_the_output_history_and_runs_its_program(ext):
    q, k, v, out, lse = _operands(strided_q=True)
    fb = _Fallback()
    prog = ext.make_program([], 16, [True, False, True], _strides(q, k, v, out, lse))
    ext.attach(q, k, v, out, lse, prog, fb)
    assert out.requires_grad and out.grad_fn.name() == "CuflashAttentionBackward" and not lse.requires_grad
    assert [e[0] is not None for e in out.grad_fn.next_functions] == [True] * 3  # q, k, v's accumulators
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert not fb.calls
    # no launches: the gradients are the node's allocations, contiguous where the program says so
    assert dq.shape == q.shape and dq.is_contiguous() and not q.is_contiguous()
    assert dk.shape == k.shape and dv.shape == v.shape and dk.stride() == k.stride()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))


def test_node_calls_the_python_backward_for_what_its_program_does_not_cover(ext):
    q, k, v, out, lse = _operands()
    fb = _Fallback()
    prog = ext.make_program([], 16, [True] * 3, _strides(q, k, v, out, lse))
    # an output gradient laid out otherwise than the output
    ext.attach(q, k, v, out, lse, prog, fb)
    dout = torch.randn(1, 2, 6, 8).transpose(1, 2)
    got = torch.autograd.grad(out, (q, k, v), dout)
    assert len(fb.calls) == 1 and fb.calls[0][0].stride() == dout.stride() and not fb.calls[0][-1]
    assert all(torch.equal(g, torch.ones_like(x)) for g, x in zip(got, (q, k, v)))
    assert torch.equal(fb.calls[0][4], out)
    # create_graph=True: the Python backward, in grad mode
    out2 = out.detach().clone()
    ext.attach(q, k, v, out2, lse, prog, fb)
    torch.autograd.grad(out2, (q, k, v), torch.randn_like(out2), create_graph=True)
    assert len(fb.calls) == 2 and fb.calls[1][-1]
    # saved tensors given back with other strides (a saved-tensor hook's copies)
    out3 = out.detach().clone()
    with torch.autograd.graph.saved_tensors_hooks(lambda x: x.mT.contiguous().mT, lambda x: x):
        ext.attach(q, k, v, out3, lse, prog, fb)
    torch.autograd.grad(out3, (q, k, v), torch.randn_like(out3))
    assert len(fb.calls) == 3
    # a q with the program's strides at an address that is not 16-byte aligned
    q4 = torch.randn(q.numel() + 1)[1:].view(q.shape).requires_grad_()
    assert q4.stride() == q.stride() and q4.data_ptr() % 16
    out4 = out.detach().clone()
    ext.attach(q4, k, v, out4, lse, prog, fb)
    torch.autograd.grad(out4, (q4, k, v), torch.randn_like(out4))
    assert len(fb.calls) == 4


def test_node_keeps_saved_tensor_hooks(ext):
    """Saved tensors go through the default hooks (torch.autograd.graph.saved_tensors_hooks,
    as checkpointing and save_on_cpu use them): packed at attach, unpacked in the backward."""
    q, k, v, out, lse = _operands()
    fb = _Fallback()
    prog = ext.make_program([], 16, [True] * 3, _strides(q, k, v, out, lse))
    packed, unpacked = [], []

    def pack(x):
        packed.append(x.shape)
        return x

    def unpack(x):
        unpacked.append(x.shape)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        ext.attach(q, k, v, out, lse, prog, fb)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert len(packed) == len(unpacked) == 5 and not fb.calls


@pytest.mark.parametrize("check", ["default", "none"])
def test_checkpoint_recompute_may_switch_to_the_node(ext, monkeypatch, check):
    """A layout switches to the C++ node at its first forward after its first backward, which a
    non-reentrant checkpoint's recompute can be (two checkpointed layers of one layout): the node
    saves q, k, v, out, lse in the Python node's order, so the recompute matches the forward's
    saved tensors one to one (determinism check) and the backward gets out and lse in place."""
    import types
    from torch.utils.checkpoint import checkpoint
    from cuflash.torch import ops
    monkeypatch.setenv("CUFLASH_CPP_NODE", "1")
    p = ops._Prepared(True, None, (-1, -1), 0.0, False)
    p.fwd = lambda q, k, v, o: (q.detach() * 2, torch.zeros(q.shape[0], q.shape[2], q.shape[1]))
    seen = []

    def bwd(p_, dout, q, k, v, out, lse):
        seen.append((tuple(out.shape), tuple(lse.shape)))
        p_.bwd = types.SimpleNamespace(allocate=(True,) * 3)
        p_.bwd_strides = [x.stride() for x in (q, k, v, out, lse)]
        return tuple(torch.ones_like(x) for x in (q, k, v))
    monkeypatch.setattr(ops, "_prepared_backward", bwd)
    monkeypatch.setattr(ops._node, "program", lambda b, strides, contiguous: ext.make_program(
        [], 16, list(contiguous), [list(st) for st in strides]))

    def layer(x):
        return ops._prepared_apply(x, x * 1, x * 1, p)[0]
    x = torch.randn(1, 6, 2, 8, requires_grad=True)
    y = checkpoint(layer, x, use_reentrant=False, determinism_check=check)
    checkpoint(layer, y, use_reentrant=False, determinism_check=check).sum().backward()
    assert seen and all(s == ((1, 6, 2, 8), (1, 2, 6)) for s in seen)



@pytest.mark.parametrize("launch, what", [
    ((1, (1, 1, 1), (32, 1, 1), 0, b"\0" * 16, [(12, 0, 0)]), "pointer field out of the struct"),
    ((1, (1, 1, 1), (32, 1, 1), 0, b"\0" * 16, [(0, 99, 0)]), "unknown role"),
    ((1, (1, 1, 1), (32, 1, 1), 0, b"\0" * 256, [(8, 0, 9, 4, [1] * 4, [1] * 3, [1] * 4, [1] * 4, 3)]),
     "tensor map field out of the struct, misaligned"),
    ((1, (1, 1), (32, 1, 1), 0, b"", []), "grid and block are 3-tuples"),
    ((1, (1, 1, 1), (32, 1, 1), 0, b"\0" * 2048, []), "parameter struct of 2048 bytes"),
])
def test_make_program_checks_its_launches(ext, launch, what):
    with pytest.raises(RuntimeError, match=what):
        ext.make_program([launch], 0, [True] * 3, [[1]] * 5)


def test_program_from_a_prepared_backward(monkeypatch):
    """node.program: each launch's struct with its blank fields, the pointer fields' offsets,
    roles and byte offsets, and the tensor maps' driver arguments; None for a role the node
    does not fill."""
    from types import SimpleNamespace
    from cuflash.backward import _Map, _Ptr
    from cuflash.kernels import fwd_ws
    from cuflash.kernels.params import TENSOR_MAP_BYTES, ParamTable
    from cuflash.torch import node
    table = ParamTable("P", (("n", "int"), ("dout", "const void*"), ("map_q", "CUtensorMap"), ("lse", "float*")))
    kernel = SimpleNamespace(table=table, layout=table.layout, ptr=0xABC)
    q_map = _Map("q", (2, 256, 8, 64), (131072, 512, 64, 1), 64, "bf16")
    la = SimpleNamespace(kernel=kernel, grid=(4, 8, 2), block=(384, 1, 1), smem=1000,
                         values=(7, 0, bytes(TENSOR_MAP_BYTES), 0), slots=((1, _Ptr("dout")), (2, q_map),
                                                                            (3, _Ptr("lse", 256))))
    made = []
    monkeypatch.setattr(node, "module", lambda: SimpleNamespace(make_program=lambda *a: made.append(a) or "P"))
    bwd = SimpleNamespace(launches=(la,), ws_floats=99)
    assert node.program(bwd, [(1,)] * 5, (True, True, False)) == "P"
    (launches, ws, contiguous, strides), = made
    assert ws == 99 and contiguous == [True, True, False] and strides == [[1]] * 5
    (fn, grid, block, smem, params, patches), = launches
    assert (fn, grid, block, smem) == (0xABC, (4, 8, 2), (384, 1, 1), 1000) and params == table.layout.pack(*la.values)
    code, dims, byte_strides, box, elem, l2 = fwd_ws._encode_args(q_map.shape, q_map.strides, "bf16", 64, 256)
    assert patches == [(table.offset("dout"), node.ROLES.index("dout"), 0),
                       (table.offset("map_q"), node.ROLES.index("q"), code, 4, list(dims), list(byte_strides),
                        list(box), list(elem), l2),
                       (table.offset("lse"), node.ROLES.index("lse"), 256)]
    assert table.offset("map_q") % 64 == 0
    la.slots += ((1, _Ptr("cu_q")),)
    assert node.program(bwd, [(1,)] * 5, (True,) * 3) is None


def _attention_node(out):
    """The name of the attention's node in ``out``'s graph (SDPA adds transposes around it)."""
    fn = out.grad_fn
    while fn is not None and "Attention" not in fn.name():
        fn = fn.next_functions[0][0]
    return None if fn is None else fn.name()


@requires_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("sq,sk,h,hk,d,causal", [(256, 256, 8, 2, 128, True), (113, 203, 4, 4, 64, False)])
@pytest.mark.parametrize("sdpa", [False, True])
def test_gpu_node_matches_the_python_node(monkeypatch, dtype, sq, sk, h, hk, d, causal, sdpa):
    """Five steps with the C++ node (the first makes the prepared launches and the Python node
    runs it; the others run the C++ node; through SDPA, from the third on node.cpp's fast_forward
    runs the forward too, where it covers the layout's kernel) against the same with the Python
    node: outputs and gradients bitwise equal (deterministic=True), through cuflash.torch.attention
    and through SDPA with cuflash active (dQ there within its atomic adds' reordering)."""
    import cuflash.torch as ct
    import cuflash.torch.sdpa as s
    from cuflash.plan import forget_plans
    from cuflash.torch import node
    if node.module() is None:
        pytest.skip(f"the C++ node cannot be built here: {node._state['why']}")
    dt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(sq + sk)
    shapes = ((2, sq, h, d), (2, sk, hk, d), (2, sk, hk, d))
    leaves = [torch.randn(*x, device="cuda", dtype=dt, generator=g) for x in shapes]
    dout = torch.randn(2, sq, h, d, device="cuda", dtype=dt, generator=g)

    eager = s._eager
    eager_calls = []
    monkeypatch.setattr(s, "_eager", lambda *a: eager_calls.append(1) or eager(*a))

    def steps(cpp):
        monkeypatch.setenv("CUFLASH_CPP_NODE", "1" if cpp else "0")
        forget_plans()
        eager_calls.clear()
        res = []
        for _ in range(5):
            q, k, v = (x.clone().requires_grad_() for x in leaves)
            if sdpa:
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                       enable_gqa=h != hk).transpose(1, 2)
            else:
                out = ct.attention(q, k, v, causal=causal, deterministic=True)
            res.append((_attention_node(out), out.detach(), *torch.autograd.grad(out, (q, k, v), dout)))
        return res

    if sdpa:
        s.activate_sdpa()
    try:
        python = steps(False)
        assert len(eager_calls) == (5 if sdpa else 0)
        cpp = steps(True)
        fast = [(p.fast, node.forward_launch(p.fwd) is not None) for p in s._served.values() if p is not None]
    finally:
        if sdpa:
            s.restore_sdpa()
        forget_plans()
    assert [r[0] for r in python] == ["_PreparedAttentionBackward"] * 5
    assert [r[0] for r in cpp] == ["_PreparedAttentionBackward"] + ["CuflashAttentionBackward"] * 4
    if sdpa:  # one layout; its forwards in C++ from the third call where node.forward_launch covers it
        (kept, covered), = fast
        assert kept == covered and len(eager_calls) == (2 if kept else 5)
    for a, b in zip(python, cpp):  # (out, dq, dk, dv); SDPA's dQ adds are atomic, in any order
        assert torch.equal(a[1], b[1]) and torch.equal(a[3], b[3]) and torch.equal(a[4], b[4])
        assert torch.equal(a[2], b[2]) if not sdpa else (
            (a[2].float() - b[2].float()).abs().max() <= 1e-2 * b[2].float().abs().max())


def test_prepared_calls_take_the_node_once_asked_for(ext, monkeypatch):
    """ops._prepared_apply: the Python node until the layout's backward is prepared or with
    CUFLASH_CPP_NODE=0; the C++ node after, except under forward-mode AD (whose tangents it would
    drop) and with compiled autograd on. The prepared launches are stand-ins here."""
    import sys
    import types
    from torch.autograd import forward_ad
    from cuflash.torch import ops
    q, k, v, out, lse = _operands()

    def fwd(q, k, v, o):
        return torch.randn(q.shape), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    def node_name(p):
        res, _ = ops._prepared_apply(q, k, v, p)
        return res.grad_fn.name()

    p = ops._Prepared(True, None, (-1, -1), 0.0, False)
    p.fwd = fwd
    monkeypatch.setenv("CUFLASH_CPP_NODE", "1")
    assert node_name(p) == "_PreparedAttentionBackward" and p.program is None  # no backward prepared yet
    monkeypatch.setattr(ops._node, "program", lambda bwd, strides, contiguous: ext.make_program(
        [], 16, list(contiguous), [list(s) for s in strides]))
    p.bwd, p.bwd_strides = types.SimpleNamespace(allocate=(True,) * 3), [x.stride() for x in (q, k, v, out, lse)]
    assert node_name(p) == "CuflashAttentionBackward" and p.program
    with forward_ad.dual_level():
        assert node_name(p) == "_PreparedAttentionBackward"
    monkeypatch.setitem(sys.modules, "torch._dynamo.compiled_autograd",
                        types.SimpleNamespace(compiled_autograd_enabled=True))
    assert node_name(p) == "_PreparedAttentionBackward"
    monkeypatch.delitem(sys.modules, "torch._dynamo.compiled_autograd")
    assert node_name(p) == "CuflashAttentionBackward"
    p2 = ops._Prepared(True, None, (-1, -1), 0.0, False)
    p2.fwd, p2.bwd, p2.bwd_strides = fwd, p.bwd, p.bwd_strides
    monkeypatch.setenv("CUFLASH_CPP_NODE", "0")
    assert node_name(p2) == "_PreparedAttentionBackward" and p2.program is False


def test_the_node_is_on_unless_turned_off(monkeypatch):
    from cuflash.torch import node
    monkeypatch.delenv("CUFLASH_CPP_NODE", raising=False)
    assert node.enabled()
    for off in ("0", "false", "Off", " no "):
        monkeypatch.setenv("CUFLASH_CPP_NODE", off)
        assert not node.enabled() and node.why_not() == f"turned off (CUFLASH_CPP_NODE={off})"
    monkeypatch.setenv("CUFLASH_CPP_NODE", "1")
    assert node.enabled()


def test_a_failed_build_keeps_the_python_node(monkeypatch, tmp_path):
    """A source that does not compile: no module, and why; nothing is remembered (a later
    process tries again)."""
    from cuflash.torch import node
    bad = tmp_path / "node.cpp"
    bad.write_text("#error this source does not compile\n")
    monkeypatch.setattr(node, "_SOURCE", bad)
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path / "cache"))
    module, why = node._load()
    assert module is None and why.startswith("the C++ node could not be loaded or built")
    assert [p.name for p in (tmp_path / "cache" / "torch-node").iterdir()]  # its build directory
    assert not list((tmp_path / "cache").rglob("*.so"))


@pytest.mark.parametrize("os_lock", [True, False])
def test_a_built_node_is_imported_without_a_compiler(ext, monkeypatch, tmp_path, os_lock):
    """Once built, a process imports the library as it is: no ninja or compiler; with PyTorch's
    newer build lock (the OS's) under it, with the older one (a file) where none is there."""
    import shutil
    from pathlib import Path
    from torch.utils import cpp_extension
    from cuflash.torch import node

    def refuse(*a, **k):
        raise AssertionError("built again")
    monkeypatch.setattr(cpp_extension, "load", refuse)
    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", refuse)
    if not os_lock:
        monkeypatch.delattr(cpp_extension, "FileLock", raising=False)
        built = Path(ext.__file__)  # the library alone in another cache: no lock file beside it
        where = tmp_path / "torch-node" / built.parent.name
        where.mkdir(parents=True, mode=0o700)
        (tmp_path / "torch-node").chmod(0o700)
        shutil.copy(built, where / built.name)
        monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path))
    module, why = node._load()
    assert why is None and hasattr(module, "fast_forward")


def test_a_stale_build_lock_is_removed(monkeypatch, tmp_path):
    """With PyTorch's older build lock (a file whose existence blocks), one left by a killed
    build (older than STALE_LOCK_S) is removed before building: torch would wait on it without
    end. A fresh one stays (a build under way)."""
    import os
    from torch.utils import cpp_extension
    from cuflash.torch import node
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delattr(cpp_extension, "FileLock", raising=False)
    seen = []
    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", lambda: None)
    monkeypatch.setattr(cpp_extension, "load", lambda name, build_directory, **k: seen.append(
        os.path.exists(os.path.join(build_directory, "lock"))) or "built")
    node._load()  # makes the build directory
    (lock,) = [d / "lock" for d in (tmp_path / "cache" / "torch-node").iterdir()]
    lock.touch()
    assert node._load() == ("built", None) and seen[-1]
    old = lock.stat().st_mtime - node.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    assert node._load() == ("built", None) and not seen[-1] and not lock.exists()


def test_fast_forward_leaves_other_calls_to_python(ext):
    """node.cpp's fast_forward (SDPA's forward in C++) answers None, for the Python path, where no
    gradient is wanted, for tensors that are not CUDA tensors, and for a layout it was not given;
    it was given none here."""
    q, k, v, _, _ = _operands()
    assert ext.fast_forward(q, k, v, True, None) is None
    with torch.no_grad():
        assert ext.fast_forward(q, k, v, True, 0.5) is None
    ext.fast_clear()


def _prepared_forward_stand_in():
    """A stand-in of cuflash.api's repeat object of a persistent fwd_ws forward (never launched)."""
    from types import SimpleNamespace
    from cuflash.kernels.params import ParamTable
    table = ParamTable("P", (("tma_q", "CUtensorMap"), ("tma_k", "CUtensorMap"), ("tma_v", "CUtensorMap"),
                             ("o", "void*"), ("lse", "float*"), ("n", "int"), ("tile_counter", "int*")))
    kernel = SimpleNamespace(table=table, layout=table.layout, ptr=0xABC)
    mq = ((2, 256, 8, 64), (131072, 512, 64, 1), 128)
    mk = ((2, 256, 2, 64), (32768, 128, 64, 1), 128)
    r = SimpleNamespace(maps=("bf16", mq, mk, mk), split=False, prep=None, kernel=kernel, grid=(132, 1, 1),
                        block=(384, 1, 1), smem=1000, mid=(7, 0), early=True, tiles=(16, 1, 1))
    return SimpleNamespace(recipe=r, packed=None, fm_ints=0, lse_shape=(2, 8, 256))


def test_keep_forward_hands_a_layout_over(ext):
    """node.keep_forward gives node.cpp the layout's forward launch and backward program (False
    without a program or for a forward it does not cover); forget_plans drops what it holds."""
    from cuflash.plan import forget_plans
    from cuflash.torch import node, ops
    q, k, v, out, lse = _operands()
    p = ops._Prepared(True, None, (-1, -1), 0.0, False, sdpa=True)
    p.fwd, p.program = _prepared_forward_stand_in(), False
    assert node.keep_forward(p, q, k, v) is False
    p.program, p.fallback = ext.make_program([], 16, [False] * 3, _strides(q, k, v, out, lse)), _Fallback()
    assert node.keep_forward(p, q, k, v) is True
    forget_plans()
    p.fwd.recipe.split = True
    assert node.keep_forward(p, q, k, v) is False


def test_a_full_table_hands_its_layouts_back(ext):
    """node.cpp keeps 64 layouts; the 65th empties the table and sets each dropped layout's
    ``fast`` to None, so that its next call hands it over again."""
    from cuflash.plan import forget_plans
    from cuflash.torch import node, ops
    q, k, v, out, lse = _operands()
    forget_plans()
    kept = []
    for _ in range(65):
        p = ops._Prepared(True, None, (-1, -1), 0.0, False, sdpa=True)
        p.fwd, p.fallback = _prepared_forward_stand_in(), _Fallback()
        p.program = ext.make_program([], 16, [False] * 3, _strides(q, k, v, out, lse))
        p.fast = node.keep_forward(p, q, k, v)
        kept.append(p)
    assert [p.fast for p in kept] == [None] * 64 + [True]
    forget_plans()
    p = ops._Prepared(True, None, (-1, -1), 0.0, False, sdpa=True)
    assert node.keep_forward(p, q, k, v) is None  # no prepared forward yet


def test_forward_launch_of_a_prepared_forward():
    """node.forward_launch: the fwd_ws launch's struct with blank maps, output, LSE and tile
    counter, their patches by role, the early-launch attribute; None for what it does not cover."""
    from types import SimpleNamespace
    from cuflash import compiler
    from cuflash.kernels import fwd_ws
    from cuflash.torch import node
    rep = _prepared_forward_stand_in()
    r = rep.recipe
    table = r.kernel.table
    (mq, mk, _) = r.maps[1:]
    (fn, grid, block, smem, params, patches, early), persistent = node.forward_launch(rep)
    assert (fn, grid, block, smem, persistent) == (0xABC, (132, 1, 1), (384, 1, 1), 1000, True)
    blank = bytes(fwd_ws.TENSOR_MAP_BYTES)
    assert params == table.layout.pack(blank, blank, blank, 0, 0, 7, 0)
    assert early == compiler._PROGRAMMATIC_STREAM_SERIALIZATION
    maps = [fwd_ws._encode_args(*m[:2], "bf16", m[2], 256) for m in (mq, mk, mk)]
    assert patches == [(table.offset(f), node.ROLES.index(role), code, 4, list(dims), list(st), list(box),
                        list(elem), l2) for f, role, (code, dims, st, box, elem, l2)
                       in zip(("tma_q", "tma_k", "tma_v"), "qkv", maps)] + [
        (table.offset("o"), node.ROLES.index("out"), 0), (table.offset("lse"), node.ROLES.index("lse"), 0),
        (table.offset("tile_counter"), node.ROLES.index("counter"), 0)]
    for other in (dict(split=True), dict(prep=("prep",)), dict(maps=None), dict(maps=("bf16", mq, None, None))):
        assert node.forward_launch(SimpleNamespace(recipe=SimpleNamespace(**{**vars(r), **other}), packed=None,
                                                   fm_ints=0, lse_shape=(2, 8, 256))) is None
    assert node.forward_launch(SimpleNamespace(recipe=r, packed=None, fm_ints=0, lse_shape=None)) is None


# ---------------------------------------------------------------------------------------------
# GPU: SDPA's forward in C++ (node.cpp's fast_forward) after the hand-over, in the settings a
# model meets: side streams, a CUDA graph capture, deterministic mode toggled, more layouts than
# its table holds, a second device.

def _sdpa_leaves(b, sq, sk, h, hk, d, seed, device="cuda"):
    """q, k, v as (batch, seqlen, nheads, d) leaves and an output gradient, bf16."""
    g = torch.Generator(device=device).manual_seed(seed)
    shapes = ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d))
    return [torch.randn(*x, device=device, dtype=torch.bfloat16, generator=g) for x in shapes]


def _sdpa_step(q, k, v, dout, causal=True):
    """One SDPA step on SDPA's views of (batch, seqlen, nheads, d) leaves: (out, dq, dk, dv)."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                           enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))


def _leaves_step(leaves, causal=True):
    q, k, v = (x.clone().requires_grad_() for x in leaves[:3])
    return _sdpa_step(q, k, v, leaves[3], causal)


def _same(a, b):
    """Bitwise equal out, dK and dV; dQ (atomic adds in any order) within 1% of its largest."""
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])
    assert (a[1].float() - b[1].float()).abs().max() <= 1e-2 * b[1].float().abs().max()


@pytest.fixture
def handed_over(monkeypatch):
    """SDPA active with the C++ node, one layout's forward handed to node.cpp (skips where its
    kernel is not covered): (leaves, the layout's ops._Prepared, the steps so far)."""
    import cuflash.torch.sdpa as s
    from cuflash.plan import forget_plans
    from cuflash.torch import node
    if node.module() is None:
        pytest.skip(f"the C++ node cannot be built here: {node._state['why']}")
    monkeypatch.setenv("CUFLASH_CPP_NODE", "1")
    forget_plans()
    s.activate_sdpa()
    leaves = _sdpa_leaves(2, 1024, 1024, 8, 2, 128, seed=5)
    steps = [_leaves_step(leaves) for _ in range(4)]
    p, = [x for x in s._served.values() if x is not None]
    if not p.fast:
        s.restore_sdpa()
        pytest.skip("this GPU's kernel for the layout is not one node.cpp's forward covers")
    yield leaves, p, steps
    s.restore_sdpa()
    forget_plans()


@requires_gpu
def test_gpu_fast_forward_on_a_side_stream(handed_over):
    """After the hand-over, a step on another stream (its own tile counter) gives the same results
    as on the default stream; so does the default stream afterwards."""
    leaves, p, steps = handed_over
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = [_leaves_step(leaves) for _ in range(2)]
    torch.cuda.current_stream().wait_stream(side)
    for r in on_side + [_leaves_step(leaves)]:
        _same(r, steps[-1])
    assert p.fast


@requires_gpu
def test_gpu_fast_forward_from_threads(handed_over):
    """After the hand-over, steps from four threads at once, each on a stream of its own (node.cpp
    queues the kernel without holding the GIL), give the results of the steps before."""
    import threading
    leaves, p, steps = handed_over
    results, errors = {}, []

    def run(i):
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.default_stream())
            with torch.cuda.stream(side):
                results[i] = [_leaves_step(leaves) for _ in range(3)]
            side.synchronize()
        except BaseException as e:  # (re-raised below, in the test's thread)
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for r in (x for i in range(4) for x in results[i]):
        _same(r, steps[-1])
    assert p.fast


@requires_gpu
def test_gpu_fast_forward_then_cuda_graph_capture(handed_over):
    """A layout handed over is captured in a CUDA graph (forward and backward; capture takes the
    Python path) and the graph's replays on new inputs match eager steps on them."""
    leaves, p, _ = handed_over
    static = [x.clone() for x in leaves]
    q, k, v = (x.requires_grad_() for x in static[:3])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (warm-up outside the capture, as PyTorch asks)
        _sdpa_step(q, k, v, static[3])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = _sdpa_step(q, k, v, static[3])
    for seed in (11, 12):
        new = _sdpa_leaves(2, 1024, 1024, 8, 2, 128, seed=seed)
        with torch.no_grad():
            for x, y in zip(static, new):
                x.copy_(y)
        graph.replay()
        torch.cuda.synchronize()
        _same(tuple(x.clone() for x in res), _leaves_step(new))
    assert p.fast


@requires_gpu
def test_gpu_fast_forward_with_deterministic_toggled(handed_over):
    """Deterministic mode switched on after the hand-over is another layout (its own backward
    kernel, dQ added in a fixed order: its steps bitwise equal, and close to the other's), and
    switched off again the handed-over layout's results come back."""
    leaves, p, steps = handed_over
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        det = [_leaves_step(leaves) for _ in range(4)]
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    for r in det[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r, det[0]))
    assert torch.equal(det[0][0], steps[-1][0])  # (the same forward; the backward is another kernel)
    for a, b in zip(det[0][1:], steps[-1][1:]):
        assert (a.float() - b.float()).abs().max() <= 1e-2 * b.float().abs().max()
    _same(_leaves_step(leaves), steps[-1])


@requires_gpu
def test_gpu_fast_forward_past_its_table(handed_over):
    """More layouts than node.cpp's table holds (64): each still matches PyTorch's own kernels,
    and the first layout, handed back and over again, keeps its results."""
    import cuflash.torch.sdpa as s
    leaves, p, steps = handed_over
    results = {}
    for i in range(70):  # (causal d = 64 layouts of one persistent fwd_ws kernel on an H100 or H200)
        n = 512 + 8 * i
        new = _sdpa_leaves(4, n, n, 16, 16, 64, seed=i)
        results[n] = (new, [_leaves_step(new) for _ in range(3)][-1])
    s.restore_sdpa()
    try:
        for n in (512, 512 + 8 * 35, 512 + 8 * 69):
            new, got = results[n]
            want = _leaves_step(new)
            for a, b in zip(got, want):
                assert (a.float() - b.float()).abs().max() <= 2e-2 * max(1.0, b.float().abs().max().item())
    finally:
        s.activate_sdpa()
    full = sum(1 for x in s._served.values() if x is not None and x.fast)
    for _ in range(3):
        _same(_leaves_step(leaves), steps[-1])
    assert full <= 64 and p.fast  # (the table held at most 64; the first layout is back in it)


@requires_gpu
def test_gpu_fast_forward_on_a_second_device(monkeypatch):
    """A layout handed over on one GPU and the same layout on another (its own prepared calls
    and counter) both match PyTorch's own kernels on that device."""
    import cuflash.torch.sdpa as s
    from cuflash.plan import forget_plans
    from cuflash.torch import node
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, PyTorch sees {torch.cuda.device_count()}")
    if node.module() is None:
        pytest.skip(f"the C++ node cannot be built here: {node._state['why']}")
    monkeypatch.setenv("CUFLASH_CPP_NODE", "1")
    forget_plans()
    per_device = {}
    s.activate_sdpa()
    try:
        for dev in ("cuda:0", "cuda:1", "cuda:0", "cuda:1"):
            leaves = _sdpa_leaves(2, 1024, 1024, 8, 2, 128, seed=5, device=dev)
            with torch.cuda.device(dev):
                per_device[dev] = (leaves, [_leaves_step(leaves) for _ in range(4)])
    finally:
        s.restore_sdpa()
        forget_plans()
    for dev, (leaves, res) in per_device.items():
        with torch.cuda.device(dev):
            want = _leaves_step(leaves)
        for r in res[1:]:
            _same(r, res[0])
        for a, b in zip(res[-1], want):
            assert a.device == torch.device(dev)
            assert (a.float() - b.float()).abs().max() <= 2e-2 * max(1.0, b.float().abs().max().item())
