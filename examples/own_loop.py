# Use ring CP in your own training loop. Run: torchrun --standalone --nproc-per-node 2 examples/own_loop.py
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

from automodel.distributed.cp_utils import make_cp_batch_and_ctx
from automodel.distributed.mesh import ParallelDims, destroy_distributed, init_distributed


def main() -> None:
    mesh = ParallelDims(cp=2).build_mesh()  # dims: dp_replicate, dp_shard, cp, tp
    torch.manual_seed(0)  # same weights and data on every rank
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    tokens = torch.randint(0, 256, (1, 1025))  # the ranks of one CP group see the same row
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}  # labels already shifted
    num_label_tokens = int((batch["labels"] != -100).sum())  # count before sharding

    train_ctx, batch = make_cp_batch_and_ctx(mesh, batch)
    with train_ctx():  # shards the batch (512 tokens per rank); SDPA runs as ring attention
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100,
                               reduction="sum") / num_label_tokens
        loss.backward()
    for p in model.parameters():  # each rank holds its tokens' share of every gradient
        dist.all_reduce(p.grad, group=mesh["cp"].get_group())
    dist.all_reduce(loss.detach_(), group=mesh["cp"].get_group())
    optimizer.step()
    if dist.get_rank() == 0:
        print(f"loss {loss.item():.4f} over {num_label_tokens} tokens")


if __name__ == "__main__":
    init_distributed()  # gloo on CPU, nccl on CUDA
    main()
    destroy_distributed()  # after main(): destroys the process groups and frees them while Python is alive
