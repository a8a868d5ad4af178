"""The tied Hugging Face checkpoint of hf_pipeline_loader.py in a DeepSpeed pipeline, the tie
kept: TiedLayerSpec on the embedding's key, the head reading the embedding's weight. For
contrast, a head that copies the embedding's weight from the file: two weights.

Run on CPU (2 processes, one stage each; with 4, four stages):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/pipeline/hf_pipeline_loader_tied.py
Run and tested here on CPU only; not run on GPUs.
"""
import os
import shutil
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from safetensors.torch import load_file
from torch import nn
from transformers import LlamaForCausalLM

from hf_pipeline_loader import (DIM, DS_CONFIG, LR, STEPS, VOCAB, EmbeddingPipe, NormPipe,
                                cross_entropy, decoder_specs, micro_batches,
                                pipeline_config, save_tiny_llama)


# --8<-- [start:tied]
def logits_from_embedding(embedding, hidden):
    """The head, on the last stage: the embedding's weight, transposed."""
    return hidden @ embedding.weight.t()


def tied_layers(config, folder):
    return [TiedLayerSpec("embed", EmbeddingPipe, config, folder),
            *decoder_specs(config, folder),
            LayerSpec(NormPipe, config, folder),
            TiedLayerSpec("embed", EmbeddingPipe, config, folder,
                          forward_fn=logits_from_embedding)]
# --8<-- [end:tied]


# --8<-- [start:copied]
class CopiedHeadPipe(nn.Linear):
    """Not a fix: lm_head.weight, or a copy of the embedding's when the file has none."""

    def __init__(self, config, folder):
        super().__init__(config.hidden_size, config.vocab_size, bias=False)
        weights = load_file(os.path.join(folder, "model.safetensors"))
        head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
        self.load_state_dict({"weight": head})


def copied_layers(config, folder):
    return [LayerSpec(EmbeddingPipe, config, folder), *decoder_specs(config, folder),
            LayerSpec(NormPipe, config, folder), LayerSpec(CopiedHeadPipe, config, folder)]
# --8<-- [end:copied]


def first_and_last_weight(engine):
    """The embedding's weight as the first stage holds it, and the head's on the last."""
    stage = engine.module
    if "embed" in stage.tied_modules:
        mine = stage.tied_modules["embed"].weight
    elif engine.is_first_stage():
        mine = stage.forward_funcs[0].weight
    elif engine.is_last_stage():
        mine = stage.forward_funcs[-1].weight
    else:  # a middle stage (4 ranks) holds neither
        mine = torch.zeros(VOCAB, DIM)
    copies = [torch.empty(VOCAB, DIM) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, mine.detach().contiguous())
    return copies[0], copies[-1]


def train(layers):
    model = PipelineModule(layers, num_stages=dist.get_world_size(),
                           loss_fn=cross_entropy, partition_method="uniform")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=DS_CONFIG)
    first, last = first_and_last_weight(engine)
    gaps = [(first - last).abs().max().item()]
    losses = []
    for _ in range(STEPS):
        losses.append(engine.train_batch(data_iter=micro_batches(engine.device)).item())
        first, last = first_and_last_weight(engine)
        gaps.append((first - last).abs().max().item())
    return losses, gaps, first, last


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank = dist.get_rank()
    folder = save_tiny_llama()
    config = pipeline_config(folder)
    keys = sorted(load_file(os.path.join(folder, "model.safetensors")))
    results = {}
    # --8<-- [start:main]
    for name, layers in [("TiedLayerSpec", tied_layers(config, folder)),
                         ("copied head", copied_layers(config, folder))]:
        losses, gaps, first, last = train(layers)
        results[name] = {"losses": losses, "gaps": gaps, "first": first, "last": last}
        if rank == 0:
            print(f"{name}: max |embedding - head| when loaded {gaps[0]:.4f}")
            for step, loss in enumerate(losses):
                print(f"  step {step}: loss {loss:.4f}, "
                      f"max |embedding - head| {gaps[step + 1]:.4f}")
    # --8<-- [end:main]
    if rank == 0:
        print(f"lm_head.weight in the file: {'lm_head.weight' in keys}")
        # --8<-- [start:reference]
        model = LlamaForCausalLM.from_pretrained(folder)  # one process, the same file
        with torch.no_grad():
            each = [cross_entropy(model(input_ids=x).logits, y).item()
                    for x, y in micro_batches("cpu")]
        print(f"Hugging Face model, one process, step 0: loss {sum(each) / len(each):.4f}")
        # --8<-- [end:reference]
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder)
    dist.destroy_process_group()
    return {"folder": folder, "keys": keys, "results": results}


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
