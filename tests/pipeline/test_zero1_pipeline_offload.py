"""snippets/pipeline/zero1_pipeline_offload.py: a tied DeepSpeed pipeline refuses ZeRO-2; with
ZeRO-1, and with ZeRO-1 whose optimizer is offloaded to the CPU (torch's SGD allowed by
zero_force_ds_cpu_optimizer=false), it trains like one process on 2 and on 4 ranks; the offload
without that key is refused with DeepSpeed's ZeRORuntimeException."""

import pytest
import torch

from rankrun.pages import output_file
from rankrun.reference import example_namespace, layers_seeded_like_deepspeed
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches, matches

SNIPPET = "snippets/pipeline/zero1_pipeline_offload.py"
REFUSED = {
    "ZeRO-2": "AssertionError: ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism",
    "ZeRO-1, optimizer offloaded": (
        "ZeRORuntimeException: You are using ZeRO-Offload with a client provided optimizer "
        "(<class 'torch.optim.sgd.SGD'>) which in most cases will yield poor performance. "
        "Please either use deepspeed.ops.adam.DeepSpeedCPUAdam or set an optimizer in your "
        "ds-config (https://www.deepspeed.ai/docs/config-json/#optimizer-parameters). If you "
        "really want to use a custom optimizer w. ZeRO-Offload and understand the performance "
        "impacts you can also set <\"zero_force_ds_cpu_optimizer\": false> in your "
        "configuration file."),
}
TRAINED = {"ZeRO-1": False, "ZeRO-1, optimizer offloaded, torch SGD allowed": True}


def train_in_one_process(replicas, momentum=None):
    """One process, no DeepSpeed: the layers seeded as seed_layers=True seeds them, one
    embedding as input layer and head, every replica's micro-batches each step (each loss
    divided by their number: the mean), SGD with the snippet's momentum (or `momentum`)."""
    ex = example_namespace(SNIPPET)
    embedding, mixer1, mixer2 = layers_seeded_like_deepspeed(ex["SEED"], {
        0: lambda: torch.nn.Embedding(ex["VOCAB"], ex["DIM"]), 1: ex["Mixer"], 2: ex["Mixer"]})
    modules = {"tied_modules.embed": embedding, "1": mixer1, "2": mixer2}
    params = [p for module in modules.values() for p in module.parameters()]
    optimizer = torch.optim.SGD(params, lr=ex["LR"],
                                momentum=ex["MOMENTUM"] if momentum is None else momentum)
    batches = [mb for replica in range(replicas) for mb in ex["micro_batches"](replica, "cpu")]
    losses = []
    for _ in range(ex["STEPS"]):
        total = 0.0
        for tokens, targets in batches:
            logits = ex["logits_from_embedding"](embedding, mixer2(mixer1(embedding(tokens))))
            loss = ex["cross_entropy"](logits, targets)
            (loss / len(batches)).backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / len(batches))
    weights = {f"{prefix}.{name}": p.detach().clone()
               for prefix, module in modules.items() for name, p in module.named_parameters()}
    return losses, weights


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero2_refused_zero1_and_its_cpu_offload_train_like_one_process(world_size, expect_output):
    result = run_snippet(SNIPPET, world_size, call="main", timeout=600).check()
    replicas = world_size // 2
    ref_losses, ref_weights = train_in_one_process(replicas)
    for rank in range(world_size):
        got = result.returned(rank)
        assert list(got) == list(example_namespace(SNIPPET)["CONFIGS"])
        for name, message in REFUSED.items():
            # Raised by deepspeed.initialize on every rank, exactly this message.
            assert got[name] == message, (rank, name)
        for name, offloaded in TRAINED.items():
            run = got[name]
            label = f"rank {rank} {name}"
            assert (run["optimizer"], run["cpu_offload"]) == ("DeepSpeedZeroOptimizer", offloaded)
            # All copies of the tied weight (both stages, every replica) bit-identical.
            assert run["differences"] == [0.0] * len(ref_losses), label
            assert_matches(run["losses"], ref_losses, f"{label} losses")
            # This rank's stage: its parameters equal the one-process model's.
            assert run["parameters"], label
            for key, value in run["parameters"].items():
                assert_matches(value, ref_weights[key], f"{label} {key}")
        # The offloaded run is the same training as the one without offload.
        assert_matches(got["ZeRO-1, optimizer offloaded, torch SGD allowed"]["losses"],
                       got["ZeRO-1"]["losses"], f"rank {rank} offloaded against not")
    # The momentum is in effect (the optimizer state ZeRO-1 partitions and the offload moves):
    # without it, one process trains otherwise.
    plain_losses, _ = train_in_one_process(replicas, momentum=0.0)
    assert not matches(plain_losses, ref_losses)
    if world_size == 4:
        expect_output(result, output_file(SNIPPET))
