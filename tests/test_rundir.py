"""The run directory (areal_hpc/rundir.py) and its checkpoints (areal_hpc/checkpoint/files.py): the config
check on resume, the lock, and checkpoints that can be trusted (the file record, the resume-time check,
retention). Files and processes only; no MPI."""

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from areal_hpc.checkpoint.files import (
    COMPLETE,
    FILES,
    checkpoint_damage,
    checkpoint_dir,
    latest_checkpoint,
    mark_complete,
    prune_checkpoints,
    record_files,
)
from areal_hpc.cli import main as cli_main
from areal_hpc.config import ConfigError, load_config
from areal_hpc.rundir import Holder, RunDirInUse, lock_run_dir, prepare_run_dir, read_lock, unlock_run_dir

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny-cpu.yaml"


def tiny(tmp_path, *overrides):
    return load_config(TINY, [f"experiment.root={tmp_path}", *overrides])


def test_resume_with_another_config_names_each_change(tmp_path):
    prepare_run_dir(tiny(tmp_path))
    with pytest.raises(ConfigError) as e:
        prepare_run_dir(tiny(tmp_path, "ppo.lr=0.1", "rollout.max_staleness=4"))
    assert "ppo.lr: 0.0003 -> 0.1" in str(e.value) and "rollout.max_staleness: 2 -> 4" in str(e.value)
    assert "train.total_steps" not in str(e.value)
    prepare_run_dir(tiny(tmp_path, "train.total_steps=900"))  # extending a run is a resume
    prepare_run_dir(tiny(tmp_path, "train.total_steps=900", "cluster.cpus_per_node=8"))  # on Slurm's nodes
    assert (tmp_path / "tiny-cpu/trial0/config.yaml").read_text().count("total_steps: 900") == 1


def test_resume_compares_the_models_shape_not_how_it_was_written(tmp_path):
    """A config that wrote out the tiny model's unset shape fields (as run directories did before they
    defaulted to null) resumes; a shape that differs is a change."""
    prepare_run_dir(tiny(tmp_path, "model.rope_theta=10000.0", "model.rms_norm_eps=1e-6", "model.head_dim=32"))
    prepare_run_dir(tiny(tmp_path))
    with pytest.raises(ConfigError, match="model.num_layers: 2 -> 4"):
        prepare_run_dir(tiny(tmp_path, "model.num_layers=4"))


def test_a_run_directory_from_before_the_recorded_split_resumes(tmp_path):
    """Launchers record the node split as allocation.gen_nodes; an older run directory left it null (the
    split came from allocation.gen_share, which is still compared)."""
    with pytest.raises(ConfigError, match="allocation.gen_nodes is not set"):  # config.yaml records a number
        prepare_run_dir(tiny(tmp_path, "cluster.nodes=4", "allocation.gen_nodes=null"))
    saved = prepare_run_dir(tiny(tmp_path, "cluster.nodes=4", "allocation.gen_nodes=3")) / "config.yaml"
    saved.write_text(saved.read_text().replace("gen_nodes: 3", "gen_nodes: null"))  # as run directories were
    prepare_run_dir(tiny(tmp_path, "cluster.nodes=4", "allocation.gen_nodes=3"))
    assert load_config(tmp_path / "tiny-cpu/trial0/config.yaml").allocation.gen_nodes == 3
    with pytest.raises(ConfigError, match="allocation.gen_nodes: 3 -> 2"):
        prepare_run_dir(tiny(tmp_path, "cluster.nodes=4", "allocation.gen_nodes=2"))
    with pytest.raises(ConfigError, match="allocation.gen_share: 0.75 -> 0.5"):
        prepare_run_dir(tiny(tmp_path, "cluster.nodes=4", "allocation.gen_nodes=3", "allocation.gen_share=0.5"))


def test_a_second_run_is_refused_naming_the_holder_and_a_dead_holders_lock_is_stale(tmp_path, capsys):
    run_dir = tmp_path / "tiny-cpu" / "trial0"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "scripts" / "hold_run_dir.py"), str(run_dir)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert first.stdout.readline().strip() == "locked"
        # what a new user tried: a second `areal-hpc run` on the directory of a running run
        assert cli_main(["run", str(TINY), f"experiment.root={tmp_path}"]) == 1
        err = capsys.readouterr().err
        assert f"is in use by process {first.pid} on host {socket.gethostname()}" in err
        assert "Ctrl-C in its terminal" in err and not (run_dir / "config.yaml").exists()  # nothing touched
    finally:
        first.kill()
        first.wait()
    # its process is gone: the lock is stale and taken over
    me = Holder.this_process()
    lock_run_dir(run_dir, me, lambda job: None)
    assert read_lock(run_dir) == me
    unlock_run_dir(run_dir, me)
    assert read_lock(run_dir) is None


def test_job_locks_and_locks_from_other_hosts(tmp_path):
    run_dir = tmp_path / "run"
    job = Holder.this_process().as_job("42")
    lock_run_dir(run_dir, job, lambda j: True)
    with pytest.raises(RunDirInUse, match=r"in use by Slurm job 42 \(submitted from .*areal-hpc cancel"):
        lock_run_dir(run_dir, Holder.this_process(), lambda j: j == "42")
    lock_run_dir(run_dir, Holder.this_process(), lambda j: False)  # the job has ended: stale
    elsewhere = Holder("other-host", 123, "99", since="2026-01-01T00:00:00Z")
    (run_dir / "LOCK").write_text(json.dumps(elsewhere.__dict__))
    with pytest.raises(RunDirInUse, match=r"process 123 on host other-host .*cannot be checked.*delete .*LOCK"):
        lock_run_dir(run_dir, Holder.this_process(), lambda j: None)


def make_checkpoint(run_dir: Path, version: int) -> Path:
    path = checkpoint_dir(run_dir, version)
    (path / "trainer").mkdir(parents=True)
    (path / "trainer" / "__0_0.distcp").write_bytes(b"x" * 5000)
    (path / "trainer" / ".metadata").write_bytes(b"meta%d" % version)
    (path / "controller.pkl").write_bytes(b"state%d" % version)
    record_files(path, threads=2)
    mark_complete(path)
    return path


def test_file_record_and_the_resume_check_skip_a_damaged_checkpoint(tmp_path, caplog):
    for v in (10, 20, 30):
        make_checkpoint(tmp_path, v)
    step30 = checkpoint_dir(tmp_path, 30)
    record = json.loads((step30 / FILES).read_text())["files"]
    assert sorted(record) == ["controller.pkl", "trainer/.metadata", "trainer/__0_0.distcp"]
    assert record["trainer/__0_0.distcp"]["size"] == 5000
    assert latest_checkpoint(tmp_path) == step30 and checkpoint_damage(step30, checksums_up_to=None) is None

    with open(step30 / "trainer" / "__0_0.distcp", "r+b") as f:  # a torn write
        f.truncate(4096)
    with caplog.at_level(logging.WARNING, "areal_hpc.rundir"):
        assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 20)
    assert f"checkpoint {step30} is damaged, skipped: trainer/__0_0.distcp has 4096 bytes, 5000 recorded" in caplog.text

    step20 = checkpoint_dir(tmp_path, 20)
    (step20 / "trainer" / ".metadata").unlink()
    assert checkpoint_damage(step20) == "trainer/.metadata is missing"
    step10 = checkpoint_dir(tmp_path, 10)
    (step10 / "controller.pkl").write_bytes(b"STATE10")  # same size, other bytes: the CRC-32 tells
    assert checkpoint_damage(step10) == "controller.pkl does not match its recorded CRC-32"
    assert latest_checkpoint(tmp_path) is None
    # a large file is checked by its size on resume, by its checksum on demand
    big = make_checkpoint(tmp_path, 40)
    (big / "trainer" / "__0_0.distcp").write_bytes(b"y" * 5000)
    assert checkpoint_damage(big, checksums_up_to=1000) is None
    assert "__0_0.distcp does not match" in checkpoint_damage(big, checksums_up_to=None)


def test_retention_keeps_the_newest_and_the_resumed_one(tmp_path):
    for v in (10, 20, 30, 40, 50):
        make_checkpoint(tmp_path, v)
    checkpoint_dir(tmp_path, 35).mkdir()  # a save that never finished
    checkpoint_dir(tmp_path, 60).mkdir()  # the save on its way
    resumed = checkpoint_dir(tmp_path, 10)
    deleted = prune_checkpoints(tmp_path, keep=2, protect=[resumed])
    assert [d.name for d in deleted] == ["step_20", "step_30", "step_35"]
    left = sorted(d.name for d in (tmp_path / "checkpoints").iterdir())
    assert left == ["step_10", "step_40", "step_50", "step_60"]
    assert (checkpoint_dir(tmp_path, 50) / COMPLETE).exists()
    assert prune_checkpoints(tmp_path, keep=0) == []  # 0 keeps every complete one
