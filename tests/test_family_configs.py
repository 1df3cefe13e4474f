"""The family matrix's configs (tests/family_matrix.py) are transformers' defaults scaled down in sizes only.

No processes and no weights: each row's config is built and its layer pattern compared with the default
config's (issue 36: the hand-picked tiny patterns hid that Nemotron-H's default ``M E * -`` was refused).
"""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from tests.family_matrix import (
    FAMILIES,
    WINDOW,
    covering_count,
    cycled,
    default_config,
    family_by_name,
    layer_pattern,
)

# keys that choose a layer pattern or switch a feature: a row gets them from the default config, never from
# its entry (``attention_types``: GPT-Neo's list must spell the layer count; a flagship row may set its pattern)
PATTERN_KEYS = {"layer_types", "layers_block_type", "block_types", "attn_layer_period", "attn_layer_offset",
                "expert_layer_period", "expert_layer_offset", "no_rope_layers", "no_rope_layer_interval",
                "use_sliding_window", "max_window_layers", "attn_temperature_tuning", "sliding_window",
                "attention_chunk_size", "attn_layer_indices", "hybrid_override_pattern"}  # fmt: skip


def test_helpers_cycle_a_pattern_to_the_fewest_layers_that_hold_every_kind():
    assert cycled(["a", "b", "c"], 5) == ["a", "b", "c", "a", "b"]
    assert covering_count(["s"] * 5 + ["f"]) == 6 and covering_count(["f"] * 3) == 2
    assert covering_count(["m", "e", "*", "-"]) == 4 and covering_count(["f", "s", "s"]) == 2


@pytest.mark.parametrize("fam", FAMILIES, ids=[f.name for f in FAMILIES])
def test_every_row_is_the_default_config_scaled_in_sizes_keeping_its_layer_pattern(fam):
    config = fam.build_config()  # raises when the layer types are not the row's pattern
    default = default_config(fam.model_type)
    flagship = fam.name.endswith("@flagship") or fam.pattern is not None
    overrides = PATTERN_KEYS & set(fam.config_kwargs)
    if not flagship:
        assert overrides <= {"attention_types"}, f"{fam.name} sets {overrides}: the default config chooses those"
        pattern = layer_pattern(default)
        if pattern is not None:  # every kind of the default pattern, in order, cycled
            got = layer_pattern(config)
            assert got == cycled(pattern, len(got)) and set(got) == set(pattern), (fam.name, got, pattern)
    else:
        assert fam.note, f"{fam.name}: a flagship row names the checkpoint whose pattern it holds"
        if fam.name.endswith("@flagship"):
            base = family_by_name(fam.name.removesuffix("@flagship"))
            assert base.model_type == fam.model_type
            assert layer_pattern(base.build_config()) != layer_pattern(config) or \
                base.config_kwargs != fam.config_kwargs, f"{fam.name} is the default row again"  # fmt: skip
    for key in ("sliding_window", "attention_window_size", "window_size", "attention_chunk_size"):
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            assert value == WINDOW, (fam.name, key, value)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or getattr(config, "d_model", 0)
    assert hidden <= 64 and config.vocab_size <= 128, fam.name


def test_nemotron_h_rows_hold_the_default_and_the_flagship_pattern():
    default = family_by_name("nemotron_h").build_config()
    assert default.layers_block_type == ["linear_attention", "moe", "full_attention", "mlp"]  # M E * -
    assert default.hybrid_override_pattern == AutoConfig.for_model("nemotron_h").hybrid_override_pattern == "ME*-"
    flagship = family_by_name("nemotron_h@flagship").build_config()
    assert flagship.hybrid_override_pattern == "M-M-M-M*"  # Nemotron-H-8B's, to its first attention layer
    assert family_by_name("gemma3_text").build_config().layer_types == ["sliding_attention"] * 5 + ["full_attention"]
