"""GatheredParameters around a product in the loss, with a trainable weight and data inputs:
it fails in backward without a decoder embedding, and trains when a module fed token ids
shares the weight, as T5's decoder embedding does; reuse and prefetch at 0 change nothing.
Fed one-hot rows that require grad, the same decoder embedding no longer saves it.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/gathered_in_loss_tied.py
On GPUs, drop DS_ACCELERATOR=cpu (not run here).
"""
import os
import sys

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch import nn

VOCAB, DIM, SEQ, BATCH, STEPS, SEED, LR = 16, 8, 5, 8, 3, 0, 0.1


# --8<-- [start:model]
class DecoderEmbedding(nn.Embedding):
    """Token ids, as in T5; or one-hot rows, which can require grad."""

    def forward(self, ids):
        if ids.is_floating_point():
            return ids @ self.weight
        return super().forward(ids)


class TiedSeq2Seq(nn.Module):
    """inputs_embeds in, as T5's encoder takes them; with decoder_ids, a decoder embedding
    fed token ids that shares the weight, as T5's decoder.embed_tokens does."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Embedding(VOCAB, DIM)
        self.decoder_embed = DecoderEmbedding(VOCAB, DIM)
        self.decoder_embed.weight = self.shared.weight  # one Parameter, as in T5
        self.mixer = nn.Linear(DIM, DIM)

    def forward(self, inputs_embeds, decoder_ids=None):
        hidden = self.mixer(inputs_embeds)
        if decoder_ids is not None:
            hidden = hidden + self.decoder_embed(decoder_ids)
        return torch.tanh(hidden) @ self.shared.weight.t()


def compute_loss(engine, sampled_input, targets, decoder_ids, seen):
    b, l, c = sampled_input.shape
    weight = engine.module.shared.weight
    with deepspeed.zero.GatheredParameters(weight):  # full weight inside the block only
        sampled_input_embed = sampled_input.reshape(b * l, c).mm(weight)
    # When backward reaches the product: is the weight whole again?
    sampled_input_embed.grad_fn.register_prehook(
        lambda grad: seen.append(weight.ds_status.name))
    logits = engine(sampled_input_embed.view(b, l, DIM), decoder_ids)
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
# --8<-- [end:model]


# --8<-- [start:cases]
CASES = {  # name: (what the decoder embedding gets, ZeRO-3 settings besides the examples')
    "decoder embedding fed token ids": ("token ids", {}),
    "decoder embedding fed token ids, reuse 0, prefetch 0":
        ("token ids", {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}),
    "decoder embedding fed one-hot rows that require grad": ("one-hot rows", {}),
    "no decoder embedding": (None, {}),
}


def decoder_input(kind, decoder_ids):
    if kind == "one-hot rows":
        return F.one_hot(decoder_ids, VOCAB).float().requires_grad_()
    return decoder_ids if kind == "token ids" else None
# --8<-- [end:cases]


def make_batch(step):
    """Soft one-hot data inputs (no gradient), targets, and the decoder's token ids."""
    generator = torch.Generator().manual_seed(SEED + step)
    scores = torch.randn(BATCH, SEQ, VOCAB, generator=generator)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return torch.softmax(scores, dim=-1), targets, targets.roll(1, dims=1)


def run(case, rank, world):
    decoder_kind, settings = CASES[case]
    config = {
        "train_micro_batch_size_per_gpu": BATCH // world,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              **settings},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }
    torch.manual_seed(SEED)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = TiedSeq2Seq()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    losses, grads, seen = [], [], []
    for step in range(STEPS):
        sampled_input, targets, decoder_ids = (
            t[rank::world].to(engine.device) for t in make_batch(step))
        try:
            loss = compute_loss(engine, sampled_input, targets,
                                decoder_input(decoder_kind, decoder_ids), seen)
            engine.backward(loss)
        except RuntimeError as error:
            return {"losses": losses, "grads": grads, "seen": seen,
                    "error": f"step {step}: RuntimeError: {error}"}
        grads.append({name: deepspeed.utils.safe_get_full_grad(p).clone()
                      for name, p in engine.module.named_parameters()})
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
    return {"losses": losses, "grads": grads, "seen": seen, "error": None}


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if BATCH % world:  # unequal shares would weigh the samples unequally: other losses
        raise ValueError(f"{BATCH} samples do not split evenly over {world} ranks; run "
                         "on 2 or 4 ranks (the printed losses were checked on both)")
    results = {case: run(case, rank, world) for case in CASES}
    if rank == 0:
        for case, result in results.items():
            losses = " ".join(f"{loss:.4f}" for loss in result["losses"])
            outcome = result["error"] or f"trains, losses {losses}"
            print(f"{case}: {outcome}")
            print(f"  shared.weight when backward reached the product: {result['seen']}")
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
