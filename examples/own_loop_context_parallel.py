# Any CP method in your own training loop. Run: torchrun --standalone --nproc-per-node 2 examples/own_loop_context_parallel.py [method]
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

from automodel.distributed.cp import context_parallel
from automodel.distributed.mesh import ParallelDims, destroy_distributed, init_distributed


def main(method: str) -> None:
    mesh = ParallelDims(cp=2).build_mesh()  # dims: dp_replicate, dp_shard, cp, tp
    torch.manual_seed(0)  # same weights and data on every rank
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(config)
    options = {"ulysses_size": 2} if method == "usp" else {}  # method-specific options are keyword arguments
    cp = context_parallel(model, mesh, method=method, **options)  # once: checks the model, switches its attention
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if dist.get_rank() == 0:
        print(cp.describe())

    for step in range(2):
        # one packed row of four documents (5, 9, 1 and 21 tokens), as transformers packs them: position_ids
        # restart at every document (or give seq_lens [B, P]); no padding to any multiple of cp_size
        docs = [torch.randint(0, 256, (n + 1,)) for n in (5, 9, 1, 21)]  # +1: the shifted label of the last token
        batch = {"input_ids": torch.cat([d[:-1] for d in docs]).unsqueeze(0),
                 "labels": torch.cat([d[1:] for d in docs]).unsqueeze(0),  # labels already shifted
                 "position_ids": torch.cat([torch.arange(len(d) - 1) for d in docs]).unsqueeze(0)}
        ctx, local = cp.shard(batch)  # this rank's tokens, padded and placed as the method needs
        with ctx():
            loss = model(**local).loss  # this rank's share: its tokens' loss sum / the batch's label count
            loss.backward()
        cp.reduce_gradients()  # sum over the CP group (FSDP2 over a mesh with cp does it for you)
        optimizer.step()
        optimizer.zero_grad()
        loss = cp.reduce_loss(loss)  # the whole batch's loss
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f} over {local['num_items_in_batch']} tokens ({method})")
    cp.restore()  # the model's own attention again


if __name__ == "__main__":
    init_distributed()  # gloo on CPU, nccl on CUDA
    main(sys.argv[1] if len(sys.argv) > 1 else "thd_docs")  # ulysses | thd | thd_docs | usp (ring: one document a row)
    destroy_distributed()  # after main(): destroys the process groups and frees them while Python is alive
