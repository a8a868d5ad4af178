"""Benchmark: generate() under ZeRO-3 inside TRL's unwrap_model_for_generation, with every weight
gathered once for the call (gather_deepspeed3_params=True, TRL's default; GRPOConfig's
ds3_gather_for_generation=True) against the per-layer gathers of ZeRO-3's hooks
(gather_deepspeed3_params=False), on a small Llama.

    DS_ACCELERATOR=cpu .venv/bin/torchrun --nproc_per_node 2 benchmarks/generation_gather.py \
        [rounds] [--settings partitioned|no-prefetch|deepspeed-defaults]

Per mode and per generated token: the wall time, the all-gathers started (ZeRO-3's hooks, and
the helper's one gather of every weight per call) and the elements they gathered (each rank
receives (world - 1) / world of them from the others); and the most elements of gathered
(whole) weights that a rank held at once, looked at before every module's forward (float32:
4 bytes each). Also the ratio of the two modes' times within each round: the median over the
rounds, with a distribution-free 95% confidence interval of that median. The two modes run interleaved, the order switched
every round, so that a change of the machine's load falls on both alike; the first round is
not counted. Prints from rank 0, with the load average before and after. The ZeRO-3 settings:
"partitioned" (the default here) sets stage3_param_persistence_threshold to 0, so that every
weight is partitioned, and keeps DeepSpeed's other defaults (stage3_prefetch_bucket_size 5e7
and stage3_max_reuse_distance 1e9 elements: on a model this small, the next layers are
gathered ahead and nothing is released within a forward); "no-prefetch" also sets those two
to 0, so that a rank holds only the weights of the module whose forward runs;
"deepspeed-defaults" sets nothing (threshold 1e5 elements: smaller weights are kept whole on
every rank and never gathered). Not part of the test suite: timings belong here.
"""

import math
import os
import statistics
import sys
import time

import accelerate
import deepspeed
import torch
from accelerate.utils import DeepSpeedPlugin
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
from transformers import LlamaConfig, LlamaForCausalLM
from trl.models.utils import unwrap_model_for_generation

VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS = 1024, 256, 512, 4, 4
PROMPTS, PROMPT, NEW, SEED = 4, 8, 32, 0
MODES = {"gathered once (True)": True, "per-layer gathers (False)": False}
GATHERS = {"calls": 0, "elements": 0}


def count_gathers():
    gather = PartitionedParameterCoordinator._PartitionedParameterCoordinator__all_gather_params
    enter = deepspeed.zero.GatheredParameters.__enter__

    def counted(self, params, forward):
        GATHERS["calls"] += 1
        GATHERS["elements"] += sum(p.ds_numel for p in params)
        return gather(self, params, forward)

    def counted_enter(self):
        if self.enabled:
            GATHERS["calls"] += 1
            GATHERS["elements"] += sum(p.ds_numel for p in self.params
                                       if p.ds_status == ZeroParamStatus.NOT_AVAILABLE)
        return enter(self)

    PartitionedParameterCoordinator._PartitionedParameterCoordinator__all_gather_params = counted
    deepspeed.zero.GatheredParameters.__enter__ = counted_enter


def median_interval(values, confidence=0.95):
    """The order statistics that bound the median with at least `confidence`, whatever the
    distribution: the number of values below the median is Binomial(n, 1/2)."""
    values, n = sorted(values), len(values)
    below, cumulative = 1, 0.0
    for k in range(n // 2 + 1):
        if cumulative + math.comb(n, k) / 2 ** n > (1 - confidence) / 2:
            below = max(k, 1)
            break
        cumulative += math.comb(n, k) / 2 ** n
    return values[below - 1], values[n - below]


def load_average():
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


SETTINGS = {"partitioned": {"stage3_param_persistence_threshold": 0},
            "no-prefetch": {"stage3_param_persistence_threshold": 0,
                            "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0},
            "deepspeed-defaults": {}}


def engine_and_accelerator(settings):
    zero = {"stage": 3, **SETTINGS[settings]}
    config = {"train_micro_batch_size_per_gpu": PROMPTS, "gradient_accumulation_steps": 1,
              "zero_optimization": zero, "zero_allow_untested_optimizer": True}
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    accelerate.PartialState(backend=get_accelerator().communication_backend_name())
    accelerator = accelerate.Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        max_position_embeddings=PROMPT + NEW, tie_word_embeddings=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, _ = accelerator.prepare(model, optimizer)
    engine.eval()
    return engine, accelerator


def peak_watch(model, peak):
    """Before every module's forward: the elements of this model's weights gathered right now."""
    params = list(model.parameters())

    def look(module, args):
        whole = sum(p.ds_numel for p in params if p.ds_status == ZeroParamStatus.AVAILABLE)
        peak[0] = max(peak[0], whole)

    return [module.register_forward_pre_hook(look) for module in model.modules()]


def generate(engine, accelerator, gather):
    rank = torch.distributed.get_rank()
    prompts = torch.randint(0, VOCAB, (PROMPTS, PROMPT),
                            generator=torch.Generator().manual_seed(rank))
    peak = [0]
    torch.distributed.barrier()
    calls, elements, start = GATHERS["calls"], GATHERS["elements"], time.perf_counter()
    with unwrap_model_for_generation(engine, accelerator,
                                     gather_deepspeed3_params=gather) as unwrapped:
        hooks = peak_watch(unwrapped, peak)
        unwrapped.generate(prompts, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                           pad_token_id=0)
        for hook in hooks:
            hook.remove()
    torch.distributed.barrier()
    return {"seconds": (time.perf_counter() - start) / NEW,
            "gathers": (GATHERS["calls"] - calls) / NEW,
            "elements": (GATHERS["elements"] - elements) / NEW, "peak": peak[0]}


def main():
    arguments = sys.argv[1:]
    settings = "partitioned"
    if "--settings" in arguments:
        settings = arguments.pop(arguments.index("--settings") + 1)
        arguments.remove("--settings")
    rounds = int(arguments[0]) if arguments else 20
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    say = print if torch.distributed.get_rank() == 0 else (lambda *args, **kwargs: None)
    count_gathers()
    engine, accelerator = engine_and_accelerator(settings)
    total = sum(p.ds_numel for p in engine.module.parameters())
    persistent = sum(p.ds_numel for p in engine.module.parameters() if p.ds_persist)
    say(f"load average before: {load_average()}", flush=True)
    seen = {mode: [] for mode in MODES}
    for index in range(1 + rounds):
        order = list(MODES) if index % 2 == 0 else list(MODES)[::-1]
        for mode in order:
            result = generate(engine, accelerator, MODES[mode])
            if index:
                seen[mode].append(result)
    say(f"DeepSpeed {deepspeed.__version__}, torch {torch.__version__}, "
        f"{torch.distributed.get_world_size()} ranks; Llama {LAYERS} layers, hidden {HIDDEN}, "
        f"vocab {VOCAB}, tied: {total:,} elements ({total * 4 / 2**20:.2f} MiB in float32), "
        f"{persistent:,} of them never partitioned")
    say(f"ZeRO-3 settings {settings!r}: {SETTINGS[settings] or 'DeepSpeed defaults'}")
    say(f"{PROMPTS} prompts of {PROMPT} tokens on each rank, {NEW} new tokens each, greedy; "
        f"{rounds} rounds after 1 warm-up round")
    say(f"{'gather_deepspeed3_params':26s} {'ms/token':>9s} {'[quartiles]':>16s} "
        f"{'gathers/token':>14s} {'elements gathered/token':>24s} {'peak whole on a rank':>21s}")
    for mode, results in seen.items():
        ms = [r["seconds"] * 1e3 for r in results]
        low, _, high = statistics.quantiles(ms, n=4)
        say(f"{mode:26s} {statistics.median(ms):9.2f} [{low:6.2f}, {high:6.2f}] "
            f"{statistics.median(r['gathers'] for r in results):14.2f} "
            f"{statistics.median(r['elements'] for r in results):24,.0f} "
            f"{max(r['peak'] for r in results):21,d}")
    fast, slow = (seen[mode] for mode in MODES)
    ratios = [a["seconds"] / b["seconds"] for a, b in zip(slow, fast)]
    low, high = median_interval(ratios)
    say(f"time per token, False / True within a round: {statistics.median(ratios):.2f} "
        f"[95% CI of the median: {low:.2f}, {high:.2f}]")
    say(f"load average after: {load_average()}", flush=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
