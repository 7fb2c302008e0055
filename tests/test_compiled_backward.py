"""moe_compile.compiled_backward: the backward of a rewritten ModuleList layer through compiled
autograd gives every gradient eager gives, and compiled autograd really ran."""
from __future__ import annotations

import functools

import pytest
import torch
from torch._dynamo.utils import counters as dynamo_counters

import moe_compile
from helpers import check_compiled, make_input, make_model


@pytest.mark.parametrize("routing,k", [("random", 2), ("empty", 2), ("hot", 1)])
def test_compiled_backward_matches_eager(routing, k):
    model = make_model(h=16, i=12, e=4, k=k, spelling="index_add", expert="swiglu", routing=routing)
    captures0 = dynamo_counters["compiled_autograd"]["captures"]
    # two input sets: the second step reuses the compiled backward
    check_compiled(model, [make_input((2, 9, 16))], expect_rewritten=1, fresh_inputs=1,
                   compiled_ctx=functools.partial(moe_compile.compiled_backward, options={"moe.inductor": False}))
    assert dynamo_counters["compiled_autograd"]["captures"] - captures0 >= 1, "compiled autograd did not run"


def test_compiled_backward_reports_missing_torch_api(monkeypatch):
    from torch._dynamo import compiled_autograd

    monkeypatch.delattr(compiled_autograd, "_enable")
    with pytest.raises(RuntimeError, match="compiled_backward: .*compiled_autograd = True"):
        with moe_compile.compiled_backward():
            pass
