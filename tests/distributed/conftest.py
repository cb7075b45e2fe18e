"""Every distributed test runs under late completion ([Note: late completion] in
hf_zero.execution.late): each asynchronous collective and copy completes only at its wait, its
output poisoned until then and its input checked at the wait, so an ordering mistake that a GPU
would show only sometimes fails here every time. The variable is set for the tests of this
folder only, before any of their fixtures (module-scoped ones spawn ranks, which inherit it); a
test that measures the engine without the mode sets ``HF_ZERO_CHECK_ASYNC=0`` itself."""

import os
from typing import Iterator

import pytest

from hf_zero.execution import CHECK_ENV


@pytest.fixture(scope="package", autouse=True)
def _late_completion() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CHECK_ENV, os.environ.get(CHECK_ENV, "1"))
        yield
