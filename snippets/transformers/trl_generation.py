"""A GRPO-shaped training step under ZeRO-3: sample completions with TRL's
unwrap_model_for_generation, score them, and train on them (a policy-gradient loss with
group-normalized rewards, as GRPO computes it), three steps on a tiny tied Llama.
The helper is given the DeepSpeed engine, as GRPOTrainer has since TRL 0.16.0, or the model
inside it, as GRPOTrainer did before; the policy is the plain Llama, or one whose forward
reads the head's weight itself (as TRL's GRPO loss with use_liger_kernel does). generate()
is left to choose synced_gpus, or given synced_gpus=False (helper given the engine).
model_inside_unsynced(): the model inside the engine with synced_gpus=False (it fails).

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/trl_generation.py
On GPUs, drop DS_ACCELERATOR=cpu.
"""
import os
import sys

import accelerate
import deepspeed
import torch
import torch.nn.functional as F
import transformers
import trl
from accelerate.state import AcceleratorState
from accelerate.utils import DeepSpeedPlugin
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_grad
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations import is_deepspeed_zero3_enabled
from trl.models.utils import unwrap_model_for_generation

VOCAB, PROMPT, NEW, GROUP, PROMPTS, STEPS, LR, SEED = 32, 3, 4, 4, 2, 3, 0.5, 0


# --8<-- [start:policy]
class HeadReadingLlama(LlamaForCausalLM):
    """Given completion_ids, its forward returns their log-probabilities, computed from the
    last hidden states and lm_head.weight read by attribute (TRL's GRPO loss with
    use_liger_kernel reads the weight the same way). generate() calls the usual forward."""

    def forward(self, input_ids, completion_ids=None, **kwargs):
        if completion_ids is None:
            return super().forward(input_ids, **kwargs)
        hidden = self.model(input_ids).last_hidden_state[:, PROMPT - 1:-1]
        logits = hidden @ self.lm_head.weight.t()  # a read DeepSpeed detects in this forward
        logps = torch.log_softmax(logits, -1)
        return logps.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
# --8<-- [end:policy]


def tiny_llama(policy=LlamaForCausalLM):
    """A tied Llama small enough for a test, built from its config (no download)."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=16, tie_word_embeddings=True)
    torch.manual_seed(SEED)
    return policy(config)


def prompts(step, rank):
    """This rank's prompts at this step, each repeated GROUP times (one group per prompt)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (PROMPTS, PROMPT), generator=generator).repeat_interleave(GROUP, 0)


def new_tokens(rank):
    return NEW + rank  # the ranks' completions differ in length: none waits for another


def reward(completions):
    """A rule-based reward: the share of even tokens in each completion."""
    return (completions % 2 == 0).float().mean(dim=1)


def sample(model, prompt_ids, step, rank, **kwargs):
    """This rank's completions, and what generate() did: the forwards it ran, and how many
    of the model's weights were still gathered (whole) on this rank when it returned."""
    torch.manual_seed(SEED + 100 * step + rank)  # each rank samples its own completions
    n = new_tokens(rank)
    forwards = []
    counter = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    output = model.generate(prompt_ids, do_sample=True, top_k=0, max_new_tokens=n,
                            min_new_tokens=n, pad_token_id=0, **kwargs)
    counter.remove()
    whole = [getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE
             for p in model.parameters()]
    return output[:, PROMPT:], {"forwards": len(forwards), "whole": sum(whole),
                                "weights": len(whole)}


def completion_logps(model, prompt_ids, completion_ids):
    """The log-probability of each completion token under the policy."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    if isinstance(getattr(model, "module", model), HeadReadingLlama):  # engine or model
        return model(input_ids, completion_ids=completion_ids)
    logits = model(input_ids).logits[:, PROMPT - 1:-1]  # the logits of each completion token
    return torch.log_softmax(logits, -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)


# --8<-- [start:loss]
def grpo_loss(model, prompt_ids, completion_ids):
    """GRPO's loss for one optimization step per generation (the ratio is 1, its gradient
    is the policy gradient); no KL term (beta = 0, GRPOConfig's default)."""
    rewards = reward(completion_ids).view(-1, GROUP)
    advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    logps = completion_logps(model, prompt_ids, completion_ids)
    ratio = torch.exp(logps - logps.detach())
    return -(ratio * advantages.view(-1, 1)).mean()
# --8<-- [end:loss]


def cpu_accelerator(config):
    """An Accelerator with DeepSpeed on this CPU run (over gloo), as TRL's trainers hold one.
    On GPUs, `accelerate launch` sets this up (not run here)."""
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    accelerate.PartialState(backend=get_accelerator().communication_backend_name())
    return accelerate.Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))


def read_gradients(engine, record):
    record["grads"].append({name: safe_get_full_grad(p).clone()
                            for name, p in engine.module.named_parameters()})


def train(give_engine, policy, **generate_kwargs):
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    config = {"train_micro_batch_size_per_gpu": PROMPTS * GROUP,
              "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
    accelerator = cpu_accelerator(config)
    model = tiny_llama(policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, optimizer = accelerator.prepare(model, optimizer)  # a DeepSpeedEngine, partitioned
    record = {"rewards": [], "grads": [], "completions": [], "error": None,
              "generate": [], "synced_gpus_default": is_deepspeed_zero3_enabled()}
    try:
        for step in range(STEPS):
            # --8<-- [start:step]
            prompt_ids = prompts(step, rank).to(engine.device)
            engine.eval()
            helper_gets = engine if give_engine else engine.module
            with unwrap_model_for_generation(helper_gets, accelerator) as unwrapped:
                completion_ids, seen = sample(unwrapped, prompt_ids, step, rank,
                                              **generate_kwargs)
            engine.train()
            loss = grpo_loss(engine, prompt_ids, completion_ids)
            engine.backward(loss)
            read_gradients(engine, record)  # what the test compares
            engine.step()
            # --8<-- [end:step]
            mean_reward = reward(completion_ids).mean()
            torch.distributed.all_reduce(mean_reward)
            record["rewards"].append(mean_reward.item() / world)
            record["completions"].append(completion_ids.cpu())
            record["generate"].append(seen)
    except (AssertionError, RuntimeError) as error:  # pragma: no cover (other releases)
        record["error"] = f"{type(error).__name__}: {error}"
    del accelerator
    AcceleratorState._reset_state(reset_partial_state=True)
    return record


CASES = [(policy, given, synced)
         for policy in (LlamaForCausalLM, HeadReadingLlama)
         for given, synced in (("engine", None), ("engine.module", None), ("engine", False))]


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    say = print if torch.distributed.get_rank() == 0 else (lambda *args: None)
    say(f"transformers {transformers.__version__}, accelerate {accelerate.__version__}, "
        f"trl {trl.__version__}")  # the DeepSpeed release: the page's stamp or note
    results = {}
    for policy, given, synced in CASES:
        kwargs = {} if synced is None else {"synced_gpus": synced}
        case = (f"{policy.__name__}, unwrap_model_for_generation({given}, ...)"
                + ("" if synced is None else f", synced_gpus={synced}"))
        results[case] = record = train(given == "engine", policy, **kwargs)
        steps = len(record["grads"])  # sampled tokens are not printed: see the test
        say(f"{case}: {steps} of {STEPS} steps trained"
            + (f", then {record['error']}" if record["error"] else ""))
        if steps:
            seen = record["generate"][0]
            say(f"  rank 0, step 0: {seen['forwards']} forwards for {new_tokens(0)} tokens; "
                f"{seen['whole']} of {seen['weights']} weights whole after generate()")
    torch.distributed.destroy_process_group()
    return results


def model_inside_unsynced():  # pragma: no cover (rank 0 aborts on purpose)
    """The helper given the model inside the engine, generate() with synced_gpus=False."""
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    return train(False, LlamaForCausalLM, synced_gpus=False)


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
