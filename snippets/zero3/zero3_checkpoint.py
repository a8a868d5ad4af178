"""Save two models that share a weight under ZeRO-3, and load them in one process without
DeepSpeed: a head tied to the embedding (one Parameter, two owners) and a forward that reads
another module's weight (a registered external parameter).

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/zero3_checkpoint.py
The checkpoints stay in the temporary directory (zero3-shared-weights/2-ranks): the resume
example on the same page loads them on 4 ranks. Run and tested here on CPU only.
"""
import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_fp32_param
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from torch import nn

VOCAB, DIM, SEQ, BATCH, SEED, LR = 16, 8, 6, 8, 0, 0.1
SAVED_AFTER, STEPS = 2, 4  # save after 2 steps; the run goes on to 4
CHECKPOINTS = os.path.join(tempfile.gettempdir(), "zero3-shared-weights")


# --8<-- [start:models]
class TiedModel(nn.Module):
    """The head is the embedding: one Parameter owned by two modules."""

    def __init__(self):
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, DIM)
        self.mixer = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embeddings.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mixer(self.embeddings(tokens))))


class ExternalModel(nn.Module):
    """forward reads the embedding's weight: a registered external parameter."""

    def __init__(self):
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, DIM)
        self.mixer = nn.Linear(DIM, DIM)
        deepspeed.zero.register_external_parameter(self, self.embeddings.weight)

    def forward(self, tokens):
        hidden = torch.tanh(self.mixer(self.embeddings(tokens)))
        return hidden @ self.embeddings.weight.t()
# --8<-- [end:models]


MODELS = {"tied": TiedModel, "external": ExternalModel}


def make_batch(step):
    """Next-token prediction on random tokens: the same batch on every rank, for every run."""
    generator = torch.Generator().manual_seed(SEED + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def ds_config(world, gather_on_save=True):
    return {
        "train_micro_batch_size_per_gpu": BATCH // world,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_gather_16bit_weights_on_model_save": gather_on_save},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }


def new_engine(model_class, config):
    torch.manual_seed(SEED)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = model_class()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def train_step(engine, step):
    """One step on this rank's share of the batch; the loss of the whole batch."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    inputs, targets = (t[rank::world].to(engine.device) for t in make_batch(step))
    loss = loss_of(engine(inputs), targets)
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    torch.distributed.all_reduce(mean)
    return mean.item() / world


def full_weights(engine):
    """Every parameter name (shared ones under each name) -> its full fp32 value (a collective)."""
    named = engine.module.named_parameters(remove_duplicate=False)
    return {name: safe_get_full_fp32_param(p).cpu() for name, p in named}


def logits_of(engine):
    """The logits for the next step's whole batch, the same on every rank (a collective)."""
    engine.eval()
    with torch.no_grad():
        logits = engine(make_batch(SAVED_AFTER)[0].to(engine.device)).cpu()
    engine.train()
    return logits


def storage_groups(state_dict):
    """The names that share one storage, for each storage held under more than one name."""
    by_storage = {}
    for name, tensor in state_dict.items():
        by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(name)
    return [names for names in by_storage.values() if len(names) > 1]


def describe(label, state_dict):
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in state_dict.values()})
    print(f"  {label}: keys {sorted(state_dict)}, dtypes {dtypes}, "
          f"shared storage {storage_groups(state_dict)}")


def one_process_next_step(model_class, state_dict):
    """What a reader does without DeepSpeed: load, check, and take the run's next step."""
    # --8<-- [start:reload]
    model = model_class()  # plain PyTorch, one process
    model.load_state_dict(state_dict)  # strict: every key present, none extra
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with torch.no_grad():
        logits = model(make_batch(SAVED_AFTER)[0])
    inputs, targets = make_batch(SAVED_AFTER)
    loss = loss_of(model(inputs), targets)  # the step the ZeRO-3 run took next
    loss.backward()
    optimizer.step()
    # --8<-- [end:reload]
    weights = {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}
    tied = getattr(model, "head", None) is not None and model.head.weight is model.embeddings.weight
    return {"logits": logits, "loss": loss.item(), "weights": weights, "tied": tied}


def sorted_sets(text):
    """safetensors names the tensors in a Python set, whose order changes from run to run."""
    return re.sub(r"\{('[^{}]*')\}", lambda m: "{" + ", ".join(sorted(m[1].split(", "))) + "}", text)


def run_script(directory, output_dir, *options):
    """The zero_to_fp32.py that save_checkpoint copied into the folder, run as a reader would."""
    # --8<-- [start:script]
    script = os.path.join(directory, "zero_to_fp32.py")
    command = [sys.executable, script, directory, output_dir, *options]
    # --8<-- [end:script]
    done = subprocess.run(command, capture_output=True, text=True)
    # The script's last words: the error its traceback ends with (here a RuntimeError).
    message = "RuntimeError: " + " ".join(done.stderr.split("RuntimeError:")[-1].split())
    return done.returncode, sorted_sets(message) if done.returncode else None, os.listdir(output_dir)


def save_and_reload(name, rank, world):
    directory = os.path.join(CHECKPOINTS, f"{world}-ranks", name)
    engine = new_engine(MODELS[name], ds_config(world))
    losses = [train_step(engine, step) for step in range(SAVED_AFTER)]
    # --8<-- [start:save]
    engine.save_checkpoint(directory)  # every rank writes its partition
    engine.save_16bit_model(directory, "model_16bit.bin")  # gathers; rank 0 writes
    # --8<-- [end:save]
    saved_weights, logits = full_weights(engine), logits_of(engine)
    losses += [train_step(engine, step) for step in range(SAVED_AFTER, STEPS)]
    torch.distributed.barrier()  # the files are complete
    result = {"losses": losses, "saved_weights": saved_weights, "logits": logits}
    if rank != 0:
        return result
    # --8<-- [start:consolidate]
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints its progress
        state_dict = get_fp32_state_dict_from_zero_checkpoint(directory)  # latest tag
    # --8<-- [end:consolidate]
    sixteen_bit = torch.load(os.path.join(directory, "model_16bit.bin"), weights_only=True)
    scripts = {}
    for options in [(), ("--safe_serialization",)]:
        output_dir = tempfile.mkdtemp(prefix="zero-to-fp32-")
        code, message, files = run_script(directory, output_dir, *options)
        scripts[" ".join(options) or "default"] = {"code": code, "message": message, "files": files}
        if code == 0 and not options:
            scripts["default"]["state_dict"] = torch.load(
                os.path.join(output_dir, "pytorch_model.bin"), weights_only=True)
    print(f"{name}: losses " + ", ".join(f"{loss:.4f}" for loss in losses))
    print(f"  checkpoint folder: {sorted(os.listdir(directory))}")
    describe("get_fp32_state_dict_from_zero_checkpoint", state_dict)
    for label, script in scripts.items():
        if script["code"] == 0:
            shown = script.get("state_dict")
            print(f"  zero_to_fp32.py ({label}): exit 0, wrote {sorted(script['files'])}")
            if shown is not None:
                describe("  its pytorch_model.bin", shown)
        else:
            print(f"  zero_to_fp32.py ({label}): exit {script['code']}: {script['message']}")
    describe("save_16bit_model file", sixteen_bit)
    reloaded = one_process_next_step(MODELS[name], state_dict)
    print(f"  one process, loaded: head is embedding: {reloaded['tied']}, "
          f"next step loss {reloaded['loss']:.4f} (ZeRO-3: {losses[SAVED_AFTER]:.4f})")
    result.update(state_dict=dict(state_dict), shared_in_state_dict=storage_groups(state_dict),
                  scripts=scripts, sixteen_bit=sixteen_bit, reloaded=reloaded)
    return result


def sixteen_bit_off(rank, world):
    """save_16bit_model when stage3_gather_16bit_weights_on_model_save is false."""
    directory = os.path.join(CHECKPOINTS, f"{world}-ranks", "gather-off")
    engine = new_engine(TiedModel, ds_config(world, gather_on_save=False))
    # --8<-- [start:off]
    saved = engine.save_16bit_model(directory, "model_16bit.bin")
    # --8<-- [end:off]
    exists = os.path.exists(os.path.join(directory, "model_16bit.bin"))
    if rank == 0:
        print(f"gather off: save_16bit_model returned {saved}; file written: {exists}")
    return {"returned": saved, "exists": exists}


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if BATCH % world:  # unequal shares would weigh the samples unequally: other losses
        raise ValueError(f"{BATCH} samples do not split evenly over {world} ranks; run "
                         "on 2 or 4 ranks (the printed losses were checked on both)")
    results = {name: save_and_reload(name, rank, world) for name in MODELS}
    results["gather_off"] = sixteen_bit_off(rank, world)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
