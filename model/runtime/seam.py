"""The tests' one seam into a run: what they plant around the train step lives in their own room.

A test that needs a run to misbehave on purpose (a host that reaches its first step late, parameters
that turn NaN after a given batch) sets JAXPT_TEST_HOOKS=1 with the hook's own variable
(tests/step_hooks.py builds both). train.py then hands its compiled step to tests/step_hooks.py
`wrap(train_step, process_index)`, imported from the repository the run starts in. Unset, as in
every user's run, nothing is imported and the loop calls the step as compiled
(docs/development.md, "The tests' seam").
"""
from __future__ import annotations

import importlib
import os

TEST_HOOKS_ENV = "JAXPT_TEST_HOOKS"
HOOKS_MODULE = "tests.step_hooks"       # the repository's tests/, never a module a variable names


def around_step(train_step, process_index: int):
    """The train step as the loop calls it: the tests' wrapper when JAXPT_TEST_HOOKS is set."""
    if not os.environ.get(TEST_HOOKS_ENV):
        return train_step
    return importlib.import_module(HOOKS_MODULE).wrap(train_step, process_index)
