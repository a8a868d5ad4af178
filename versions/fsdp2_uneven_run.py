"""pytorch/pytorch issue #176076 by run: the tied model of snippets/pipeline/fsdp_tied_uneven.py
(15 rows, which 2 ranks split 8 + 7 and 4 ranks 4 + 4 + 4 + 3) with its embedding and its head
in separate `fully_shard` groups, trained 3 steps on 2 and on 4 CPU processes over gloo, beside the same model in one process, for
each Python interpreter given (each with its own torch installed): whether every row of each
rank's shard changed, and how far the weight is from the one-process weight. Writes what it
printed to snippets/pipeline/fsdp2_uneven_run.txt.

    python3 versions/fsdp2_uneven_run.py /tmp/torch211/bin/python .venv/bin/python

Only the pinned torch 2.13.0 is a CPU wheel; other releases come from PyPI as CUDA builds
(several GB each with their nvidia-* packages), which run on CPU processes without a GPU:
`python3 -m venv /tmp/torchX && /tmp/torchX/bin/pip install torch==X`, then delete it.
"""
import os
import runpy
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "snippets" / "pipeline" / "fsdp_tied_uneven.py"
RECORD = ROOT / "snippets" / "pipeline" / "fsdp2_uneven_run.txt"


def ranks():
    """One rank of the run (started by torch.distributed.run)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    ex = runpy.run_path(str(EXAMPLE), run_name="reference")
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    lines = [f"torch {torch.__version__}: embed and head in separate fully_shard groups, "
             f"{ex['VOCAB']} rows over {world} ranks"]
    try:
        got = ex["train"](torch.device("cpu"), separate_groups=True)
    except Exception as error:
        lines.append(f"  raises {type(error).__name__}: {error}")
    else:
        torch.manual_seed(ex["SEED"])
        model = ex["TiedLanguageModel"]()
        optimizer = torch.optim.SGD(model.parameters(), lr=ex["LR"])
        tokens, targets = ex["batch"]()
        losses = []
        for _ in range(ex["STEPS"]):
            loss = F.cross_entropy(model(tokens).reshape(-1, ex["VOCAB"]), targets.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        torch.manual_seed(ex["SEED"])
        start = ex["TiedLanguageModel"]().embed.weight.detach()
        shards = torch.arange(ex["VOCAB"]).chunk(world)
        lines += [
            "  losses " + " ".join(f"{x:.4f}" for x in got["losses"])
            + " (one process " + " ".join(f"{x:.4f}" for x in losses) + ")",
            f"  rows of each rank's shard: {got['rows']}"]
        for name in ("weight", "head"):
            weight = got[name]
            changed = [int((weight[rows] != start[rows]).any(dim=1).sum()) for rows in shards]
            apart = (weight - model.embed.weight.detach()).abs().max().item()
            label = "embed.weight" if name == "weight" else "head.weight"
            lines.append(f"  {label}: rows changed in each rank's shard {changed}; "
                         f"max |{label} - the one-process weight| {apart:.4f}")
    if dist.get_rank() == 0:
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()


def main(pythons):
    printed = []
    for python in pythons:
        for ranks in ("2", "4"):
            run = subprocess.run(
                [python, "-m", "torch.distributed.run", "--nproc_per_node", ranks,
                 "--master_port", "29533", __file__, "--ranks"],
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
