"""Peak figures of a few GPUs, for the dry run's rough step-time and communication estimate.

Data, not measurements: dense BF16 tensor-core peak (no sparsity) and link bandwidth per GPU and per
direction, from the vendors' data sheets. ``intra_node_gb_s`` is NVLink (PCIe where a GPU has none);
``inter_node_gb_s`` assumes one NIC per GPU of the speed named in ``network``. Achieved figures are
lower (model FLOPs utilisation is typically 30-50 %, collectives reach 70-90 % of the link), which the
estimate says. ``recipe.gpu_type`` names one of :data:`GPU_SPECS`; ``recipe.plan_nproc_per_node`` (else
``gpus_per_node``) decides which groups stay inside a node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["GPUSpec", "GPU_SPECS", "gpu_problems"]


@dataclass(frozen=True)
class GPUSpec:
    name: str
    bf16_tflops: float  # dense BF16 peak, TFLOP/s
    memory_gib: float
    intra_node_gb_s: float  # GB/s per GPU per direction inside a node
    inter_node_gb_s: float  # GB/s per GPU per direction between nodes
    network: str
    gpus_per_node: int = 8


GPU_SPECS: dict[str, GPUSpec] = {
    "h100": GPUSpec("NVIDIA H100 SXM5 80GB", 989.0, 80, 450.0, 50.0, "NVLink 4 (900 GB/s both ways); 400 Gb/s NIC per GPU"),
    "h200": GPUSpec("NVIDIA H200 SXM 141GB", 989.0, 141, 450.0, 50.0, "NVLink 4 (900 GB/s both ways); 400 Gb/s NIC per GPU"),
    "a100": GPUSpec("NVIDIA A100 SXM4 80GB", 312.0, 80, 300.0, 25.0, "NVLink 3 (600 GB/s both ways); 200 Gb/s NIC per GPU"),
    "l40s": GPUSpec("NVIDIA L40S 48GB", 362.0, 48, 32.0, 25.0, "PCIe 4.0 x16, no NVLink; 200 Gb/s NIC per GPU"),
}


def gpu_problems(cfg: Any) -> list[str]:
    """``recipe.gpu_type`` names a known GPU (or is null); ``recipe.gpus`` is >= 1 (or null)."""
    problems = []
    name = cfg.recipe.gpu_type
    if name is not None and name.lower() not in GPU_SPECS:
        problems.append(
            f"recipe.gpu_type={name!r} is not a known GPU; use one of {sorted(GPU_SPECS)} (automodel/config/gpu_specs.py)"
        )
    if cfg.recipe.gpus is not None and cfg.recipe.gpus < 1:
        problems.append(f"recipe.gpus={cfg.recipe.gpus} must be >= 1 (the GPUs this config is written for), or null")
    return problems
