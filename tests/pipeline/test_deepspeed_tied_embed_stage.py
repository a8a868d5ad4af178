"""snippets/pipeline/deepspeed_tied_embed_stage.py: a stage that holds only the tied embedding
(DeepSpeed issue #1522's layout), ZeRO-1 in fp32 with clipping, on 2 ranks (2 stages) and 4
(2 stages x 2 replicas): no hang, the copies stay bit-identical, and training (losses, the
norm clipping divides by, the weights) equals one process with clip_grad_norm_. DeepSpeed's
own layer seeding with a type: partition raises a TypeError."""

import pytest
import torch

from rankrun.pages import output_file
from rankrun.project import PEER_WENT_AWAY
from rankrun.reference import example_namespace, gradient_norm, layers_seeded_like_deepspeed
from rankrun.runner import run_snippet
from rankrun.tolerance import assert_matches, matches

SNIPPET = "snippets/pipeline/deepspeed_tied_embed_stage.py"
SEEDED_FILE = output_file(SNIPPET).with_name("deepspeed_tied_embed_stage_seeded.txt")
# Where each partition puts the stage boundaries (the first layer of each stage).
PARTS = {"by hand, [0, 1, 4]": [0, 1, 4], 'partition_method="type:embed"': [0, 3, 4]}
# A hang here would be a collective one stage skips: a few steps of this tiny model take
# seconds, so a run still going after this long is stuck.
TIMEOUT = 120


def train_in_one_process(replicas):
    """One fp32 process on every replica's micro-batches: each step the mean of their
    losses' gradients, clip_grad_norm_ to CLIP over the whole model (the tied weight
    once), SGD. Returns the losses, the norms before clipping, and the tied weight; also
    the norm of the embedding's gradient alone (what stage 0 holds by hand)."""
    ex = example_namespace(SNIPPET)
    embedding, mixer1, mixer2 = layers_seeded_like_deepspeed(ex["SEED"], {
        0: lambda: torch.nn.Embedding(ex["VOCAB"], ex["DIM"]), 1: ex["Mixer"], 2: ex["Mixer"]})
    params = [*embedding.parameters(), *mixer1.parameters(), *mixer2.parameters()]
    optimizer = torch.optim.SGD(params, lr=ex["LR"])
    micro_batches = [mb for replica in range(replicas)
                     for mb in ex["micro_batches"](replica, "cpu")]
    losses, norms, embedding_norms = [], [], []
    for _ in range(ex["STEPS"]):
        total = 0.0
        for tokens, targets in micro_batches:
            logits = ex["logits_from_embedding"](embedding, mixer2(mixer1(embedding(tokens))))
            loss = ex["cross_entropy"](logits, targets)
            (loss / len(micro_batches)).backward()
            total += loss.item()
        embedding_norms.append(gradient_norm([embedding.weight]))
        norms.append(torch.nn.utils.clip_grad_norm_(params, ex["CLIP"]).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / len(micro_batches))
    return losses, norms, embedding.weight.detach().clone(), embedding_norms


@pytest.fixture(scope="module", params=[2, 4])
def run(request):
    return run_snippet(SNIPPET, request.param, call="main", timeout=TIMEOUT).check()


def test_a_stage_with_only_the_tied_embedding_trains_like_one_process(run, expect_output):
    world = run.world_size
    ref_losses, ref_norms, ref_weight, embedding_norms = train_in_one_process(world // 2)
    ex = example_namespace(SNIPPET)
    assert all(norm > ex["CLIP"] for norm in ref_norms)  # clipping acts at every step
    for rank in range(world):
        stage, replica = divmod(rank, world // 2)  # stage-major, as DeepSpeed lays them out
        for partition, got in run.returned(rank).items():
            label = f"rank {rank} {partition}"
            assert (got["stage"], got["replica"]) == (stage, replica), label
            assert got["parts"] == PARTS[partition], label
            assert got["optimizer"] == "DeepSpeedZeroOptimizer", label
            assert got["differences"] == [0.0] * len(ref_losses), label
            assert_matches(got["losses"], ref_losses, f"{label} losses")
            # ZeRO-1 clips by the whole model's norm, the tied weight counted once ...
            assert_matches(got["norms"], ref_norms, f"{label} norms")
            # ... not by the norm of what the first stage holds.
            assert not matches(got["norms"], embedding_norms), label
            assert_matches(got["weight"], ref_weight, f"{label} tied weight")
    if world == 2:
        expect_output(run, output_file(SNIPPET))


def test_deepspeeds_own_seeding_with_a_type_partition_raises(expect_output):
    result = run_snippet(SNIPPET, 2, call="seeded_by_deepspeed", timeout=TIMEOUT)
    assert not result.ok and result.errors == [
        "TypeError: The only supported seed types are: None,\n"
        "int, float, str, bytes, and bytearray."], result.failure_report()
    # Every rank raises it; under load a slower rank may not get there: the runner stops it
    # after the first one raised (its grace period), or the collective it is in fails because
    # that rank went away (gloo's "Connection reset by peer").
    raised = [rank for rank in result.ranks
              if rank.exception and not PEER_WENT_AWAY.search(rank.exception["message"])]
    assert result.ranks[0] in raised or len(raised) == 1, result.failure_report()
    for rank in raised:
        assert "ds_utils.set_random_seed(self.base_seed + layer_idx)" in rank.exception["traceback"]
    expect_output(result, SEEDED_FILE)
