"""The generated image-text dataset, its collator, the offline processor and the VLM-only checks."""

from __future__ import annotations

import pytest
import torch

from automodel.data import load_tokenizer
from automodel.data.vlm_dataset import SyntheticImageTextDataset, VLMCollator
from automodel.errors import UserInputError
from automodel.models.vlm_cp import check_data_for_model


@pytest.fixture(scope="module")
def dataset():
    return SyntheticImageTextDataset(load_tokenizer(None), 256, num_examples=16, image_token_id=1026,
                                     vision_start_token_id=1024, vision_end_token_id=1025)


def test_examples(dataset):
    tok = dataset.tokenizer
    sizes = set()
    for i in range(len(dataset)):
        e = dataset[i]
        ids, labels, grid = e["input_ids"], e["labels"], e["image_grid_thw"]
        n_img = int((ids == 1026).sum())
        assert n_img == int(grid.prod()) // 4  # t*h*w / merge**2 placeholders
        assert e["pixel_values"].shape == (int(grid.prod()), 3 * 2 * 4 * 4)
        assert ids[0] == 1024 and ids[n_img + 1] == 1025
        # labels: shifted, only the answer (and EOS) is predicted, never an image token
        predicted = labels != -100
        first = int(predicted.nonzero()[0])
        assert predicted[first:-1].all() and not predicted[-1] and not predicted[:first].any()
        assert torch.equal(labels[first:-1], ids[first + 1 :]) and labels[-2] == tok.eos_token_id
        sizes.add(tuple(grid[0, 1:].tolist()))
    assert len(sizes) >= 3  # several image sizes: dynamic resolution matters
    again = dataset[3]
    assert torch.equal(again["pixel_values"], dataset[3]["pixel_values"])  # deterministic


def test_splits_differ_and_answers_describe_the_image(dataset):
    val = SyntheticImageTextDataset(dataset.tokenizer, 256, split="validation", num_examples=4)
    assert not torch.equal(val[0]["pixel_values"][:8], dataset[0]["pixel_values"][:8])
    texts = [dataset.tokenizer.decode(dataset[i]["input_ids"][dataset[i]["labels"].ne(-100).nonzero()[0] + 1 :])
             for i in range(8)]
    assert any(w in " ".join(texts) for w in ("square", "circle", "stripes", "pixels"))


def test_collator_concatenates_images_in_row_order(dataset):
    rows = [dataset[i] for i in range(3)] + [{"input_ids": torch.zeros(0, dtype=torch.long),
                                              "labels": torch.zeros(0, dtype=torch.long)}]
    batch = VLMCollator(pad_token_id=1, pad_to_multiple_of=8)(rows)
    assert batch["input_ids"].shape[1] % 8 == 0 and batch["input_ids"].shape[0] == 4
    assert (batch["labels"][3] == -100).all() and (batch["input_ids"][3] == 1).all()
    assert torch.equal(batch["pixel_values"], torch.cat([r["pixel_values"] for r in rows[:3]]))
    assert batch["image_grid_thw"].tolist() == [r["image_grid_thw"][0].tolist() for r in rows[:3]]
    assert int((batch["input_ids"] == 1026).sum()) == int(batch["image_grid_thw"].prod(-1).sum()) // 4


def test_errors(dataset):
    with pytest.raises(UserInputError, match=r"has 91 tokens \(64 image tokens\), more than data.seq_len=40"):
        SyntheticImageTextDataset(dataset.tokenizer, 40, num_examples=4, image_sizes=[[64, 64]])[0]
    with pytest.raises(UserInputError, match=r"gives <\|image_pad\|> the id 1026 but the dataset was told 99"):
        SyntheticImageTextDataset(dataset.tokenizer, 256, image_token_id=99)
    from transformers import LlamaConfig

    with pytest.raises(UserInputError, match="yields images, but the model .*LlamaConfig.* is not a VLM"):
        check_data_for_model(dataset, LlamaConfig())


def test_vlm_with_a_method_it_cannot_run_is_rejected_before_weights():
    from transformers import Qwen2VLConfig

    from automodel.distributed.cp import check_model_config_for_cp
    from automodel.errors import UserInputError

    config = Qwen2VLConfig()
    with pytest.raises(UserInputError, match=r"cp_method=thd does not run VLMs.*methods that run this model exactly: ring \(one document per row\) \| ulysses$"):
        check_model_config_for_cp("thd", config, 2)
    check_model_config_for_cp("ring", config, 2)  # supported
    check_model_config_for_cp("thd", config, 1)  # no CP: no method runs
