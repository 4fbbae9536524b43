"""The run directory (areal_hpc/rundir.py) and its checkpoints (areal_hpc/checkpoint/files.py): the config
check on resume (what each kind of setting may do, and the record of changes), the lock, and checkpoints that can be trusted (the file record, the resume-time check,
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
from areal_hpc.rundir import (
    HISTORY,
    Change,
    Holder,
    RunDirInUse,
    changes_at,
    lock_run_dir,
    prepare_run_dir,
    read_lock,
    unlock_run_dir,
)

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny-cpu.yaml"


def tiny(tmp_path, *overrides):
    return load_config(TINY, [f"experiment.root={tmp_path}", *overrides])


def test_a_resume_refuses_identity_and_unpermitted_training_changes_naming_each(tmp_path):
    run_dir = prepare_run_dir(tiny(tmp_path))
    make_checkpoint(run_dir, 4)
    with pytest.raises(ConfigError) as e:
        prepare_run_dir(tiny(tmp_path, "ppo.lr=0.1", "rollout.max_staleness=4", "train.save_every=5"))
    lines = [line.strip() for line in str(e.value).splitlines()]
    assert "ppo.lr: 0.0003 -> 0.1  (training: --allow-change ppo.lr changes it from step 5 on)" in lines
    assert "rollout.max_staleness: 2 -> 4  (identity: another experiment)" in lines
    assert "save_every" not in str(e.value)  # operational: not refused
    with pytest.raises(ConfigError, match="rollout.max_staleness: 2 -> 4"):  # no permission lets identity change
        prepare_run_dir(tiny(tmp_path, "ppo.lr=0.1", "rollout.max_staleness=4"), allow_change=["ppo", "rollout"])
    with pytest.raises(ConfigError, match="--allow-change rollout.group_size: .* is identity"):
        prepare_run_dir(tiny(tmp_path), allow_change=["rollout.group_size"])
    with pytest.raises(ConfigError, match=r"lora.rank: 0 -> 8  \(identity: another experiment\)"):  # LoRA's rank too
        prepare_run_dir(tiny(tmp_path, "lora.rank=8"), allow_change=["lora"])
    with pytest.raises(ConfigError, match="--allow-change ppo.lrr: no such config field or section"):
        prepare_run_dir(tiny(tmp_path), allow_change=["ppo.lrr"])
    assert not (run_dir / HISTORY).exists() and load_config(run_dir / "config.yaml") == tiny(tmp_path)


def test_operational_changes_resume_and_the_run_says_what_changed(tmp_path, caplog):
    """The issue's case: resubmitted where there is room, for longer, saving and printing at another
    cadence, on another node split."""
    run_dir = prepare_run_dir(tiny(tmp_path))
    make_checkpoint(run_dir, 4)
    changed = tiny(
        tmp_path,
        "train.save_every=5",
        "cluster.time=08:00:00",
        "logging.progress_every=1",
        "cluster.nodes=4",
        "allocation.gen_gpus=2",
        "allocation.train_tp=2",
        "train.total_steps=900",
    )
    with caplog.at_level(logging.WARNING, logger="areal_hpc.rundir"):
        prepare_run_dir(changed)
    said = caplog.text
    assert "resuming from step 4 with changed settings (recorded in config_history.jsonl)" in said
    for line in ("train.save_every: 100 -> 5  (operational)", "cluster.time: 00:30:00 -> 08:00:00  (operational)"):
        assert line in said
    assert load_config(run_dir / "config.yaml") == changed
    rows = history(run_dir)
    assert {r["field"]: (r["old"], r["new"]) for r in rows} == {
        "train.save_every": (100, 5),
        "cluster.time": ("00:30:00", "08:00:00"),
        "logging.progress_every": (10, 1),
        "cluster.nodes": (2, 4),
        "allocation.gen_gpus": (1, 2),
        "allocation.train_tp": (1, 2),
        "train.total_steps": (600, 900),
    }
    assert {(r["step"], r["kind"]) for r in rows} == {(4, "operational")}
    assert changes_at(run_dir, 4) == [f"{Change(r['field'], r['old'], r['new'])}  (operational)" for r in rows]
    assert changes_at(run_dir, 8) == []  # a later checkpoint was trained with these settings


def test_a_training_change_needs_permission_and_is_recorded_with_it(tmp_path, caplog):
    run_dir = prepare_run_dir(tiny(tmp_path))
    make_checkpoint(run_dir, 6)
    with pytest.raises(ConfigError, match="--allow-change ppo.lr changes it from step 7 on"):
        prepare_run_dir(tiny(tmp_path, "ppo.lr=0.0001"))
    prepare_run_dir(tiny(tmp_path, "ppo.lr=0.0001"), allow_change=["ppo.lr"])
    [row] = history(run_dir)
    assert row["step"] == 6 and row["time"].endswith("Z")
    assert {k: row[k] for k in ("field", "kind", "old", "new", "allowed_by")} == {
        "field": "ppo.lr",
        "kind": "training",
        "old": 0.0003,
        "new": 0.0001,
        "allowed_by": "--allow-change ppo.lr",
    }
    # The same command again (a resubmission), or the job's requeue (it runs the saved config.yaml): the
    # change is made already, nothing is refused or recorded twice.
    prepare_run_dir(tiny(tmp_path, "ppo.lr=0.0001"))
    assert len(history(run_dir)) == 1
    # A section's permission covers its training fields.
    make_checkpoint(run_dir, 8)
    prepare_run_dir(tiny(tmp_path, "ppo.lr=0.0001", "ppo.kl_coef=0.01", "ppo.minibatches=2"), allow_change=["ppo"])
    assert [(r["step"], r["field"], r["allowed_by"]) for r in history(run_dir)[1:]] == [
        (8, "ppo.kl_coef", "--allow-change ppo"),
        (8, "ppo.minibatches", "--allow-change ppo"),
    ]


def test_resuming_a_finished_run_warns_that_it_trains_nothing(tmp_path, caplog):
    run_dir = prepare_run_dir(tiny(tmp_path, "train.total_steps=4"))
    make_checkpoint(run_dir, 4)
    with caplog.at_level(logging.WARNING, logger="areal_hpc.rundir"):
        prepare_run_dir(tiny(tmp_path, "train.total_steps=4"))
    assert "trains nothing: its checkpoint step_4 has reached train.total_steps (4)" in caplog.text


def test_a_cli_resume_says_what_changed_and_refuses_a_training_change(tmp_path, caplog, capsys):
    """Through the command line: `render` prepares the run directory as `submit` does; `run` refuses
    before anything starts."""
    out, root = tmp_path / "job.sbatch", tmp_path / "runs"
    render = ["render", str(TINY), "-o", str(out), f"experiment.root={root}", "cluster.cpus_per_node=8"]
    assert cli_main([*render, "--nodes", "3"]) == 0
    make_checkpoint(root / "tiny-cpu/trial0", 2)
    with caplog.at_level(logging.WARNING, logger="areal_hpc.rundir"):
        assert cli_main([*render, "--nodes", "4", "cluster.time=08:00:00", "logging.progress_every=5"]) == 0
    assert "cluster.nodes: 3 -> 4  (operational)" in caplog.text
    assert "logging.progress_every: 10 -> 5  (operational)" in caplog.text
    run = ["run", str(TINY), f"experiment.root={root}", "cluster.nodes=4", "cluster.cpus_per_node=8"]
    assert cli_main([*run, "cluster.time=08:00:00", "logging.progress_every=5", "ppo.lr=0.001"]) == 2
    assert "ppo.lr: 0.0003 -> 0.001  (training: --allow-change ppo.lr" in capsys.readouterr().err
    over = ["cluster.time=08:00:00", "logging.progress_every=5", "ppo.lr=0.001", "--allow-change", "ppo.lr"]
    assert cli_main([*render, "--nodes", "4", *over]) == 0
    assert [r["field"] for r in history(root / "tiny-cpu/trial0")][-1] == "ppo.lr"


def history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / HISTORY).read_text().splitlines()]


def test_resume_compares_the_models_shape_not_how_it_was_written(tmp_path):
    """A config that wrote out the tiny model's unset shape fields (as run directories did before they
    defaulted to null) resumes; a shape that differs is a change."""
    prepare_run_dir(tiny(tmp_path, "model.rope_theta=10000.0", "model.rms_norm_eps=1e-6", "model.head_dim=32"))
    prepare_run_dir(tiny(tmp_path))
    with pytest.raises(ConfigError, match="model.num_layers: 2 -> 4"):
        prepare_run_dir(tiny(tmp_path, "model.num_layers=4"))


def test_a_run_directory_records_its_gpu_split(tmp_path):
    with pytest.raises(ConfigError, match="allocation.gen_gpus is not set"):  # config.yaml records a number
        prepare_run_dir(tiny(tmp_path, "cluster.nodes=4", "allocation.gen_gpus=null"))


def test_a_run_directory_that_recorded_its_split_in_nodes_resumes_unchanged(tmp_path, caplog):
    """A run directory from before gen_gpus: its config.yaml says gen_nodes 1 (of 1 GPU each), which is gen_gpus 1."""
    run_dir = prepare_run_dir(tiny(tmp_path))
    recorded = (run_dir / "config.yaml").read_text()
    assert "  gen_gpus: 1\n" in recorded and "  gen_nodes: null\n" in recorded
    (run_dir / "config.yaml").write_text(
        recorded.replace("  gen_gpus: 1\n", "").replace("gen_nodes: null", "gen_nodes: 1")
    )
    make_checkpoint(run_dir, 4)
    with caplog.at_level(logging.WARNING, logger="areal_hpc.rundir"):
        prepare_run_dir(tiny(tmp_path))
    assert "changed settings" not in caplog.text and not (run_dir / HISTORY).exists()
    assert load_config(run_dir / "config.yaml").allocation.gen_gpus == 1


def test_a_second_run_is_refused_naming_the_holder_and_a_dead_holders_lock_is_stale(tmp_path, capsys):
    run_dir = tmp_path / "tiny-cpu" / "trial0"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "support" / "hold_run_dir.py"), str(run_dir)],
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
