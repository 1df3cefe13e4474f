#!/usr/bin/env python
"""Fine-tune a Hugging Face causal LM with context parallelism.

    torchrun --nproc-per-node 2 recipes/finetune.py --config configs/cp.yaml [key=value ...]

Overrides use Hydra's grammar (``key=value``, ``+new.key=value``, ``~key``); every key is in
docs/recipe.md. ``recipe.dry_run=true`` prints the plan (the mesh, the per-rank shapes, memory and
a step-time estimate) and exits without loading weights. The ``automodel finetune`` command
(automodel/cli.py) launches this file the way torchrun does. Exit codes: 0 done, 2 a mistake in the
input (config, data, tokenizer, model path, checkpoint: one ``error:`` line from rank 0, the
traceback in the run's logs/rank_<r>.log), 3 a non-finite loss, gradient or weight (one ``error:``
line naming the step and the quantity; ``recipe.on_nonfinite``), 4 a rank was lost, 143 stopped by
SIGTERM (a checkpoint was written; resume with checkpoint.resume=true).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from automodel.config import USAGE, ConfigError, load_config  # noqa: E402
from automodel.config.compose import parse_argv  # noqa: E402

EXIT_CONFIG_ERROR = 2
EXIT_SIGTERM = 143


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if parse_argv(argv)[2]:
            print(USAGE)
            return 0
        import torch

        loaded = load_config(argv, cuda_available=torch.cuda.is_available())
    except ConfigError as e:  # every rank validates the same config: one copy, printed before any rank exits
        from automodel.training.user_errors import report_error_before_setup

        return report_error_before_setup(str(e))

    if loaded.cfg.recipe.dry_run:
        from automodel.training.dry_run import dry_run_report

        try:
            report = dry_run_report(loaded)
            if os.environ.get("RANK", "0") == "0":  # under torchrun, one copy is enough
                print(report)
        except (ValueError, TypeError) as e:
            from automodel.training.user_errors import report_error_before_setup

            return report_error_before_setup(str(e))
        return 0

    import torch.distributed as dist

    from automodel.training.console_hold import hold_console
    from automodel.training.peer_loss import stop_quietly_if_peer_lost
    from automodel.training.trainer import FinetuneTrainer
    from automodel.training.user_errors import RunAborted, run_guarded

    trainer = FinetuneTrainer(loaded)
    console = hold_console()  # the setup's output shows once it worked (or after a few seconds), not around an error

    def train():
        console.release()
        return stop_quietly_if_peer_lost(trainer.train, step=lambda: trainer.step)  # a lost rank: no traceback

    try:  # a user error: one `error:` line from rank 0, exit 2 on every rank; others keep their traceback
        result = run_guarded(trainer.setup, train)
    except RunAborted as e:
        console.discard()
        return e.exit_code
    finally:
        console.restore()
        if dist.is_initialized():  # the groups are freed once main() returns (destroy_distributed below)
            dist.destroy_process_group()
    return EXIT_SIGTERM if result.stopped_by_sigterm else 0


if __name__ == "__main__":
    from automodel.distributed.mesh import destroy_distributed
    from automodel.training.user_errors import exit_process

    code = main()
    destroy_distributed()  # now that nothing of the run is referenced: its process groups are freed here
    exit_process(code, keep=(0, EXIT_SIGTERM))
