"""A fused linear + cross-entropy loss under ZeRO-3: a function that takes the last hidden
states, lm_head.weight and the labels, and returns the loss without ever making the logits of
every token (what Liger-Kernel's fused linear cross-entropy and TRL's use_liger_kernel do).
Two kinds of such a function, each trained three steps in five placements.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/fused_loss.py
On GPUs, drop DS_ACCELERATOR=cpu.
"""
import os
import sys

import deepspeed
import torch
import torch.nn.functional as F
import transformers
import trl
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_grad
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations import HfDeepSpeedConfig
from trl.models.utils import _ForwardRedirection
from trl.trainer.utils import maybe_gather_lm_head_ctx

VOCAB, HIDDEN, SEQ, BATCH, CHUNK, STEPS, LR, SEED = 32, 16, 6, 4, 4, 3, 0.5, 0


# --8<-- [start:in_forward]
class GradientInForward(torch.autograd.Function):
    """hidden (N, H), weight (V, H), labels (N,) -> mean cross-entropy, CHUNK tokens at a
    time. Like Liger's fused linear cross-entropy, it computes both gradients in its
    forward; backward only scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, labels):
        n = hidden.shape[0]
        loss, grad_weight = 0.0, torch.zeros_like(weight)
        grad_hidden = torch.empty_like(hidden)
        for start in range(0, n, CHUNK):
            h, y = hidden[start:start + CHUNK], labels[start:start + CHUNK]
            logits = h @ weight.t()  # the only logits that exist at once
            loss = loss + F.cross_entropy(logits, y, reduction="sum")
            grad_logits = (logits.softmax(-1) - F.one_hot(y, VOCAB)) / n
            grad_hidden[start:start + CHUNK] = grad_logits @ weight
            grad_weight += grad_logits.t() @ h
        ctx.save_for_backward(grad_hidden, grad_weight)  # not the weight
        return loss / n

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, grad_weight * grad_loss, None
# --8<-- [end:in_forward]


# --8<-- [start:in_backward]
class GradientInBackward(torch.autograd.Function):
    """The same loss; it keeps hidden and weight and computes the gradients in backward,
    making each chunk's logits again there (as Liger does with reduction="none")."""

    @staticmethod
    def forward(ctx, hidden, weight, labels):
        ctx.save_for_backward(hidden, weight, labels)  # the weight, for backward
        return sum(F.cross_entropy(hidden[s:s + CHUNK] @ weight.t(), labels[s:s + CHUNK],
                                   reduction="sum")
                   for s in range(0, hidden.shape[0], CHUNK)) / hidden.shape[0]

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, labels = ctx.saved_tensors
        n = hidden.shape[0]
        grad_hidden, grad_weight = torch.empty_like(hidden), torch.zeros_like(weight)
        for start in range(0, n, CHUNK):
            h, y = hidden[start:start + CHUNK], labels[start:start + CHUNK]
            grad_logits = ((h @ weight.t()).softmax(-1) - F.one_hot(y, VOCAB)) / n
            grad_hidden[start:start + CHUNK] = grad_logits @ weight
            grad_weight += grad_logits.t() @ h
        return grad_hidden * grad_loss, grad_weight * grad_loss, None
# --8<-- [end:in_backward]


# --8<-- [start:model]
class FusedLossLlama(LlamaForCausalLM):
    """A Llama whose forward returns the loss through a fused function, the forward that
    Liger's apply_liger_kernel_to_llama installs, in short. Without labels: the hidden
    states, for a loss computed outside."""

    fused = GradientInForward

    def forward(self, input_ids, labels=None):
        hidden = self.model(input_ids).last_hidden_state[:, :-1].reshape(-1, HIDDEN)
        if labels is None:
            return hidden
        weight = self.lm_head.weight  # read by attribute: lm_head's forward never runs
        return self.fused.apply(hidden, weight, labels[:, 1:].reshape(-1))
# --8<-- [end:model]


def tiny_llama(fused=GradientInForward):
    """An untied Llama small enough for a test, built from its config (no download)."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=SEQ, tie_word_embeddings=False)
    torch.manual_seed(SEED)
    model = FusedLossLlama(config)
    model.fused = fused
    return model


def batch(step):
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


# --8<-- [start:placements]
def in_the_forward(engine, tokens):
    return engine(tokens, labels=tokens)  # the model's forward reads lm_head.weight


def from_the_loop(engine, tokens):
    hidden = engine(tokens)
    weight = engine.module.lm_head.weight  # outside every forward: empty
    return engine.module.fused.apply(hidden, weight, tokens[:, 1:].reshape(-1))


def gathered_in_the_loop(engine, tokens):
    hidden = engine(tokens)
    weight = engine.module.lm_head.weight
    with deepspeed.zero.GatheredParameters([weight]):  # modifier_rank=None
        return engine.module.fused.apply(hidden, weight, tokens[:, 1:].reshape(-1))
    # the training loop's backward runs after the block, with the weight empty again
# --8<-- [end:placements]


# --8<-- [start:backward_inside]
def backward_inside_the_block(engine, tokens):
    hidden = engine(tokens)
    weight = engine.module.lm_head.weight
    with deepspeed.zero.GatheredParameters([weight]):
        loss = engine.module.fused.apply(hidden, weight, tokens[:, 1:].reshape(-1))
        engine.backward(loss)  # the weight is whole while backward needs it
    return loss
# --8<-- [end:backward_inside]


GATHERED_BY_TRL = []  # whether TRL's helper gathered the weight, call by call


# --8<-- [start:trl]
def as_the_engines_forward(engine, tokens, hidden_from_the_whole_model=False):
    """TRL's path: the loss run as the engine's forward (TRL's _ForwardRedirection), the
    hidden states from the base model, TRL's gather helper around the fused call."""
    def loss_of(model, tokens):
        if hidden_from_the_whole_model:  # a call of the top module inside its own forward
            hidden = model(tokens)
        else:  # as TRL's trainers do
            hidden = model.model(tokens).last_hidden_state[:, :-1].reshape(-1, HIDDEN)
        weight = model.lm_head.weight
        gather = maybe_gather_lm_head_ctx(weight)  # a null context if already gathered
        GATHERED_BY_TRL.append(type(gather).__name__ == "GatheredParameters")
        with gather:
            return model.fused.apply(hidden, weight, tokens[:, 1:].reshape(-1))
    return _ForwardRedirection()(engine, engine.module, loss_of, engine.module, tokens)
# --8<-- [end:trl]


PLACEMENTS = {
    "weight read in the model's forward": in_the_forward,
    "weight passed from the training loop": from_the_loop,
    "gathered in the loop, backward after the block": gathered_in_the_loop,
    "gathered in the loop, backward inside the block": backward_inside_the_block,
    "run as the engine's forward (TRL)": as_the_engines_forward,
    "run as the engine's forward, after a call of the whole model":
        lambda engine, tokens: as_the_engines_forward(engine, tokens, True),
}
KINDS = {"gradient in forward": GradientInForward, "gradient in backward": GradientInBackward}


def train(placement, fused, config):
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = tiny_llama(fused)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    record = {"losses": [], "grads": [], "error": None}
    GATHERED_BY_TRL.clear()
    try:
        for step in range(STEPS):
            tokens = batch(step)[rank::world].to(engine.device)
            loss = PLACEMENTS[placement](engine, tokens)
            if placement != "gathered in the loop, backward inside the block":
                engine.backward(loss)
            record["grads"].append({name: safe_get_full_grad(p).clone()
                                    for name, p in engine.module.named_parameters()})
            engine.step()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            record["losses"].append(mean.item() / world)
    except RuntimeError as error:
        record["error"] = f"RuntimeError: {error}"
    record["gathered by TRL"] = any(GATHERED_BY_TRL)
    # Elements this rank holds in the parameters themselves now (a partitioned parameter
    # holds none: its slice is elsewhere), and the model's elements.
    params = list(engine.module.parameters())
    record["held"] = sum(p.numel() for p in params)
    record["elements"] = sum(p.ds_numel for p in params)
    return record


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    world = torch.distributed.get_world_size()
    if BATCH % world:  # unequal shares would weigh the samples unequally: other losses
        raise ValueError(f"{BATCH} sequences do not split evenly over {world} ranks; run "
                         "on 2 or 4 ranks (the printed losses were checked on both)")
    say = print if torch.distributed.get_rank() == 0 else (lambda *args: None)
    say(f"deepspeed {deepspeed.__version__}, transformers {transformers.__version__}, "
        f"trl {trl.__version__}")
    config = {"train_micro_batch_size_per_gpu": BATCH // world,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
    hf_config = HfDeepSpeedConfig(config)  # ZeRO-3 configured, as under Trainer: TRL's helper gathers
    results = {}
    for kind, fused in KINDS.items():
        say(f"{kind}:")
        for placement in PLACEMENTS:
            results[kind, placement] = record = train(placement, fused, config)
            losses = " ".join(f"{x:.4f}" for x in record["losses"]) or "-"
            gathered = " (TRL's helper gathered it)" if record["gathered by TRL"] else ""
            say(f"  {placement}{gathered}: losses {losses}"
                + (f", then {record['error']}" if record["error"] else ""))
    del hf_config
    torch.distributed.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
