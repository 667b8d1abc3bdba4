"""strata from Python.

- ``strata.optim.CPUAdamW``: a ``torch.optim.Optimizer`` running strata's SIMD AdamW on
  the CPU (fp32 or 8-bit state), on the tensors' own memory.
- ``strata.io.Store``: the NVMe tier's checksummed tensor store (io_uring).
- ``strata.plan(...)`` and ``strata.doctor()``: the CLI's answers, as dicts (the settings
  reach strata typed, as keywords, not as a command line).

``import strata`` does not import torch; ``strata.optim`` does.
"""

import json as _json
import math as _math
import os as _os

from . import _native
from . import io

__version__ = _native.__version__
__all__ = ["plan", "doctor", "io", "optim", "__version__"]


def __getattr__(name):
    # strata.optim needs torch; import it only when asked for.
    if name == "optim":
        import importlib

        return importlib.import_module(".optim", __name__)
    raise AttributeError(f"module 'strata' has no attribute {name!r}")


def plan(ranks=1, config=None, **options):
    """What ``strata plan`` answers, as a dict.

    Takes ``strata plan``'s flags as keyword arguments, named as ``--print-config`` names
    them and typed (``model="gpt2-xl", device_mem="24GiB", host_mem="64GiB", batch=4,
    seq=1024, clip=0``; a list for a flag that repeats, ``nvme=["/mnt/a", "/mnt/b"]``;
    ``True`` or ``False`` for a switch; ``None`` leaves a setting as it is), ``ranks=2`` to
    plan one rank of two, and ``config`` for a TOML file of settings the keywords
    override. Keys: the model and step, ``ranks``, ``budgets``, ``rates``, one row per
    built-in policy in ``policies`` and the policies refused for this step, with the
    reason, in ``unavailable``, ``auto`` (the plan auto picks, or None with the reason in
    ``no_fit``), and ``text``, the CLI's printout.
    Raises ValueError for what the CLI would refuse, TypeError for a value no flag takes
    (a path may be a ``pathlib.Path``).
    """
    typed = {key: _keyword(key, value) for key, value in options.items() if value is not None}
    if isinstance(ranks, bool) or not isinstance(ranks, int):
        raise TypeError(f"ranks must be an int, not {type(ranks).__name__}")
    if ranks < 1:
        raise ValueError(f"ranks={ranks}: a step needs at least one rank")
    config = None if config is None else _path("config", config)
    return _json.loads(_native.plan_json(_json.dumps(typed), ranks, config))


def _path(name, value):
    """A path given as a str, bytes or os.PathLike, as a str; TypeError for the rest."""
    if not isinstance(value, (str, bytes, _os.PathLike)):
        raise TypeError(f"{name} must be a path (str or os.PathLike), not {type(value).__name__}")
    return _os.fsdecode(_os.fspath(value))


def _keyword(key, value):
    """A keyword of ``plan`` as the JSON value the settings take: paths as strings, and
    what JSON cannot carry (non-finite numbers, other objects) refused naming the flag."""
    flag = "--" + key.replace("_", "-")
    if isinstance(value, (list, tuple)):
        return [_keyword(key, v) for v in value]
    if isinstance(value, _os.PathLike):
        return _os.fsdecode(_os.fspath(value))
    if isinstance(value, float) and not _math.isfinite(value):
        raise ValueError(f"{flag} must be a finite number, not {value}")
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(
        f"{key}={value!r}: {flag} takes a str, int, float, bool or a list of them, "
        f"not {type(value).__name__}"
    )


def doctor(nvme=None):
    """What ``strata doctor`` finds on this machine, as a dict (``text``: its printout).

    ``nvme``: a folder, or a list of folders, to check for swap files (default: the
    temporary folder).
    """
    if nvme is None:
        paths = []
    elif isinstance(nvme, (list, tuple)):
        paths = [_path("nvme", p) for p in nvme]
    else:
        paths = [_path("nvme", nvme)]
    return _json.loads(_native.doctor_json(paths))
