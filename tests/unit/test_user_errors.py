"""One error type for what the user must fix: every project error class derives from
`sharding.errors.UserError` (printed as one line by every command) unless it is named here
as something else."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import benchmarks
import pipelines
import recsys
import sharding
from recsys.console import command
from sharding.errors import UserError

# errors that are not the user's to fix as such, and why
NOT_USER_ERRORS = {
    "recsys.launch.RankFailedError",  # a rank failed: one line naming its first cause and log
    "sharding.hybrid._TooLarge",  # the planner's own control flow, caught inside it
    "sharding.hybrid._NoBufferRoom",  # likewise
}


def _project_error_classes() -> dict[str, type]:
    found = {}
    for package in (sharding, pipelines, recsys, benchmarks):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            module = importlib.import_module(info.name)
            for name, obj in vars(module).items():
                if (
                    inspect.isclass(obj)
                    and issubclass(obj, Exception)
                    and obj.__module__ == module.__name__
                ):
                    found[f"{obj.__module__}.{name}"] = obj
    return found


def test_every_project_error_is_a_user_error_or_named_otherwise() -> None:
    classes = _project_error_classes()
    assert "sharding.cluster.ClusterConfigError" in classes  # the scan sees the project
    assert NOT_USER_ERRORS <= set(classes)
    stray = sorted(
        n for n, c in classes.items() if not issubclass(c, UserError) and n not in NOT_USER_ERRORS
    )
    assert not stray, f"derive these from UserError or name them in NOT_USER_ERRORS: {stray}"


def test_a_command_prints_a_user_error_in_one_line_and_a_bug_with_its_traceback(capsys) -> None:
    class KeyError_(UserError):
        pass

    with pytest.raises(SystemExit) as stop, command():
        raise KeyError_("model.embedding_dim=7: use a multiple of 4")
    assert stop.value.code == 1
    assert capsys.readouterr().err == "error: model.embedding_dim=7: use a multiple of 4\n"
    with pytest.raises(ZeroDivisionError), command():  # a bug: not swallowed into one line
        raise ZeroDivisionError("bug")
