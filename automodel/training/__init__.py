"""The training loop and its pieces: ``loss``, ``lr_schedule``, ``optim``, ``step`` (one micro-batch
under the CP context), ``cp_dispatch`` (cp_method -> batch/context function), ``checkpoint``,
``metrics``, ``plot``, ``export``, ``run_dir``, ``dry_run`` and ``trainer`` (``FinetuneTrainer``).

Import the modules directly (this package imports nothing, so ``automodel.config`` can use
``cp_dispatch`` without pulling in the trainer)."""
