"""The disk cache against other users and odd files (issue 18): a cache directory or entry that
is not this user's, or is writable by group or others, is refused (warning, memory only); no
symlink is followed, no FIFO blocks, temporary files are fresh; `cache list/clear` and `info`
touch only cuflash's own names and survive directories, symlinks and permission errors. No GPU.

Tests run as root here, so "another user" is simulated by changing the uid cuflash takes for
its own (compiler._euid)."""
import hashlib
import os
import threading
import warnings
from pathlib import Path

import pytest

from cuflash import compiler
from cuflash.__main__ import main
from cuflash.kernels.combine import CombineVariant

ELF = b"\x7fELF"
V = CombineVariant(head_dim=32, dtype="fp16", arch=80)  # compiles in a fraction of a second
W = CombineVariant(head_dim=64, dtype="fp16", arch=80)
POISON = b"\x7fELF not a kernel: planted by another user"


def planted(payload=POISON) -> bytes:
    """What another user would write: a well-formed entry (magic + sha256 + payload)."""
    return compiler._MAGIC + hashlib.sha256(payload).digest() + payload


@pytest.fixture
def cache(monkeypatch, tmp_path):
    d = tmp_path / "cache"
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(d))
    return d


@pytest.fixture
def other_user(monkeypatch):
    """cuflash now runs as another uid: every existing file belongs to someone else."""
    monkeypatch.setattr(compiler, "_euid", lambda: os.geteuid() + 1000)


def quiet_cubin(v=V):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return compiler.cubin_for(v)


def run_with_timeout(fn, seconds=120):
    """fn() on a daemon thread; fails (instead of hanging the run) if it blocks."""
    box = {}
    t = threading.Thread(target=lambda: box.update(r=fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "blocked"
    return box["r"]


# ---------------------------------------------------------------------------------------------
# What cuflash creates

def test_directory_0700_and_files_0600(cache):
    old = os.umask(0)  # even with no umask at all
    try:
        cubin = quiet_cubin()
    finally:
        os.umask(old)
    path = compiler.cache_path(V)
    assert cubin[:4] == ELF
    assert cache.stat().st_mode & 0o777 == 0o700
    assert path.stat().st_mode & 0o777 == 0o600
    assert Path(str(path) + ".lock").stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in cache.iterdir()) == [path.name, path.name + ".lock"]


# ---------------------------------------------------------------------------------------------
# Poisoning: directories and entries of other users, or writable by them

@pytest.mark.parametrize("how", ["other_owner", "group_writable", "world_writable"])
def test_untrusted_cache_dir_is_refused(cache, monkeypatch, how):
    cache.mkdir(mode=0o700)
    compiler.cache_path(V).write_bytes(planted())
    compiler.cache_path(V).chmod(0o644)
    if how == "other_owner":
        monkeypatch.setattr(compiler, "_euid", lambda: os.geteuid() + 1000)
    else:
        cache.chmod(0o770 if how == "group_writable" else 0o777)
    with pytest.warns(RuntimeWarning) as rec:
        cubin = compiler.cubin_for(V)
        assert compiler.cubin_for(W)[:4] == ELF  # a second kernel: no second warning
    assert cubin[:4] == ELF and cubin != POISON
    msgs = [str(w.message) for w in rec]
    assert len(msgs) == 1, msgs
    assert str(cache) in msgs[0] and "kept in memory only" in msgs[0]
    assert ("owned by uid" if how == "other_owner" else "writable by group or others") in msgs[0]
    assert compiler.cache_path(V).read_bytes() == planted()  # left alone
    assert sorted(p.name for p in cache.iterdir()) == [compiler.cache_path(V).name]  # nothing written


def test_readme_demo_dir_made_by_another_user(monkeypatch, tmp_path, other_user):
    """The README's `CUFLASH_CACHE_DIR=/tmp/cuflash-demo-cache` and `XDG_CACHE_HOME=/tmp/shared`,
    both made (and filled with a well-formed entry) by someone else first."""
    demo, shared = tmp_path / "cuflash-demo-cache", tmp_path / "shared"
    for d in (demo, shared / "cuflash"):
        d.mkdir(parents=True)
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(demo))
    demo_entry = compiler.cache_path(V)
    monkeypatch.setenv("CUFLASH_CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(shared))
    xdg_entry = compiler.cache_path(V)
    assert xdg_entry.parent == shared / "cuflash"
    for entry in (demo_entry, xdg_entry):
        entry.write_bytes(planted())
    for env in ({"CUFLASH_CACHE_DIR": str(demo)}, {"CUFLASH_CACHE_DIR": ""}):
        for k, val in env.items():
            monkeypatch.setenv(k, val)
        with pytest.warns(RuntimeWarning, match="owned by uid"):
            assert compiler.cubin_for(V) != POISON
    assert demo_entry.read_bytes() == xdg_entry.read_bytes() == planted()


def test_entry_of_another_user_is_refused_and_kept(cache, monkeypatch):
    """A well-formed entry by another uid in our own directory: not loaded, not deleted, not
    replaced; the kernel is compiled and kept in memory."""
    cache.mkdir(mode=0o700)
    entry = compiler.cache_path(V)
    entry.write_bytes(planted())
    entry.chmod(0o644)
    real_uid = os.geteuid()
    monkeypatch.setattr(compiler, "cache_dir_problem", lambda d=None: None)  # the directory passes
    monkeypatch.setattr(compiler, "_euid", lambda: real_uid + 1000)
    with pytest.warns(RuntimeWarning, match=r"not using the cache file .* owned by uid .*kept in memory"):
        cubin = compiler.cubin_for(V)
    assert cubin[:4] == ELF and cubin != POISON
    assert entry.read_bytes() == planted()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files to another uid")
def test_real_files_of_another_uid(cache, tmp_path):
    """No simulation: a directory and an entry really owned by uid 65534 (nobody)."""
    cache.mkdir(mode=0o700)
    compiler.cache_path(V).write_bytes(planted())
    os.chown(cache, 65534, 65534)
    with pytest.warns(RuntimeWarning, match=f"cache directory {cache} is owned by uid 65534"):
        assert compiler.cubin_for(V) != POISON
    os.chown(cache, 0, 0)
    os.chown(compiler.cache_path(V), 65534, 65534)
    with pytest.warns(RuntimeWarning, match="not using the cache file .* owned by uid 65534"):
        assert compiler.cubin_for(V) != POISON
    st = compiler.cache_path(V).stat()
    assert st.st_uid == 65534 and compiler.cache_path(V).read_bytes() == planted()


def test_group_writable_entry_is_refused(cache):
    quiet_cubin()
    entry = compiler.cache_path(V)
    entry.write_bytes(planted())
    entry.chmod(0o664)
    with pytest.warns(RuntimeWarning, match="writable by group or others"):
        assert compiler.cubin_for(V)[:4] == ELF and compiler.cubin_for(V) != POISON
    assert entry.read_bytes() == planted()


def test_own_private_entry_is_used(cache, monkeypatch):
    """The other side: an entry of this user's, 0600 in a 0700 directory, is a hit."""
    cubin = quiet_cubin()
    monkeypatch.setattr(compiler, "compile_variant", lambda v: pytest.fail("compiled again"))
    assert quiet_cubin() == cubin


# ---------------------------------------------------------------------------------------------
# Symlinks, FIFOs, directories at cuflash's names

def test_symlinked_entry_is_not_followed(cache, tmp_path):
    cache.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere.cubin"
    elsewhere.write_bytes(planted())
    elsewhere.chmod(0o600)
    compiler.cache_path(V).symlink_to(elsewhere)
    with pytest.warns(RuntimeWarning, match="is a symbolic link"):
        cubin = compiler.cubin_for(V)
    assert cubin[:4] == ELF and cubin != POISON
    assert compiler.cache_path(V).is_symlink() and elsewhere.read_bytes() == planted()


def test_symlinked_lock_does_not_create_its_target(cache, tmp_path):
    cache.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    Path(str(compiler.cache_path(V)) + ".lock").symlink_to(victim)
    with pytest.warns(RuntimeWarning, match=r"\.lock is a symbolic link"):
        assert compiler.cubin_for(V)[:4] == ELF
    assert not victim.exists() and not os.path.lexists(compiler.cache_path(V))


def test_symlinks_at_temp_names_are_not_written_through(cache, tmp_path, monkeypatch):
    """Old-style predictable temp names and the name mkstemp tries first, both planted as symlinks
    to a victim file: it is never written; the entry still lands."""
    import tempfile
    cache.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    name = compiler.cache_path(V).name
    (cache / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp").symlink_to(victim)
    (cache / f".{name}.planted.tmp").symlink_to(victim)
    names = iter(["planted", "fresh"])
    monkeypatch.setattr(tempfile, "_get_candidate_names", lambda: names)
    cubin = quiet_cubin()
    assert victim.read_bytes() == b"precious"
    assert compiler._read_entry(compiler.cache_path(V)) == cubin
    assert not (cache / f".{name}.fresh.tmp").exists()  # renamed into place


@pytest.mark.parametrize("where", ["entry", "lock"])
def test_fifo_does_not_block(cache, where):
    cache.mkdir(mode=0o700)
    path = compiler.cache_path(V)
    os.mkfifo(path if where == "entry" else str(path) + ".lock", 0o600)
    with pytest.warns(RuntimeWarning, match="is not a regular file"):
        cubin = run_with_timeout(lambda: compiler.cubin_for(V))
    assert cubin[:4] == ELF


def test_directory_at_entry_name(cache):
    compiler.cache_path(V).mkdir(parents=True)
    with pytest.warns(RuntimeWarning, match="is not a regular file"):
        assert compiler.cubin_for(V)[:4] == ELF
    assert compiler.cache_path(V).is_dir()


# ---------------------------------------------------------------------------------------------
# python -m cuflash cache list|clear and info

def cli(capsys, *args):
    """(exit status, stdout, stderr) of `python -m cuflash ARGS`, run in this process."""
    try:
        main(list(args))
        rc = 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, int) and e.code:
            print(e.code, file=__import__("sys").stderr)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def messy(cache, tmp_path):
    """A cache directory with two real entries (a lock, a leftover temp file) among things that
    are not cuflash's: other .cubin files, a directory and dangling symlinks named *.cubin."""
    quiet_cubin(V)
    quiet_cubin(W)
    ours = {compiler.cache_path(V).name, compiler.cache_path(W).name}
    (cache / f".{compiler.cache_path(V).name}.abc123.tmp").write_bytes(b"interrupted")
    (cache / "mine.cubin").write_bytes(b"someone's own cubin")
    (cache / "x.cubin").mkdir()
    (cache / "y.cubin").symlink_to(tmp_path / "nowhere")
    (cache / "notes.txt").write_text("not a kernel")
    fake = f"{V.name}-{'0' * 20}.cubin"  # cuflash's naming, but a dangling symlink
    (cache / fake).symlink_to(tmp_path / "nowhere")
    keep = {"mine.cubin", "x.cubin", "y.cubin", "notes.txt"}
    return cache, ours, keep, fake


def test_cache_list_and_info_skip_what_is_not_an_entry(messy, capsys):
    d, ours, keep, fake = messy
    rc, out, err = cli(capsys, "cache", "list")
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[-1] == f"2 kernels in {d}"
    assert sorted(ln.split()[-1] for ln in lines[:-1]) == sorted(ours)
    rc, out, err = cli(capsys, "info")
    assert rc == 0, err
    assert f"cache: {d}  (2 kernels," in out


def test_cache_clear_removes_only_cuflash_files(messy, capsys):
    d, ours, keep, fake = messy
    rc, out, err = cli(capsys, "cache", "clear")
    assert rc == 0, err
    assert f"removed 2 kernels from {d}" in out
    assert {p.name for p in d.iterdir()} == keep  # entries, lock, temp file and the fake link gone
    assert (d / "mine.cubin").read_bytes() == b"someone's own cubin" and (d / "x.cubin").is_dir()


def test_cache_clear_reports_what_it_cannot_remove(messy, capsys, monkeypatch):
    d, ours, keep, fake = messy
    odd = d / f"{W.name}-{'1' * 20}.cubin"
    odd.mkdir()  # cuflash's name, but a directory
    stuck = compiler.cache_path(V)
    real_unlink = Path.unlink

    def unlink(self, missing_ok=False):
        if self == stuck:
            raise PermissionError(13, "Permission denied", str(self))
        return real_unlink(self, missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    rc, out, err = cli(capsys, "cache", "clear")
    assert rc == 1
    assert f"removed 1 kernels from {d}" in out
    assert f"not removed: {stuck} (Permission denied)" in err
    assert f"not removed: {odd} (a directory)" in err
    assert stuck.exists() and not compiler.cache_path(W).exists()


def test_cache_clear_leaves_other_users_files(messy, capsys, other_user):
    d, ours, keep, fake = messy
    rc, out, err = cli(capsys, "cache", "clear")
    assert rc == 1 and "removed 0 kernels" in out
    assert all(os.path.lexists(d / n) for n in ours | keep | {fake})
    assert err.count("owned by uid") == len(ours) * 2 + 2  # entries, their locks, the temp file, the link


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_cache_clear_in_read_only_dir(messy, capsys):
    d = messy[0]
    d.chmod(0o500)
    try:
        rc, out, err = cli(capsys, "cache", "clear")
    finally:
        d.chmod(0o700)
    assert rc == 1 and "Permission denied" in err and "Traceback" not in err


def test_cache_commands_on_a_file_or_untrusted_dir(cache, capsys, monkeypatch):
    cache.parent.mkdir(exist_ok=True)
    cache.write_text("a file, not a directory")
    rc, out, err = cli(capsys, "cache", "list")
    assert rc == 1 and f"cannot read the cache directory {cache}" in err
    rc, out, err = cli(capsys, "info")
    assert rc == 0 and f"cache: {cache}  (not readable:" in out
    cache.unlink()
    cache.mkdir(mode=0o777)
    cache.chmod(0o777)
    rc, out, err = cli(capsys, "cache", "list")
    assert rc == 0 and "does not use this directory" in err and "writable by group or others" in err
    rc, out, err = cli(capsys, "info")
    assert "0 kernels, 0.0 MB); not used: it is writable by group or others" in out
