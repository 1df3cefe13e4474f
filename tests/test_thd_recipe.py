"""``distributed.cp_method: thd`` in the recipe: parity with cp=1, registry, config rules and bad input.

Parity (two launches for the module): configs/cp_packed.yaml with the tiny fp32 overrides of
tests/workers/recipe_worker.py, 8 steps, thd cp=2 vs the same run at cp=1, on packed rows (each
document padded to 2*cp=4 automatically at cp=2, by hand at cp=1 so the rows are identical) and
on unpacked rows (each row one document).
"""

from __future__ import annotations

import pytest
import torch

from automodel.config import ConfigError, load_config
from automodel.distributed.cp import get_cp_method
from tests.dist_harness import run_distributed
from tests.technique_checks import assert_two_layers_recomputed_and_inputs_offloaded

LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-4
PACKED = "configs/cp_packed.yaml"


def problems(*overrides: str, world: int = 2, config: str = PACKED) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(["--config", config, "distributed.cp_method=thd", *overrides], world_size=world)
    return str(info.value)


# ------------------------------------------------------------------ registry and config rules


def test_registry_entry():
    from automodel.distributed.cp.thd.attention import make_thd_batch_and_ctx

    m = get_cp_method("thd")
    assert m.batch_function() is make_thd_batch_and_ctx
    assert m.supports_packed and m.chunks_per_rank == 2 and m.layout == "head_tail" and not m.splits_heads
    assert m.attn_implementations == ("sdpa", "eager")


def test_config_loads_and_rules():
    cfg = load_config(["--config", PACKED, "distributed.cp_method=thd"], world_size=2).cfg
    assert cfg.distributed.cp_method == "thd" and cfg.distributed.thd_kernel == "portable"
    assert cfg.data.dataset["pack"] is True
    msg = problems("distributed.thd_kernel=bogus")
    assert "distributed.thd_kernel='bogus' is not one of portable | flash_attn | te" in msg
    msg = problems("+data.dataset.seq_pad_multiple=2")
    assert "data.dataset.seq_pad_multiple=2 is not a multiple of 2*cp_size = 2*2 = 4" in msg
    msg = problems("distributed.thd_kernel=flash_attn", "distributed.backend=gloo")
    assert "distributed.thd_kernel=flash_attn needs CUDA, but this run is on CPU" in msg
    msg = problems("distributed.thd_cp_comm_type=ring")
    assert "distributed.thd_cp_comm_type='ring' is not one of" in msg


def test_ring_with_packed_rows_is_still_refused():
    msg = problems("distributed.cp_method=ring")
    assert "data.dataset.pack=true (several documents per row) with distributed.cp_method=ring" in msg
    named = msg.split("takes packed rows with this config: ")[1].split(", or auto")[0].split(" | ")
    assert "thd" in named and "ring" not in named, named


def test_dataset_padding_is_automatic():
    thd_dataset_kwargs = get_cp_method("thd").dataset_options

    cfg = load_config(["--config", PACKED, "distributed.cp_size=4"], world_size=4).cfg
    assert thd_dataset_kwargs(cfg, cfg.data.dataset) == {"seq_pad_multiple": 8}
    cfg = load_config(["--config", PACKED, "+data.dataset.seq_pad_multiple=16"], world_size=2).cfg
    assert thd_dataset_kwargs(cfg, cfg.data.dataset) == {}  # the user's value stays
    cfg = load_config(["--config", PACKED, "distributed.cp_size=1"], world_size=1).cfg
    assert thd_dataset_kwargs(cfg, cfg.data.dataset) == {}


# ------------------------------------------------------------------ bad input through the batch function


def _packed(seq_lens, seq_lens_padded, seq=8):
    return {
        "input_ids": torch.ones(1, seq, dtype=torch.long),
        "labels": torch.ones(1, seq, dtype=torch.long),
        "seq_lens": torch.tensor([seq_lens]),
        "seq_lens_padded": torch.tensor([seq_lens_padded]),
    }


def test_bad_packed_batches():
    from automodel.distributed.cp.te_batch import make_cp_batch_for_te

    class Fake:
        ndim = 1

        def size(self):
            return 2

        def get_local_rank(self):
            return 0

    # a document not padded to a multiple of 2*cp
    with pytest.raises(
        ValueError, match=r"padded length 6, not divisible by 2\*cp_size=4.*seq_pad_multiple=4"
    ):
        make_cp_batch_for_te(Fake(), _packed([3, 2], [6, 2]))
    # inconsistent seq_lens / seq_lens_padded
    with pytest.raises(
        ValueError, match=r"seq_lens=5, seq_lens_padded=4; need 0 <= seq_lens <= seq_lens_padded"
    ):
        make_cp_batch_for_te(Fake(), _packed([5, 2], [4, 4]))
    with pytest.raises(ValueError, match="disagree on which entries are the padding sentinel"):
        make_cp_batch_for_te(Fake(), _packed([3, -1000], [4, 4]))


def test_model_whose_attention_cannot_be_swapped():
    from automodel.distributed.cp.thd.attention import set_thd_attention

    class Custom(torch.nn.Module):
        config = None

    with pytest.raises(ValueError, match=r"Custom is not a transformers PreTrainedModel.*cannot be swapped"):
        set_thd_attention(Custom())


# ------------------------------------------------------------------ recipe parity


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("thd_recipe")
    pair = run_distributed("tests.workers.thd_recipe_worker:pair", world_size=2, timeout=600, out=str(out))
    (single,) = run_distributed(
        "tests.workers.thd_recipe_worker:single", world_size=1, timeout=600, out=str(out)
    )
    return {**single, **pair[0]}


def _max_rel(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(abs(a[k] - b[k]) / abs(b[k]) for k in b)


@pytest.mark.dist
@pytest.mark.parametrize(
    "name, ref",
    [
        ("thd_packed_cp2", "packed_ref"),
        ("thd_plain_cp2", "plain_ref"),
        ("thd_sliding_packed_cp2", "sliding_packed_ref"),  # Mistral, window 16: the halo kernel
    ],
)
def test_recipe_parity_cp2(runs, name, ref):
    got, want = runs[name], runs[ref]
    assert got["cp_method"] == "thd" and got["attn_impl"] == "thd"
    assert want["attn_impl"] == "sdpa"  # cp=1: the plain single-device model
    assert len(got["losses"]) == 8
    assert _max_rel(got["losses"], want["losses"]) <= LOSS_RTOL
    assert _max_rel(got["val_losses"], want["val_losses"]) <= LOSS_RTOL
    diff = max((got["state"][k] - want["state"][k]).abs().max().item() for k in want["state"])
    assert diff <= WEIGHT_ATOL


@pytest.mark.dist
def test_checkpointing_and_offload_act_under_thd(runs):
    """Issue 41: under thd (packed rows, cp=2) with FSDP2 every layer is recomputed once per micro-batch and offload
    moves one tensor per layer and micro-batch, the layer input; the run log names no technique that did not act."""
    run = runs["thd_sliding_packed_cp2"]
    # global batch 8 = 2 rows x 4 micro-batches (dp 1)
    assert_two_layers_recomputed_and_inputs_offloaded(run["techniques"], run["technique_log"], 4)


@pytest.mark.dist
def test_packed_rows_really_packed_and_padded_automatically(runs):
    assert runs["thd_packed_cp2"]["seq_pad_multiple"] == 4  # automatic 2*cp
    assert runs["packed_ref"]["seq_pad_multiple"] == 4
    assert runs["thd_packed_cp2"]["packed_docs"] > 8  # several documents per row
    assert runs["thd_plain_cp2"]["packed_docs"] is None
    # the run log says that the rows differ from cp=1's and how to get the same rows there (the packed_ref run's
    # overrides, which it names); no such line where the padding was set by hand, or rows are not packed
    (line,) = runs["thd_packed_cp2"]["padding_log"]
    assert line.startswith("data: cp_method=thd pads every packed document to a multiple of 4 tokens"), line
    assert "+data.dataset.seq_pad_multiple=4 data.pad_to_multiple_of=4" in line and "thd_docs" in line, line
    assert runs["packed_ref"]["padding_log"] == runs["thd_plain_cp2"]["padding_log"] == []


def test_own_loop_page_thd_example_is_the_example_file():
    import re

    from tests.dist_harness import REPO_ROOT

    readme = (REPO_ROOT / "docs" / "own_loop.md").read_text()
    block = re.search(
        r"<!-- own_loop_thd:start -->\n```python\n(.*?)```\n<!-- own_loop_thd:end -->", readme, re.S
    )
    assert block, "docs/own_loop.md has no own_loop_thd block"
    assert block.group(1) == (REPO_ROOT / "examples" / "own_loop_thd.py").read_text()
