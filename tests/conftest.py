import os

# the interpreter runs many tiny numpy matmuls: a multithreaded BLAS makes each ~1000x slower
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# every forward with a kept plan decides again and compares (flexlite.api's forward plans: a key that misses what the
# decisions read fails the test that changes it)
os.environ.setdefault("FLEXLITE_CHECK_PLANS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# No GPU here: run every kernel through Triton's interpreter. Must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_INT_POISON = {torch.int32: -(2**31), torch.int64: -(2**63)}


@pytest.fixture(autouse=True)
def fresh_plans(monkeypatch):
    """Each test starts without plans (flexlite.api's, launch_forward_ws'): a test that patches a decision function
    (api._warp_specialize, say) then decides anew, whatever the tests before it kept."""
    from helpers import drop_plans

    drop_plans(monkeypatch)


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    """torch.empty returns NaN-filled floats (and extreme ints), so unwritten outputs fail the checks."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        with torch.no_grad():  # (a leaf that requires grad, as torch.utils.checkpoint makes)
            if t.is_floating_point():
                t.fill_(float("nan"))
            elif t.dtype in _INT_POISON:
                t.fill_(_INT_POISON[t.dtype])
        return t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.fixture(autouse=True)
def first_calls_worker_done():
    """What a test asked flexlite.first_calls' worker to compile is compiled before the next test starts (on a GPU,
    where it is on by default): no test sees another's compile-only calls in its spies. With
    FLEXLITE_TEST_FIRST_CALLS=fresh every test starts knowing no compiled kernels, so that each one's first calls are
    new whatever ran before it in its process (what a GPU run's first test of a kind sees)."""
    from flexlite import first_calls

    if os.environ.get("FLEXLITE_TEST_FIRST_CALLS") == "fresh":
        first_calls._ready.clear()
        first_calls._failed.clear()
    yield
    first_calls.wait()


# GPU runs can test decode settings that are off by default (e.g. '{"use_tma": true, "use_pdl": true}')
if os.environ.get("FLEXLITE_TEST_DECODE_TILES"):
    import json

    from flexlite.runtime import launch

    launch.DECODE_TILES.update(json.loads(os.environ["FLEXLITE_TEST_DECODE_TILES"]))


# first calls in torch ops (flexlite.eager, on by default on CUDA) only where a test asks for them
# (FLEXLITE_TEST_EAGER=1: every test's, so a GPU run checks the torch ops instead of its kernels on each first call)
from flexlite import first_calls as _first_calls  # noqa: E402

_first_calls.EAGER = os.environ.get("FLEXLITE_TEST_EAGER") == "1"

# first_calls (on by default on CUDA only) on CPU too: FLEXLITE_TEST_FIRST_CALLS=always runs every test's first calls of
# a new mask_mod through the bits' kernels, as a GPU run does ("fresh": and every test's first calls are new)
if os.environ.get("FLEXLITE_TEST_FIRST_CALLS"):
    from flexlite import first_calls

    first_calls.ENABLED = {"always": "always", "fresh": "always", "0": False}.get(
        os.environ["FLEXLITE_TEST_FIRST_CALLS"], True)
