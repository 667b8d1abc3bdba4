"""strata.plan and strata.doctor: the CLI's answers as dicts, equal to what the `strata`
binary prints (when one is built beside this checkout)."""

import os
import subprocess
from pathlib import Path

import pytest

import strata
from conftest import REPO

PLAN_FLAGS = dict(model="gpt2-xl", device_mem="24GiB", host_mem="64GiB", batch=4, seq=1024, clip=0)


def _cli():
    """The strata binary: STRATA_CLI, else target/{debug,release}/strata of this checkout."""
    candidates = [os.environ.get("STRATA_CLI")] + [
        REPO / "target" / profile / "strata" for profile in ("debug", "release")
    ]
    for c in candidates:
        if c and Path(c).is_file():
            return str(c)
    return None


def test_plan_answers_as_a_dict():
    r = strata.plan(**PLAN_FLAGS)
    assert r["model"] == "gpt2-xl"
    assert 1.5e9 < r["params"] < 1.6e9
    assert r["training_state_bytes"] == 16 * r["params"]
    assert r["budgets"]["device"] == 24 << 30 and r["budgets"]["host"] == 64 << 30
    names = [row["policy"] for row in r["policies"]]
    assert names[0] == "all-on-device" and len(names) == 4
    by_name = {row["policy"]: row for row in r["policies"]}
    assert by_name["all-on-device"]["fits"] is False
    assert by_name["all-on-device"]["short"] == ["device"]
    assert by_name["cpu-offload"]["fits"] is True
    assert r["auto"]["policy"] in by_name or r["auto"]["policy"].split("(")[0] in str(names)
    assert r["auto"]["peak_bytes"]["device"] <= r["budgets"]["device"]
    assert r["no_fit"] is None
    assert "auto picks" in r["text"]


def test_plan_says_when_nothing_fits():
    r = strata.plan(model="gpt2-xl", device_mem="64MiB", host_mem="64MiB", nvme=[os.getcwd()],
                    batch=1, seq=64)
    assert r["auto"] is None and r["no_fit"]
    assert not any(row["fits"] for row in r["policies"])


def test_plan_refuses_what_the_cli_refuses():
    with pytest.raises(ValueError, match="--policy"):
        strata.plan(policy="fastest")
    with pytest.raises(ValueError, match="unexpected argument"):
        strata.plan(colour="blue")


@pytest.mark.skipif(_cli() is None, reason="no strata binary built in target/ (cargo build)")
def test_plan_text_is_what_the_cli_prints():
    flags = []
    for k, v in PLAN_FLAGS.items():
        flags += ["--" + k.replace("_", "-"), str(v)]
    out = subprocess.run([_cli(), "plan", *flags], capture_output=True, text=True, check=True)
    assert strata.plan(**PLAN_FLAGS)["text"] == out.stdout


def test_doctor_answers_as_a_dict(tmp_path):
    r = strata.doctor(nvme=str(tmp_path))
    for key in ("cpu", "memory", "io_uring", "nvme", "cuda", "summary"):
        assert key in r, key
    assert r["nvme"][0]["path"] == str(tmp_path)
    assert r["summary"]["io_backend"] in ("io_uring", "threads")
    assert r["strata_version"] == strata.__version__
    assert "summary:" in r["text"]


@pytest.mark.skipif(_cli() is None, reason="no strata binary built in target/ (cargo build)")
def test_doctor_json_is_what_the_cli_writes(tmp_path):
    import json

    out = tmp_path / "doctor.json"
    subprocess.run([_cli(), "doctor", "--nvme", str(tmp_path), "--json", str(out)],
                   capture_output=True, check=True)
    cli = json.loads(out.read_text())
    ours = strata.doctor(nvme=str(tmp_path))
    # Facts that move between two looks (free memory and space) aside, the two agree.
    # Not the CUDA library probe's reason: a process that imported torch has NVRTC and
    # cuBLAS from torch's wheels loaded already, the CLI's process has not.
    for key in ("cpu", "io_uring"):
        assert ours[key] == cli[key], key
    assert ours["summary"]["io_backend"] == cli["summary"]["io_backend"]
    assert ours["summary"]["device"] == cli["summary"]["device"]
    assert ours["cuda"]["usable_for_training"] == cli["cuda"]["usable_for_training"]
    assert ours["nvme"][0]["filesystem"] == cli["nvme"][0]["filesystem"]
