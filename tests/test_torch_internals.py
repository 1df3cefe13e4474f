"""Every private torch API automodel uses resolves on the installed torch (2.11 .. 2.15).

``scripts/compat.sh VERSION`` runs this with the parity subset on each tested release; the CUDA
ring's imports are checked here too (its kernels cannot run without a GPU).
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

from automodel.distributed import torch_internals


def _version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def test_pyproject_states_the_tested_ranges():
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    deps = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
    assert torch_internals.TORCH_REQUIREMENT in deps
    assert torch_internals.TRANSFORMERS_REQUIREMENT in deps


def test_torch_release_parses_local_versions():
    assert torch_internals.torch_release() == _version()
    assert torch_internals.TORCH_REQUIREMENT == "torch>=2.11,<2.16"
    assert {v.rsplit(".", 1)[0] for v in torch_internals.TESTED_TORCH_VERSIONS} == {
        "2.11", "2.12", "2.13", "2.14", "2.15"
    }


def test_every_private_torch_symbol_resolves():
    assert torch_internals.missing_torch_internals() == []


def test_sharding_rule_api_matches_the_torch_release():
    expected = "op_strategy" if _version() < (2, 14) else "single_dim"
    assert torch_internals.sharding_rule_api() == expected


def test_accessors_return_torch_objects():
    attn = torch_internals.cp_attention_module()
    assert torch_internals.templated_ring_attention() is attn._templated_ring_attention
    assert torch_internals.templated_ring_attention_backward() is attn._templated_ring_attention_backward
    assert torch_internals.cp_options() is attn._cp_options
    fwd, bwd = torch_internals.cpu_flash_attention_ops()
    assert fwd is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    assert bwd is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    from torch.distributed.tensor import DTensor

    assert torch_internals.dtensor_op_dispatcher() is DTensor._op_dispatcher
    assert callable(torch_internals.dynamo_calculate_time_spent)
    assert torch_internals.dynamo_counters() is not None


def test_cuda_ring_imports_resolve():
    """What torch's own (CUDA) ring needs: context_parallel and its CP attention module."""
    from torch.distributed.tensor.experimental import context_parallel  # noqa: F401

    attn = torch_internals.cp_attention_module()
    for name in ("custom_ops", "_create_rotater", "_cp_options", "set_rotate_method", "context_parallel_unshard"):
        assert hasattr(attn, name), name
    for op in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention"):
        assert getattr(torch.ops.aten, op).default in attn.custom_ops, op


def test_missing_symbol_is_a_clear_error(monkeypatch):
    attn = torch_internals.cp_attention_module()
    monkeypatch.delattr(attn, "_cp_options")
    with pytest.raises(RuntimeError) as err:
        torch_internals.cp_options()
    message = str(err.value)
    assert f"torch {torch.__version__} does not have" in message
    assert f"{torch_internals.CP_ATTENTION}._cp_options" in message
    assert re.search(r"tested with torch 2\.11\.0, 2\.12\.1, 2\.13\.0, 2\.14\.1, 2\.15\.0 \(torch>=2\.11,<2\.16\)", message)


def test_missing_sharding_rule_api_names_both_versions(monkeypatch):
    import importlib

    rules = importlib.import_module(torch_internals.CP_SHARDING_RULES)
    for name in ("_op_strategy_context", "_single_dim_strategy_context"):
        monkeypatch.delattr(rules, name, raising=False)
    assert torch_internals.sharding_rule_api() is None
    with pytest.raises(
        RuntimeError, match=r"_single_dim_strategy_context \(torch 2\.14\+\) or .*_op_strategy_context \(torch 2\.11 \.\. 2\.13\)"
    ):
        torch_internals.require("ring context parallelism on CPU")


def test_transformers_internals_resolve_to_transformers_objects():
    import importlib

    assert torch_internals.missing_transformers_internals() == []
    for name, module_name in torch_internals._TRANSFORMERS.items():
        assert getattr(torch_internals, name) is getattr(importlib.import_module(module_name), name), name


def test_transformers_internal_is_looked_up_afresh(monkeypatch):
    """A patched module global (hf_causal_mask's) is what an import from torch_internals sees."""
    import transformers.masking_utils as masking_utils

    def patched(position_ids):
        return None

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", patched)
    from automodel.distributed.torch_internals import find_packed_sequence_indices

    assert find_packed_sequence_indices is patched


def test_missing_transformers_internal_is_a_clear_import_error(monkeypatch):
    import transformers
    import transformers.masking_utils as masking_utils

    monkeypatch.delattr(masking_utils, "and_masks")
    with pytest.raises(ImportError, match=rf"transformers\.masking_utils\.and_masks, which transformers {re.escape(transformers.__version__)}"):
        from automodel.distributed.torch_internals import and_masks  # noqa: F401
    with pytest.raises(AttributeError):
        torch_internals.no_such_name  # noqa: B018


def test_context_parallel_before_2_13_is_undone_when_the_block_raises():
    """torch 2.11 / 2.12's context_parallel has no try/finally: the wrapper undoes its patch and the
    buffer sharding when the block raises (on 2.13+ torch does it; the real check runs at cp=2 in
    tests/workers/cp_worker.py's buffer checks)."""
    events = []

    @contextlib.contextmanager
    def old_cp(mesh, *, buffers, buffer_seq_dims, no_restore_buffers):  # as torch 2.11 / 2.12: no finally
        for b in buffers:
            b.resize_(2).fill_(-1)
        events.append("patched")
        yield
        events.append("undone by torch")

    def run(raise_inside: bool):
        events.clear()
        kept, dropped = torch.arange(4.0), torch.arange(4.0)
        with torch_internals._restoring_context_parallel(
            old_cp, lambda: events.append("undone by automodel"), None,
            buffers=[kept, dropped], buffer_seq_dims=[0, 0], no_restore_buffers={dropped},
        ):
            assert kept.shape == (2,)
            if raise_inside:
                raise KeyError("inside")
        return kept, dropped

    with pytest.raises(KeyError, match="inside"):
        run(raise_inside=True)
    assert events == ["patched", "undone by automodel"]
    kept = torch.arange(4.0)
    with pytest.raises(KeyError):
        with torch_internals._restoring_context_parallel(
            old_cp, lambda: None, None, buffers=[kept], buffer_seq_dims=[0], no_restore_buffers=None
        ):
            raise KeyError
    assert torch.equal(kept, torch.arange(4.0))  # restored from the wrapper's own copy
    run(raise_inside=False)
    assert events == ["patched", "undone by torch"]  # a normal exit is torch's own
