"""configs/vlm_cp.yaml through the recipe on gloo ranks (run by tests/test_vlm_recipe.py).

Every run uses the same overrides (fp32, 4 steps, validation every 2), so cp=2 (ring, Ulysses) and
cp=1 must give the same per-step losses. The ring cp=2 run exports the model; the cp=1 group then
loads that export with ``from_pretrained``.
"""

from __future__ import annotations

from pathlib import Path

from automodel.config import load_config
from automodel.training.trainer import FinetuneTrainer

CONFIG = "configs/vlm_cp.yaml"
FAST = [
    "step_scheduler.max_steps=4",
    "step_scheduler.val_every_steps=2",
    "step_scheduler.ckpt_every_steps=null",
    "checkpoint.save_final=false",
    "fsdp.param_dtype=float32",
    "logging.plot=false",
    "export.enabled=false",
]


def _run(world: int, out: Path, name: str, overrides: list[str]) -> dict:
    argv = ["--config", CONFIG, *FAST, f"recipe.output_dir={out / name}", *overrides]
    trainer = FinetuneTrainer(load_config(argv, world_size=world))
    result = trainer.run()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {
        "losses": dict(result.losses),
        "val_losses": dict(result.val_losses),
        "grad_norms": dict(result.grad_norms),
        "state": state if trainer.rank == 0 else None,
        "export": str(result.export_dir) if result.export_dir else None,
        "attn": trainer.model.model.language_model.config._attn_implementation,
        "vision_attn": trainer.model.model.visual.config._attn_implementation,
    }


def pair(rank: int, world_size: int, out: str) -> dict:
    """World 2: ring cp=2 (exports the model) and Ulysses cp=2."""
    out_dir = Path(out)
    return {
        "ring": _run(world_size, out_dir, "ring", ["export.enabled=true"]),
        "ulysses": _run(world_size, out_dir, "ulysses", ["distributed.cp_method=ulysses"]),
    }


def single(rank: int, world_size: int, out: str, export: str) -> dict:
    """World 1: the cp=1 reference, and the ring run's export loaded with from_pretrained."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    ref = _run(world_size, Path(out), "ref", ["distributed.cp_size=1"])
    loaded = AutoModelForImageTextToText.from_pretrained(export)
    return {
        "ref": ref,
        "loaded_class": type(loaded).__name__,
        "loaded_state": {k: v.detach().clone() for k, v in loaded.state_dict().items()},
        "loaded_dtype": str(next(loaded.parameters()).dtype),
        "export_files": sorted(p.name for p in Path(export).iterdir()),
        "processor": _load_processor(export, AutoImageProcessor).to_dict(),  # the export includes the processor
    }


def _load_processor(export: str, auto):
    """The exported image processor, as a user loads it: ``AutoImageProcessor``; transformers 5.17's Auto class
    requires torchvision (which automodel does not install) even for the PIL processor the dataset saves, so there it
    is loaded by the class its ``preprocessor_config.json`` names."""
    try:
        return auto.from_pretrained(export)
    except ImportError as err:
        if "Torchvision" not in str(err):
            raise
        import json

        import transformers

        name = json.loads((Path(export) / "preprocessor_config.json").read_text())["image_processor_type"]
        return getattr(transformers, name).from_pretrained(export)
