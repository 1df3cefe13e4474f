"""Sequence-parallel primitives with autograd: the building blocks for CP in a model of one's own.

``all_to_all``: all-to-all (even and uneven sizes); ``split_gather``: split/gather along a dimension
(contiguous, load-balanced head-tail, per packed sequence, by indices); ``hybrid``: ring x Ulysses
split/gather and its group factoring; ``sharding``: ``sp_shard`` / ``sp_gather`` and the
``ShardingValidator``; ``communication``: MindSpeed-MM's communication module under one import;
``padding``: the padding CP, TP sequence parallelism and FP8 need.

``automodel.distributed.sp_sharding`` and ``automodel.distributed.sp_communication`` are the seed APIs'
import paths (re-exports; docs/seed_api.md lists them).
"""
