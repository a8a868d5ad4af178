"""Which PyTorch releases refuse a tied weight split over two FSDP2 groups, by running it: for
each Python interpreter given (each with its own torch installed), the tied model of
snippets/pipeline/fsdp_tied.py with its embedding and its head in separate `fully_shard`
groups, trained 3 steps on 2 CPU processes over gloo, beside the same model in one process.
Writes what it printed to snippets/pipeline/fsdp2_shared_check_run.txt.

    python3 versions/fsdp2_shared_check_run.py /tmp/torch211/bin/python \\
        /tmp/torch212/bin/python .venv/bin/python

Only the pinned torch 2.13.0 is a CPU wheel; other releases come from PyPI as CUDA builds
(several GB each with their nvidia-* packages). They run on CPU processes without a GPU:
`python3 -m venv /tmp/torchX && /tmp/torchX/bin/pip install torch==X` (nothing else is
needed), then delete the environment.
"""
import os
import runpy
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "snippets" / "pipeline" / "fsdp_tied.py"
RECORD = ROOT / "snippets" / "pipeline" / "fsdp2_shared_check_run.txt"


def ranks():
    """One rank of the run (started by torch.distributed.run)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    ex = runpy.run_path(str(EXAMPLE), run_name="reference")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, targets = ex["batch"]()

    def step(model, optimizer, inputs, labels):
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, ex["VOCAB"]), labels.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    torch.manual_seed(ex["SEED"])
    model = ex["TiedLanguageModel"]()
    fully_shard(model.embed)  # the two owners of the tied weight in separate groups
    fully_shard(model.head)
    fully_shard(model.mixer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=ex["LR"])
    torch.manual_seed(ex["SEED"])
    reference = ex["TiedLanguageModel"]()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=ex["LR"])
    lines = [f"torch {torch.__version__}: embed and head in separate fully_shard groups"]
    number = 0
    try:
        for number in range(ex["STEPS"]):
            loss = step(model, optimizer, tokens[rank::world], targets[rank::world])
            dist.all_reduce(loss)
            ref_loss = step(reference, ref_optimizer, tokens, targets)
            embed = model.embed.weight.full_tensor()
            head = model.head.weight.full_tensor()
            lines.append(f"  step {number}: loss {loss.item() / world:.4f} (one process "
                         f"{ref_loss.item():.4f}), max |embed.weight - head.weight| "
                         f"{(embed - head).abs().max().item():.4f}")
    except Exception as error:
        lines.append(f"  step {number} raises {type(error).__name__}: {error}")
    if rank == 0:
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()


def main(pythons):
    printed = []
    for python in pythons:
        run = subprocess.run(
            [python, "-m", "torch.distributed.run", "--nproc_per_node", "2",
             "--master_port", "29531", __file__, "--ranks"],
            capture_output=True, text=True, cwd=ROOT, timeout=600,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        if run.returncode:
            raise SystemExit(f"{python}: exit status {run.returncode}\n{run.stderr[-3000:]}")
        printed.append(run.stdout.strip())
    RECORD.write_text("\n".join(printed) + "\n")
    print(RECORD.read_text(), end="")


if __name__ == "__main__":
    if sys.argv[1:] == ["--ranks"]:
        ranks()
    else:
        main(sys.argv[1:])
