"""strata from Python.

- ``strata.optim.CPUAdamW``: a ``torch.optim.Optimizer`` running strata's SIMD AdamW on
  the CPU (fp32 or 8-bit state), on the tensors' own memory.
- ``strata.io.Store``: the NVMe tier's checksummed tensor store (io_uring).
- ``strata.plan(...)`` and ``strata.doctor()``: the CLI's answers, as dicts (the settings
  reach strata typed, as keywords, not as a command line).

``import strata`` does not import torch; ``strata.optim`` does.
"""

import json as _json

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
    Raises ValueError for what the CLI would refuse.
    """
    typed = {key: value for key, value in options.items() if value is not None}
    config = None if config is None else str(config)
    return _json.loads(_native.plan_json(_json.dumps(typed), ranks, config))


def doctor(nvme=None):
    """What ``strata doctor`` finds on this machine, as a dict (``text``: its printout).

    ``nvme``: a folder, or a list of folders, to check for swap files (default: the
    temporary folder).
    """
    if nvme is None:
        paths = []
    elif isinstance(nvme, (list, tuple)):
        paths = [str(p) for p in nvme]
    else:
        paths = [str(nvme)]
    return _json.loads(_native.doctor_json(paths))
