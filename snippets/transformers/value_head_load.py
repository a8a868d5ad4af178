"""Loading weights into a model that ZeRO-3 partitions: a causal LM with a value head (a small
equivalent of TRL's AutoModelForCausalLMWithValueHead, whose head is `v_head.summary`) loads a
trained head with load_state_dict. Loaded into the partitioned head it fails with a size
mismatch against torch.Size([0]); the four fixes, each trained two steps and compared with one
process; and generate(), which the wrapper passes to the inner model. Nothing is downloaded.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/value_head_load.py
On GPUs, drop DS_ACCELERATOR=cpu (not run here).
"""
import os
import sys
import tempfile

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from torch import nn
from transformers import LlamaForCausalLM, LlamaForSequenceClassification
from transformers.integrations import HfDeepSpeedConfig

from tied_causal_lm import SEED, VOCAB, error_text, save_tiny_llama

HEAD_SEED, STEPS, LR, BATCH, SEQ = 1, 2, 0.1, 2, 6


# --8<-- [start:model]
class ValueHead(nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.summary = nn.Linear(hidden_size, 1)

    def forward(self, hidden_states):
        return self.summary(hidden_states).squeeze(-1)


class CausalLMWithValueHead(nn.Module):
    """A language model and a value head on its last hidden states."""

    def __init__(self, pretrained_model):
        super().__init__()
        self.pretrained_model = pretrained_model
        self.v_head = ValueHead(pretrained_model.config.hidden_size)

    def forward(self, input_ids):
        out = self.pretrained_model(input_ids=input_ids, output_hidden_states=True)
        return out.logits, self.v_head(out.hidden_states[-1])

    def generate(self, *args, **kwargs):  # as TRL's wrapper does: the inner model's
        return self.pretrained_model.generate(*args, **kwargs)
# --8<-- [end:model]


def config(threshold):
    zero = {"stage": 3}
    if threshold is not None:  # None: DeepSpeed's default (100,000)
        zero["stage3_param_persistence_threshold"] = threshold
    return {"train_micro_batch_size_per_gpu": BATCH, "zero_optimization": zero,
            "gradient_clipping": 0.0,  # DeepSpeed's default clips to 1.0 since 0.19.3
            "zero_allow_untested_optimizer": True}


def save_value_head(hidden_size):
    """A trained value head's file, as a reward or critic training leaves it."""
    torch.manual_seed(HEAD_SEED)
    path = os.path.join(tempfile.mkdtemp(prefix="v-head-"), "v_head.pt")
    torch.save(ValueHead(hidden_size).state_dict(), path)
    return path


def batch(step):
    """Each rank's micro-batch of the step: its own rows of the step's 2 x BATCH rows."""
    generator = torch.Generator().manual_seed(SEED + step)
    tokens = torch.randint(0, VOCAB, (2 * BATCH, SEQ), generator=generator)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    return tokens.chunk(world)[rank] if world <= 2 * BATCH else None


def loss_of(model, tokens):
    """Language-model loss plus a value loss (values pulled towards 1)."""
    logits, values = model(tokens)
    lm = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    return lm + (values - 1).square().mean()


def train(engine):
    """STEPS steps; the full head after each, and the values on a fixed batch (every rank)."""
    heads = [full_head(engine.module)]
    for step in range(STEPS):
        engine.backward(loss_of(engine, batch(step).to(engine.device)))
        engine.step()
        heads.append(full_head(engine.module))
    return heads


def full_head(model):
    weights = list(model.v_head.parameters())
    with deepspeed.zero.GatheredParameters(weights):
        return {name: p.detach().clone() for name, p in model.v_head.named_parameters()}


def initialize(model, threshold=0):
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=config(threshold))
    return engine


CONFIG = config(0)  # stage3_param_persistence_threshold 0: every parameter is partitioned


def reader(directory, head_file):
    """The reader's order: the head built partitioned, then its trained weights loaded."""
    # --8<-- [start:reader]
    base = LlamaForCausalLM.from_pretrained(directory)  # partitioned: ZeRO-3 configured
    with deepspeed.zero.Init(config_dict_or_path=CONFIG):
        model = CausalLMWithValueHead(base)
    model.v_head.load_state_dict(torch.load(head_file))
    # --8<-- [end:reader]


def after_initialize(directory, head_file, threshold, steps_before=0):
    """The head loaded after deepspeed.initialize (and `steps_before` training steps); where
    that raises nothing, one more training step."""
    base = LlamaForCausalLM.from_pretrained(directory)
    with deepspeed.zero.Init(config_dict_or_path=config(threshold)):
        model = CausalLMWithValueHead(base)
    engine = initialize(model, threshold)
    for step in range(steps_before):
        engine.backward(loss_of(engine, batch(step).to(engine.device)))
        engine.step()
    result = {"error": error_text(
        lambda: model.v_head.load_state_dict(torch.load(head_file)))}
    if result["error"] is None:  # the head is whole here: read it without a gather
        head = dict(model.v_head.named_parameters())
        result["loaded"] = {name: p.detach().clone() for name, p in head.items()}
        result["optimizer's copy"] = {  # what engine.step() updates
            name: deepspeed.utils.safe_get_full_fp32_param(p).clone()
            for name, p in head.items()}
        engine.backward(loss_of(engine, batch(0).to(engine.device)))
        result["gradient"] = {name: deepspeed.utils.safe_get_full_grad(p).clone()
                              for name, p in head.items()}
        engine.step()
        result["after the step"] = full_head(model)
    return result


def load_first(directory, head_file):
    # --8<-- [start:load_first]
    base = LlamaForCausalLM.from_pretrained(directory)
    model = CausalLMWithValueHead(base)  # the head is whole: built outside zero.Init
    model.v_head.load_state_dict(torch.load(head_file))
    engine = initialize(model)  # partitions the head as it is
    # --8<-- [end:load_first]
    return engine


def gathered(directory, head_file):
    # --8<-- [start:gathered]
    base = LlamaForCausalLM.from_pretrained(directory)
    with deepspeed.zero.Init(config_dict_or_path=CONFIG):
        model = CausalLMWithValueHead(base)
    head = list(model.v_head.parameters())
    with deepspeed.zero.GatheredParameters(head, modifier_rank=0):  # every rank
        model.v_head.load_state_dict(torch.load(head_file))
    engine = initialize(model)
    # --8<-- [end:gathered]
    return engine


def from_checkpoint(directory, checkpoint):
    # --8<-- [start:checkpoint]
    base = LlamaForCausalLM.from_pretrained(directory)
    with deepspeed.zero.Init(config_dict_or_path=CONFIG):
        model = CausalLMWithValueHead(base)  # any head: the checkpoint replaces it
    engine = initialize(model)
    engine.load_checkpoint(checkpoint)  # every rank: each reads its own partition
    # --8<-- [end:checkpoint]
    return engine


def save_reward_model(directory, head_file):
    """A reward model saved with save_pretrained: the language model's body and the value head
    as `score` (LlamaForSequenceClassification, one label, no bias), in one process."""
    head = torch.load(head_file)
    model = LlamaForSequenceClassification.from_pretrained(directory, num_labels=1)
    with torch.no_grad():
        model.score.weight.copy_(head["summary.weight"])
    folder = tempfile.mkdtemp(prefix="reward-model-")
    model.save_pretrained(folder)
    return folder


def reward_model(folder):
    # --8<-- [start:from_pretrained]
    model = LlamaForSequenceClassification.from_pretrained(folder)  # ZeRO-3 configured
    # --8<-- [end:from_pretrained]
    return model


def shared_folder():
    folder = [tempfile.mkdtemp(prefix="checkpoint-")]
    torch.distributed.broadcast_object_list(folder, src=0)
    return folder[0]


def main():
    directory = save_tiny_llama()  # each rank its own copy, before the process group
    hidden = LlamaForCausalLM.from_pretrained(directory).config.hidden_size
    head_file = save_value_head(hidden)
    reward_folder = save_reward_model(directory, head_file)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    zero3 = HfDeepSpeedConfig(CONFIG)  # ZeRO-3 configured: from_pretrained partitions
    results = {"reader": {"error": error_text(lambda: reader(directory, head_file))}}
    for name, threshold, steps in (("after initialize, threshold 0", 0, 0),
                                   ("after initialize, DeepSpeed's default", None, 0),
                                   ("after a step, threshold 0", 0, 1),
                                   ("after a step, DeepSpeed's default", None, 1)):
        results[name] = after_initialize(directory, head_file, threshold, steps)
    engines = {}
    for name, build in (("load, then initialize", load_first),
                        ("GatheredParameters(modifier_rank=0)", gathered)):
        engines[name] = build(directory, head_file)
        results[name] = {"heads": train(engines[name])}
    checkpoint = shared_folder()
    engines["load, then initialize"].save_checkpoint(checkpoint)
    engine = from_checkpoint(directory, checkpoint)
    results["engine.load_checkpoint"] = {"heads": [full_head(engine.module)] + train(engine)[1:]}
    model = reward_model(reward_folder)
    with deepspeed.zero.GatheredParameters(model.score.weight):
        results["from_pretrained"] = {"score": model.score.weight.detach().clone()}
    results["generate"] = generate(engines["load, then initialize"])
    if torch.distributed.get_rank() == 0:
        print_report(results, torch.load(head_file))
    del zero3
    torch.distributed.barrier()
    return results


def generate(engine):
    """The wrapper's generate() on the trained engine: greedy, 4 new tokens, every rank."""
    prompt = torch.tensor([[1, 2, 3]], device=engine.device)
    # --8<-- [start:generate]
    with torch.no_grad():
        tokens = engine.module.generate(prompt, max_new_tokens=4, do_sample=False)
    # --8<-- [end:generate]
    return tokens.cpu()


def print_report(results, saved):
    trained = results["load, then initialize"]["heads"][-1]
    for name, result in results.items():
        if name in ("from_pretrained", "generate"):
            continue
        if result.get("error"):
            print(f"{name}: {result['error']}")
        elif "heads" in result or "loaded" in result:
            head = result["loaded"] if "loaded" in result else result["heads"][0]
            want = trained if name == "engine.load_checkpoint" else saved
            print(f"{name}: loaded head equals the "
                  f"{'trained head' if want is trained else 'file'}: "
                  f"{all(torch.equal(head[k], want[k]) for k in want)}")
            if "optimizer's copy" in result:
                copy, after = result["optimizer's copy"], result["after the step"]
                print(f"  the optimizer's copy of the head equals the file: "
                      f"{all(torch.equal(copy[k], saved[k]) for k in saved)}")
                moved = max((after[k] - saved[k]).abs().max().item() for k in saved)
                print(f"  after the next step, the head is off the file's by up to "
                      f"{moved:.4f}")
    score = results["from_pretrained"]["score"]
    print(f"from_pretrained: score.weight equals the file's summary.weight: "
          f"{torch.equal(score, saved['summary.weight'])}")
    print(f"generate() through the wrapper: {results['generate'].tolist()}")


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
