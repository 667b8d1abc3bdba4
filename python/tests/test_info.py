"""strata.plan and strata.doctor: the CLI's answers as dicts, equal to what the `strata`
binary prints (when one is built beside this checkout)."""

import os
import re
import subprocess
from pathlib import Path

import pytest

import strata
from conftest import REPO

# nvme_mem stated: the free space of the temporary folder moves between two looks.
PLAN_FLAGS = dict(model="gpt2-xl", device_mem="24GiB", host_mem="64GiB", nvme_mem="100GiB", batch=4,
                  seq=1024, clip=0)


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
    # The free space it reports moves between two looks (other processes write to the disk).
    free = re.compile(r"[0-9.]+ [KMGT]?i?B free")
    assert free.sub("N free", strata.plan(**PLAN_FLAGS)["text"]) == free.sub("N free", out.stdout)


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


def test_plan_keywords_of_the_wrong_type_are_refused_naming_the_keyword(tmp_path):
    with pytest.raises(TypeError, match="batch"):
        strata.plan(model="gpt2", batch=object())
    with pytest.raises(ValueError, match="--clip"):
        strata.plan(model="gpt2", clip=float("nan"))
    with pytest.raises(ValueError, match="--clip"):
        strata.plan(model="gpt2", clip=float("inf"))
    with pytest.raises(ValueError, match="ranks"):
        strata.plan(model="gpt2", ranks=-1)
    with pytest.raises(TypeError, match="ranks"):
        strata.plan(model="gpt2", ranks="2")
    with pytest.raises(TypeError, match="config"):
        strata.plan(model="gpt2", config=3)
    # The CLI's own checks: sizes are strings, a list for nvme.
    with pytest.raises(ValueError, match="--device-mem must be a size string"):
        strata.plan(model="gpt2", device_mem=24)
    with pytest.raises(ValueError, match="unknown unit 'xb'"):
        strata.plan(model="gpt2", device_mem="1XB")
    with pytest.raises(ValueError, match="--batch must be a whole number"):
        strata.plan(model="gpt2", batch="4")


def test_plan_takes_pathlib_paths_as_the_cli_takes_folders(tmp_path):
    r = strata.plan(model="gpt2", nvme=[tmp_path], host_mem="1GiB", nvme_mem="1GiB")
    s = strata.plan(model="gpt2", nvme=[str(tmp_path)], host_mem="1GiB", nvme_mem="1GiB")
    free = re.compile(r"[0-9.]+ [KMGT]?i?B free")  # moves between two looks
    assert free.sub("N free", r["text"]) == free.sub("N free", s["text"])
    config = tmp_path / "plan.toml"
    config.write_text('batch = 2\n')
    assert strata.plan(model="gpt2", config=config)["batch"] == 2


def test_doctor_refuses_a_folder_that_is_not_a_path():
    with pytest.raises(TypeError, match="nvme"):
        strata.doctor(nvme=3)
