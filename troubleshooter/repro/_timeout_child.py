"""One rank of the collective-timeout reproduction (run by troubleshooter.repro.timeout).

Rank 1 is "stuck" (it sleeps instead of joining the collective); rank 0 waits in an all-reduce on
a sub-group created the way DeepSpeed creates its expert groups, ``new_group(ranks)``. Prints one
JSON line: the timeouts of both groups and how long rank 0 waited before its collective failed.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--timeout", type=float, required=True, help="the world group's timeout, seconds")
    parser.add_argument("--stuck-for", type=float, required=True, help="how long rank 1 stays away, seconds")
    parser.add_argument("--fix", action="store_true", help="apply ZeroMoEStrategy's timeout to every group")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    # A generous rendezvous, then the short timeout the user asked for on the world group.
    dist.init_process_group("gloo", rank=args.rank, world_size=2, timeout=timedelta(seconds=120))
    timeout = timedelta(seconds=args.timeout)
    from lightning_zeromoe.engine import collectives
    from lightning_zeromoe._private.torch import default_group, group_timeout, set_group_timeout

    set_group_timeout(timeout, default_group())
    expert_group = dist.new_group([0, 1])  # what deepspeed/utils/groups.py does
    if args.fix:
        from lightning_zeromoe.engine.processes import apply_timeout_to_all_groups

        apply_timeout_to_all_groups(timeout)
    collectives.barrier()

    record = {"rank": args.rank, "world_timeout": group_timeout(default_group()).total_seconds(),
              "expert_group_timeout": group_timeout(expert_group).total_seconds()}
    if args.rank == 1:
        time.sleep(args.stuck_for)
    else:
        start = time.monotonic()
        try:
            collectives.all_reduce(torch.ones(4), group=expert_group)
            record["error"] = None
        except RuntimeError as err:
            record["error"] = str(err).splitlines()[0][:300]
        record["waited"] = round(time.monotonic() - start, 2)
    print(json.dumps(record), flush=True)
    os._exit(0)  # skip process-group teardown: the peer may be gone


if __name__ == "__main__":
    main()
