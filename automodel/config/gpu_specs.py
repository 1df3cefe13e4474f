"""Peak figures of a few GPUs, for the dry run's rough step-time and communication estimate.

Data, not measurements: dense BF16 tensor-core peak (no sparsity), HBM bandwidth and link bandwidth,
from the vendors' data sheets. ``intra_node_gb_s`` is NVLink per GPU and direction (PCIe where a GPU
has none). ``node_nic_gb_s`` is the network bandwidth of a whole node per direction (the usual build:
one NIC per GPU of the speed named in ``network``, e.g. 8 x 400 Gb/s = 400 GB/s for an H100 node); the
GPUs of a node share it, so a rank of a group that spans nodes gets ``node_nic_gb_s / ranks per node``
(every rank of a node runs the same collective at once). The achieved fractions of these peaks are the
step estimate's constants (``automodel/training/step_estimate.py``, ``docs/estimate.md``).
``recipe.gpu_type`` names one of :data:`GPU_SPECS`; ``recipe.plan_nproc_per_node`` (else
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
    node_nic_gb_s: float  # GB/s per node per direction between nodes (shared by the node's GPUs)
    hbm_gb_s: float  # HBM bandwidth per GPU, GB/s
    network: str
    gpus_per_node: int = 8
    capability: tuple[int, int] = (9, 0)  # CUDA compute capability: which attention kernel torch picks (auto)

    def inter_node_gb_s(self, ranks_per_node: int) -> float:
        """GB/s one rank gets across nodes while every rank of its node sends: the node's NICs shared."""
        return self.node_nic_gb_s / max(1, ranks_per_node)


GPU_SPECS: dict[str, GPUSpec] = {
    "h100": GPUSpec("NVIDIA H100 SXM5 80GB", 989.0, 80, 450.0, 400.0, 3350.0,
                    "NVLink 4 (900 GB/s both ways); 8 x 400 Gb/s NICs per node"),
    "h200": GPUSpec("NVIDIA H200 SXM 141GB", 989.0, 141, 450.0, 400.0, 4800.0,
                    "NVLink 4 (900 GB/s both ways); 8 x 400 Gb/s NICs per node"),
    "a100": GPUSpec("NVIDIA A100 SXM4 80GB", 312.0, 80, 300.0, 200.0, 2039.0,
                    "NVLink 3 (600 GB/s both ways); 8 x 200 Gb/s NICs per node", capability=(8, 0)),
    "l40s": GPUSpec("NVIDIA L40S 48GB", 362.0, 48, 32.0, 200.0, 864.0,
                    "PCIe 4.0 x16, no NVLink; 8 x 200 Gb/s NICs per node", capability=(8, 9)),
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
