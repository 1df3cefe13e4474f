"""``context_parallel``: every method through the one own-loop entry point against one process, and its
handle (describe, restore), batch conversion and bad arguments.

The parity checks run in ONE gloo launch of 2 ranks (tests/workers/context_parallel_worker.py): ring,
ulysses, thd, thd_docs and usp (ulysses_size 2 and 1), fp32 and fp64, on plain rows (right padding and a
loss mask) and on packed rows given by ``seq_lens`` or by ``position_ids`` restarts, each against every
document run alone in one process; and every method with activation checkpointing + activation offload and the
offloaded optimizer against the same method without them (issue 35); and Falcon (its mask materialised) under
every method, fp32 and fp64, every batch form; and every method with ``model.tiled_layer`` against the same
method without it, fp32 and fp64, every batch form; and checkpoint groups (``model.checkpoint_group_layers``) under
FSDP2 with ring and Ulysses, the tiled layer, the tiled MLP and activation offload against groups of 1.
"""

from __future__ import annotations

import pytest
import torch

from automodel.distributed.cp import context_parallel
from automodel.distributed.cp.context import SENTINEL, canonical_batch
from tests.dist_harness import run_distributed

BARS = {"float64": (1e-10, 1e-10), "float32": (1e-5, 1e-4)}
METHODS = ("ring", "ulysses", "thd", "thd_docs", "thd_docs_cost", "usp", "usp_u1", "toy_gather", "auto")
#: methods that attend across the whole row: packed rows are refused
UNPACKED = ("ring", "toy_gather")
FORMS = ("plain", "packed_seq_lens", "packed_restarts")


@pytest.fixture(scope="module")
def results():
    return run_distributed(
        "tests.workers.context_parallel_worker:main", world_size=2, timeout=600, dtypes=["float32", "float64"]
    )


@pytest.mark.dist
def test_every_method_matches_one_process(results):
    for r in results:
        ran = set(r["checks"])
        for dtype in BARS:
            for method in METHODS:
                for form in FORMS:
                    key = (dtype, method, form)
                    if method in UNPACKED and form != "plain":
                        assert key in r["refused"], key  # ring attends across the row: packed rows refused
                        continue
                    assert key in ran, key
                    loss_bar, grad_bar = BARS[dtype]
                    assert r["checks"][key]["loss_rel"] <= loss_bar, (key, r["checks"][key])
                    assert r["checks"][key]["grad_rel"] <= grad_bar, (key, r["checks"][key])
                    assert r["checks"][key].get("hf_loss_rel", 0.0) <= 1e-5, (key, r["checks"][key])
    # the ranks hold their own share, not the whole batch: ring's 16 padded tokens of 2 x 13 -> 2 x 8 each
    assert results[0]["checks"][("float32", "ring", "plain")]["local_tokens"] == 16


@pytest.mark.dist
def test_every_method_with_both_offloads_equals_the_run_without(results):
    # activation offload (with checkpointing) on the plain rows, first dtype (fp32): loss and every gradient are
    # those of the same method without it, bit for bit; two offloaded AdamW steps on them equal plain ones
    for r in results:
        assert sorted(r["offload"]) == sorted(METHODS)
        for label, check in r["offload"].items():
            assert check["loss_diff"] == 0.0 and check["grads_equal"], (label, check)
            assert check["unpacked"] == 2, (label, check)  # both layers' inputs came back from the host store
            # issue 41: only those went there, and each layer was recomputed in the backward
            assert check["packed"] == 2 and check["recomputed"] == 2, (label, check)
            assert check["optimizer_equal"], label


@pytest.mark.dist
def test_every_method_matches_one_process_with_tiled_mlp(results):
    """model.tiled_mlp (tiles of 3 tokens) under every method at cp=2, fp64, against the untiled reference."""
    for r in results:
        for method in METHODS:
            for form in ("plain", "packed_seq_lens"):
                if method in UNPACKED and form != "plain":
                    continue
                check = r["tiled"][(method, form)]
                assert check["loss_rel"] <= 1e-10 and check["grad_rel"] <= 1e-10, (method, form, check)


@pytest.mark.dist
def test_every_method_with_the_tiled_layer_equals_the_run_without(results):
    """model.tiled_layer (tiles of 3 tokens) under every method at cp=2, fp32 and fp64, every batch form the method
    runs: the loss and every gradient equal the same method's untiled run (fp32 <= 1e-6, fp64 <= 1e-14)."""
    bars = {"float64": 1e-14, "float32": 1e-6}
    for r in results:
        checks = r["tiled_layer"]
        for dtype, bar in bars.items():
            for method in METHODS:
                for form in FORMS:
                    if method in UNPACKED and form != "plain":
                        continue
                    check = checks[(dtype, method, form)]
                    assert check["loss_rel"] <= bar and check["grad_rel"] <= bar, (dtype, method, form, check)
            assert all(c > 0 for c in checks[(dtype, "calls")])  # both layers ran in tiles


@pytest.mark.dist
def test_checkpoint_groups_under_fsdp2_equal_the_run_without(results):
    """model.checkpoint_group_layers at cp=2 under FSDP2 (5 layers: ring in groups of 2, Ulysses in groups of 3), with
    the tiled layer, the tiled MLP, checkpointing and activation offload: the loss and every gathered gradient equal
    groups of 1 (fp32 <= 1e-6, fp64 <= 1e-15; in practice bit for bit); only the groups' first inputs went to the
    host, the others were rebuilt by one forward of the layer before them, every layer recomputed once."""
    from tests.workers.context_parallel_worker import GROUP_CASES

    bars = {"float64": 1e-15, "float32": 1e-6}
    for r in results:
        for dtype, bar in bars.items():
            for label, (_, k) in GROUP_CASES.items():
                c = r["checkpoint_groups"][(dtype, label)]
                starts = -(-5 // k)
                assert c["loss_rel"] <= bar and c["grad_rel"] <= bar and c["grads"] > 0, (dtype, label, c)
                assert c["packed"] == c["kept"] == starts, (dtype, label, c)
                assert c["dropped"] == c["rebuilt"] == c["replayed"] == 5 - starts, (dtype, label, c)
                assert c["recomputed"] == [1] * 5, (dtype, label, c)


@pytest.mark.dist
def test_falcon_is_exact_under_every_method_where_it_dispatches_its_attention(results):
    """Falcon with RoPE and grouped KV heads: from transformers 5.25 its attention goes through the
    AttentionInterface with the causal mask materialised (ring proves it plain causal and drops it); every method,
    fp32 and fp64, plain rows (padding, loss mask) and packed rows against each document alone. Where the installed
    FalconAttention computes its own attention (5.17), every method refuses it when the model is prepared."""
    from transformers.models.falcon.modeling_falcon import FalconAttention

    from automodel.distributed.cp.profile import _dispatches_attention
    from tests.workers.context_parallel_worker import FALCON_METHODS

    for r in results:
        falcon = r["falcon"]
        if not _dispatches_attention(FalconAttention):
            assert not falcon["checks"] and sorted(falcon["refused"]) == sorted(FALCON_METHODS)
            for label, message in falcon["refused"].items():
                assert "FalconAttention, which computes its own attention" in message, (label, message)
            continue
        for dtype, (loss_bar, grad_bar) in BARS.items():
            for method in FALCON_METHODS:
                for form in FORMS:
                    key = (dtype, method, form)
                    if method in UNPACKED and form != "plain":
                        assert "packed rows" in falcon["refused"][key], key
                        continue
                    check = falcon["checks"][key]
                    assert check["loss_rel"] <= loss_bar and check["grad_rel"] <= grad_bar, (key, check)
                    assert check["grads"] == 19, (key, check)  # every parameter has a gradient


@pytest.mark.dist
def test_ring_refuses_packed_rows_naming_the_methods_that_run_them(results):
    message = results[0]["refused"][("float32", "ring", "packed_restarts")]
    assert "packed rows" in message and "method=ring attends across the whole row" in message
    # usp is not named: it has no configuration at cp_size 2 (ulysses_size must be a proper divisor)
    assert "methods that run packed rows of this model: ulysses | thd | thd_docs; or give it one document" in message


@pytest.mark.dist
def test_a_model_the_method_does_not_compute_exactly_is_refused_when_prepared(results):
    message = results[0]["refused"]["ring_flex"]
    assert "distributed.cp_method=ring does not compute LlamaForCausalLM" in message
    assert "its attention implementation is 'flex_attention'" in message
    assert "set distributed.cp_method to one of the methods that run this model exactly: ulysses. See" in message


@pytest.mark.dist
def test_describe_and_restore(results):
    r = results[0]
    assert all(attn == "sdpa" for attn in r["restored"].values()), r["restored"]
    text = r["describe"]["thd_docs"]
    assert "method thd_docs" in text and "cp_size 2" in text and "2 full_attention" in text
    assert "attention 'sdpa' -> 'thd_docs'" in text
    assert "options: ulysses_size=2" in r["describe"]["usp"]
    assert "options: cost=CostModel(" in r["describe"]["thd_docs_cost"]
    assert "attention unchanged" in r["describe"]["ring"]  # ring replaces SDPA inside its context only
    assert "attention 'sdpa' -> 'toy_gather'" in r["describe"]["toy_gather"]
    name, reason = r["chosen"]["auto"]  # method="auto", packed=True: a method that takes packed rows, and why
    assert name == "thd_docs" and reason.startswith("cp_method auto: thd_docs, the cheapest method")
    assert f"method thd_docs ({reason})" in r["describe"]["auto"] and "refused: ring (packed rows" in reason


# ------------------------------------------------------------------------------------------ one process


def tiny_model():
    from tests.workers.thd_attention_worker import tiny_llama

    return tiny_llama(2, torch.float32)


def test_describe_restore_and_shard_without_cp():
    model = tiny_model()
    cp = context_parallel(model, None, method="thd")
    text = cp.describe()
    assert "method thd" in text and "cp_size 1" in text and "no context parallelism" in text
    batch = {"input_ids": torch.arange(6)[None], "labels": torch.arange(1, 7)[None]}
    ctx, local = cp.shard(batch)
    with ctx():
        loss = model(**local).loss
    assert torch.isfinite(loss) and local["num_items_in_batch"] == 6
    assert local["shift_labels"] is local["labels"]
    cp.restore()
    cp.restore()  # idempotent
    assert "restored" in cp.describe()
    with pytest.raises(RuntimeError, match="was restored"):
        cp.shard(batch)


def test_bad_arguments_are_named():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"'nope' is not one of"):
        context_parallel(model, None, method="nope")
    with pytest.raises(ValueError, match=r"got options \['kernal'\].*its options are \['cp_comm_type', 'kernel'"):
        context_parallel(model, None, method="thd", kernal="portable")
    cp = context_parallel(model, None, method="ulysses")
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"batch keys \['cu_seqlens'\] are not taken"):
        cp.shard({"input_ids": ids, "labels": ids, "cu_seqlens": torch.tensor([0, 4])})
    with pytest.raises(ValueError, match="no 'labels'"):
        cp.shard({"input_ids": ids})
    with pytest.raises(ValueError, match="left or inner padding"):
        cp.shard({"input_ids": ids, "labels": ids, "attention_mask": torch.tensor([[0, 1, 1, 1]])})
    with pytest.raises(ValueError, match=r"labels'\]\[0, 3\] = 7 lies in a padding slot"):
        cp.shard({"input_ids": ids, "labels": torch.tensor([[1, 2, 3, 7]]), "attention_mask": torch.tensor([[1, 1, 1, 0]])})
    with pytest.raises(ValueError, match="does not match position_ids"):
        cp.shard({"input_ids": ids, "labels": ids, "seq_lens": torch.tensor([[2, 2]]), "position_ids": torch.arange(4)[None]})
    with pytest.raises(ValueError, match=r"position_ids'\] has shape \(3, 1, 4\)"):
        cp.shard({"input_ids": ids, "labels": ids, "position_ids": torch.zeros(3, 1, 4, dtype=torch.long)})


def test_canonical_batch_pads_every_document_to_the_multiple():
    ids = torch.arange(10, 19)[None]  # documents of 3, 5 and 1 tokens by position_ids restarts
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0]])
    labels = ids + 100
    out, packed = canonical_batch({"input_ids": ids, "labels": labels, "position_ids": pos}, 4, True)
    assert packed
    assert out["input_ids"].tolist() == [[10, 11, 12, 0, 13, 14, 15, 16, 17, 0, 0, 0, 18, 0, 0, 0]]
    assert out["labels"].tolist() == [[110, 111, 112, -100, 113, 114, 115, 116, 117] + [-100] * 3 + [118] + [-100] * 3]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]
    assert out["seq_lens"].tolist() == [[3, 5, 1]] and out["seq_lens_padded"].tolist() == [[4, 8, 4]]
    # the same documents by seq_lens (no positions: they restart per document), rows of unequal length
    two = {
        "input_ids": torch.stack([ids[0], ids[0]]),
        "labels": torch.stack([labels[0], labels[0].masked_fill(torch.arange(9) >= 2, -100)]),
        "seq_lens": torch.tensor([[3, 5, 1], [2, SENTINEL, SENTINEL]]),
    }
    out2, _ = canonical_batch(two, 4, True)
    assert out2["input_ids"][0].tolist() == out["input_ids"][0].tolist()
    assert out2["position_ids"][0].tolist() == out["position_ids"][0].tolist()
    assert out2["seq_lens"][1].tolist() == [2, SENTINEL, SENTINEL]
    assert out2["seq_lens_padded"][1].tolist() == [16, SENTINEL, SENTINEL]  # the row's padding joins its document
    # a plain row is padded at its end only; a packed batch is refused where documents would mix
    plain, packed = canonical_batch({"input_ids": ids, "labels": labels}, 4, False)
    assert not packed and plain["input_ids"].shape == (1, 12) and "seq_lens" not in plain
    assert plain["position_ids"].tolist() == [list(range(12))]
    with pytest.raises(ValueError, match="packed rows.*use another"):
        canonical_batch({"input_ids": ids, "labels": labels, "position_ids": pos}, 4, False, "use another")


def test_canonical_batch_takes_the_collators_padded_documents():
    # a collator's row: documents of 3 and 5 real tokens in slots of 4 and 8 (pads: label -100)
    ids = torch.arange(1, 13)[None]
    labels = torch.tensor([[1, 2, 3, -100, 5, 6, 7, 8, 9, -100, -100, -100]])
    batch = {"input_ids": ids, "labels": labels, "seq_lens": torch.tensor([[3, 5]]), "seq_lens_padded": torch.tensor([[4, 8]])}
    out, packed = canonical_batch(batch, 2, True)  # the method's multiple is 2: the slots shrink to 4 and 6
    assert packed and out["seq_lens"].tolist() == [[3, 5]] and out["seq_lens_padded"].tolist() == [[4, 6]]
    assert out["input_ids"].tolist() == [[1, 2, 3, 0, 5, 6, 7, 8, 9, 0]]
    assert out["labels"].tolist() == [[1, 2, 3, -100, 5, 6, 7, 8, 9, -100]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]]
    with pytest.raises(ValueError, match=r"labels'\]\[0, 3\] = 4 lies in a padding slot"):
        canonical_batch({**batch, "labels": labels.masked_fill(labels == -100, 4)}, 2, True)
