"""``apply_tensor_parallel`` on gloo ranks against the same model on one process (see tests/test_tensor_parallel.py).

Each case builds a tiny stock HF model from one seed on every rank, keeps an unsharded copy as the
single-device reference, shards the other over the ``tp`` mesh and runs forward, a token-sum
cross-entropy (under ``loss_parallel()`` when the LM head is vocabulary-sharded) and backward on
the same batch, with ignored (-100) labels. Returned: both losses, the worst relative difference of
every parameter gradient (TP gradients gathered with ``full_tensor()``), the LM head's local output
shape and the parameter placements.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F

CASES = {
    # name: (config class, extra config kwargs, loss_parallel, sequence_parallel)
    "llama": ("LlamaConfig", {}, False, False),
    "llama_lp": ("LlamaConfig", {}, True, False),
    "llama_lp_sp": ("LlamaConfig", {}, True, True),
    "qwen2_bias_lp": ("Qwen2Config", {}, True, False),  # q/k/v biases are column-sharded with the weights
    "qwen3_tied_lp": ("Qwen3Config", {"tie_word_embeddings": True}, True, False),  # per-head q_norm/k_norm
    "qwen3_tied_sp": ("Qwen3Config", {"tie_word_embeddings": True}, False, True),
    "mistral_lp_sp": ("MistralConfig", {"sliding_window": None}, True, True),
    # model.tiled_mlp after the TP split: tiles of 7 tokens (not dividing the rank's 64 or, under sequence
    # parallel, 32 tokens), each all-gathered and reduce-scattered by TP's own hooks
    "llama_lp_tiled": ("LlamaConfig", {}, True, False, 7),
    "llama_lp_sp_tiled": ("LlamaConfig", {}, True, True, 7),
}
VOCAB = 256


def _model(kind: str, extra: dict, dtype: torch.dtype):
    import transformers
    from transformers import AutoModelForCausalLM

    config = getattr(transformers, kind)(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attn_implementation="sdpa",
        **{"tie_word_embeddings": False, **extra},
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(dtype)


def _case(name: str, mesh, dtype: torch.dtype) -> dict:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from automodel.distributed.tensor_parallel import apply_tensor_parallel

    kind, extra, lp, sp, *tiled = CASES[name]
    ref = _model(kind, extra, dtype)
    model = apply_tensor_parallel(copy.deepcopy(ref), mesh["tp"], loss_parallel=lp, sequence_parallel=sp)
    if tiled:
        from automodel.models.tiled_mlp import apply_tiled_mlp

        apply_tiled_mlp(model, tiled[0], tp_size=mesh["tp"].size(), sequence_parallel=sp)
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 33))
    x, y = ids[:, :-1], ids[:, 1:].clone()
    y[0, 20:] = -100  # right padding: ignored labels
    pos = torch.arange(32).expand(2, 32)

    ref_loss = F.cross_entropy(ref(input_ids=x, position_ids=pos).logits.flatten(0, 1), y.flatten(), reduction="sum")
    ref_loss.backward()
    with loss_parallel() if lp else contextlib.nullcontext():
        logits = model(input_ids=x, position_ids=pos).logits
        head_local = tuple((logits.to_local() if isinstance(logits, DTensor) else logits).shape)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
        loss = loss.to_local() if isinstance(loss, DTensor) else loss
        loss.backward()
    worst, placements = 0.0, {}
    ref_params = dict(ref.named_parameters())
    for pname, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        want = ref_params[pname].grad
        worst = max(worst, ((grad - want).abs().max() / want.abs().max().clamp(min=1e-30)).item())
        placements[pname] = str(p.placements[0]) if isinstance(p, DTensor) else "plain"
    return {
        "loss": loss.item(),
        "ref_loss": ref_loss.item(),
        "grad_rel": worst,
        "head_local": head_local,
        "placements": placements,
        "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
        "params": sorted(ref_params) == sorted(dict(model.named_parameters())),
    }


def parity(rank: int, world_size: int) -> dict:
    from automodel.distributed.mesh import ParallelDims

    mesh = ParallelDims(tp=world_size).build_mesh("cpu")
    out = {}
    for dtype in (torch.float64, torch.float32):
        for name in CASES:
            out[(name, str(dtype).removeprefix("torch."))] = _case(name, mesh, dtype)
    return out
