"""Tiny VLM configs that build on CPU in a second (tests, benchmarks, the CPU recipe ``configs/vlm_cp.yaml``)."""

from __future__ import annotations

from typing import Any

__all__ = ["TINY_QWEN2_VL", "tiny_qwen2_vl_config", "tiny_qwen2_5_vl_config"]

#: Field values of the tiny Qwen2-VL: 4 query / 2 kv heads of dim 16 (mRoPE sections 2+3+3 = 16/2),
#: a 2-block vision tower of width 32 on 4x4-pixel patches, 2x2 merge, 2-frame tubelets.
TINY_QWEN2_VL: dict[str, Any] = {
    "text_config": {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    },
    "vision_config": {
        "depth": 2,
        "embed_dim": 32,
        "hidden_size": 64,
        "num_heads": 2,
        "mlp_ratio": 2,
        "in_channels": 3,
        "patch_size": 4,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "vision_start_token_id": 248,
    "vision_end_token_id": 249,
    "image_token_id": 250,
    "video_token_id": 251,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}


def tiny_qwen2_vl_config(attn_implementation: str = "sdpa", **overrides: Any):
    """A ``transformers.Qwen2VLConfig`` with :data:`TINY_QWEN2_VL` (top-level ``overrides`` win)."""
    from transformers import Qwen2VLConfig

    fields = {**TINY_QWEN2_VL, **overrides}
    config = Qwen2VLConfig(**fields)
    config._attn_implementation = attn_implementation
    config.text_config._attn_implementation = attn_implementation
    config.vision_config._attn_implementation = attn_implementation
    return config


def tiny_qwen2_5_vl_config(attn_implementation: str = "sdpa", **overrides: Any):
    """A ``transformers.Qwen2_5_VLConfig``: the text model of :data:`TINY_QWEN2_VL` and a 2-block vision
    tower of width 32 with window attention (16-pixel windows) in block 0 and full attention in block 1."""
    from transformers import Qwen2_5_VLConfig

    vision = {
        "depth": 2,
        "hidden_size": 32,
        "out_hidden_size": 64,
        "intermediate_size": 64,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 4,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 16,
        "fullatt_block_indexes": [1],
    }
    fields = {**TINY_QWEN2_VL, "vision_config": vision, **overrides}
    config = Qwen2_5_VLConfig(**fields)
    for c in (config, config.text_config, config.vision_config):
        c._attn_implementation = attn_implementation
    return config
