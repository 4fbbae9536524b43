"""`areal-hpc doctor`'s probe job: the run's own heterogeneous job (`render_sbatch` with a stand-in command,
areal_hpc/launch/doctor_probe.py on every rank) under a short time limit, so it asks for exactly what the run
will. Submitted, waited for, its ranks' reports read back and judged (areal_hpc/launch/doctor_reports.py);
they go to RUN_DIR/.doctor/probe/<time>/, removed when every check passes.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

from areal_hpc.config import Config
from areal_hpc.launch import LaunchError
from areal_hpc.launch.doctor_reports import Check, evaluate
from areal_hpc.launch.record import ACTIVE, SqueueError, query_states
from areal_hpc.launch.sbatch import render_sbatch
from areal_hpc.launch.slurm import HetSlurmExecutor, describe_request
from areal_hpc.layout import Layout, Role

PROBE = Path(__file__).resolve().parent / "doctor_probe.py"
PROBE_TIME = "00:05:00"
"""Time limit of the probe job (it takes about a minute; a hung MPI start ends there)."""


def probe(cfg: Config, python: str, wait_s: float, say) -> list[Check]:
    """Submit the probe job, wait for it, read what its ranks wrote."""
    layout = Layout.from_config(cfg)
    run_dir = (Path.cwd() / cfg.run_dir).resolve()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    experiment = dataclasses.replace(cfg.experiment, root=str(run_dir / ".doctor"), name="probe", trial=stamp)
    cluster = dataclasses.replace(cfg.cluster, time=PROBE_TIME, max_requeues=0)
    pcfg = dataclasses.replace(cfg, experiment=experiment, cluster=cluster)
    reports = pcfg.run_dir / "reports"
    reports.mkdir(parents=True)
    token = uuid.uuid4().hex
    (reports / "token").write_text(token)
    starts = probe_starts(layout)
    sources = probe_sources(layout)
    interface = cfg.cluster.network_interface
    command = [python, "-u", str(PROBE), str(reports), cfg.cluster.device, starts, sources, interface]
    script = render_sbatch(pcfg, workdir=Path.cwd(), python=python, command=command)
    try:
        job = HetSlurmExecutor(pcfg.run_dir / "slurm", script).submit_script()
    except LaunchError as e:
        return [Check("run directory", "FAIL", f"the probe job was not accepted: {e}", "see the partitions check")]
    say(
        f"      probe job {job.job_id} submitted ({describe_request(cfg)}); waiting for it (up to {wait_s:.0f} s to start)"
    )
    state = _wait(job.job_id, wait_s, say)
    if state == "PENDING":
        subprocess.run(["scancel", job.job_id], capture_output=True)
        return [
            Check(
                "run directory", "FAIL", f"the probe job did not start within {wait_s:.0f} s",
                "wait for free nodes (areal-hpc doctor --wait), or ask for fewer",
            )
        ]  # fmt: skip
    found = {}
    for p in reports.glob("rank*.json"):
        try:
            found[int(p.stem[4:])] = json.loads(p.read_text())
        except (ValueError, OSError):
            continue
    checks = evaluate(cfg, layout, found, token, _login_versions(), pcfg.run_dir)
    if all(c.status != "FAIL" for c in checks):  # nothing to look at: leave no trace (but a run's files)
        shutil.rmtree(pcfg.run_dir, ignore_errors=True)
        for empty in (pcfg.run_dir.parent, run_dir / ".doctor", run_dir):
            try:
                empty.rmdir()
            except OSError:
                break
    return checks


def _wait(job_id: str, wait_s: float, say) -> str:
    """Poll until the job has ended ("ENDED") or is still pending after wait_s ("PENDING")."""
    t0, last_say, answered = time.monotonic(), 0.0, time.monotonic()
    while True:
        try:
            info = query_states(job_id)
        except SqueueError:  # a busy controller: ask again, for a while
            if time.monotonic() - answered > 300:
                raise
            time.sleep(2)
            continue
        answered = time.monotonic()
        state = info[job_id]["State"] if info else "ENDED"
        if state not in ACTIVE:
            return "ENDED"
        now = time.monotonic() - t0
        if state == "PENDING" and now > wait_s:
            return "PENDING"
        if now - last_say > 30:
            reasons = {v.get("Reason") for k, v in (info or {}).items() if "+" in k} - {None, "None"}
            say(f"      probe job {job_id}: {state}" + (f" ({', '.join(sorted(reasons))})" if reasons else ""))
            last_say = now
        time.sleep(2)


def _login_versions() -> dict[str, str]:
    out = subprocess.run([sys.executable, str(PROBE), "--versions"], capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def probe_starts(layout: Layout) -> str:
    """The probe's STARTS: the first world rank of each role, in `Role` order ("0,1,2,3")."""
    return ",".join(str(layout.ranks(role).start) for role in Role)


def probe_sources(layout: Layout) -> str:
    """The probe's SOURCES: each weight-sync group's source (`Layout.sync_sources`) as stage:expert
    rank:world rank, comma-separated ("0:0:4,0:1:5,1:0:8,1:1:9")."""
    return ",".join(f"{stage}:{e}:{r}" for stage, e, r in layout.sync_sources())
