"""Activation-checkpoint offload (automodel.training.activation_offload), one process on the CPU.

- exactness: the loss and every gradient with offload equal those with checkpointing alone, bit for bit, in
  fp32 and fp64, over two micro-batches (the store serves a second forward after a backward), with LoRA and
  with a compiled block (aot_eager);
- the store really holds the layer inputs: the hidden states that enter a block are freed after the forward
  (a weak reference to them dies) and come back from the host; the host bytes are one micro-batch's inputs;
- the CUDA path's scheduling on a fake stream API: device->host on the side stream after waiting for the
  compute stream and record_stream on the source; at the backward of layer i the inputs of layer i-1 are
  prefetched and the compute stream waits only on the events of the copies it uses;
- the refusals: no checkpointing, a device type without a copy path, the config rule;
- observably on (issue 41): with compile and a class swapped as FSDP2 swaps it, every block is recomputed once
  per micro-batch (its attention runs twice) and only the layer inputs reach the store; the report the run log
  prints says so, and names a technique that did not act;
- host memory follows the training shapes: rows of varying lengths do not grow the pool.

Multi-process parity (every CP method at cp 2, ring at cp 4) runs in the existing launches:
tests/test_context_parallel.py and tests/test_cp_parity.py; the recipe's technique report under FSDP2 (2 gloo
ranks: ring and Ulysses with offload, the tiled MLP, TP, compile) in tests/test_recipe_parity.py,
tests/test_tp_recipe.py and tests/test_compile_recipe.py.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from automodel.training.activation_offload import (
    HostBufferPool,
    HostCopier,
    OffloadStore,
    StreamCopier,
    apply_activation_offload,
    make_copier,
)

VOCAB = 96


def _model(
    dtype: torch.dtype = torch.float32, layers: int = 3, checkpointing: bool = True
) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(dtype)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _batches(n: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": torch.randint(0, VOCAB, (2, 20), generator=g),
             "labels": torch.randint(0, VOCAB, (2, 20), generator=g)} for _ in range(n)]  # fmt: skip


def _losses_and_grads(model: torch.nn.Module) -> tuple[list[float], dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    losses = []
    for b in _batches():
        loss = model(**b).loss
        loss.backward()
        losses.append(loss.item())
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_loss_and_every_gradient_equal_checkpointing_alone(one_thread, dtype):
    ref_losses, ref_grads = _losses_and_grads(_model(dtype))
    model = _model(dtype)
    store = apply_activation_offload(model)
    losses, grads = _losses_and_grads(model)
    assert losses == ref_losses
    assert sorted(grads) == sorted(ref_grads) and len(grads) > 10
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), name
    s = store.stats()
    # 3 layers x 2 micro-batches: each block's input went to the host and came back; after the first layer
    # of each backward, the others were prefetched
    assert (s.packed, s.unpacked, s.prefetched) == (6, 6, 4)
    layer_input = 2 * 20 * 32 * torch.tensor([], dtype=dtype).element_size()
    assert s.offloaded_bytes == 6 * layer_input
    assert s.peak_live_bytes == 3 * layer_input  # one micro-batch's layer inputs at its forward's end
    assert s.live_bytes == 0  # the backward released them all
    assert s.host_bytes == 3 * layer_input == s.peak_host_bytes  # the pool served micro-batch 2 again


def test_layer_inputs_leave_and_come_back(one_thread):
    """The hidden states entering block 1 are freed after the forward with offload (held without it)."""

    def forward_and_watch(model: torch.nn.Module) -> tuple[bool, torch.Tensor]:
        seen: list = []
        hook = model.model.layers[1].register_forward_pre_hook(
            lambda m, args: seen.append(weakref.ref(args[0]))
        )
        loss = model(**_batches(1)[0]).loss
        hook.remove()
        gc.collect()
        alive = seen[0]() is not None
        loss.backward()
        return alive, model.model.layers[0].mlp.up_proj.weight.grad.clone()

    ref_alive, ref_grad = forward_and_watch(_model())
    model = _model()
    store = apply_activation_offload(model)
    alive, grad = forward_and_watch(model)
    assert ref_alive and not alive  # checkpointing keeps the block input; offload releases it
    assert store.stats().unpacked == 3
    assert torch.equal(grad, ref_grad)


def test_with_lora(one_thread):
    from automodel.config.schema import PeftSection
    from automodel.models.lora import apply_lora

    def run(offload: bool) -> dict:
        model = _model()
        apply_lora(model, PeftSection(r=4, target_modules=["q_proj", "v_proj"]), seed=0)
        if offload:
            apply_activation_offload(model)
        return _losses_and_grads(model)

    (ref_losses, ref_grads), (losses, grads) = run(False), run(True)
    assert losses == ref_losses and sorted(grads) == sorted(ref_grads)
    assert all("lora" in n for n in grads)
    assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)


def test_with_a_compiled_block(one_thread):
    from automodel.models.compile import compile_decoder_blocks

    torch._dynamo.reset()
    ref = _model(layers=2)
    compile_decoder_blocks(ref, "aot_eager")
    ref_losses, ref_grads = _losses_and_grads(ref)
    model = _model(layers=2)
    compile_decoder_blocks(model, "aot_eager")
    store = apply_activation_offload(model)  # after compile: the hooks are outside the compiled code
    losses, grads = _losses_and_grads(model)
    torch._dynamo.reset()
    assert losses == ref_losses
    assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
    assert store.stats().packed >= 4  # every block's input went through the store


def test_refused_without_checkpointing():
    with pytest.raises(ValueError, match=r"not checkpointed.*model.activation_checkpointing=true"):
        apply_activation_offload(_model(checkpointing=False))
    model = _model()
    apply_activation_offload(model)
    with pytest.raises(ValueError, match="applied to this model already"):
        apply_activation_offload(model)


def test_tensors_of_another_device_stay_where_they_are():
    store = OffloadStore(StreamCopier(api=object()))  # a CUDA copier: a host tensor is not its to move
    t = torch.ones(3)
    assert store.pack(t) is t and store.unpack(t) is t
    assert store.stats().kept == 1 and store.stats().packed == 0


def test_an_empty_saved_tensor_stays_where_it_is():
    # torch 2.11's non-reentrant checkpoint saves a [0] placeholder beside the layer's inputs: moving it
    # would count a second "layer input" per layer (and the trainer would report the layers as offloaded)
    store = OffloadStore(HostCopier())
    empty = torch.empty(0, requires_grad=True)
    assert store.pack(empty) is empty and store.unpack(empty) is empty
    assert store.stats().kept == 1 and store.stats().packed == 0


def test_device_without_a_copy_path_is_refused():
    with pytest.raises(ValueError, match="no copy path for device type 'meta'.*activation_offload=false"):
        make_copier(torch.device("meta"))


def test_host_buffer_pool_serves_nearby_sizes_and_trims_what_is_unused():
    pool = HostBufferPool()
    a = pool.acquire(torch.Size([4, 8]), torch.float32)  # 128 bytes: a new buffer of 128
    pool.release(a)
    b = pool.acquire(torch.Size([4, 7]), torch.float32)  # 112 bytes: served by the 128-byte buffer
    assert b.data_ptr() == a.data_ptr() and b.shape == (4, 7) and b.dtype == torch.float32 and b.is_contiguous()
    c = pool.acquire(torch.Size([4, 8]), torch.float64)  # 256 bytes: a new buffer
    assert pool.allocations == 2 and pool.host_bytes == 128 + 256
    assert pool.in_use_bytes == 112 + 256 == pool.peak_in_use_bytes
    pool.release(b)
    pool.release(c)
    tiny = pool.acquire(torch.Size([2]), torch.float32)  # 8 bytes: no free buffer is within twice its size
    assert pool.allocations == 3
    pool.release(tiny)
    assert pool.trim() == 0  # each served since the pool began
    x = pool.acquire(torch.Size([4, 8]), torch.float64)
    pool.release(x)
    assert pool.trim() == 128 + 8 and pool.host_bytes == 256  # only the 256-byte buffer served since
    pool.clear()
    assert pool.host_bytes == 0 and pool.in_use_bytes == 0


def test_host_memory_follows_the_training_shapes(one_thread):
    """Rows of 21 different lengths, then rows of one length: the pool holds at most two micro-batches' buffers
    at the longest length, then exactly one micro-batch's at the last length (the shape-keyed pool of issue 41
    kept one buffer per layer and length: 21 x 3 here)."""
    from automodel.training.activation_offload import _capacity

    model = _model()
    store = apply_activation_offload(model)
    g = torch.Generator().manual_seed(5)
    lengths = [int(n) for n in torch.randint(10, 31, (30,), generator=g)] + [12] * 6
    peak = 0
    for n in lengths:
        ids = torch.randint(0, VOCAB, (2, n), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        peak = max(peak, store.pool.host_bytes)
    per_row = 2 * 32 * 4  # B x H x fp32, per token
    assert peak <= 2 * 3 * _capacity(30 * per_row)
    assert store.pool.host_bytes == 3 * _capacity(12 * per_row)
    allocations = store.pool.allocations
    for _ in range(3):  # the steady state allocates nothing
        model(input_ids=ids, labels=ids).loss.backward()
    assert store.pool.allocations == allocations


# ---------------------------------------------------------------- every technique observably on
def _fsdp_like_subclass(module: torch.nn.Module) -> None:
    """What fully_shard does to a block's class: a subclass made at run time (transformers 5.25 wraps its
    ``forward`` once more in ``__init_subclass__``). The real FSDP2 runs in tests/test_recipe_parity.py."""
    cls = type(module)
    module.__class__ = type(f"FSDP{cls.__name__}", (cls,), {})


@pytest.mark.parametrize("wrap", ["eager", "subclassed", "compiled", "compiled_subclassed"])
def test_every_layer_recomputed_and_only_its_input_offloaded(one_thread, wrap):
    """Issue 41: with checkpointing (transformers' own switch, as a user calls it), compile, offload and then the
    class swap of FSDP2, in the trainer's order, every block's attention runs twice per micro-batch (forward and
    recomputation) and the store gets exactly one tensor per layer and micro-batch: the hidden states entering
    it. Before the fix the swapped class ran each block once and the store got every activation."""
    from automodel.models.compile import compile_decoder_blocks
    from automodel.training.technique_report import (
        collect_technique_report,
        technique_lines,
        technique_problems,
    )

    torch._dynamo.reset()
    ref_losses, ref_grads = _losses_and_grads(_model(layers=2))
    model = _model(layers=2)
    if wrap.startswith("compiled"):
        compile_decoder_blocks(model, "aot_eager")
    store = apply_activation_offload(model)
    if wrap.endswith("subclassed"):
        for layer in model.model.layers:
            _fsdp_like_subclass(layer)
    attention_calls = [0]
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(lambda *_: attention_calls.__setitem__(0, attention_calls[0] + 1))
    losses, grads = _losses_and_grads(model)  # two micro-batches of [2, 20]
    torch._dynamo.reset()
    assert attention_calls[0] == 2 * 2 * 2  # layers x (forward + recomputation) x micro-batches
    layer_input = 2 * 20 * 32 * 4  # [B, S, H] fp32
    report = collect_technique_report(model, store, micro_batches=2)
    assert report["activation_checkpointing"] == {
        "layers": 2, "layers_recomputed": 2, "checkpointed_calls": 4, "recomputed": 4, "recomputed_per_layer": [2, 2],
    }  # fmt: skip
    off = report["activation_offload"]
    assert off["per_layer"] == {"0": {"tensors": 2, "bytes": 2 * layer_input}, "1": {"tensors": 2, "bytes": 2 * layer_input}}
    assert off["tensors"] == off["layer_inputs"] == 4 and off["host_bytes"] == 2 * layer_input
    assert technique_problems(report) == []
    assert technique_lines(report) == [
        "activation checkpointing: 2 of 2 decoder layers recomputed in the backward (4 recomputation(s) of 4 "
        "checkpointed call(s), 2 micro-batch(es))",
        "activation offload: 4 tensor(s), 20.0 KiB moved to the host over 2 micro-batch(es) (each of 2 layers: 2 "
        "tensor(s), 10.0 KiB; the layer inputs: 4); host pool 10.0 KiB",
    ]
    if wrap.startswith("compiled"):  # aot_eager's decompositions round differently from eager (bit for bit
        # against a compiled run without offload: test_with_a_compiled_block)
        assert losses == pytest.approx(ref_losses, rel=1e-6)
        assert all(torch.allclose(grads[n], ref_grads[n], rtol=1e-5, atol=1e-7) for n in ref_grads)
    else:
        assert losses == ref_losses
        assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)


def test_a_technique_that_did_not_act_is_named():
    from automodel.training.technique_report import technique_problems

    report = {
        "micro_batches": 1,
        "activation_checkpointing": {"layers": 2, "layers_recomputed": 0, "checkpointed_calls": 2, "recomputed": 0,
                                     "recomputed_per_layer": [0, 0]},  # fmt: skip
        "activation_offload": {"tensors": 68, "layer_inputs": 2},
    }
    problems = technique_problems(report)
    assert problems[0].startswith("model.activation_checkpointing=true but 2 of 2 decoder layers (e.g. layer 0)")
    assert "moved 68 tensors to the host, more than the 2 layer inputs" in problems[1]
    report["activation_offload"] = {"tensors": 0, "layer_inputs": 2}
    assert technique_problems(report)[1] == "model.activation_offload=true but no tensor was moved to the host"
    report["activation_offload"] = {"tensors": 1, "layer_inputs": 2}  # e.g. a pending collective's result kept
    assert technique_problems(report)[1] == (
        "model.activation_offload=true moved only 1 of the 2 layer inputs to the host: the others stayed on the device"
    )


# ---------------------------------------------------------------- the CUDA path's scheduling, on a fake API
class _FakeStream:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def wait_stream(self, other: _FakeStream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: _FakeEvent) -> None:
        self.log.append(("wait_event", self.name, event.id))


class _FakeEvent:
    count = 0

    def __init__(self, log: list):
        _FakeEvent.count += 1
        self.log, self.id = log, _FakeEvent.count

    def record(self, stream: _FakeStream) -> None:
        self.log.append(("record", stream.name, self.id))


class _FakeCuda:
    """torch.cuda's stream API as StreamCopier uses it, logging each call; copies run on the CPU."""

    def __init__(self):
        self.log: list = []
        self.compute = _FakeStream(self.log, "compute")
        self.on = "compute"

    def Stream(self, device):  # noqa: N802
        return _FakeStream(self.log, "side")

    def Event(self):  # noqa: N802
        return _FakeEvent(self.log)

    def current_stream(self, device):
        return self.compute

    def stream(self, stream):
        import contextlib

        @contextlib.contextmanager
        def on():
            self.on, before = stream.name, self.on
            self.log.append(("enter", stream.name))
            yield
            self.on = before

        return on()

    def record_stream(self, tensor, stream):
        self.log.append(("record_stream", stream.name, tuple(tensor.shape)))


class _LoggingCopier(StreamCopier):
    """StreamCopier on the fake API; each copy logs which stream it ran on (and for to_device, which buffer)."""

    device_type = "cpu"  # the fake "CUDA" tensors are CPU tensors

    def __init__(self, api: _FakeCuda, names: dict):
        super().__init__(api)
        self.names = names  # id(host buffer) -> layer index

    def to_host(self, tensor, buf):
        super().to_host(tensor, buf)
        self.names[id(buf)] = len(self.names)
        self.api.log.append(("d2h", "layer", self.names[id(buf)]))

    def to_device(self, buf, device):
        out, ready = super().to_device(buf, device)
        self.api.log.append(("h2d", "layer", self.names[id(buf)], ready.id))
        return out, ready


def test_stream_schedule_prefetches_the_previous_layer_and_waits_only_on_events(one_thread):
    api = _FakeCuda()
    copier = _LoggingCopier(api, {})
    store = OffloadStore(copier, HostBufferPool(pin=False))
    model = _model()
    apply_activation_offload(model, store)
    model.zero_grad(set_to_none=True)
    batch = _batches(1)[0]
    loss = model(**batch).loss
    forward_log = list(api.log)
    # forward: per layer, the side stream waits for the compute stream, copies, and the source is recorded
    assert [e for e in forward_log if e[0] == "d2h"] == [
        ("d2h", "layer", 0),
        ("d2h", "layer", 1),
        ("d2h", "layer", 2),
    ]
    assert forward_log[:4] == [("wait_stream", "side", "compute"), ("enter", "side"),
                               ("record_stream", "side", (2, 20, 32)), ("d2h", "layer", 0)]  # fmt: skip
    api.log.clear()
    loss.backward()
    log = api.log
    copies = [e for e in log if e[0] == "h2d"]
    # backward runs the layers in reverse: layer 2 is fetched on demand, then at each unpack the layer
    # before it is prefetched; nothing is fetched twice
    assert [c[2] for c in copies] == [2, 1, 0]
    waits = [e for e in log if e[0] == "wait_event"]
    assert [w[2] for w in waits] == [c[3] for c in copies]  # the compute stream waits on exactly these events
    assert all(w[1] == "compute" for w in waits)
    # the prefetch of layer 1 is issued before the compute stream waits for layer 2's copy
    assert log.index(copies[1]) < log.index(waits[0])
    # every host->device copy ran on the side stream after it waited for the compute stream
    for c in copies:
        i = log.index(c)
        assert log[i - 3 : i] == [
            ("wait_stream", "side", "compute"),
            ("enter", "side"),
            ("record", "side", c[3]),
        ]
    assert not any(e[0] == "synchronize" for e in log)
    assert store.stats().prefetched == 2
    grads = {n: p.grad for n, p in model.named_parameters()}
    ref_model = _model()
    ref_model(**batch).loss.backward()
    assert all(torch.equal(grads[n], p.grad) for n, p in ref_model.named_parameters())
