"""strata.io: round trips (in place and through the bounce buffer, one and two folders),
pinned buffers on registered memory, checksums catching corruption, and each bad input
as a Python exception."""

import errno
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import strata
from strata.io import Store


def test_torch_and_numpy_round_trip_through_one_and_two_folders(swap_dir):
    dirs = [os.path.join(swap_dir, "a"), os.path.join(swap_dir, "b")]
    for d in dirs:
        os.mkdir(d)
    for paths in (dirs[:1], dirs):
        with Store(paths, "64MiB", queue_depth=8, block_size="256KiB") as store:
            x = torch.randn(1_000_003)  # not a multiple of 4096 bytes: bounce buffer
            a = np.arange(3 << 20, dtype=np.uint8)
            handles = [store.write("x", x), store.write("a", a)]
            for h in handles:
                h.wait()
            y = torch.empty_like(x)
            b = np.zeros_like(a)
            store.read("x", y)
            store.read("a", b)
            store.wait_all()
            assert torch.equal(x, y)
            assert np.array_equal(a, b)
            assert store.names() == ["a", "x"]
            assert len(store.files) == len(paths)


def test_rewriting_a_name_with_another_size_replaces_it(swap_dir):
    with Store(swap_dir, "16MiB") as store:
        store.write("t", torch.ones(10)).wait()
        store.write("t", torch.full((5000,), 2.0)).wait()
        out = torch.zeros(5000)
        store.read("t", out).wait()
        assert torch.equal(out, torch.full((5000,), 2.0))


def test_pinned_buffers_are_used_in_place_through_registered_memory(swap_dir):
    with Store(swap_dir, "64MiB") as store:
        src = store.pinned_empty((3, 1000), torch.float32)
        dst = store.pinned_empty((3, 1000), torch.float32)
        bf = store.pinned_empty(777, torch.bfloat16)
        arr = store.pinned_empty((2, 5), np.float16)
        assert src.shape == (3, 1000) and src.dtype == torch.float32
        assert bf.dtype == torch.bfloat16 and isinstance(arr, np.ndarray)
        assert src.data_ptr() % 4096 == 0 and torch.count_nonzero(src) == 0
        src.copy_(torch.randn(3, 1000))
        bf.copy_(torch.randn(777))
        store.write("src", src).wait()
        store.write("bf", bf).wait()
        store.read("src", dst).wait()
        back = store.pinned_empty(777, torch.bfloat16)
        store.read("bf", back).wait()
        assert torch.equal(src, dst) and torch.equal(bf, back)
        fixed, plain = store.io_counters()
        if store.backend == "io_uring":
            assert fixed > 0 and plain == 0, (fixed, plain)


def _open_swap_file(path):
    """A store's swap file, opened for writing. Its name is removed as soon as the store
    opens it (so that a killed process leaves nothing behind): it is reached through this
    process's own descriptor for it."""
    path = str(path)
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target in (path, path + " (deleted)"):
            return open(f"/proc/self/fd/{fd}", "r+b")
    raise FileNotFoundError(path)


def test_a_corrupted_swap_file_fails_the_read_naming_the_extent(swap_dir):
    with Store(swap_dir, "8MiB") as store:
        assert store.checksums
        x = torch.arange(4096, dtype=torch.float32)
        store.write("x", x).wait()
        (path,) = store.files
        with _open_swap_file(path) as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
            f.flush()
            os.fsync(f.fileno())
        with pytest.raises(OSError, match="extent 'x' is corrupt"):
            store.read("x", torch.empty(4096)).wait()


def test_a_missing_folder_is_an_oserror_naming_the_file_and_errno(swap_dir):
    missing = os.path.join(swap_dir, "no", "such", "dir")
    with pytest.raises(OSError) as info:
        Store(missing, "1MiB")
    assert info.value.errno == errno.ENOENT
    assert "no/such/dir" in str(info.value)


def test_a_capacity_beyond_the_disk_is_refused_before_anything_is_written(swap_dir):
    with pytest.raises(OSError, match="not enough free space"):
        Store(swap_dir, "1000TiB")


def test_a_name_never_written_is_a_key_error(swap_dir):
    with Store(swap_dir, "1MiB") as store:
        with pytest.raises(KeyError, match="nothing named 'ghost'"):
            store.read("ghost", torch.empty(4))


def test_reading_into_a_too_small_buffer_is_a_value_error(swap_dir):
    with Store(swap_dir, "1MiB") as store:
        store.write("x", torch.ones(100)).wait()
        with pytest.raises(ValueError, match="holds 400 bytes.*only 396"):
            store.read("x", torch.empty(99))


def test_bad_tensors_are_refused_with_clear_messages(swap_dir):
    with Store(swap_dir, "1MiB") as store:
        with pytest.raises(ValueError, match="not contiguous"):
            store.write("t", torch.zeros(8, 8).t())
        with pytest.raises(ValueError, match="not C-contiguous"):
            store.write("a", np.zeros((8, 8), np.float32)[:, ::2])
        with pytest.raises(TypeError, match="meta tensor"):
            store.write("m", torch.zeros(8, device="meta"))
        with pytest.raises(TypeError, match="torch tensor or a numpy array"):
            store.write("l", [1.0, 2.0])
        with pytest.raises(TypeError, match="name is a str"):
            store.write(3, torch.zeros(8))
        store.write("x", torch.ones(8)).wait()
        ro = np.zeros(8, np.float32)
        ro.setflags(write=False)
        with pytest.raises(ValueError, match="read-only"):
            store.read("x", ro)
        with pytest.raises(ValueError, match="empty"):
            store.write("e", torch.zeros(0))
    with pytest.raises(ValueError, match="queue_depth must be at least 1"):
        Store(swap_dir, "1MiB", queue_depth=0)
    with pytest.raises(ValueError, match="block size"):
        Store(swap_dir, "1MiB", block_size=1000)
    with pytest.raises(ValueError, match="backend"):
        Store(swap_dir, "1MiB", backend="aio")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_cuda_tensor_is_a_type_error(swap_dir):
    with Store(swap_dir, "1MiB") as store:
        with pytest.raises(TypeError, match="cuda tensor"):
            store.write("c", torch.zeros(8, device="cuda"))


def test_the_threaded_backend_gives_the_same_bytes(swap_dir):
    with Store(swap_dir, "16MiB", backend="threads", checksums=False) as store:
        assert store.backend == "threads" and not store.checksums
        x = torch.randn(300_000)
        store.write("x", x).wait()
        y = torch.empty_like(x)
        h = store.read("x", y)
        h.wait()
        h.wait()  # a second wait does nothing
        assert h.done() and torch.equal(x, y)


def test_import_strata_does_not_need_torch():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import strata, strata.io\n"
        "print(strata.__version__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == strata.__version__


# Each promise of the README's "From Python" section about strata.io, as a user meets it.


@pytest.mark.parametrize("capacity", [-1, 1 << 64, "1XB", "-1GiB", "", 0, "0"])
def test_a_bad_capacity_is_a_value_error(swap_dir, capacity):
    with pytest.raises(ValueError):
        Store(swap_dir, capacity)


@pytest.mark.parametrize("capacity", [1.5, None, b"1GiB", True])
def test_a_capacity_of_the_wrong_type_is_a_type_error(swap_dir, capacity):
    with pytest.raises(TypeError, match="size"):
        Store(swap_dir, capacity)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(queue_depth=-1), ValueError, "queue_depth"),
        (dict(queue_depth="8"), TypeError, "queue_depth"),
        (dict(queue_depth=2.7), TypeError, "queue_depth"),
        (dict(queue_depth=True), TypeError, "queue_depth"),
        (dict(block_size=-4096), ValueError, "size"),
        (dict(block_size="1XB"), ValueError, "unknown unit"),
        (dict(checksums="no"), TypeError, "checksums"),
        (dict(checksums=None), TypeError, "checksums"),
        (dict(backend=3), TypeError, "backend"),
    ],
)
def test_store_settings_of_the_wrong_type_or_range_are_refused(swap_dir, kwargs, error, message):
    with pytest.raises(error, match=message):
        Store(swap_dir, "1MiB", **kwargs)


def test_paths_must_be_folders_named_by_str_bytes_or_pathlike(swap_dir):
    import pathlib

    with pytest.raises(TypeError, match="path"):
        Store([1], "1MiB")
    with pytest.raises(TypeError, match="path"):
        Store(None, "1MiB")
    # bytes and pathlib paths name the folder itself (not "b'/var/tmp'").
    for p in (os.fsencode(swap_dir), pathlib.Path(swap_dir)):
        with Store(p, "1MiB") as store:
            assert os.path.dirname(str(store.files[0])) == swap_dir


def _tmpfs_folder():
    """A fresh folder on tmpfs (/dev/shm), or None where there is none."""
    if not os.path.isdir("/dev/shm") or not strata.doctor(nvme="/dev/shm")["nvme"][0]["tmpfs"]:
        return None
    import tempfile

    return tempfile.mkdtemp(prefix="strata-pytest-", dir="/dev/shm")


def test_a_store_on_tmpfs_is_refused_as_strata_train_refuses_it(swap_dir):
    d = _tmpfs_folder()
    if d is None:
        pytest.skip("no tmpfs at /dev/shm")
    try:
        with pytest.raises(ValueError, match="is on tmpfs, which is RAM, not a drive"):
            Store(d, "1MiB")
        with pytest.raises(ValueError, match="tmpfs"):
            Store([swap_dir, d], "1MiB")  # one folder of several
        assert os.listdir(d) == [] and os.listdir(swap_dir) == []  # no swap file made
        # doctor gives the same verdict for the folder.
        assert "tmpfs" in strata.doctor(nvme=d)["nvme"][0]["verdict"]
    finally:
        os.rmdir(d)


@pytest.mark.parametrize(
    "out",
    [
        torch.zeros(1024, dtype=torch.int32),
        torch.zeros(4096, dtype=torch.bfloat16),
        np.zeros(1024, np.uint32),
        np.zeros(512, np.float64),
    ],
    ids=["int32", "bfloat16-larger", "numpy-uint32", "numpy-float64"],
)
def test_reading_into_another_dtype_is_a_type_error(swap_dir, out):
    with Store(swap_dir, "1MiB") as store:
        store.write("x", torch.arange(1024, dtype=torch.float32)).wait()
        with pytest.raises(TypeError, match="'x' was written as float32"):
            store.read("x", out)
        # The same dtype from numpy or torch reads back the bytes written.
        back = np.zeros(1024, np.float32)
        store.read("x", back).wait()
        assert np.array_equal(back, np.arange(1024, dtype=np.float32))


def test_pinned_empty_refuses_shapes_and_dtypes_numpy_and_torch_refuse(swap_dir):
    with Store(swap_dir, "1MiB") as store:
        for shape in ((2.5,), ("3",), (None,)):
            with pytest.raises(TypeError, match="shape"):
                store.pinned_empty(shape, torch.float32)
        with pytest.raises(ValueError, match="negative"):
            store.pinned_empty((-1,), torch.float32)
        # Object arrays would hold null pointers: refused, as is a missing dtype.
        for dtype in (object, np.dtype([("a", object)]), None):
            with pytest.raises(TypeError, match="dtype"):
                store.pinned_empty((3,), dtype)
        with pytest.raises(TypeError, match="unsupported dtype"):
            store.pinned_empty((3,), torch.complex64)


def test_pinned_memory_the_system_refuses_is_an_oserror_with_errno(swap_dir):
    with Store(swap_dir, "1MiB") as store:
        with pytest.raises(OSError) as info:
            store.pinned_empty((1 << 50,), torch.uint8)  # a petabyte: mmap refuses it
        assert info.value.errno == errno.ENOMEM


def test_a_closed_store_is_a_value_error_not_an_attribute_error(swap_dir):
    store = Store(swap_dir, "1MiB")
    store.write("x", torch.ones(8)).wait()
    store.close()
    store.close()  # closing twice does nothing
    for call in (
        lambda: store.write("x", torch.ones(8)),
        lambda: store.read("x", torch.ones(8)),
        lambda: store.wait_all(),
        lambda: store.pinned_empty(8, torch.float32),
        lambda: store.names(),
    ):
        with pytest.raises(ValueError, match="closed"):
            call()


def test_the_readme_example_runs_as_written(tmp_path, monkeypatch):
    """The README's "From Python" example, run as a user would paste it."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## From Python", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md (From Python)", "exec"), {})
