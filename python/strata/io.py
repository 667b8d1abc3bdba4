"""``strata.io``: tensors to and from NVMe through strata's tensor store.

::

    store = strata.io.Store(["/mnt/nvme0", "/mnt/nvme1"], capacity="8GiB")
    buf = store.pinned_empty((1 << 20,), torch.float32)   # page-locked, io_uring fixed
    h = store.write("layer0", buf); h.wait()
    h = store.read("layer0", out); store.wait_all()

Each folder gets one preallocated swap file (several folders are striped, as several
drives); files are opened with O_DIRECT where the filesystem allows (tmpfs does not:
buffered I/O then, with one warning) and removed when the store is closed. Every write
records a crc32c and every read verifies it (``checksums=False`` turns that off).
The I/O runs on io_uring, or on threads when io_uring is refused (the reason is logged
once, as by the CLI). While a transfer is in flight its tensor must not be used.

Tensors are used in place when O_DIRECT can: memory from ``pinned_empty``, or a tensor
that starts on a 4096-byte boundary and whose size is a multiple of 4096. Others go
through an aligned bounce buffer (one copy). Failed system calls raise OSError with the
errno and the swap file; a name never written raises KeyError; a too-small buffer, a
non-contiguous tensor or a CUDA tensor raise ValueError or TypeError.
"""

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
        raise TypeError("a size is an int or a string such as '4GiB'")
    if isinstance(size, int):
        return size
    if isinstance(size, str):
        return _native.parse_bytes(size)
    raise TypeError(f"a size is an int or a string such as '4GiB', not {type(size).__name__}")


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
        if isinstance(paths, (str, bytes)) or hasattr(paths, "__fspath__"):
            paths = [paths]
        paths = [str(p) for p in paths]
        self._store = _native.Store(
            paths,
            parse_size(capacity),
            int(queue_depth),
            parse_size(block_size),
            bool(checksums),
            backend,
        )

    def write(self, name, tensor):
        """Starts writing ``tensor`` (contiguous, CPU) under ``name``; returns a handle."""
        return self._store.write(_name(name), tensor)

    def read(self, name, out):
        """Starts reading ``name`` into ``out`` (contiguous, CPU, at least as many bytes
        as were written); returns a handle."""
        return self._store.read(_name(name), out)

    def wait_all(self):
        """Waits for every transfer not yet waited for; raises the first error."""
        self._store.wait_all()

    def pinned_empty(self, shape, dtype):
        """A page-locked tensor registered with this store's io_uring (fixed buffers):
        a torch tensor for a torch dtype, else a numpy array. Zero-filled."""
        import numpy

        shape = (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"pinned_empty: negative size in shape {shape}")
        torch_view = None
        if type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype":
            entry = _NUMPY_OF_TORCH.get(str(dtype))
            if entry is None:
                raise TypeError(f"pinned_empty: unsupported dtype {dtype}")
            typestr, torch_view = entry[0], dtype
        else:
            typestr = numpy.dtype(dtype).str
        itemsize = numpy.dtype(typestr).itemsize
        count = 1
        for s in shape:
            count *= s
        buf = self._store.pinned_empty(count * itemsize, typestr, list(shape))
        array = numpy.asarray(buf)
        if torch_view is None:
            return array
        import torch

        tensor = torch.from_numpy(array)
        return tensor.view(torch_view) if tensor.dtype != torch_view else tensor

    def names(self):
        """The names written so far."""
        return self._store.names()

    @property
    def backend(self):
        """``"io_uring"`` or ``"threads"``."""
        return self._store.backend

    @property
    def direct_io(self):
        """Whether every swap file bypasses the page cache (O_DIRECT)."""
        return self._store.direct_io

    @property
    def checksums(self):
        """Whether writes record and reads verify a crc32c."""
        return self._store.checksums

    @property
    def files(self):
        """The swap files' paths. Their names are removed as soon as the store opens them
        (a killed process leaves nothing behind), so these say where the space is."""
        return self._store.files

    def io_counters(self):
        """(chunks through registered buffers, chunks through plain ones)."""
        return self._store.io_counters()

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


def _name(name):
    if not isinstance(name, str):
        raise TypeError(f"a tensor's name is a str, not {type(name).__name__}")
    return name
