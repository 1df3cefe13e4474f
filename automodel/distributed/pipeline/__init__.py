"""Pipeline communication between modules on rank groups (see ``automodel.distributed.pipeline.multimodule``).

``topology``: module DAGs, rank grids and stage arithmetic; ``bridge``: redistribution plans between
dp/cp/tp layouts; ``p2p``: one batched exchange with shape headers and timeouts; ``schedule``: GPipe.
"""
