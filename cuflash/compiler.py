"""Source -> compiled kernel. NVRTC is called directly, for an explicit arch, so that the same
function compiles on a machine with no GPU (offline, CI, build nodes) and at run time; the cubin
is then loaded through CuPy.

Caches: a per-process dict (variant, device) -> loaded function, and a disk cache of cubins
keyed by source, options, arch, NVRTC version and library version. Writes are atomic (temp file
+ rename under a file lock); a corrupt entry is rebuilt with a warning; an unwritable cache
directory falls back to memory with a warning.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

from . import __version__
from .codegen import render
from .kernels import KernelVariant as Variant

NVRTC_OPTIONS = ("-std=c++17", "-default-device", "-ftz=true", "--ptxas-options=-v")
_MAGIC = b"CUFLASH-CUBIN-1\n"


class _NVRTC:
    """Minimal ctypes binding of NVRTC (the library CuPy uses, located by cuda-pathfinder).

    Our own binding, because the cubin must come back byte-exact (it is an ELF image, not a
    string) and compilation must work with no GPU and no driver.
    """

    def __init__(self):
        import ctypes
        # CUFLASH_NVRTC: a chosen NVRTC library (e.g. another toolkit's, to see what its ptxas
        # makes of a kernel); else cuda-pathfinder's, else the system's.
        path = os.environ.get("CUFLASH_NVRTC")
        if path:
            self._load_builtins(ctypes, path)
        else:
            path = self._find(ctypes)
        self.ct = ctypes
        self.lib = ctypes.CDLL(path)
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        self._first, self._warm = threading.Lock(), False

    def _check(self, status, what):
        if status != 0:
            raise RuntimeError(f"NVRTC {what} failed: {self.lib.nvrtcGetErrorString(status).decode()}")

    @staticmethod
    def _find(ctypes) -> str:
        try:
            from cuda import pathfinder
            return pathfinder.load_nvidia_dynamic_lib("nvrtc").abs_path
        except Exception:  # pathfinder missing or library not found there: try the system
            import ctypes.util
            import glob
            path = ctypes.util.find_library("nvrtc")
            for root in (os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"):
                found = sorted(glob.glob(os.path.join(root, "lib64", "libnvrtc.so*"))) if root else []
                path = path or (found[0] if found else None)
        if not path:
            raise RuntimeError("cuflash: NVRTC not found; install the nvidia-cuda-nvrtc wheel")
        return path

    @staticmethod
    def _load_builtins(ctypes, path: str) -> None:
        """Check CUFLASH_NVRTC's file and load the builtins library beside it, which NVRTC opens
        by name at its first compile (so no library path needs setting)."""
        import glob
        if not os.path.isfile(path):
            raise RuntimeError(f"cuflash: CUFLASH_NVRTC must name an NVRTC library file (libnvrtc.so.*), got {path!r}")
        found = sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so.*")))
        if found:
            ctypes.CDLL(found[0], mode=ctypes.RTLD_GLOBAL)

    def version(self) -> tuple[int, int]:
        major, minor = self.ct.c_int(), self.ct.c_int()
        self._check(self.lib.nvrtcVersion(self.ct.byref(major), self.ct.byref(minor)), "version")
        return major.value, minor.value

    def _get(self, prog, what):
        size = self.ct.c_size_t()
        self._check(getattr(self.lib, f"nvrtcGet{what}Size")(prog, self.ct.byref(size)), what)
        buf = self.ct.create_string_buffer(size.value)
        self._check(getattr(self.lib, f"nvrtcGet{what}")(prog, buf), what)
        return buf.raw[:size.value]

    def compile(self, source: str, name: str, options: list[str]) -> tuple[bool, bytes, str]:
        """(ok, cubin, log). The first compilation runs alone: NVRTC 13.0 loads its builtins
        library then, and concurrent first loads fail."""
        if not self._warm:
            with self._first:
                if not self._warm:
                    result = self._compile(source, name, options)
                    self._warm = True
                    return result
        return self._compile(source, name, options)

    def _compile(self, source, name, options):
        ct = self.ct
        prog = ct.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ct.byref(prog), source.encode(), name.encode(),
                                                0, None, None), "create")
        try:
            opts = (ct.c_char_p * len(options))(*[o.encode() for o in options])
            status = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            log = self._get(prog, "ProgramLog").rstrip(b"\0").decode(errors="replace")
            return status == 0, (self._get(prog, "CUBIN") if status == 0 else b""), log
        finally:
            self.lib.nvrtcDestroyProgram(ct.byref(prog))


_nvrtc_instance: _NVRTC | None = None
_nvrtc_lock = threading.Lock()


def _nvrtc() -> _NVRTC:
    global _nvrtc_instance
    if _nvrtc_instance is None:
        with _nvrtc_lock:
            if _nvrtc_instance is None:
                _nvrtc_instance = _NVRTC()
    return _nvrtc_instance


def nvrtc_version() -> tuple[int, int]:
    return _nvrtc().version()


@dataclass(frozen=True)
class Resources:
    """What ptxas reports for one kernel."""
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    static_smem: int


def parse_resources(log: str, name: str = "") -> Resources:
    """ptxas's report in an NVRTC log: of entry function ``name`` when given (a log can hold
    another kernel's report too, see compile_source)."""
    if name:
        start = log.find(f"entry function '{name}'")
        if start < 0:
            raise ValueError(f"no ptxas resource report for {name} in the NVRTC log:\n{log}")
        end = log.find("Compiling entry function", start + 1)
        log = log[start:end if end >= 0 else len(log)]

    def grab(pattern, default=0):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else default
    regs = grab(r"Used (\d+) registers", -1)
    if regs < 0:
        raise ValueError(f"no ptxas resource report in the NVRTC log:\n{log}")
    return Resources(regs, grab(r"(\d+) bytes spill stores"), grab(r"(\d+) bytes spill loads"),
                     grab(r"(\d+) bytes stack frame"), grab(r"(\d+) bytes smem"))


@dataclass(frozen=True)
class Compiled:
    cubin: bytes
    log: str
    name: str = ""

    @property
    def resources(self) -> Resources:
        return parse_resources(self.log, self.name)


def compile_source(source: str, name: str, arch: int | str) -> Compiled:
    """Compile CUDA C++ to a cubin for sm_<arch> (e.g. 90 or "90a") with NVRTC. Needs no GPU."""
    nvrtc = _nvrtc()
    # NVRTC 12.9 and later keep a compile cache of their own, shared by processes, and a
    # compile served from it has no ptxas report in its log: cuflash caches cubins itself.
    no_cache = ["--no-cache"] if nvrtc.version() >= (12, 9) else []
    ok, cubin, log = nvrtc.compile(source, f"{name}.cu", [f"-arch=sm_{arch}", *NVRTC_OPTIONS, *no_cache])
    if not ok:
        raise RuntimeError(f"NVRTC failed to compile {name} for sm_{arch}:\n{log}")
    return Compiled(cubin, log, name)


def compile_variant(variant: Variant) -> Compiled:
    return compile_source(render(variant), variant.name, variant.target)


# ---------------------------------------------------------------------------------------------
# Disk cache
#
# A cubin is code that runs on the GPU, and the checksum in an entry detects corruption, not
# tampering. So the cache directory and every file used in it must belong to this user (the
# effective uid) and be writable by no one else: a directory under /tmp or a shared
# XDG_CACHE_HOME may have been made by another user. Anything else is refused with a warning and
# the kernel is kept in memory; another user's file is left alone. Files are opened without
# following a symlink and without blocking on a FIFO, and accepted only when regular; entries are
# written to a fresh temporary file (mkstemp: O_EXCL, mode 0600) renamed into place.

_ENTRY_NAME = r"[A-Za-z0-9_]+-[0-9a-f]{20}\.cubin"  # <variant name>-<key>.cubin
_ENTRY_RE = re.compile(_ENTRY_NAME)
_OWN_RE = re.compile(rf"{_ENTRY_NAME}(\.lock)?|\.{_ENTRY_NAME}\.[A-Za-z0-9_.]+\.tmp")  # + locks, temp files


class _Refused(Exception):
    """Something at a cache path that is not this user's own regular file: neither used nor replaced."""


def cache_dir() -> Path:
    env = os.environ.get("CUFLASH_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cuflash"


def cache_key(variant: Variant) -> str:
    h = hashlib.sha256()
    for part in (render(variant), " ".join(NVRTC_OPTIONS), variant.target,
                 "%d.%d" % nvrtc_version(), __version__):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def cache_path(variant: Variant) -> Path:
    return cache_dir() / f"{variant.name}-{cache_key(variant)}.cubin"


def _euid() -> int:
    return os.geteuid()


def _untrusted(st: os.stat_result) -> str | None:
    """Why a file or directory with status ``st`` is not to be trusted, or None."""
    if st.st_uid != _euid():
        return f"owned by uid {st.st_uid}, not by this user (uid {_euid()})"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {st.st_mode & 0o7777:o})"
    return None


def cache_dir_problem(d: Path | None = None) -> str | None:
    """Why the cache directory (``d`` or cache_dir()) is refused, or None (a missing one is fine)."""
    import stat
    try:
        st = os.stat(cache_dir() if d is None else d)
    except FileNotFoundError:
        return None
    return _untrusted(st) if stat.S_ISDIR(st.st_mode) else "not a directory"


def _open_own(path: Path, flags: int) -> int:
    """A descriptor of ``path`` (created mode 0600 with O_CREAT) if it is this user's regular file,
    writable by no one else; _Refused otherwise. Never follows a symlink at ``path``, never blocks
    on a FIFO there."""
    import errno
    import stat
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as e:
        what = {errno.ELOOP: "a symbolic link", errno.EISDIR: "a directory"}.get(e.errno)
        if what:
            raise _Refused(f"{path} is {what}") from None
        raise
    st = os.fstat(fd)
    why = _untrusted(st) if stat.S_ISREG(st.st_mode) else "not a regular file"
    if why:
        os.close(fd)
        raise _Refused(f"{path} is {why}")
    return fd


def _read_entry(path: Path) -> bytes | None:
    """The cubin stored at ``path``, or None if absent. Corrupt entries are removed. _Refused if
    something there is not this user's own regular file."""
    try:
        with open(_open_own(path, os.O_RDONLY), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        warnings.warn(f"cuflash: cannot read cache entry {path} ({e}); recompiling", RuntimeWarning)
        return None
    head = len(_MAGIC)
    payload = data[head + 32:]
    if data[:head] == _MAGIC and hashlib.sha256(payload).digest() == data[head:head + 32] and payload:
        return payload
    warnings.warn(f"cuflash: cache entry {path} is corrupt; rebuilding it", RuntimeWarning)
    with contextlib.suppress(OSError):
        path.unlink()
    return None


def _write_entry(path: Path, cubin: bytes) -> None:
    import tempfile
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # O_EXCL, 0600
    try:
        with open(fd, "wb") as f:
            f.write(_MAGIC + hashlib.sha256(cubin).digest() + cubin)
        os.replace(tmp, path)  # atomic: readers see the old entry or the whole new one
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _file_lock(path: Path):
    import fcntl
    fd = _open_own(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


_warned_dirs: set[str] = set()


def _warn_dir(d: Path, why: str) -> None:
    if str(d) not in _warned_dirs:
        _warned_dirs.add(str(d))
        warnings.warn(f"cuflash: cache directory {d} {why}; compiled kernels are kept in memory only",
                      RuntimeWarning)


def cubin_for(variant: Variant) -> bytes:
    """The variant's cubin: from the disk cache, or compiled now and stored there. A cache
    directory or entry that is refused or unusable leaves it in memory only, with a warning."""
    path = cache_path(variant)
    cubin = None
    try:
        os.makedirs(path.parent, mode=0o700, exist_ok=True)
        problem = cache_dir_problem(path.parent)
        if problem:
            _warn_dir(path.parent, f"is {problem}: not using it (chmod 700 a directory of your own, "
                                    "or set CUFLASH_CACHE_DIR to one)")
            return compile_variant(variant).cubin
        cubin = _read_entry(path)
        if cubin is None:
            with _file_lock(path.with_name(path.name + ".lock")):
                cubin = _read_entry(path)  # another process may have built it while we waited
                if cubin is None:
                    cubin = compile_variant(variant).cubin
                    _write_entry(path, cubin)
        return cubin
    except _Refused as e:
        warnings.warn(f"cuflash: not using the cache file {e}; the kernel is kept in memory only",
                      RuntimeWarning)
    except OSError as e:
        _warn_dir(path.parent, f"is not usable ({e})")
    return cubin if cubin is not None else compile_variant(variant).cubin


def cache_entries(d: Path | None = None) -> list[tuple[Path, int]]:
    """(path, size) of each entry in the cache directory (``d`` or cache_dir()): regular files
    named as cuflash names them, nothing else. [] if there is no directory; OSError if it cannot
    be read."""
    import stat
    d = cache_dir() if d is None else Path(d)
    try:
        names = sorted(os.listdir(d))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        if _ENTRY_RE.fullmatch(name):
            try:
                st = os.lstat(d / name)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                out.append((d / name, st.st_size))
    return out


def clear_cache(d: Path | None = None) -> tuple[int, list[str]]:
    """Remove cuflash's own files from the cache directory (``d`` or cache_dir()): entries, their
    locks and interrupted temporary files, recognised by name, and only this user's (a directory or
    another user's file of such a name stays). Returns the number of entries removed and one line
    for each such file left in place. OSError if the directory cannot be read."""
    import stat
    d = cache_dir() if d is None else Path(d)
    try:
        names = sorted(os.listdir(d))
    except FileNotFoundError:
        return 0, []
    removed, left = 0, []
    for name in filter(_OWN_RE.fullmatch, names):
        p = d / name
        try:
            st = os.lstat(p)
            why = ("a directory" if stat.S_ISDIR(st.st_mode) else
                   f"owned by uid {st.st_uid}" if st.st_uid != _euid() else None)
            if why is None:
                p.unlink()  # a symlink is removed, not followed
                removed += name.endswith(".cubin") and stat.S_ISREG(st.st_mode)
        except FileNotFoundError:
            continue
        except OSError as e:
            why = e.strerror or str(e)
        if why:
            left.append(f"{p} ({why})")
    return removed, left


# ---------------------------------------------------------------------------------------------
# Loaded kernels (needs a GPU)

_loaded: dict[tuple[str, int], object] = {}  # (variant name, device) -> loaded function
_lock = threading.Lock()


def get_kernel(variant: Variant, device: int):
    """The loaded kernel for ``variant`` on ``device``: one dict lookup (on its name) once loaded."""
    key = (variant.name, device)
    fn = _loaded.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _loaded.get(key)
        if fn is None:
            fn = _load(variant, device)
            _loaded[key] = fn
    return fn


def _load(variant: Variant, device: int):
    import cupy
    from cupy_backends.cuda.api import driver
    cubin = cubin_for(variant)
    with cupy.cuda.Device(device):
        mod = cupy.cuda.function.Module()
        mod.load(cubin)
        fn = mod.get_function(variant.name)
        smem = variant.smem_limit
        if smem > 48 * 1024:
            driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
    return Kernel(fn, variant)


class _Buffers:
    """A thread's kernel-parameter buffer and the ``kernelParams`` array of cuLaunchKernel
    pointing at it (every kernel takes one parameter, the struct): a launch packs its arguments
    into the buffer. Not CU_LAUNCH_PARAM_BUFFER_POINTER: that buffer must hold the parameter at
    its offset in the kernel's parameter space, which is not 0 for a struct aligned beyond the
    space's start (a 128-byte aligned struct holding tensor maps); through kernelParams the
    driver puts it where the kernel reads it."""

    def __init__(self):
        import ctypes
        import cupy
        from cupy_backends.cuda.api import driver
        self.buf = ctypes.create_string_buffer(1024 + 128)
        self.offset = -ctypes.addressof(self.buf) % 128  # the struct starts 128-byte aligned
        self.params = (ctypes.c_void_p * 1)(ctypes.addressof(self.buf) + self.offset)
        self.params_ptr = ctypes.addressof(self.params)
        self.launch_ex = _LaunchEx(self.params_ptr) if _cuda_driver() is not None else None
        if not driver.ctxGetCurrent():  # a new thread: bind the current device's primary context
            cupy.cuda.runtime.setDevice(cupy.cuda.runtime.getDevice())


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


@functools.lru_cache(maxsize=1)
def _cuda_driver():
    """cuLaunchKernelEx from the CUDA driver (CUDA 12+), or None where it is missing."""
    import ctypes
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p] * 4
    fn.restype = ctypes.c_int
    return fn


class _LaunchEx:
    """A thread's CUlaunchConfig with one attribute, programmatic stream serialisation, for
    cuLaunchKernelEx with the thread's packed parameters (``kernelParams``)."""

    def __init__(self, params_ptr: int):
        import ctypes

        class Attr(ctypes.Structure):  # CUlaunchAttribute: id, 4 pad bytes, a 64-byte value union
            _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_uint), ("value", ctypes.c_int * 16)]

        class Config(ctypes.Structure):  # CUlaunchConfig
            _fields_ = [("dims", ctypes.c_uint * 7), ("stream", ctypes.c_void_p),
                        ("attrs", ctypes.POINTER(Attr)), ("num_attrs", ctypes.c_uint)]

        self.attr = Attr(_PROGRAMMATIC_STREAM_SERIALIZATION)
        self.attr.value[0] = 1  # programmaticStreamSerializationAllowed
        self.config = Config(attrs=ctypes.pointer(self.attr), num_attrs=1)
        self.config_ptr, self.params_ptr, self.fn = ctypes.addressof(self.config), params_ptr, _cuda_driver()

    def __call__(self, fn_ptr: int, grid: tuple, block: tuple, shared_mem: int, stream: int):
        self.config.dims[:] = (*grid, *block, shared_mem)
        self.config.stream = stream
        rc = self.fn(self.config_ptr, fn_ptr, self.params_ptr, None)
        if rc:
            from cupy_backends.cuda.api import driver
            raise driver.CUDADriverError(rc)


_thread = threading.local()


def _buffers() -> _Buffers:
    b = getattr(_thread, "buffers", None)
    if b is None:
        b = _thread.buffers = _Buffers()
    return b


class Kernel:
    """A loaded kernel taking one parameter struct (the variant's ``params`` table).
    ``launch`` takes the struct's values in field order (the cached-call path builds them once);
    calling the kernel takes them by name."""

    __slots__ = ("fn", "ptr", "name", "table", "layout")

    def __init__(self, fn, variant: Variant):
        self.fn, self.ptr, self.name = fn, fn.ptr, variant.name
        self.table, self.layout = variant.params, variant.params.layout
        if self.layout.size > 1024:
            raise ValueError(f"{self.name}: {self.layout.size} bytes of kernel parameters")

    def launch(self, grid: tuple, block: tuple, shared_mem: int, stream: int, values, early: bool = False):
        """One cuLaunchKernel: grid and block are 3-tuples, ``stream`` a raw pointer, ``values``
        the struct's fields in order. ``early`` launches with programmatic stream serialisation
        (sm_90, cuLaunchKernelEx): the grid may start while the stream's previous kernel
        finishes, so the kernel must wait for it (``griddepcontrol.wait``) before it touches
        memory."""
        b = _buffers()
        self.layout.pack_into(b.buf, b.offset, *values)
        try:
            if early and b.launch_ex is not None:
                b.launch_ex(self.ptr, grid, block, shared_mem, stream)
            else:
                _launch_kernel(self.ptr, *grid, *block, shared_mem, stream, b.params_ptr, 0)
        except Exception as e:
            raise RuntimeError(f"launching {self.name} failed: {e} (grid {grid}, block {block}, "
                               f"{shared_mem} B shared)") from None

    def __call__(self, grid, block, stream: int, shared_mem: int = 0, **values):
        """Launch with the struct's fields given by name (every one of them)."""
        self.launch((*grid, 1, 1)[:3], (*block, 1, 1)[:3], shared_mem, stream, self.table.values(**values))


def _launch_kernel(*args):
    """cuLaunchKernel (CuPy's binding: typed arguments, the GIL released, errors raised)."""
    global _launch_kernel
    from cupy_backends.cuda.api.driver import launchKernel
    _launch_kernel = launchKernel
    return launchKernel(*args)


def compile_all(variants, workers: int | None = None) -> dict:
    """Variant -> Compiled for each of ``variants``, in parallel (no disk cache, no GPU). The
    first compile runs alone: NVRTC loads its builtins then."""
    from concurrent.futures import ThreadPoolExecutor
    variants = list(variants)
    if not variants:
        return {}
    out = {variants[0]: compile_variant(variants[0])}
    with ThreadPoolExecutor(workers or max(2, os.cpu_count() or 2)) as ex:
        out.update(zip(variants[1:], ex.map(compile_variant, variants[1:])))
    return out


def warmup(variants, workers: int | None = None, progress=None) -> tuple[list[Variant], list[Variant]]:
    """Fill the disk cache for ``variants`` in parallel (NVRTC releases the GIL). Needs no GPU.
    ``progress(done, total, variant)`` is called after each one. Returns (the variants compiled
    now, those already cached), each in the given order. On an exception (KeyboardInterrupt
    included) the compiles not yet started are cancelled, those under way finish, and it
    propagates."""
    from concurrent.futures import ThreadPoolExecutor, as_completed
    variants = list(dict.fromkeys(variants))
    workers = workers or min(16, os.cpu_count() or 1)
    was_cached = {}

    def warm(v):  # True if v's cubin was in the disk cache already
        if _read_entry(cache_path(v)) is not None:
            return True
        cubin_for(v)
        return False

    with ThreadPoolExecutor(workers) as ex:
        futures = {ex.submit(warm, v): v for v in variants}
        try:
            for i, f in enumerate(as_completed(futures), 1):
                was_cached[futures[f]] = f.result()
                if progress:
                    progress(i, len(variants), futures[f])
        except BaseException:
            ex.shutdown(wait=False, cancel_futures=True)
            raise
    return ([v for v in variants if not was_cached[v]], [v for v in variants if was_cached[v]])

