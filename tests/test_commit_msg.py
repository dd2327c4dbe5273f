"""The commit-message check pre-commit runs (scripts/check_commit_msg.py)."""

from __future__ import annotations

import importlib.util
import pathlib

_spec = importlib.util.spec_from_file_location(
    "check_commit_msg", pathlib.Path(__file__).resolve().parents[1] / "scripts" / "check_commit_msg.py")
assert _spec is not None and _spec.loader is not None
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)


def test_a_short_subject_and_a_body_pass():
    assert check.problems("Fix the plan digest\n\nBoth sides hashed different orders.\n") == []


def test_a_long_subject_or_no_body_is_named():
    assert check.problems("x" * 73 + "\n\nwhy\n") == ["the subject is 73 characters (at most 72)"]
    assert check.problems("Subject only\n") == ["after the subject, a blank line and a body that says why"]
    assert check.problems("Subject\nno blank line\n") == ["after the subject, a blank line and a body that says why"]
    assert check.problems("# a comment\n\n") == ["the message has no subject"]


def test_git_comment_lines_are_not_the_body():
    assert check.problems("Subject\n\n# Please enter the commit message\n") == [
        "after the subject, a blank line and a body that says why"]
