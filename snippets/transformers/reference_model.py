"""A second model beside the trained one under ZeRO-3: a frozen teacher (or a DPO reference
model) built while ZeRO-3 is configured, and never given to deepspeed.initialize.
Its forward fails; two fixes give the teacher's outputs and the training of plain PyTorch.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/transformers/reference_model.py
On GPUs, drop DS_ACCELERATOR=cpu.
"""
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

import accelerate
import deepspeed
import torch
import torch.nn.functional as F
import transformers
import trl
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_grad
from accelerate.state import AcceleratorState
from accelerate.utils import DeepSpeedPlugin
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations import HfDeepSpeedConfig
from trl.models.utils import prepare_deepspeed

VOCAB, SEQ, BATCH, STEPS, LR, BETA = 32, 6, 8, 3, 0.1, 0.5
STUDENT_SEED, TEACHER_SEED = 0, 1


# --8<-- [start:model]
def tiny_llama(seed):
    """A tied Llama small enough for a test, built from its config (no download)."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=SEQ, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def saved(seed):
    """The model's directory, for from_pretrained (as a reader loads a checkpoint)."""
    directory = tempfile.mkdtemp(prefix=f"tiny-llama-{seed}-")
    tiny_llama(seed).save_pretrained(directory)
    return directory
# --8<-- [end:model]


def batch():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def ds_config(world_size):
    return {
        "train_micro_batch_size_per_gpu": BATCH // world_size,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }


# --8<-- [start:loss]
def distillation_loss(student_logits, teacher_logits, tokens):
    """Next-token loss plus BETA * KL(teacher || student) over every position."""
    log_p = F.log_softmax(student_logits, dim=-1)
    next_token = F.nll_loss(log_p[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    log_q = F.log_softmax(teacher_logits, dim=-1)
    kl = F.kl_div(log_p.reshape(-1, VOCAB), log_q.reshape(-1, VOCAB),
                  log_target=True, reduction="batchmean")
    return next_token + BETA * kl
# --8<-- [end:loss]


def train(student, teacher_forward, config):
    """STEPS steps of the student on its rank's share of the batch; the teacher is frozen."""
    optimizer = torch.optim.SGD(student.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=student, optimizer=optimizer, config=config)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    tokens = batch()[rank::world].to(engine.device)
    losses, grads, teacher_logits = [], [], []
    for _ in range(STEPS):
        with torch.no_grad():
            teacher_logits.append(teacher_forward(tokens))
        loss = distillation_loss(engine(tokens).logits, teacher_logits[-1], tokens)
        engine.backward(loss)
        grads.append({name: safe_get_full_grad(p).clone()
                      for name, p in engine.module.named_parameters()})
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
    return {"losses": losses, "grads": grads, "teacher_logits": teacher_logits[0].cpu()}


# --8<-- [start:cpu_accelerator]
def cpu_accelerator(config):
    """An Accelerator with DeepSpeed on this CPU run (over gloo), as TRL's trainers hold one.
    On GPUs, `accelerate launch` or Trainer sets this up (not run here)."""
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    accelerate.PartialState(backend=get_accelerator().communication_backend_name())
    return accelerate.Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
# --8<-- [end:cpu_accelerator]


def error_of(call):
    """The error `call` raises, and the function that raised it; printed, not raised, so
    that one launch shows every case."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the error is what the case shows
        where = traceback.extract_tb(error.__traceback__)[-1]
        return f"{type(error).__name__}: {error}", f"{where.name} ({Path(where.filename).name})"
    return None  # pragma: no cover (every case shown raises)


def main():
    # Saved before the process group exists: save_pretrained writes on rank 0 only after.
    student_dir, teacher_dir = saved(STUDENT_SEED), saved(TEACHER_SEED)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    world = torch.distributed.get_world_size()
    if BATCH % world:  # unequal shares would weigh the samples unequally: other losses
        raise ValueError(f"{BATCH} samples do not split evenly over {world} ranks; run "
                         "on 2 or 4 ranks (the printed losses were checked on both)")
    say = print if torch.distributed.get_rank() == 0 else (lambda *args: None)
    say(f"transformers {transformers.__version__}, accelerate {accelerate.__version__}, "
        f"trl {trl.__version__}")
    config = ds_config(world)
    results = {}

    # --8<-- [start:fails]
    hf_config = HfDeepSpeedConfig(config)  # what Trainer creates: ZeRO-3 is configured
    student = LlamaForCausalLM.from_pretrained(student_dir)  # inside zero.Init: partitioned
    teacher = LlamaForCausalLM.from_pretrained(teacher_dir).eval()  # partitioned as well
    teacher.requires_grad_(False)
    # deepspeed.initialize(student) hooks the student's modules only
    results["fails"] = error_of(lambda: train(student, lambda t: teacher(t).logits, config))
    # --8<-- [end:fails]
    results["teacher_shape"] = tuple(teacher.model.embed_tokens.weight.shape)
    say("teacher built under ZeRO-3, embed_tokens.weight shape:", results["teacher_shape"])
    say("teacher never given to deepspeed.initialize: {}, raised in {}".format(*results["fails"]))

    # --8<-- [start:engine]
    student = LlamaForCausalLM.from_pretrained(student_dir)
    teacher = LlamaForCausalLM.from_pretrained(teacher_dir)
    # The teacher's own engine, no optimizer: its hooks gather its weights in its forward.
    teacher_engine, *_ = deepspeed.initialize(model=teacher, config=config)
    teacher_engine.eval()
    results["engine"] = train(student, lambda t: teacher_engine(t).logits, config)
    # --8<-- [end:engine]
    say("teacher as its own engine, losses:", *(f"{x:.4f}" for x in results["engine"]["losses"]))
    del hf_config

    # --8<-- [start:trl]
    accelerator = cpu_accelerator(config)  # its DeepSpeed plugin configures ZeRO-3
    student = LlamaForCausalLM.from_pretrained(student_dir)
    teacher = LlamaForCausalLM.from_pretrained(teacher_dir)
    teacher_engine = prepare_deepspeed(teacher, accelerator)  # TRL's helper: the same
    results["trl"] = train(student, lambda t: teacher_engine(t).logits, config)
    # --8<-- [end:trl]
    say("teacher from trl's prepare_deepspeed, losses:",
        *(f"{x:.4f}" for x in results["trl"]["losses"]))
    del accelerator
    AcceleratorState._reset_state(reset_partial_state=True)

    # --8<-- [start:outside]
    teacher = LlamaForCausalLM.from_pretrained(teacher_dir)  # before ZeRO-3: a full copy
    teacher.eval().requires_grad_(False)
    teacher.to(get_accelerator().current_device_name())
    hf_config = HfDeepSpeedConfig(config)
    student = LlamaForCausalLM.from_pretrained(student_dir)  # partitioned
    results["outside"] = train(student, lambda t: teacher(t).logits, config)
    # --8<-- [end:outside]
    say("teacher built outside ZeRO-3, losses:", *(f"{x:.4f}" for x in results["outside"]["losses"]))
    del hf_config
    shutil.rmtree(student_dir)
    shutil.rmtree(teacher_dir)
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
