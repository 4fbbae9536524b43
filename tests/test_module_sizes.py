"""No module of the library (areal_hpc/) or of the tools (tools/) passes MAX_LINES lines: past that a
file holds more than one idea, and is split along them (as areal_hpc/launch/doctor.py, doctor_job.py and
doctor_reports.py are). Pure file reading."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 500
FOLDERS = ("areal_hpc", "tools")


def module_lines() -> dict[str, int]:
    """{path from the repository root: its line count} of every .py file under FOLDERS."""
    return {
        str(path.relative_to(REPO)): len(path.read_text(encoding="utf-8").splitlines())
        for folder in FOLDERS
        for path in sorted((REPO / folder).rglob("*.py"))
    }


def test_there_are_modules_to_measure():
    lines = module_lines()
    assert "areal_hpc/cli.py" in lines and "tools/bench_figures.py" in lines, sorted(lines)[:10]


def test_no_module_passes_500_lines():
    over = {path: n for path, n in module_lines().items() if n > MAX_LINES}
    named = ", ".join(f"{path} ({n})" for path, n in sorted(over.items(), key=lambda item: -item[1]))
    assert not over, f"over {MAX_LINES} lines (split each along its ideas): {named}"
