"""The suite's time report (tests.support.cpu_time): the machine's busy CPU read from /proc/stat, and the lines
`--cpu-time` prints."""

import os

from tests.support.cpu_time import Span, busy_cpu_s, report


def test_busy_cpu_leaves_out_idle_and_iowait():
    hz = os.sysconf("SC_CLK_TCK")
    # user nice system idle iowait irq softirq steal guest guest_nice
    line = f"cpu  {3 * hz} {hz} {2 * hz} {100 * hz} {50 * hz} {hz} {hz} {hz} {7 * hz} 0"
    assert busy_cpu_s(line) == 9.0
    assert busy_cpu_s() > 0  # this machine's


def test_files_are_ranked_by_wall_time_and_the_rest_summed():
    spans = {
        "tests/a.py": [Span(10, 4)],
        "tests/b.py": [Span(30, 60), Span(10, 20)],
        "tests/c.py": [Span(2, 1)],
        "tests/d.py": [Span(1, 1)],
    }
    lines = report(spans, Span(60, 90), n_cores=2, top=2)
    assert [line.split()[-1] for line in lines[1:3]] == ["tests/b.py", "tests/a.py"]
    assert lines[1].split()[:4] == ["40.0", "80.0", "100%", "2"]
    assert lines[2].split()[:4] == ["10.0", "4.0", "20%", "1"]
    assert lines[3].split()[:4] == ["3.0", "2.0", "33%", "2"] and lines[3].endswith("the other 2 files")
    assert lines[4].split()[:4] == ["60.0", "90.0", "75%", "5"] and lines[4].endswith("the session")
    assert lines[5] == "the session's CPU alone takes 45 s on 2 cores at full use; it took 60 s"


def test_a_session_without_spans_reports_its_own_line():
    """pytest-xdist's: its tests ran in the workers."""
    lines = report({}, Span(8, 4), n_cores=2)
    assert len(lines) == 3 and lines[1].split()[:4] == ["8.0", "4.0", "25%", "-"]
