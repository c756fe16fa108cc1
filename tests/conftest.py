"""Shared fixtures: the debug config every model test builds on, and determinism."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors in Triton's interpreter. It must be chosen before triton is
    # imported (importing transformers may import it): triton.language's own helpers are jit
    # functions decorated at import.
    # On a GPU machine it is left unset, so that the Triton kernels tested on CUDA tensors are the
    # compiled ones. A test that runs a Triton kernel on CPU tensors there sets the variable itself
    # (the `triton_interpreter` fixture of tests/sharding/test_fused_adam.py, or in the environment
    # of the processes it spawns): the fused Adam kernel is decorated on first use, once per value
    # of the variable, and uses none of those helpers, so setting it late is enough for it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import tnlg  # noqa: F401  (registers the Auto classes)
from tnlg import TNLGConfig, TNLGForCausalLM
from tnlg.tools.spawn import start_rank_server

# Several hundred tests run functions on 2-4 gloo ranks, forked from a server that imports torch,
# Transformers and tnlg once (tnlg/tools/spawn.py). It starts here, with the session's environment
# (TRITON_INTERPRET chosen above) before any test changes a variable, and imports in the background
# while the tests are collected.
start_rank_server()


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA; skip them (visibly) on CPU-only machines."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def debug_config() -> TNLGConfig:
    """The tiny preset: 2 layers, 64 wide, 4 heads, 128 positions, 512 tokens."""
    return TNLGConfig.from_preset("debug")


@pytest.fixture
def debug_model(debug_config) -> TNLGForCausalLM:
    return TNLGForCausalLM(debug_config).eval()


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    """A TNLG_CACHE for the runs of a session: the embedded corpus and default tokenizer, built once."""
    return tmp_path_factory.mktemp("tnlg-cache")
