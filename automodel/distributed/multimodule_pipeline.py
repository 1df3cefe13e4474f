"""Stable import path: the code lives in :mod:`automodel.distributed.pipeline.multimodule` (re-exported here)."""

from automodel.distributed.pipeline.multimodule import (
    ModuleGrid,
    MultiModulePipelineCommunicator,
    RankModuleInfo,
    Shape,
    _prepare_tensor_for_comm,
    _restore_tensor_from_comm,
    compute_total_pipeline_stages,
    run_gpipe,
)

__all__ = [
    "ModuleGrid",
    "MultiModulePipelineCommunicator",
    "RankModuleInfo",
    "Shape",
    "_prepare_tensor_for_comm",
    "_restore_tensor_from_comm",
    "compute_total_pipeline_stages",
    "run_gpipe",
]
