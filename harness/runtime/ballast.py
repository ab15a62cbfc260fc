"""Ballast: shrink a big card's free memory to a smaller card's size, for jobs that share a card.

`set_per_process_memory_fraction` caps one process; several processes sharing one emulated card
must compete for one pool, so this process takes everything but `--leave` bytes of the device's
free memory and holds it until it is killed. The workers started after it see the smaller card's
free memory, their own contexts included, as they would on the real card. The ready file holds
the device memory left free, which the run records: less than `--leave` means another process
held memory on the card before the run (harness.measure.records.CaseRun.card_shortfall). It also exits once the
harness that started it is gone (harness.runtime.process_tree.exit_with_owner), which a stopped harness
could not ask of it.

    python -m harness.runtime.ballast --device 0 --leave 25254903398 --ready FILE
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--leave", type=int, required=True, help="bytes to leave free")
    parser.add_argument("--ready", required=True, help="file written once the ballast is held")
    args = parser.parse_args(argv)

    from harness.runtime.process_tree import exit_with_owner

    exit_with_owner()  # before torch's import and CUDA's start-up, which take seconds
    import torch

    device = torch.device("cuda", args.device)
    torch.zeros(1, device=device)
    free, _ = torch.cuda.mem_get_info(device)
    take = free - args.leave
    chunk = 1 << 30
    held = []
    while take > 0:  # in 1 GiB pieces, so fragmentation cannot refuse one huge block
        n = min(chunk, take)
        held.append(torch.empty(n, dtype=torch.uint8, device=device))
        take -= n
    torch.cuda.synchronize(device)
    free_after, _ = torch.cuda.mem_get_info(device)
    ready = Path(args.ready)  # whole or absent: the launcher reads the free memory from it
    ready.with_suffix(".tmp").write_text(f"{free_after}\n")
    ready.with_suffix(".tmp").replace(ready)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    return 0


if __name__ == "__main__":
    sys.exit(main())
