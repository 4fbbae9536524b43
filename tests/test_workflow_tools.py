"""The workflow tools: the calculator evaluates arithmetic and refuses everything else with a ToolError;
the python tool runs in the sandbox; `run_tool` and the `ToolPool` answer every call with text, once."""

import os
import time

import pytest

from areal_hpc.config.schema import RolloutConfig
from areal_hpc.workflow import tools
from areal_hpc.workflow.tools import MAX_DIGITS, TOOLS, ToolError, ToolPool, calculator, cut, run_tool


@pytest.mark.parametrize(
    "expression, value",
    [
        ("37*48", "1776"),
        (" 37 * 48 ", "1776"),
        ("(2+3)*-4", "-20"),
        ("7/2", "3.5"),
        ("7//2", "3"),
        ("-7 % 3", "2"),
        ("2**10", "1024"),
        ("2**-1", "0.5"),
        ("1_000 + 0.25", "1000.25"),
        ("+5", "5"),
        ("-" * 499 + "1", "-1"),  # deep, within the length limit
    ],
)
def test_calculator_evaluates_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression, message",
    [
        ("1/0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("__import__('os').system('true')", "unsupported"),
        ("x + 1", "unsupported"),
        ("'a' * 3", "unsupported"),
        ("True + 1", "unsupported"),
        ("1j * 2", "unsupported"),
        ("[1, 2]", "unsupported"),
        ("3 < 4", "unsupported"),
        ("1 << 10", "unsupported"),
        ("37*", "not an arithmetic expression"),
        ("", "not an arithmetic expression"),
        ("1e308 * 10", "not a finite number"),
        ("(-8) ** 0.5", "not a real number"),
        ("2.0 ** 5000", f"larger than {MAX_DIGITS} digits"),
        ("10 ** 101", f"larger than {MAX_DIGITS} digits"),
        ("1" + "0" * 60 + " * 1" + "0" * 60, f"larger than {MAX_DIGITS} digits"),
        ("(" * 240 + "1" + ")" * 240, "not an arithmetic expression"),
        ("1+" * 300 + "1", "longer than"),
    ],
)
def test_calculator_refuses_with_a_message(expression, message):
    with pytest.raises(ToolError, match=message):
        calculator(expression)


def test_calculator_refuses_a_tower_of_powers_at_once():
    started = time.monotonic()
    for expression in ("9**9**9", "(10**50)**(10**50)", "2**2**2**2**2**2"):
        with pytest.raises(ToolError, match="larger than"):
            calculator(expression)
    assert time.monotonic() - started < 1.0


def test_calculator_refuses_what_is_not_a_string():
    with pytest.raises(ToolError, match="must be a string"):
        calculator(1776)


# --- run_tool: what a pool child runs; it never raises ------------------------------------------


@pytest.mark.parametrize(
    "name, arguments, text",
    [
        ("calculator", {"expression": "37*48"}, "1776"),
        ("calculator", {"expression": "1/0"}, "error: division by zero"),
        ("abacus", {"expression": "1"}, "error: unknown tool 'abacus' (tools: calculator, python)"),
        ("calculator", "37*48", "error: the arguments of calculator must be a JSON object (got str)"),
        ("calculator", {}, "error: calculator takes the arguments expression (missing expression)"),
        ("calculator", {"expression": "1", "x": 2}, "error: calculator takes the arguments expression (unknown x)"),
        ("python", {"code": 42}, "error: code must be a string (got int)"),
    ],
)
def test_run_tool_answers_every_call_with_text(name, arguments, text):
    got, ok, seconds = run_tool(name, arguments, timeout_s=5.0, output_chars=2000)
    assert (got, ok) == (text, not text.startswith("error: ")) and seconds >= 0


def test_run_tool_turns_an_unexpected_exception_into_an_error_text(monkeypatch):
    monkeypatch.setattr(tools, "calculator", lambda expression: 1 / 0)
    assert run_tool("calculator", {"expression": "1"}, 5.0, 2000)[:2] == (
        "error: ZeroDivisionError: division by zero",
        False,
    )


def test_output_is_cut_to_its_limit_keeping_head_and_tail():
    text = "".join(f"line {i}\n" for i in range(1000))
    short = cut(text, 200)
    assert len(short) <= 200 and short.startswith("line 0\n") and short.endswith("line 999\n")
    assert "characters cut" in short and cut("1776", 200) == "1776" and cut(text, 5) == "line "


def test_every_tool_has_an_openai_schema():
    for name, schema in TOOLS.items():
        assert schema["type"] == "function" and schema["function"]["name"] == name
        params = schema["function"]["parameters"]
        assert set(params["required"]) <= set(params["properties"])


# --- the python tool: the code reward's sandbox -------------------------------------------------


def test_python_tool_returns_stdout_the_stderr_tail_and_a_failing_exit_status():
    text, ok, _ = run_tool("python", {"code": "print(6 * 7)"}, 5.0, 2000)
    assert (text, ok) == ("42\n", True)
    code = "import sys\nprint('partial')\nprint('x' * 20000, file=sys.stderr)\nraise ValueError('bad input')"
    text, ok, _ = run_tool("python", {"code": code}, 5.0, 2000)
    assert ok, "a program that raises is an answer (its traceback), not a tool failure"
    assert text.startswith("partial\n") and text.endswith("ValueError: bad input\nexit status 1")
    assert len(text) <= 2000


def test_python_tool_has_no_network_and_leaves_no_files():
    code = "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\nexcept OSError as e:\n    print('no network')"
    assert run_tool("python", {"code": code}, 5.0, 2000)[0] == "no network\n"
    write = "open('/tmp/left-behind', 'w').write('x')\nimport os\nprint(os.listdir('/tmp'))"
    assert run_tool("python", {"code": write}, 5.0, 2000)[0] == "['left-behind']\n"
    assert run_tool("python", {"code": "import os\nprint(os.listdir('/tmp'))"}, 5.0, 2000)[0] == "[]\n"


def test_python_tool_over_its_time_limit_is_an_error_with_the_output_so_far():
    started = time.monotonic()
    code = "import time\nprint('started', flush=True)\ntime.sleep(30)"
    # 2 s: the interpreter's start, before it prints, took over 0.5 s on a loaded 2-core host
    text, ok, _ = run_tool("python", {"code": code}, 2.0, 2000)
    assert not ok and text == "error: the program ran over its 2 s limit; its output until then:\nstarted\n"
    assert time.monotonic() - started < 5


# --- the pool ------------------------------------------------------------------------------------


def drain(pool: ToolPool, limit_s: float = 60) -> dict:
    out, give_up = {}, time.monotonic() + limit_s
    while pool.pending:
        for key, text, ok, seconds in pool.poll(0.01):
            assert key not in out, f"call {key} answered twice"
            assert isinstance(text, str) and isinstance(ok, bool) and seconds >= 0
            out[key] = (text, ok)
        assert time.monotonic() < give_up, f"{pool.pending} calls unanswered"
    return out


@pytest.mark.slow
def test_tool_pool_runs_calculator_and_python_and_survives_timeouts():
    pool = ToolPool(2, timeout_s=1.0, output_chars=100)
    try:
        pool.submit("calc", "calculator", {"expression": "37*48"})
        pool.submit("bad", "calculator", {"expression": "x"})
        pool.submit("py", "python", {"code": "print(sum(range(10)))"})
        pool.submit("long", "python", {"code": "print('y' * 1000)"})
        pool.submit("sleep", "python", {"code": "import time\ntime.sleep(30)"})
        pool.submit("unknown", "shell", {"cmd": "ls"})
        got = drain(pool)
        assert got["calc"] == ("1776", True) and got["py"] == ("45\n", True)
        assert got["bad"] == ("error: unsupported in an arithmetic expression: 'x'", False)
        assert got["sleep"] == ("error: the program ran over its 1 s limit", False)
        assert got["unknown"][0].startswith("error: unknown tool 'shell'") and not got["unknown"][1]
        assert got["long"][1] and len(got["long"][0]) <= 100 and "characters cut" in got["long"][0]
        pool.submit("after", "calculator", {"expression": "2**10"})
        assert drain(pool) == {"after": ("1024", True)}
    finally:
        pool.close()


@pytest.mark.slow
def test_tool_pool_kills_a_call_past_its_deadline_and_keeps_working():
    """The pool's own deadline, for a call whose tool does not stop by itself (a negative grace puts the
    deadline before the sandbox's own limit)."""
    pool = ToolPool(1, timeout_s=2.0, output_chars=2000, grace_s=-1.5)
    try:
        pool.submit("stuck", "python", {"code": "import time\ntime.sleep(30)"})
        started = time.monotonic()
        assert drain(pool) == {"stuck": ("error: the tool ran over its 2 s limit", False)}
        assert time.monotonic() - started < 1.5 and pool.replaced == 1
        pool.submit("next", "calculator", {"expression": "6*7"})
        assert drain(pool) == {"next": ("42", True)}
    finally:
        pool.close()


@pytest.mark.slow
def test_tool_pool_answers_many_concurrent_calls_each_once():
    pool = ToolPool(3, timeout_s=5.0, output_chars=2000)
    try:
        for i in range(60):
            if i % 3 == 0:
                pool.submit(i, "python", {"code": f"print({i} * 2)"})
            else:
                pool.submit(i, "calculator", {"expression": f"{i}*2"})
        got = drain(pool)
        assert sorted(got) == list(range(60))
        for i, (text, ok) in got.items():
            assert ok and text.strip() == str(i * 2)
        for i in range(4):
            pool.submit(("c", i), "python", {"code": "import time\ntime.sleep(30)"})
        pool.poll(0.2)
        cancelled = pool.close()
        assert sorted(k for k, *_ in cancelled) == [("c", i) for i in range(4)] and pool.pending == 0
        assert {(text, ok) for _, text, ok, _ in cancelled} == {("error: cancelled", False)}
    finally:
        pool.close()


def test_tool_pool_from_config_takes_the_rollout_settings():
    rollout = RolloutConfig(tool_processes=0, tool_timeout_s=3.0, tool_output_chars=77)
    pool = ToolPool.from_config(rollout)
    try:
        assert len(pool.pids) == len(os.sched_getaffinity(0))
        assert (pool.timeout_s, pool.output_chars) == (3.0, 77)
    finally:
        pool.close()


def test_tool_pool_from_config_warns_when_this_node_has_no_bubblewrap(monkeypatch, caplog):
    monkeypatch.setattr(tools.shutil, "which", lambda name: None)
    pool = ToolPool.from_config(RolloutConfig(tool_processes=1))
    pool.close()
    assert "bubblewrap (bwrap) is not installed on this node" in caplog.text
