"""How often a process aborts at exit ("terminate called without an active exception", SIGABRT) when a thread is
inside a C++ call with the GIL released as the interpreter finalizes (NOTE [Teardown] in exec/distributed.py).

    python tools/exit_aborts.py daemon 20          # a daemon thread writing to a TCPStore in a loop; stop set, no join
    python tools/exit_aborts.py daemon-join 20     # the same, the thread joined before exit
    python tools/exit_aborts.py comm 40            # the project's Comm on a 1-rank gloo world, the heartbeat every
                                                   # 0.5 ms (not 0.5 s), close(), then finalization, as a target rank
    python tools/exit_aborts.py comm 40 --tree DIR # the same with the dflash_graph of another checkout (a before)

Each run is a fresh `python` process (one import of torch each: about 3-8 s on a loaded 2-core machine). Prints
each failed exit and then "MODE: K of N exits aborted", with the 1-minute load average before and after.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DAEMON = '''
import sys, threading, time
from datetime import timedelta
import torch.distributed as dist
master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
client = dist.TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
stop = threading.Event()
def beat():
    n = 0
    while not stop.is_set():
        n += 1
        client.set("beat", str(n))
t = threading.Thread(target=beat, daemon=True)
t.start()
time.sleep(0.05)
stop.set()
if sys.argv[1] == "daemon-join":
    t.join()
'''

COMM = '''
import os, socket, sys, time, types
sys.path.insert(0, sys.argv[2])
import dflash_graph.exec.distributed as D
D.BEAT_SECONDS = 0.0005
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
comm = D.Comm(types.SimpleNamespace(backend="gloo", transfers=[]), {0: ["d0"]}, 30.0, str)
time.sleep(0.2)
comm.close()
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["daemon", "daemon-join", "comm"])
    ap.add_argument("n", type=int)
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose dflash_graph `comm` imports")
    args = ap.parse_args()
    code = COMM if args.mode == "comm" else DAEMON
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    aborted = 0
    for i in range(args.n):
        p = subprocess.run([sys.executable, "-c", code, args.mode, str(args.tree.resolve())], env=env,
                           capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            aborted += p.returncode in (-6, 134)
            said = next((ln for ln in p.stderr.splitlines() if "terminate" in ln), p.stderr.strip()[-200:])
            print(f"  run {i + 1}: exit {p.returncode}: {said}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print(f"{args.mode}: {aborted} of {args.n} exits aborted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
