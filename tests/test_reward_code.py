"""Code reward: tests run in a bubblewrap sandbox; hostile programs score 0 and leave the host as it was."""

import json
import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from areal_hpc.reward.code import (
    STDERR_BYTES,
    SandboxLimits,
    code_reward,
    code_score,
    extract_program,
    output_matches,
    run_program,
    sandbox_uid,
)

FAST = SandboxLimits(cpu_s=1, wall_s=2.0, memory_mb=256, processes=8, output_bytes=64 << 10)
ADD = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 7\n", "output": "12"}, {"input": "0 0", "output": "0"}]


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\nDone."


def sandbox_processes() -> list[int]:
    """Pids of processes running as this process's sandbox uid (`sandbox_uid`): those of another process (a
    run beside the tests) are not counted."""
    ours = sandbox_uid()
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                uid = int((d / "status").read_text().split("Uid:")[1].split()[0])
            except (OSError, IndexError):
                continue
            if uid == ours:
                pids.append(int(d.name))
    return pids


def processes_with(marker: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker.encode() in (d / "cmdline").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                continue
    return pids


def test_extract_program():
    assert extract_program("```python\nprint(1)\n```") == "print(1)\n"
    assert extract_program("```py\na\n```\ntext\n```python\nb\n```") == "b\n"
    assert extract_program("```python\na\n```\n```\nplain\n```") == "a\n", "a python-tagged block wins"
    assert extract_program("```\nplain\n```") == "plain\n"
    assert extract_program("```cpp\nint main(){}\n```") is None
    assert extract_program("no code") is None
    assert extract_program("```python\nunterminated") is None


def test_output_comparison():
    assert output_matches("3\n", "3")
    assert output_matches("a  \nb\t\n\n\n", "a\nb")
    assert output_matches("a\r\nb\r\n", "a\nb\n")
    assert not output_matches("3\n4\n", "3\n")
    assert not output_matches(" 3", "3"), "leading whitespace counts"


def test_fraction_of_tests_passed():
    good = fenced("a, b = map(int, input().split())\nprint(a + b)")
    assert code_score(good, ADD, limits=FAST) == (1.0, "ok")
    assert code_reward(good, json.dumps(ADD), limits=FAST) == 1.0, "tests as JSON work too"
    wrong_on_zero = fenced("a, b = map(int, input().split())\nprint(a + b if a else 1)")
    assert code_reward(wrong_on_zero, ADD, limits=FAST) == pytest.approx(2 / 3)
    crashes = fenced("a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(1)")
    assert code_reward(crashes, ADD, limits=FAST) == 0.0, "a non-zero exit fails the test"
    assert code_score("no code at all", ADD, limits=FAST) == (0.0, "ok")


def test_bad_tests_are_an_error_not_an_exception():
    good = fenced("print(1)")
    for tests in ["not json", "[]", '[{"input": 1}]', None, 42]:
        reward, reason = code_score(good, tests, limits=FAST)
        assert reward == 0.0 and reason.startswith("error: 'tests"), (tests, reason)
    assert code_score(None, ADD, limits=FAST)[0] == 0.0


def test_endless_loop_hits_the_cpu_limit():
    started = time.monotonic()
    assert code_score(fenced("while True:\n    pass"), ADD[:1], limits=FAST) == (0.0, "ok")
    assert time.monotonic() - started < 2 * FAST.wall_s
    assert sandbox_processes() == []


def test_sleeper_hits_the_wall_clock_limit():
    started = time.monotonic()
    run = run_program("import time\ntime.sleep(60)", limits=FAST)
    assert run.status == "timeout" and time.monotonic() - started < FAST.wall_s + 1
    assert sandbox_processes() == []


def test_call_time_limit_scores_zero_with_reason_timeout():
    started = time.monotonic()
    slow = fenced("import time\ntime.sleep(0.4)\nprint(3)")
    tests = [{"input": "", "output": "3"}] * 10
    assert code_score(slow, tests, timeout_s=1.0, limits=FAST) == (0.0, "timeout")
    assert time.monotonic() - started < 2.0


def test_memory_hog_fails_and_host_is_unharmed():
    hog = fenced("blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))\nprint('survived')")
    run = run_program(extract_program(hog), limits=FAST)
    assert run.exit_code != 0 and "survived" not in run.stdout
    assert code_reward(hog, [{"input": "", "output": "survived"}], limits=FAST) == 0.0


def test_fork_bomb_is_contained_and_leaves_no_process():
    bomb = fenced("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    started = time.monotonic()
    assert code_reward(bomb, [{"input": "", "output": ""}], limits=FAST) == 0.0
    assert time.monotonic() - started < 2 * FAST.wall_s
    assert sandbox_processes() == []
    # The process limit holds: at most `processes` run at once.
    count = run_program(
        "import os, time\nn = 0\ntry:\n    for _ in range(100):\n        if os.fork() == 0:\n"
        "            time.sleep(30)\n            os._exit(0)\n        n += 1\nexcept OSError:\n    pass\nprint(n)",
        limits=FAST,
    )
    assert int(count.stdout) < FAST.processes
    assert sandbox_processes() == []


def test_daemonised_children_are_killed_on_return():
    marker = f"{uuid.uuid4().int % 10**6}.{uuid.uuid4().int % 10**6}"
    program = (
        "import os\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv('/usr/bin/sleep', ['sleep', '{marker}'])\n"
        "    os._exit(0)\n"
        "print('parent done')\n"
    )
    run = run_program(program, limits=FAST)
    assert run.stdout == "parent done\n" and run.exit_code == 0
    time.sleep(0.1)
    assert processes_with(marker) == [], "the daemon outlived the sandbox"
    assert sandbox_processes() == []


def test_files_outside_tmp_cannot_be_written_and_tmp_is_private(tmp_path):
    probe = Path("/var/tmp") / f"areal-probe-{uuid.uuid4().hex}"
    host_tmp_file = Path("/tmp") / f"areal-host-{uuid.uuid4().hex}"
    host_tmp_file.write_text("host")
    repo_probe = Path(__file__).resolve().parent / f"probe-{uuid.uuid4().hex}"
    targets = [probe, repo_probe, Path("/usr/areal-probe"), Path("/probe"), Path(os.path.realpath(os.sys.executable))]
    program = (
        "import os\n"
        f"for path in {[str(t) for t in targets]!r}:\n"
        "    try:\n"
        "        with open(path, 'a') as f:\n"
        "            f.write('pwned')\n"
        "        print('wrote', path)\n"
        "    except OSError as e:\n"
        "        print('refused', path, e.errno)\n"
        f"print('sees host tmp', os.path.exists({str(host_tmp_file)!r}))\n"
        "open('/tmp/inside', 'w').write('x')\n"
        "print('tmp ok')\n"
    )
    try:
        run = run_program(program, limits=FAST)
        assert run.exit_code == 0, run
        assert "wrote" not in run.stdout and run.stdout.count("refused") == len(targets)
        assert "sees host tmp False" in run.stdout and "tmp ok" in run.stdout
        assert not probe.exists() and not repo_probe.exists() and not Path("/usr/areal-probe").exists()
        assert not Path("/tmp/inside").exists()
        # /tmp is small: a program cannot fill the host's memory through it
        fill = run_program("open('/tmp/big', 'wb').write(b'x' * (200 << 20))\nprint('filled')", limits=FAST)
        assert "filled" not in fill.stdout
    finally:
        host_tmp_file.unlink()


def test_no_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    program = (
        "import socket\n"
        "for host in ['127.0.0.1', '10.0.0.1', 'pypi.org']:\n"
        "    try:\n"
        f"        socket.create_connection((host, {port}), timeout=1).close()\n"
        "        print('connected', host)\n"
        "    except OSError as e:\n"
        "        print('no', host)\n"
    )
    try:
        run = run_program(program, limits=FAST)
        assert "connected" not in run.stdout and run.stdout.count("no ") == 3, run
        assert code_reward(fenced(program), [{"input": "", "output": "connected 127.0.0.1"}], limits=FAST) == 0.0
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()


def test_cannot_signal_the_caller_or_other_host_processes():
    canary = subprocess.Popen(["sleep", "60"])
    try:
        program = (
            "import os, signal\n"
            f"for pid in [{canary.pid}, {os.getpid()}, os.getppid(), 1, -1]:\n"
            "    try:\n"
            "        os.kill(pid, signal.SIGKILL)\n"
            "        print('killed', pid)\n"
            "    except OSError as e:\n"
            "        print('refused', pid)\n"
        )
        run = run_program(program, limits=FAST)
        assert f"killed {canary.pid}" not in run.stdout and f"killed {os.getpid()}" not in run.stdout
        time.sleep(0.1)
        assert canary.poll() is None, "a host process was signalled from the sandbox"
    finally:
        canary.kill()
        canary.wait()


def test_callers_environment_is_not_visible(monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("AREAL_TEST_SECRET", secret)
    program = (
        "import os\n"
        "print(dict(os.environ))\n"
        "for d in os.listdir('/proc'):\n"
        "    try:\n"
        "        print(open(f'/proc/{d}/environ', 'rb').read())\n"
        "    except OSError:\n"
        "        pass\n"
    )
    run = run_program(program)  # the default limits: FAST's 2 s of wall time is short for a busy machine
    assert run.exit_code == 0 and "PATH" in run.stdout, run
    assert secret not in run.stdout and "AREAL_TEST_SECRET" not in run.stdout
    leak = fenced("import os\nprint(os.environ.get('AREAL_TEST_SECRET', 'none'))")
    assert code_reward(leak, [{"input": "", "output": secret}], limits=FAST) == 0.0


def test_output_flood_is_capped():
    started = time.monotonic()
    run = run_program("while True:\n    print('x' * 4096)", limits=FAST)
    assert run.status == "output-limit" and len(run.stdout) <= FAST.output_bytes
    assert time.monotonic() - started < FAST.wall_s
    flood = fenced("import sys\nwhile True:\n    sys.stderr.write('e' * 65536)")
    assert code_reward(flood, [{"input": "", "output": ""}], limits=FAST) == 0.0
    assert sandbox_processes() == []


def test_stderr_tail_is_kept_and_capped():
    run = run_program(
        "import sys\nprint('out')\nsys.stderr.write('e' * 50000)\nraise SystemExit('the end')", limits=FAST
    )
    assert run.stdout == "out\n" and run.exit_code == 1 and run.status == "ok"
    assert len(run.stderr.encode()) == STDERR_BYTES and run.stderr.endswith("e" * 100 + "the end\n")
    assert run_program("print(1)", limits=FAST).stderr == ""


def test_input_larger_than_a_pipe_buffer():
    big = "\n".join(str(i) for i in range(100_000))
    program = fenced("import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))")
    assert code_reward(program, [{"input": big, "output": str(sum(range(100_000)))}], limits=FAST) == 1.0


def test_caller_survives_kill_of_its_own_group():
    """A program cannot reach our process group: bwrap runs in a new session and PID namespace."""
    before = signal.getsignal(signal.SIGTERM)
    run = run_program("import os, signal\nos.killpg(0, signal.SIGKILL)\nprint('after')", limits=FAST)
    assert run.exit_code != 0 and signal.getsignal(signal.SIGTERM) == before
