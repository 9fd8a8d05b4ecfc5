"""Suite-wide fixtures."""

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _fresh_jax_caches():
    """Drop compiled executables between test modules.

    A full default run compiles thousands of small programs in one process; late in that run
    (~75 %, in tests/models) XLA's CPU compiler segfaulted twice while each module alone
    passes. Clearing the caches per module keeps the process's compiled code bounded.
    """
    jax.clear_caches()
    yield
