"""Shared helpers of the Python tests: the repository's data, a safetensors reader, and a
folder on a real filesystem for swap files (O_DIRECT needs one; tmpfs refuses it)."""

import json
import os
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"

_DTYPES = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "U8": np.uint8}


def read_safetensors(path):
    """{name: numpy array} of a .safetensors file (its format: an 8-byte little-endian
    header length, a JSON header of dtypes, shapes and offsets, then the bytes)."""
    raw = Path(path).read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    body = raw[8 + header_len :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        array = np.frombuffer(body[start:end], dtype=_DTYPES[info["dtype"]])
        out[name] = array.reshape(info["shape"]).copy()
    return out


@pytest.fixture
def swap_dir():
    """A fresh folder for swap files: STRATA_TEST_NVME if set, else /var/tmp (ext4 on
    the machines this is tested on), else the temporary folder."""
    base = os.environ.get("STRATA_TEST_NVME") or ("/var/tmp" if os.path.isdir("/var/tmp") else None)
    with tempfile.TemporaryDirectory(prefix="strata-pytest-", dir=base) as d:
        yield d
