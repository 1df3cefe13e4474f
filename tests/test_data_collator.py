"""Collator: right padding to the CP multiple with label -100, no mask by default, packed metadata,
and the documented claim that right padding without a mask is exact for a causal LM."""

from __future__ import annotations

import pytest
import torch

from automodel.data.collator import Collator, collate, count_label_tokens, empty_example


def _ex(ids, labels):
    return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)}


def test_pads_right_to_the_multiple_with_ignored_labels():
    a = _ex([5, 6, 7, 8, 9], [6, 7, 8, 9, 10])
    b = _ex([11, 12, 13], [-100, 13, 14])
    batch = Collator(pad_token_id=1, pad_to_multiple_of=4)([a, b])
    assert set(batch) == {"input_ids", "labels"}  # no attention_mask: ring CP takes plain causal only
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.int64
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 1, 1, 1], [11, 12, 13, 1, 1, 1, 1, 1]]
    assert batch["labels"].tolist() == [[6, 7, 8, 9, 10] + [-100] * 3, [-100, 13, 14] + [-100] * 5]
    assert count_label_tokens(batch) == 7
    assert a["input_ids"].tolist() == [5, 6, 7, 8, 9]  # inputs not mutated


@pytest.mark.parametrize("multiple,expected", [(1, 5), (2, 6), (8, 8), (12, 12)])
def test_length_is_the_longest_row_rounded_up(multiple, expected):
    batch = collate([_ex([1] * 5, [1] * 5), _ex([2], [2])], pad_token_id=0, pad_to_multiple_of=multiple)
    assert batch["input_ids"].shape == (2, expected)


def test_attention_mask_only_on_request_and_only_with_padding():
    padded = [_ex([3, 4, 5], [4, 5, 6]), _ex([7], [8])]
    full = [_ex([3, 4, 5, 6], [4, 5, 6, 7]), _ex([7, 8, 9, 10], [8, 9, 10, 11])]
    assert "attention_mask" not in collate(padded, pad_token_id=0, pad_to_multiple_of=4)
    mask = collate(padded, pad_token_id=0, pad_to_multiple_of=4, emit_attention_mask=True)["attention_mask"]
    assert mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]] and mask.dtype == torch.int64
    assert "attention_mask" not in collate(
        full, pad_token_id=0, pad_to_multiple_of=4, emit_attention_mask=True
    )


def test_packed_rows_get_padded_metadata():
    row1 = {
        "input_ids": torch.tensor([5, 6, 1, 1, 7, 8, 9, 1]),
        "labels": torch.tensor([6, 0, -100, -100, 8, 9, 0, -100]),
        "position_ids": torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]),
        "seq_lens": torch.tensor([2, 3]),
        "seq_lens_padded": torch.tensor([4, 4]),
    }
    row2 = {
        "input_ids": torch.tensor([4, 4, 4, 1]),
        "labels": torch.tensor([4, 4, 0, -100]),
        "position_ids": torch.tensor([0, 1, 2, 3]),
        "seq_lens": torch.tensor([3]),
        "seq_lens_padded": torch.tensor([4]),
    }
    batch = collate([row1, row2, empty_example(packed=True)], pad_token_id=1, pad_to_multiple_of=4)
    assert batch["input_ids"].shape == (3, 8)
    assert batch["seq_lens"].tolist() == [[2, 3], [3, -1000], [8, -1000]]
    assert batch["seq_lens_padded"].tolist() == [[4, 4], [8, -1000], [8, -1000]]
    assert batch["position_ids"].tolist() == [
        [0, 1, 2, 3, 0, 1, 2, 3],
        [0, 1, 2, 3, 4, 5, 6, 7],
        list(range(8)),
    ]
    assert batch["labels"][1].tolist() == [4, 4, 0] + [-100] * 5
    assert bool((batch["labels"][2] == -100).all()) and bool((batch["input_ids"][2] == 1).all())
    for b in range(3):  # the THD invariant: padded lengths cover the row exactly
        spl = batch["seq_lens_padded"][b]
        assert int(spl[spl != -1000].sum()) == 8


def test_errors():
    with pytest.raises(ValueError, match=r"pad_to_multiple_of=0 must be an integer >= 1"):
        Collator(pad_token_id=0, pad_to_multiple_of=0)
    with pytest.raises(ValueError, match=r"pad_token_id=-1 must be an integer >= 0"):
        Collator(pad_token_id=-1)
    with pytest.raises(ValueError, match=r"do not mix packed and unpacked"):
        collate([_ex([1], [1]), empty_example(packed=True)], pad_token_id=0)
    with pytest.raises(ValueError, match=r"emit_attention_mask=True is not supported for packed rows"):
        collate([empty_example(packed=True)], pad_token_id=0, emit_attention_mask=True)
    with pytest.raises(ValueError, match="empty list"):
        collate([], pad_token_id=0)


def test_right_padding_without_mask_is_exact_for_a_causal_lm():
    """The claim in collator.py: padded positions come after every real token, so with causal
    attention and label -100 they change neither the loss nor any gradient."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager",
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg).double()
    ids = torch.randint(2, 64, (2, 7))
    rows = [_ex(ids[0, :-1].tolist(), ids[0, 1:].tolist()), _ex(ids[1, :4].tolist(), ids[1, 1:5].tolist())]

    def loss_and_grads(batch):
        # summed token losses: a token-mean loss divides this by count_label_tokens (not by B*S)
        model.zero_grad()
        logits = model(input_ids=batch["input_ids"]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="sum"
        )
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    # reference: each row on its own, no padding at all
    singles = [loss_and_grads(collate([r], pad_token_id=0)) for r in rows]
    padded = collate(rows, pad_token_id=0, pad_to_multiple_of=8)
    assert padded["input_ids"].shape == (2, 8) and "attention_mask" not in padded
    assert count_label_tokens(padded) == 6 + 4
    loss, grads = loss_and_grads(padded)
    # fp64 model, but transformers' LlamaRMSNorm normalises in fp32: a [2, 8] batch and a [1, 4] row
    # reduce their hidden vectors with other vectorisation, so fp32 round-off (~1e-7 on a norm) reaches
    # the loss at ~1e-10 relative. Padding that leaked into a real token would show up at >= 1e-3.
    torch.testing.assert_close(loss, singles[0][0] + singles[1][0], rtol=1e-8, atol=0)
    for k, g in grads.items():
        want = singles[0][1][k] + singles[1][1][k]
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
