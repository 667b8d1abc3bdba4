"""``strata.io``: tensors to and from NVMe through strata's tensor store.

::

    store = strata.io.Store(["/mnt/nvme0", "/mnt/nvme1"], capacity="8GiB")
    buf = store.pinned_empty((1 << 20,), torch.float32)   # page-locked, io_uring fixed
    h = store.write("layer0", buf); h.wait()
    h = store.read("layer0", out); store.wait_all()

Each folder gets one preallocated swap file (several folders are striped, as several
drives); files are opened with O_DIRECT where the filesystem allows (else buffered I/O,
with one warning) and removed when the store is closed. A folder on tmpfs is refused
(ValueError), as ``strata train`` refuses it: it is RAM, not a drive. Every write
records a crc32c and every read verifies it (``checksums=False`` turns that off).
The I/O runs on io_uring, or on threads when io_uring is refused (the reason is logged
once, as by the CLI). While a transfer is in flight its tensor must not be used.

Tensors are used in place when O_DIRECT can: memory from ``pinned_empty``, or a tensor
that starts on a 4096-byte boundary and whose size is a multiple of 4096. Others go
through an aligned bounce buffer (one copy). Failed system calls raise OSError with the
errno and the swap file; a name never written raises KeyError; a too-small buffer or a
non-contiguous tensor raise ValueError; a CUDA tensor, or a read into another dtype than
the one written, TypeError. Every setting is checked for its type and range before the
swap files are made.
"""

import operator
import os

from . import _native

#: Defaults: the tensor store's own (StoreConfig::new), the setting of the recorded
#: ``strata bench nvme`` run (benches/results/nvme-vm-virtio-ext4.json) and of DeepNVMe's
#: ds_io. A ``strata bench nvme --sweep`` on the target drive says whether another is better.
DEFAULT_QUEUE_DEPTH = 32
DEFAULT_BLOCK_SIZE = 1 << 20

_NUMPY_OF_TORCH = {
    "torch.float32": ("<f4", None),
    "torch.float64": ("<f8", None),
    "torch.float16": ("<f2", None),
    "torch.bfloat16": ("<u2", "bfloat16"),
    "torch.uint8": ("|u1", None),
    "torch.int8": ("|i1", None),
    "torch.int16": ("<i2", None),
    "torch.int32": ("<i4", None),
    "torch.int64": ("<i8", None),
    "torch.bool": ("|b1", None),
}


def parse_size(size):
    """Bytes from an int or a string such as ``"4GiB"`` (as the CLI reads sizes)."""
    if isinstance(size, bool):
        raise TypeError("a size is an int or a string such as '4GiB', not bool")
    if isinstance(size, int):
        if not 0 <= size < 1 << 64:
            raise ValueError(f"a size of {size} bytes is out of range (0 to 2^64 - 1)")
        return size
    if isinstance(size, str):
        return _native.parse_bytes(size)
    raise TypeError(f"a size is an int or a string such as '4GiB', not {type(size).__name__}")


def _count(name, value):
    """A setting that is a whole number of at least 1 (TypeError or ValueError)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, not {value}")
    return value


def _folder(path):
    """A folder named by a str, bytes or os.PathLike, as a str."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"a swap folder's path is a str or os.PathLike, not {type(path).__name__}")
    return os.fsdecode(os.fspath(path))


class Store:
    """A checksummed tensor store over one or more folders (one swap file each).

    ``capacity``: bytes the tensors may take in all (int or ``"4GiB"``), preallocated.
    ``queue_depth``, ``block_size``: at most that many chunks of that size in flight.
    ``backend``: ``"auto"`` (io_uring, else threads), ``"io_uring"`` or ``"threads"``.
    """

    def __init__(
        self,
        paths,
        capacity,
        *,
        queue_depth=DEFAULT_QUEUE_DEPTH,
        block_size=DEFAULT_BLOCK_SIZE,
        checksums=True,
        backend="auto",
    ):
        self._store = None
        if isinstance(paths, (str, bytes, os.PathLike)):
            paths = [paths]
        if not isinstance(paths, (list, tuple)):
            raise TypeError(
                f"paths is a folder's path or a list of them, not {type(paths).__name__}"
            )
        paths = [_folder(p) for p in paths]
        if not isinstance(checksums, bool):
            raise TypeError(f"checksums must be True or False, not {checksums!r}")
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str, not {type(backend).__name__}")
        self._dtypes = {}
        self._store = _native.Store(
            paths,
            parse_size(capacity),
            _count("queue_depth", queue_depth),
            parse_size(block_size),
            checksums,
            backend,
        )

    def _open(self):
        """The native store; ValueError once closed (as a closed file's I/O)."""
        if self._store is None:
            raise ValueError("I/O on a closed strata.io.Store")
        return self._store

    def write(self, name, tensor):
        """Starts writing ``tensor`` (contiguous, CPU) under ``name``; returns a handle."""
        name = _name(name)
        handle = self._open().write(name, tensor)
        self._dtypes[name] = _dtype_name(tensor)
        return handle

    def read(self, name, out):
        """Starts reading ``name`` into ``out`` (contiguous, CPU, at least as many bytes
        as were written); returns a handle."""
        name, store = _name(name), self._open()
        written, wanted = self._dtypes.get(name), _dtype_name(out)
        if written is not None and wanted is not None and written != wanted:
            raise TypeError(
                f"'{name}' was written as {written}; the tensor to read into is {wanted} "
                f"(read into a {written} tensor, then convert)"
            )
        return store.read(name, out)

    def wait_all(self):
        """Waits for every transfer not yet waited for; raises the first error."""
        self._open().wait_all()

    def pinned_empty(self, shape, dtype):
        """A page-locked tensor registered with this store's io_uring (fixed buffers):
        a torch tensor for a torch dtype, else a numpy array. Zero-filled."""
        import numpy

        store = self._open()
        try:
            sizes = [shape] if isinstance(shape, int) else list(shape)
            shape = tuple(operator.index(s) for s in sizes)
        except TypeError:
            raise TypeError(f"pinned_empty: a shape is ints, not {shape!r}") from None
        if any(s < 0 for s in shape):
            raise ValueError(f"pinned_empty: negative size in shape {shape}")
        torch_view = None
        if type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype":
            entry = _NUMPY_OF_TORCH.get(str(dtype))
            if entry is None:
                raise TypeError(f"pinned_empty: unsupported dtype {dtype}")
            typestr, torch_view = entry[0], dtype
        elif dtype is None:
            raise TypeError("pinned_empty: give a dtype (a torch or numpy dtype)")
        else:
            if numpy.dtype(dtype).hasobject:
                raise TypeError(
                    f"pinned_empty: dtype {numpy.dtype(dtype)} holds Python objects, "
                    "which cannot live in pinned memory"
                )
            typestr = numpy.dtype(dtype).str
        itemsize = numpy.dtype(typestr).itemsize
        count = 1
        for s in shape:
            count *= s
        buf = store.pinned_empty(count * itemsize, typestr, list(shape))
        array = numpy.asarray(buf)
        if torch_view is None:
            return array
        import torch

        tensor = torch.from_numpy(array)
        return tensor.view(torch_view) if tensor.dtype != torch_view else tensor

    def names(self):
        """The names written so far."""
        return self._open().names()

    @property
    def backend(self):
        """``"io_uring"`` or ``"threads"``."""
        return self._open().backend

    @property
    def direct_io(self):
        """Whether every swap file bypasses the page cache (O_DIRECT)."""
        return self._open().direct_io

    @property
    def checksums(self):
        """Whether writes record and reads verify a crc32c."""
        return self._open().checksums

    @property
    def files(self):
        """The swap files' paths. Their names are removed as soon as the store opens them
        (a killed process leaves nothing behind), so these say where the space is."""
        return self._open().files

    def io_counters(self):
        """(chunks through registered buffers, chunks through plain ones)."""
        return self._open().io_counters()

    def close(self):
        """Waits for what is in flight and removes the swap files."""
        if self._store is not None:
            try:
                self._store.wait_all()
            finally:
                self._store = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _dtype_name(obj):
    """The element type of a torch tensor or numpy array (``"float32"``, ``"bfloat16"``),
    or None for anything else (the native half says what it needs)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return str(obj.dtype).removeprefix("torch.")
    interface = getattr(obj, "__array_interface__", None)
    if isinstance(interface, dict) and "typestr" in interface:
        import numpy

        return numpy.dtype(interface["typestr"]).name
    return None


def _name(name):
    if not isinstance(name, str):
        raise TypeError(f"a tensor's name is a str, not {type(name).__name__}")
    return name
