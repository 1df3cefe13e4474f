"""Rules of ``recipe.sample_prompts``: completions of the exported model at the end of a run."""

from __future__ import annotations

from automodel.config.schema import RecipeConfig

__all__ = ["sample_problems"]


def sample_problems(cfg: RecipeConfig) -> list[str]:
    """Problems of the sample keys (empty: fine)."""
    r, problems = cfg.recipe, []
    if r.sample_prompts is None:
        return problems
    if not r.sample_prompts or not all(isinstance(p, str) and p for p in r.sample_prompts):
        problems.append(
            f"recipe.sample_prompts={r.sample_prompts!r} must be a non-empty list of non-empty strings, or null"
        )
    if r.sample_max_new_tokens < 1:
        problems.append(f"recipe.sample_max_new_tokens={r.sample_max_new_tokens} must be >= 1")
    if not cfg.export.enabled:
        problems.append(
            "recipe.sample_prompts generates from the exported model, but export.enabled=false; set "
            "export.enabled=true or recipe.sample_prompts=null"
        )
    return problems
