# Packed documents placed by cost (thd_docs) in your own loop. Run: torchrun --standalone --nproc-per-node 2 examples/own_loop_docs.py
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

from automodel.distributed.cp.thd_docs import model_cost
from automodel.distributed.cp.thd_docs.attention import make_doc_batch_and_ctx, set_doc_attention
from automodel.distributed.mesh import ParallelDims, destroy_distributed, init_distributed


def main() -> None:
    mesh = ParallelDims(cp=2).build_mesh()  # dims: dp_replicate, dp_shard, cp, tp
    torch.manual_seed(0)  # same weights and data on every rank
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(config)
    set_doc_attention(model)  # once: the model's attention becomes document-placement attention
    cost = model_cost(model)  # the placement's cost model (attention pairs vs per-token work)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # one packed row of four documents (5, 9, 1 and 21 tokens): no padding per document
    docs = [torch.randint(0, 256, (n + 1,)) for n in (5, 9, 1, 21)]  # +1: the shifted label of the last token
    ids = torch.cat([d[:-1] for d in docs]).unsqueeze(0)
    labels = torch.cat([d[1:] for d in docs]).unsqueeze(0)  # labels already shifted
    batch = {"input_ids": ids, "labels": labels,
             "position_ids": torch.cat([torch.arange(len(d) - 1) for d in docs]).unsqueeze(0),
             "seq_lens": torch.tensor([[len(d) - 1 for d in docs]]),
             "seq_lens_padded": torch.tensor([[len(d) - 1 for d in docs]])}
    num_label_tokens = int((labels != -100).sum())  # count before sharding

    train_ctx, batch = make_doc_batch_and_ctx(mesh, batch, cost=cost)  # this rank's documents, as [1, T_rank]
    with train_ctx():  # whole documents stay local; only split ones exchange K/V, among their ranks
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100,
                               reduction="sum") / num_label_tokens
        loss.backward()
    for p in model.parameters():  # each rank holds its tokens' share of every gradient
        dist.all_reduce(p.grad, group=mesh["cp"].get_group())
    dist.all_reduce(loss.detach_(), group=mesh["cp"].get_group())
    optimizer.step()
    if dist.get_rank() == 0:
        print(batch["placement"].describe())
        print(f"loss {loss.item():.4f} over {num_label_tokens} tokens in {len(docs)} documents")


if __name__ == "__main__":
    init_distributed()  # gloo on CPU, nccl on CUDA
    main()
    destroy_distributed()  # after main(): destroys the process groups and frees them while Python is alive
