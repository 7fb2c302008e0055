import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Two tiers. The default run (CI, the README's test command) leaves out the tests marked `slow`:
# multi-process runs whose contract a faster test also covers (4 ranks where 2 ranks run by default,
# every model where one runs by default, the examples under torchrun). `MOE_SLOW=1` runs them too
# (everything); run it before closing an issue that touches what they cover. `-n 2` (pytest-xdist)
# runs two workers: each test is its own unit (no shared state across tests but the Inductor cache),
# and the multi-process tests use file-based rendezvous (no ports).
RUN_SLOW = os.environ.get("MOE_SLOW", "") not in ("", "0")


def pytest_collection_modifyitems(config, items):
    if RUN_SLOW or "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow tier: set MOE_SLOW=1 to run it")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


@pytest.fixture
def no_compile_cache():
    """Inductor's FX graph cache and AOTAutograd's cache off for one test: on a cache hit the
    post_grad passes do not run (the graph they made is loaded), and a test that spies on them
    must see them run. Through the configs' own ``patch`` (pytest >= 9.2's monkeypatch deletes a
    config module's attribute on undo, which hides it from every later test)."""
    import torch._functorch.config
    import torch._inductor.config

    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield


@pytest.fixture
def swap_params_on_conversion():
    """``torch.__future__.set_swap_module_params_on_conversion(True)`` for one test: ``model.to(dtype)`` and
    ``load_state_dict`` swap each Parameter's contents (``torch.utils.swap_tensors``), which torch refuses for
    a tensor something holds a weak reference to."""
    import torch

    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


@pytest.fixture
def gemm_dtypes(monkeypatch):
    """The (input, weight) dtypes every grouped GEMM of the compiled graphs ran with, on the CPU
    (3-D and stacked weights: grouped_mm; per-expert lists, e.g. with biases: grouped_mm_list[_cat])."""
    import torch

    from moe_compile.kernels import reference, registry

    registry.implementation("grouped_mm", torch.empty(0))   # load the CPU providers first
    seen = []

    def spy(op):
        def run(x, w, *args, **kwargs):
            seen.append((x.dtype, (w[0] if isinstance(w, (list, tuple)) else w).dtype))
            return getattr(reference, op)(x, w, *args, **kwargs)
        return run

    for op in ("grouped_mm", "grouped_mm_list", "grouped_mm_list_cat"):
        monkeypatch.setitem(registry._IMPLS, (op, "cpu"), spy(op))
    return seen
