"""Suite-wide pytest hooks: a test that passes its per-test timeout says which launch was slow, phase by phase, and
a test that leaves torch's default dtype changed fails (it would change the numbers of every later test)."""

from __future__ import annotations

import os

import pytest
import torch

from meshwise.testing import describe_launches

# `make test` runs two pytest-xdist workers on the 2-core machine (docs/dev/test-durations.md): one intra-op
# thread each, as every launched rank has, so the in-process tests of one worker do not take the other's core.
if "PYTEST_XDIST_WORKER" in os.environ:
    torch.set_num_threads(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    outcome = yield
    report = outcome.get_result()
    # pytest-timeout fails the test with "Timeout (>300s) from pytest-timeout." and a stack dump that shows only
    # this process waiting; the launches of this phase (setup, call or teardown) say which ranks were where.
    if report.failed and call.excinfo is not None and "from pytest-timeout" in str(call.excinfo.value):
        launches = describe_launches(call.start)
        report.sections.append(("meshwise launches of this test", launches or "none: the time went elsewhere"))


@pytest.fixture(autouse=True)
def _default_dtype_kept():
    before = torch.get_default_dtype()
    yield
    after = torch.get_default_dtype()
    if after != before:
        torch.set_default_dtype(before)
        pytest.fail(f"the test left torch's default dtype {after} (it was {before}): restore it in the test")
