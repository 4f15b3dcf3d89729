"""Test setup: the repo root on sys.path, CPU-only JAX, quiet HF warnings."""

import os
import sys
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Reuse compiled programs across tests and the subprocesses they start (same config -> same program).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "kimi-linear-jax-test-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def interpreted_dense_matmul(monkeypatch):
    """The Pallas dense matmul (pallas_gmm.dense_matmul) run by the Pallas interpreter; returns the list of how many
    kernels each call multiplied (the caller decides where `dense_matmul` resolves to it)."""
    from MaxText.kernels.grouped_matmul import pallas_gmm
    calls, kernel_fn = [], pallas_gmm.dense_matmul

    def interpreted(rows, kernels, **options):
        calls.append(len(kernels))
        return kernel_fn(rows, kernels, interpret=True, **options)
    monkeypatch.setattr(pallas_gmm, "dense_matmul", interpreted)
    return calls


@pytest.fixture
def interpreted_norm_and_router(monkeypatch):
    """The norms' and the MoE router's Pallas kernels run by the Pallas interpreter, as on one GPU (the layers resolve
    to them: grouped_matmul's single-GPU check passes); returns the list of the kernels' names as they are called."""
    from MaxText.kernels import grouped_matmul
    from MaxText.kernels.grouped_matmul import pallas_gmm
    from MaxText.kernels.moe_router import pallas_route
    from MaxText.kernels.rms_norm import pallas_norm
    calls = []

    def interpreted(module, name, interpret_positional=False):
        fn = getattr(module, name)

        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, True) if interpret_positional else fn(*args, **kwargs, interpret=True)
        monkeypatch.setattr(module, name, call)
    monkeypatch.setattr(grouped_matmul, "single_gpu_reason", lambda kernel: None)  # as on one GPU
    interpreted(pallas_norm, "rms_norm", interpret_positional=True)
    interpreted(pallas_norm, "add_rms_norm", interpret_positional=True)
    for module, name in ((pallas_gmm, "vector_matrix_partials"), (pallas_route, "route_logits"),
                         (pallas_route, "norm_and_route")):
        interpreted(module, name)
    return calls
