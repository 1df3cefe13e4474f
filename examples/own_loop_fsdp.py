# Data parallel x CP with FSDP2 in your own training loop. Run: torchrun --standalone --nproc-per-node 4 examples/own_loop_fsdp.py
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

from automodel.distributed.cp import context_parallel
from automodel.distributed.mesh import ParallelDims, destroy_distributed, get_submesh, init_distributed
from automodel.models.parallelize import apply_fsdp2


def packed_row(step: int, dp_rank: int) -> dict[str, torch.Tensor]:
    """One packed row of three documents, different on every data-parallel rank (labels already shifted)."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    docs = [torch.randint(0, 256, (n + 1,), generator=g) for n in (7 + dp_rank, 12, 3)]  # +1: the last label
    return {"input_ids": torch.cat([d[:-1] for d in docs]).unsqueeze(0),
            "labels": torch.cat([d[1:] for d in docs]).unsqueeze(0),
            "position_ids": torch.cat([torch.arange(len(d) - 1) for d in docs]).unsqueeze(0)}


def main() -> None:
    mesh = ParallelDims(dp_shard=2, cp=2).build_mesh()  # 4 ranks: 2 data-parallel replicas x 2 CP ranks
    torch.manual_seed(0)  # same initial weights on every rank
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(config)
    cp = context_parallel(model, mesh, method="thd_docs")  # first: checks the model, switches its attention
    apply_fsdp2(model, mesh, param_dtype=None, reduce_dtype=torch.float32)  # shards over dp x cp, SUMs gradients
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dp, dp_cp = get_submesh(mesh, "dp"), get_submesh(mesh, "dp_cp")  # the replicas; every rank of the step

    for step in range(2):
        batch = packed_row(step, dp.get_local_rank())  # the CP ranks of one replica see the same row
        ctx, local = cp.shard(batch)
        n_tokens = torch.tensor(local["num_items_in_batch"])  # this replica's label count, before sharding
        dist.all_reduce(n_tokens, group=dp.get_group())  # the loss is normalised by the global count ...
        local["num_items_in_batch"] = int(n_tokens)  # ... so every rank's share adds up to one process's loss
        with ctx():
            loss = model(**local).loss
            loss.backward()  # FSDP2 reduce-scatters the gradient SUM over dp x cp: no cp.reduce_gradients()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=dp_cp.get_group())  # every rank's share summed: the global batch's loss
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.6f} grad norm {grad_norm.item():.6f} over {int(n_tokens)} tokens")
    cp.restore()


if __name__ == "__main__":
    init_distributed()  # gloo on CPU, nccl on CUDA
    main()
    destroy_distributed()  # after main(): destroys the process groups and frees them while Python is alive
