"""`rollout.workflow` names a Workflow subclass; anything else stops the run at start, saying what it found."""

import pytest

from areal_hpc.errors import ConfigError
from areal_hpc.workflow import Workflow, load_workflow

USER_FILE = """
from areal_hpc.workflow import Workflow


class Echo(Workflow):
    async def arun_episode(self, client, row):
        return 1.0


def helper():
    pass


class Blocking(Workflow):
    def arun_episode(self, client, row):
        return 1.0


class Configured(Workflow):
    def __init__(self, size):
        self.size = size

    async def arun_episode(self, client, row):
        return None
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_agent.py"
    path.write_text(USER_FILE)
    return path


def test_a_file_path_loads_its_workflow(user_file):
    import asyncio

    cls = load_workflow(f"{user_file}:Echo")
    assert issubclass(cls, Workflow) and asyncio.run(cls().arun_episode(None, {})) == 1.0


def test_a_module_path_loads_its_workflow(user_file, monkeypatch):
    monkeypatch.syspath_prepend(str(user_file.parent))
    assert load_workflow("my_agent:Echo").__name__ == "Echo"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_such_pkg.agent:Echo", "rollout.workflow: no module named 'no_such_pkg'"),
        ("missing.py:Echo", "rollout.workflow: no file missing.py"),
        (
            "{file}:Nope",
            r"rollout.workflow: .*my_agent.py has no attribute 'Nope' \(its Workflow subclasses: Blocking, Configured, Echo\)",
        ),
        ("{file}:helper", r"rollout.workflow: .*:helper is a function, not a subclass of areal_hpc.workflow.Workflow"),
        (
            "areal_hpc.errors:ConfigError",
            "is the class areal_hpc.errors.ConfigError, not a subclass of areal_hpc.workflow.Workflow",
        ),
        ("{file}:Blocking", r"must define `async def arun_episode\(self, client, row\)`"),
        ("areal_hpc.workflow:Workflow", r"must define `async def arun_episode"),
        ("{file}:Configured", "must be built with no arguments"),
        ("areal_hpc.workflow.Workflow", "must be 'package.module:Name' or 'path/to/file.py:Name'"),
    ],
)
def test_a_bad_workflow_names_the_setting_and_what_it_found(spec, message, user_file):
    with pytest.raises(ConfigError, match=message):
        load_workflow(spec.format(file=user_file))


def test_a_module_that_fails_to_import_says_why(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import no_such_dependency\n")
    with pytest.raises(
        ConfigError, match="importing .*broken.py raised ModuleNotFoundError: No module named 'no_such_dep"
    ):
        load_workflow(f"{path}:Agent")
