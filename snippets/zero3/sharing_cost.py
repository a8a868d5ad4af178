"""What sharing a weight costs under ZeRO-3: the full-parameter bytes each rank holds at every
moment of a training step, for four ways of reading the embedding weight in the logits, and the
ZeRO-3 settings that change it.

Run on CPU (2 processes):
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 snippets/zero3/sharing_cost.py
On GPUs, drop DS_ACCELERATOR=cpu (not run here). Every rank prints the same bytes; rank 0
prints them. The time per step goes to stderr: it is not part of the compared output.
"""
import os
import statistics
import sys
import time

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

VOCAB, DIM, LAYERS, SEQ, BATCH, SEED, LR = 8192, 128, 4, 8, 4, 0, 0.01
STEPS = int(os.environ.get("SHARING_COST_STEPS", "2"))  # the benchmark runs more steps
MIB = 2**20


# --8<-- [start:models]
def compute_logits(hidden, weight):
    return hidden @ weight.t()


class Detected(nn.Module):
    """The LanguageModel pattern: the root forward reads embeddings.weight; nothing
    registered."""

    def __init__(self):
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(LAYERS))
        self.setup()

    def setup(self):
        pass

    def hidden(self, tokens):
        hidden = self.embeddings(tokens)
        for layer in self.layers:
            hidden = torch.tanh(layer(hidden))
        return hidden

    def forward(self, tokens):
        return compute_logits(self.hidden(tokens), self.embeddings.weight)


class Registered(Detected):
    """The same read, registered on the module whose forward reads it: the root."""

    def setup(self):
        deepspeed.zero.register_external_parameter(self, self.embeddings.weight)


class OwnModule(Detected):
    """The read moved into a small module of its own: a head that shares the Parameter."""

    def setup(self):
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embeddings.weight  # one Parameter, two owners

    def forward(self, tokens):
        return self.head(self.hidden(tokens))


class Gathered(Detected):
    """GatheredParameters around the read, as DeepSpeed's docstring shows it in a forward."""

    def forward(self, tokens):
        hidden = self.hidden(tokens)
        with deepspeed.zero.GatheredParameters(self.embeddings.weight, fwd_module=self):
            return compute_logits(hidden, self.embeddings.weight)


class LinearRead(Registered):
    """The registered read, computed with F.linear instead of a product with weight.t()."""

    def forward(self, tokens):
        return F.linear(self.hidden(tokens), self.embeddings.weight)


class GatheredFromList(Detected):
    """GatheredParameters around a read that DeepSpeed does not detect (a list reference)."""

    def setup(self):
        self.tied = [self.embeddings.weight]

    def forward(self, tokens):
        hidden = self.hidden(tokens)
        with deepspeed.zero.GatheredParameters(self.tied[0]):
            return compute_logits(hidden, self.tied[0])
# --8<-- [end:models]


# --8<-- [start:variants]
SMALL = DIM * DIM  # numel of one layer's weight: less than the embedding's VOCAB * DIM
LEAN = {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}
# Every variant sets stage3_param_persistence_threshold to 0 (train() below), so that
# the small layers are partitioned too; None leaves it out: DeepSpeed's default.
DEFAULT_THRESHOLD = {"stage3_param_persistence_threshold": None}
VARIANTS = {  # name: (model, ZeRO-3 settings besides the threshold 0 and the defaults)
    "detected": (Detected, {}),
    "registered": (Registered, {}),
    "own module": (OwnModule, {}),
    "GatheredParameters": (Gathered, {}),
    "GatheredParameters, list": (GatheredFromList, {}),
    "registered, reuse 0": (Registered, {"stage3_max_reuse_distance": 0}),
    "registered, prefetch 0": (Registered, {"stage3_prefetch_bucket_size": 0}),
    "registered, reuse 0, live small": (
        Registered, {"stage3_max_reuse_distance": 0, "stage3_max_live_parameters": SMALL}),
    "registered, reuse 0, prefetch 0": (Registered, LEAN),
    "registered F.linear, reuse 0, prefetch 0": (LinearRead, LEAN),
    "own module, reuse 0, prefetch 0": (OwnModule, LEAN),
    "registered, default threshold": (Registered, DEFAULT_THRESHOLD),
    "registered, reuse 0, prefetch 0, default threshold":
        (Registered, {**LEAN, **DEFAULT_THRESHOLD}),
}
# --8<-- [end:variants]


# --8<-- [start:recorder]
class Recorder:
    """At every moment a hook fires: the bytes of full parameters this rank holds.

    held: parameters whose tensor is full now (DeepSpeed's view: gathered, not yet released).
    alive: storages of full parameters seen at earlier moments that are still allocated (a
    tensor autograd saved for backward keeps a released parameter's memory alive).
    """

    def __init__(self, model):
        self.params = list(dict.fromkeys(model.parameters()))  # a shared Parameter once
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.storages, self.events, self.step = {}, [], 0
        for name, module in model.named_modules():
            label = name or "model"
            module.register_forward_pre_hook(
                lambda m, a, label=label: self.record(f"{label}.forward start"))
            module.register_forward_hook(
                lambda m, a, o, label=label: self.record(f"{label}.forward end"))
            module.register_full_backward_pre_hook(
                lambda m, g, label=label: self.record(f"{label}.backward start"))
            module.register_full_backward_hook(
                lambda m, gi, go, label=label: self.record(f"{label}.backward end"))
        for p in self.params:
            p.register_hook(
                lambda grad, name=self.names[id(p)]: self.record(f"gradient of {name}"))

    def record(self, moment):
        full = [p for p in self.params if p.data.numel() > 0]
        for p in full:
            storage = p.data.untyped_storage()
            self.storages.setdefault(StorageWeakRef(storage), storage.nbytes())
        self.storages = {ref: size for ref, size in self.storages.items() if not ref.expired()}
        self.events.append({
            "step": self.step, "moment": moment,
            "held": sum(p.ds_numel * p.element_size() for p in full),
            "alive": sum(self.storages.values()),
            "full": [self.names[id(p)] for p in full],
        })

    def watch_reads(self):
        """compute_logits, watched: a moment when the forward reads the weight, and one when
        backward reaches that product."""
        plain = compute_logits

        def watched(hidden, weight):
            self.record("logits read the weight")
            logits = plain(hidden, weight)
            logits.grad_fn.register_prehook(
                lambda grad: self.record("backward reaches the read"))
            return logits

        return watched
# --8<-- [end:recorder]


def make_batch(step):
    """Next-token prediction on random tokens: the same batch on every rank, for every run."""
    generator = torch.Generator().manual_seed(SEED + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def train(model_class, settings, rank, world):
    global compute_logits
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, **settings}
    ds_config = {
        "train_micro_batch_size_per_gpu": BATCH // world,
        "zero_optimization": {key: value for key, value in zero.items() if value is not None},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # no clipping: the run must equal plain PyTorch
    }
    torch.manual_seed(SEED)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = model_class()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    recorder = Recorder(engine.module)
    plain, compute_logits = compute_logits, recorder.watch_reads()
    result = {"losses": [], "grads": {}, "seconds": [], "error": None}
    try:
        for step in range(STEPS):
            recorder.step = step
            train_step(engine, recorder, step, rank, world, result)
    except RuntimeError as error:  # one variant fails in its second step: that is its result
        result["error"] = f"step {step}: RuntimeError: {str(error).split('. ')[0]}"
    compute_logits = plain
    partition = sum(p.ds_tensor.numel() * p.element_size() for p in recorder.params)
    return {**result, "events": recorder.events, "partition": partition}


def train_step(engine, recorder, step, rank, world, result):
    inputs, targets = make_batch(step)
    mine = slice(rank, None, world)  # each rank trains on its share of the batch
    device = get_accelerator().current_device_name()
    start = time.perf_counter()
    logits = engine(inputs[mine].to(device))
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets[mine].to(device).reshape(-1))
    del logits
    engine.backward(loss)
    recorder.record("engine.backward returned")
    elapsed = time.perf_counter() - start
    if step in (0, STEPS - 1):  # full gradients of the first and the last step, kept by rank 0
        grads = {name: deepspeed.utils.safe_get_full_grad(p).clone()
                 for name, p in engine.module.named_parameters()}
        result["grads"][step] = grads if rank == 0 else None
    start = time.perf_counter()
    engine.step()
    result["seconds"].append(elapsed + time.perf_counter() - start)
    mean_loss = loss.detach().clone()
    torch.distributed.all_reduce(mean_loss)
    result["losses"].append(mean_loss.item() / world)


def peak(events, key):
    """The peak bytes, and the moments it is reached."""
    top = max(e[key] for e in events)
    return top, [f"{e['moment']} (step {e['step']})" for e in events if e[key] == top]


def where(moments, count):
    listed = moments[0] if len(moments) == 1 else f"{moments[0]} ... {moments[-1]}"
    return f"at {len(moments)} of {count} moments: {listed}"


def report(results, world):
    first = results["detected"]
    print(f"embeddings.weight {VOCAB} x {DIM} fp32: {VOCAB * DIM * 4 / MIB:.2f} MiB; "
          f"{LAYERS} layers of {(DIM * DIM + DIM) * 4 / MIB:.4f} MiB; {world} ranks, "
          f"each keeps a partition of {first['partition'] / MIB:.4f} MiB")
    print(f"losses {', '.join(f'{loss:.4f}' for loss in first['losses'])} in every variant that ran")
    print("\nHeld: full parameters a rank holds (MiB), peak of each step; where the last step peaks")
    for name, result in results.items():
        steps = [[e for e in result["events"] if e["step"] == step] for step in range(STEPS)]
        if result["error"]:
            print(f"  {name:50} {result['error']}")
            continue
        top, moments = peak(steps[-1], "held")
        print(f"  {name:50} " + " ".join(f"{peak(events, 'held')[0] / MIB:5.2f}" for events in steps)
              + f"  {where(moments, len(steps[-1]))}")
    print("\nAllocated: memory of those parameters still allocated (MiB), peak over all steps; "
          "where, if above the peak held")
    for name, result in results.items():
        if not result["error"]:
            top, moments = peak(result["events"], "alive")
            above = top > max(e["held"] for e in result["events"])
            print(f"  {name:50} {top / MIB:5.2f}  {where(moments, len(result['events'])) if above else ''}".rstrip())
    on_paper(results)


# --8<-- [start:paper]
def on_paper(results, vocab=262144, hidden=4096, bytes_per_value=2):
    """Derived, not run: the measured pattern, scaled to a real embedding (here bf16)."""
    embedding, real = VOCAB * DIM * 4, vocab * hidden * bytes_per_value
    print(f"\nOn paper (derived, not run): a {vocab} x {hidden} embedding in bf16 is "
          f"{real / 2**30:.2f} GiB per full copy")
    for name, result in results.items():
        if not result["error"]:
            last = [e for e in result["events"] if e["step"] == STEPS - 1]
            copies = max(e["alive"] for e in result["events"]) // embedding
            holding = sum("embeddings.weight" in e["full"] for e in last)
            print(f"  {name:50} {copies} full "
                  f"{'copy' if copies == 1 else 'copies'} at the peak = "
                  f"{copies * real / 2**30:.2f} GiB + the layers gathered then; "
                  f"held at {holding} of {len(last)} moments")
# --8<-- [end:paper]


def main():
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if BATCH % world:  # unequal shares would weigh the samples unequally: other losses
        raise ValueError(f"{BATCH} samples do not split evenly over {world} ranks; run "
                         "on 2 or 4 ranks (the printed losses were checked on both)")
    results = {name: train(model, settings, rank, world) for name, (model, settings) in VARIANTS.items()}
    if rank == 0:
        report(results, world)
        # Time per step varies from run to run: it goes to stderr, not to the compared output.
        base = statistics.median(results["detected"]["seconds"][1:])
        for name, result in results.items():
            if not result["error"]:
                median = statistics.median(result["seconds"][1:])
                print(f"time per step after step 0, median of {len(result['seconds']) - 1}: "
                      f"{name:50} {median:6.3f} s  {median / base:4.2f} x detected", file=sys.stderr)
    torch.distributed.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # os._exit does not flush
    os._exit(0)  # no interpreter shutdown, which gloo's threads can abort
