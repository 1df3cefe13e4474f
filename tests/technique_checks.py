"""Assertions on a recipe run's technique report (``automodel.training.technique_report``), shared by the recipe
launches that check that checkpointing and activation offload acted under their CP method."""

from __future__ import annotations


def assert_two_layers_recomputed_and_inputs_offloaded(report: dict, log: list[str], micro_batches: int) -> None:
    """A 2-layer model's run: ``micro_batches`` micro-batches, each layer recomputed once per micro-batch, offload
    moving one tensor per layer and micro-batch (the layer input), and no technique warning in the run log."""
    m = report["micro_batches"]
    assert m == micro_batches
    ac = report["activation_checkpointing"]
    assert ac["layers"] == ac["layers_recomputed"] == 2 and ac["recomputed_per_layer"] == [m, m]
    off = report["activation_offload"]
    assert off["tensors"] == off["layer_inputs"] == 2 * m
    assert [off["per_layer"][str(i)]["tensors"] for i in range(2)] == [m, m]
    assert not any("WARNING" in line for line in log), log
