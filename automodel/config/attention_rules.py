"""``model.attention_backend``: the kernel names and the combinations that cannot run what they pin.

The names and what each pins live below config (:mod:`automodel.distributed.cp.attention_kernels`); a pin
applies on CUDA only (a CPU run keeps torch's CPU kernels, said once in the run log).
"""

from __future__ import annotations

from automodel.config.schema import RecipeConfig
from automodel.distributed.cp import AUTO, cp_methods
from automodel.distributed.cp.attention_kernels import AUTO_BACKEND, attention_backend_problem

__all__ = ["attention_backend_problems"]


def attention_backend_problems(cfg: RecipeConfig) -> list[str]:
    """Problems of ``cfg.model.attention_backend`` (empty list: fine)."""
    name, attn = cfg.model.attention_backend, cfg.model.attn_implementation or "sdpa"
    problem = attention_backend_problem(name)
    if problem:
        return [problem]
    if name == AUTO_BACKEND:
        return []
    if attn == "eager":
        return [
            f"model.attention_backend={name} pins a fused kernel, but model.attn_implementation=eager runs the model's "
            "own matmul-softmax attention, which no pin reaches; set model.attention_backend=auto, or "
            "model.attn_implementation=sdpa"
        ]
    method = cp_methods().get(cfg.distributed.cp_method)
    if cfg.distributed.cp_size == 1 or cfg.distributed.cp_method == AUTO or method is None:
        path = "sdpa"
    else:
        nodes = (cfg.data.dataset, cfg.data.validation_dataset)  # packed rows (cp_auto.packed_rows: imports rules)
        path = method.kernel_path(any(node is not None and node.get("pack") is True for node in nodes))
    if name == "flex" and path == "sdpa" and attn != "flex_attention":
        return [
            "model.attention_backend=flex: this run's attention goes through torch's SDPA dispatch (cp_size 1, or "
            "the CP method's inner sdpa kernel), which has no FlexAttention backend; set "
            "model.attn_implementation=flex_attention, or pin flash / cudnn / efficient / math"
        ]
    return []
