"""The smallest useful run: every rank joins the group and reports what torchrun would set."""
import os

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    print(f"[rank {dist.get_rank()}] world {dist.get_world_size()} local {os.environ['LOCAL_RANK']} sum {total.item():.0f}")
    report = {"rank": dist.get_rank(), "sum": total.item()}
    dist.destroy_process_group()
    return report


if __name__ == "__main__":
    main()
