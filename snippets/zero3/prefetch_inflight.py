"""Generation between training steps under ZeRO-3, with a module that some forwards run and
others skip: a prompt encoder that the first forward of a generation (the prefill) and the
scoring forward over the whole sequence run, and the decoding forwards do not (as a vision
encoder in a multimodal model). DeepSpeed 0.14.5 prefetches the encoder for the first
generation's first decoding forward and stops with "RuntimeError: still have inflight
params"; the pinned release goes on (tests/zero3/test_prefetch_inflight.py compares it with
one process). No ZeRO-3 switch that 0.14.5 lacks is set, so that the matrix can run it there.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/prefetch_inflight.py
On GPUs, drop DS_ACCELERATOR=cpu.
"""
import os
import sys

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch import nn

VOCAB, HIDDEN, BATCH, PROMPT, NEW_TOKENS, SEED, LR, ROUNDS = 16, 8, 4, 3, 3, 0, 0.1, 2


# --8<-- [start:model]
class WithPromptEncoder(nn.Module):
    """A language model whose prompt positions go through an encoder in some forwards."""

    def __init__(self):
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.prompt_encoder = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.layer = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens, encode_prompt=True):
        hidden = self.embeddings(tokens)
        if encode_prompt:  # the prefill and the scoring run it; decoding does not
            prompt = hidden[:, :PROMPT] + self.prompt_encoder(hidden[:, :PROMPT])
            hidden = torch.cat([prompt, hidden[:, PROMPT:]], dim=1)
        return self.head(torch.tanh(self.layer(hidden)))
# --8<-- [end:model]


def prompts(round_):
    generator = torch.Generator().manual_seed(SEED + round_)
    return torch.randint(0, VOCAB, (BATCH, PROMPT), generator=generator)


# --8<-- [start:rollout]
def rollout(engine, prompt):
    """Generate, then score the whole sequence: no gradients, the model in eval mode."""
    engine.eval()
    tokens = prompt
    with torch.no_grad():
        for position in range(NEW_TOKENS):
            logits = engine(tokens, encode_prompt=position == 0)  # prefill, then decoding
            tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
        scores = engine(tokens).log_softmax(-1)  # the encoder runs again
    engine.train()
    return tokens, scores
# --8<-- [end:rollout]


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if BATCH % world:  # unequal shares would weigh the samples unequally: other losses
        raise ValueError(f"{BATCH} samples do not split evenly over {world} ranks; run "
                         "on 2 or 4 ranks (the printed losses were checked on both)")
    config = {"train_micro_batch_size_per_gpu": BATCH // world,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
    torch.manual_seed(SEED)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = WithPromptEncoder()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    say = print if rank == 0 else (lambda *args, **kwargs: None)
    results = {"generated": [], "losses": []}
    for round_ in range(ROUNDS):
        tokens, scores = rollout(engine, prompts(round_).to(engine.device))
        say(f"round {round_}: generated {tokens[0].tolist()}", flush=True)
        # Train on this rank's share of the generated sequences (a language-model loss).
        mine = tokens[rank::world]
        logits = engine(mine[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), mine[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        say(f"round {round_}: training step loss {mean.item() / world:.4f}", flush=True)
        results["generated"].append(tokens)
        results["losses"].append(mean.item() / world)
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
