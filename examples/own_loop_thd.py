# Packed documents with THD CP in your own loop. Run: torchrun --standalone --nproc-per-node 2 examples/own_loop_thd.py
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

from automodel.distributed.cp.thd.attention import make_thd_batch_and_ctx, set_thd_attention
from automodel.distributed.mesh import ParallelDims, destroy_distributed, init_distributed


def main() -> None:
    mesh = ParallelDims(cp=2).build_mesh()  # dims: dp_replicate, dp_shard, cp, tp
    torch.manual_seed(0)  # same weights and data on every rank
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(config)
    set_thd_attention(model)  # once: the model's attention becomes THD attention (model code unchanged)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # one packed row of three documents (5, 9 and 1 tokens), each padded to a multiple of 2*cp = 4
    docs = [torch.randint(0, 256, (n + 1,)) for n in (5, 9, 1)]  # +1: the shifted label of the last token
    padded = [-(-(len(d) - 1) // 4) * 4 for d in docs]
    ids = torch.zeros(1, sum(padded), dtype=torch.long)
    labels = torch.full_like(ids, -100)  # pad slots predict nothing
    at = 0
    for d, p in zip(docs, padded):
        ids[0, at : at + len(d) - 1], labels[0, at : at + len(d) - 1] = d[:-1], d[1:]
        at += p
    batch = {"input_ids": ids, "labels": labels,  # labels already shifted
             "position_ids": torch.cat([torch.arange(p) for p in padded]).unsqueeze(0),
             "seq_lens": torch.tensor([[len(d) - 1 for d in docs]]), "seq_lens_padded": torch.tensor([padded])}
    num_label_tokens = int((labels != -100).sum())  # count before sharding

    train_ctx, batch = make_thd_batch_and_ctx(mesh, batch)  # this rank's tokens of every document, as [1, T/cp]
    with train_ctx():  # attention gathers K/V over the CP group and stays inside each document
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100,
                               reduction="sum") / num_label_tokens
        loss.backward()
    for p in model.parameters():  # each rank holds its tokens' share of every gradient
        dist.all_reduce(p.grad, group=mesh["cp"].get_group())
    dist.all_reduce(loss.detach_(), group=mesh["cp"].get_group())
    optimizer.step()
    if dist.get_rank() == 0:
        print(f"loss {loss.item():.4f} over {num_label_tokens} tokens in {len(docs)} documents")


if __name__ == "__main__":
    init_distributed()  # gloo on CPU, nccl on CUDA
    main()
    destroy_distributed()  # after main(): destroys the process groups and frees them while Python is alive
