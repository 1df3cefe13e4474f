"""The training loop and its pieces: ``loss``, ``lr_schedule``, ``optim``, ``step`` (one micro-batch
under the CP context), ``row_padding``, ``checkpoint``, ``metrics``, ``plot``, ``export``, ``run_dir``,
``dry_run`` and ``trainer`` (``FinetuneTrainer``). The CP methods themselves are strategies in
:mod:`automodel.distributed.cp`; nothing here branches on a method's name.

Import the modules directly (this package imports nothing)."""
