"""The one transformers adapter (cp/hf_attention.py): the signature, the call object, the context lookup."""

from __future__ import annotations

import pytest
import torch

from automodel.distributed.cp import active, hf_attention


def test_the_adapter_packs_transformers_arguments_and_run_replays_them():
    seen = {}

    def impl(call: hf_attention.AttentionCall):
        """the docstring"""
        seen["call"] = call
        return call.query + 1, None

    fn = hf_attention.hf_attention_function(impl, "my_attention")
    assert fn.__name__ == "my_attention" and fn.__doc__ == "the docstring"
    q = torch.zeros(1, 2, 3, 4)
    module = torch.nn.Module()
    out, _ = fn(module, q, q, q, None, 0.0, 0.5, True, sliding_window=8)
    call = seen["call"]
    assert torch.equal(out, q + 1) and call.module is module and call.scaling == 0.5 and call.causal()
    assert call.kwargs == {"sliding_window": 8}

    def inner(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        return module, query, attention_mask, dropout, scaling, kwargs

    k2 = torch.ones(1)
    got = call.run(inner, query=k2, scaling=0.25, extra=1)
    assert got[0] is module and got[1] is k2 and got[2] is None and got[3] == 0.0 and got[4] == 0.25
    assert got[5] == {"sliding_window": 8, "is_causal": True, "extra": 1}
    assert call.replace(query=k2).query is k2 and call.query is q


def test_enter_call_counts_calls_and_names_the_batch_function_outside_a_context():
    class Ctx:
        calls = 0

    with pytest.raises(RuntimeError, match=r"'x' was called outside an X context; run the model inside .* from make_x"):
        hf_attention.enter_call("x-test", "x", "an X context", "make_x")
    ctx = Ctx()
    with active.activate("x-test", ctx):
        assert hf_attention.enter_call("x-test", "x", "an X context", "make_x") is ctx
    assert ctx.calls == 1


def test_registration_refuses_mask_names_and_non_models():
    with pytest.raises(ValueError, match="'sdpa' is a mask implementation name"):
        hf_attention.register_attention("sdpa", lambda *a, **k: None)
    with pytest.raises(TypeError, match=r"^Linear is not a transformers PreTrainedModel; use one$"):
        hf_attention.require_hf_model(torch.nn.Linear(1, 1), "; use one", TypeError)
