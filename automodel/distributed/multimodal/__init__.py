"""Multimodal context parallelism: vision inputs split across CP ranks (Megatron's names).

``comm``: the group a helper runs on and the gather with its backward; ``cp``: fixed-size samples
and the public names (it re-exports dynamic resolution); ``dynamic_res``: whole images per rank
balanced by patch count; ``megatron_split``: Megatron's dynamic-resolution split.

``automodel.distributed.multimodal_cp`` is Megatron's seed import path (a re-export of ``cp``;
docs/seed_api.md lists it).
"""
