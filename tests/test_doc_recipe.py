"""``distributed.cp_method: thd_docs`` in the recipe: configs/cp_packed.yaml as shipped at cp=1 and cp=2
(same rows, same per-step losses, the CP self-check passing), rows independent of cp_size, config rules,
refusals and the dry run. cp=4 is a manual run (docs/thd.md): ``tests.workers.doc_recipe_worker:shipped``
on 4 ranks."""

from __future__ import annotations

import pytest
import torch

from automodel.config import ConfigError, load_config
from automodel.distributed.cp import check_model_for_cp, get_cp_method
from automodel.distributed.cp.profile import LayerSpec, ModelProfile
from automodel.errors import CPUnsupportedError
from tests.dist_harness import run_distributed

PACKED = "configs/cp_packed.yaml"


def test_registry_entry_and_layout():
    from automodel.distributed.cp.thd_docs.attention import make_doc_batch_and_ctx

    m = get_cp_method("thd_docs")
    assert m.batch_function() is make_doc_batch_and_ctx
    assert m.supports_packed and not m.supports_vlm and not m.splits_heads
    assert m.row_multiple(4) == (1, "1") and m.row_multiple(8, 2, False)[0] == 1


def _rows(cp: int, method: str | None = None) -> list[dict]:
    from hydra.utils import instantiate

    from automodel.data import load_tokenizer

    extra = [f"distributed.cp_method={method or 'thd_docs'}"]  # the shipped config picks it with cp_method auto
    cfg = load_config(["--config", PACKED, f"distributed.cp_size={cp}", *extra], world_size=cp).cfg
    m = get_cp_method(cfg.distributed.cp_method)
    ds = instantiate(
        cfg.data.dataset,
        split=cfg.data.train_split,
        tokenizer=load_tokenizer(cfg.data.tokenizer),
        seq_len=cfg.data.seq_len,
        **m.dataset_options(cfg, cfg.data.dataset),
        _convert_="all",
    )
    return [ds[i] for i in range(6)]


def _same(a: list[dict], b: list[dict]) -> bool:
    return all(sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def test_packed_rows_do_not_depend_on_cp_size():
    from automodel.training.row_padding import pad_multiple

    ref = _rows(1)
    assert ref[0]["seq_lens"].numel() > 1  # really packed
    assert _same(_rows(8), ref)
    for cp in (2, 4, 8):  # the dataset and the collator get the same arguments at every cp_size
        cfg = load_config(["--config", PACKED, f"distributed.cp_size={cp}", "distributed.cp_method=thd_docs"],
                          world_size=cp).cfg  # fmt: skip
        assert get_cp_method("thd_docs").dataset_options(cfg, cfg.data.dataset) == {}
        assert pad_multiple(cfg) == 1
    assert not _same(_rows(2, "thd"), ref)  # thd pads every document to 2*cp: the check can fail


def test_sequence_parallel_and_thd_kernels_are_refused():
    with pytest.raises(ConfigError) as info:
        load_config(
            ["--config", PACKED, "distributed.cp_method=thd_docs", "distributed.tp_size=2",
             "distributed.sequence_parallel=true"], world_size=4,  # fmt: skip
        )
    assert "distributed.cp_method=thd_docs gives each CP rank a different number of tokens" in str(info.value)
    with pytest.raises(ConfigError) as info:  # a thd key that thd_docs would silently ignore
        load_config(["--config", PACKED, "distributed.cp_method=thd_docs", "distributed.thd_kernel=te"], world_size=2)
    assert "distributed.thd_kernel=te is a kernel of distributed.cp_method=thd; thd_docs runs" in str(info.value)


def _profile(*layers: LayerSpec) -> ModelProfile:
    return ModelProfile("llama", "LlamaForCausalLM", layers, 4, 2, 16, False, "sdpa", True)


def test_layer_kinds_are_computed_as_thd_computes_them():
    from automodel.distributed.cp import get_cp_method

    kinds = [
        LayerSpec(0, "sliding_window", window=64),
        LayerSpec(0, "chunked_attention", chunk=64),
        LayerSpec(0, "full_attention", sinks=True),
        LayerSpec(0, "sliding_window", window=64, softcap=50.0),
        LayerSpec(0, "full_attention", qk_head_dim=24, v_head_dim=16),
        LayerSpec(0, "full_attention", rope=False, position_scaled=True),
    ]
    thd, docs = get_cp_method("thd"), get_cp_method("thd_docs")
    for layer in kinds:
        for seq in (512, None):
            assert docs.layer_problem(layer, seq) is None and thd.layer_problem(layer, seq) is None, layer
        check_model_for_cp("thd_docs", _profile(LayerSpec(1, "full_attention"), layer), seq_len=512)
    mask_only = LayerSpec(0, "sliding_window", window=64, window_in_mask_only=True)  # PhiMoE: never seen at the call
    assert docs.layer_problem(mask_only, 512) == thd.layer_problem(mask_only, 512).replace("thd", "thd_docs")
    with pytest.raises(CPUnsupportedError, match="distributed.cp_method=thd_docs does not compute"):
        check_model_for_cp("thd_docs", _profile(LayerSpec(0, "unknown")), seq_len=512)


def test_windows_shorter_than_a_document_run_the_halo_kernel_at_the_call():
    from automodel.distributed.cp.thd_docs.attention import DocPlan, doc_attention_forward, doc_context
    from automodel.distributed.cp.thd_docs.placement import plan_documents

    plan = DocPlan(None, 1, 0, plan_documents([3, 8], 1), 8)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 11, 4, generator=g, dtype=torch.float64) for _ in range(3))
    with doc_context(plan):
        out, _ = doc_attention_forward(torch.nn.Module(), q, k, v, None, sliding_window=4)
        full, _ = doc_attention_forward(torch.nn.Module(), q, k, v, None, sliding_window=8)  # never cuts
        causal, _ = doc_attention_forward(torch.nn.Module(), q, k, v, None)
    i, j = torch.arange(11).unsqueeze(1), torch.arange(11).unsqueeze(0)
    doc = (torch.arange(11) >= 3).long()
    allowed = (j <= i) & (doc[j] == doc[i]) & (i - j < 4)
    s = (q @ k.transpose(-1, -2) / 2).masked_fill(~allowed, float("-inf"))
    assert torch.allclose(out, (s.softmax(-1) @ v).transpose(1, 2), atol=1e-12)
    assert torch.equal(full, causal) and not torch.allclose(out, causal)
    with pytest.raises(CPUnsupportedError, match="uses attention biases"):
        with doc_context(plan):
            doc_attention_forward(torch.nn.Module(), q, k, v, None, position_bias=torch.zeros(1))
    with pytest.raises(RuntimeError, match="no document-placement attention ran"):
        with doc_context(DocPlan(None, 1, 0, plan_documents([3], 1), 3)):
            pass


def test_bad_batches():
    from automodel.distributed.cp.thd_docs.attention import make_doc_batch_and_ctx

    batch = {"input_ids": torch.ones(1, 8, dtype=torch.long), "seq_lens_padded": torch.tensor([[3, 4]])}
    with pytest.raises(ValueError, match=r"row 0: seq_lens_padded \[3, 4\] must .* add up to the row length 8"):
        make_doc_batch_and_ctx(None, batch)
    left = {"input_ids": torch.ones(1, 4, dtype=torch.long), "attention_mask": torch.tensor([[0, 1, 1, 1]])}
    with pytest.raises(ValueError, match="attention_mask has a padding slot before a real token"):
        make_doc_batch_and_ctx(None, left)
    with pytest.raises(ValueError, match="needs 'input_ids'"):
        make_doc_batch_and_ctx(None, {"labels": torch.ones(1, 8)})


def test_pad_slots_are_left_out_only_when_they_carry_no_loss():
    from automodel.distributed.cp.thd_docs.attention import make_doc_batch_and_ctx

    def batch(**extra):
        labels = torch.tensor([[5, 6, 7, -100, 8, 9, -100, -100]])
        out = {"input_ids": torch.arange(8).view(1, 8), "labels": labels, "seq_lens": torch.tensor([[3, 2]]),
               "seq_lens_padded": torch.tensor([[4, 4]])}  # fmt: skip
        out.update(extra)
        return out

    _, local = make_doc_batch_and_ctx(None, batch())
    assert local["input_ids"].tolist() == [[0, 1, 2, 4, 5]]  # the pad slots 3, 6, 7 are not computed
    assert local["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert local["placement"].lengths == (3, 2)
    b = batch()
    b["labels"][0, 7] = 3  # a pad slot with a label: every slot is kept (and placed with its document)
    _, local = make_doc_batch_and_ctx(None, b)
    assert local["input_ids"].shape == (1, 8) and local["placement"].lengths == (4, 4)
    _, local = make_doc_batch_and_ctx(None, batch(loss_mask=torch.ones(1, 8)))
    assert local["input_ids"].shape == (1, 8)


def test_dry_run_prints_the_sample_placement(capsys):
    from recipes.finetune import main

    assert main(["--config", PACKED, "recipe.dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert "\ncp_method auto: thd_docs, the cheapest method that computes every layer of LlamaForCausalLM" in out
    assert "refused: ring (packed rows" in out  # the shipped config: cp_method auto, packed rows at cp_size 2
    assert "cp_method thd_docs (packed documents placed whole" in out
    assert "placement (thd_docs)   sample batch of 2 x 512 tokens" in out and "imbalance" in out
    assert "K/V KiB sent per rank per layer and step" in out
    assert "exact under cp_method thd_docs" in out


# ------------------------------------------------------------------ the shipped config, cp=1 vs cp=2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("doc_recipe"))
    (one,) = run_distributed("tests.workers.doc_recipe_worker:shipped", world_size=1, timeout=600, out=out)
    two = run_distributed("tests.workers.doc_recipe_worker:shipped", world_size=2, timeout=600, out=out)
    return one, two[0]


@pytest.mark.dist
def test_shipped_config_same_losses_at_cp1_and_cp2(runs):
    import json

    one, two = runs
    assert one["cp_method"] == two["cp_method"] == "thd_docs"  # the shipped cp_method: auto picked it
    assert two["world_line"].endswith("cp=2 tp=1 (cp_method=thd_docs)")
    # the run log: the model profile (layer kinds with counts) and the method with why auto chose it (rank 0)
    for run in (one, two):
        assert "model profile: LlamaForCausalLM (llama), 4 layers: full attention x4; 4 heads, 2 kv heads" in (
            run["profile_line"]
        )
    assert ": cp_method auto: thd_docs, the cheapest method that computes every layer" in two["method_line"]
    assert ": cp_method auto: thd_docs (cp_size 1: no context parallelism" in one["method_line"]
    assert one["attn_impl"] == "sdpa" and two["attn_impl"] == "thd_docs"
    assert one["rows"] == two["rows"]
    assert len(one["losses"]) == 8
    worst = max(abs(two["losses"][k] - one["losses"][k]) / abs(one["losses"][k]) for k in one["losses"])
    assert worst <= 1e-5, worst
    check = json.loads(two["self_check"])  # the self-check ran the placement against one process
    assert check["passed"] and check["loss_rel"] <= 1e-5


def test_own_loop_page_docs_example_is_the_example_file():
    import re

    from tests.dist_harness import REPO_ROOT

    readme = (REPO_ROOT / "docs" / "own_loop.md").read_text()
    block = re.search(r"<!-- own_loop_docs:start -->\n```python\n(.*?)```\n<!-- own_loop_docs:end -->", readme, re.S)
    assert block, "docs/own_loop.md has no own_loop_docs block"
    assert block.group(1) == (REPO_ROOT / "examples" / "own_loop_docs.py").read_text()
