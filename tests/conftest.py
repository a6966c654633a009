import importlib.util
import os

import pytest
import torch
from hypothesis import settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# HYPOTHESIS_PROFILE=ci (.ci/run): the same examples on every run, so CI's verdict does not depend on
# what a fresh database happens to draw; the default profile keeps searching for new counterexamples.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="module", autouse=True)
def _no_process_group_outlives_its_module():
    """Destroy a default process group that a test module left behind in this pytest process.

    The group is process-wide: one left by an earlier module would make later tests depend on the order
    they run in (``init_distributed`` reuses it; a test of group creation finds one already there).
    Module scope, torn down after the module's own fixtures, so the tests of one module may still
    share a group on purpose (a module-scoped fixture that builds it once).
    """
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def pytest_collection_modifyitems(config, items):
    # a GPU image may hold torch without megatron-core (the `megatron` extra): its tests skip, as vLLM's do
    if importlib.util.find_spec("megatron") is None:
        skip_megatron = pytest.mark.skip(reason="the megatron marker needs megatron-core (the megatron extra)")
        for item in items:
            if "megatron" in item.keywords:
                item.add_marker(skip_megatron)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
