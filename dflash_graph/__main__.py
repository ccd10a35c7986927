import sys

from .cli.main import main

code = main()
if code and "dflash_graph.exec.distributed" in sys.modules:   # a rank under torchrun (exec/distributed.py)
    sys.modules["dflash_graph.exec.distributed"].exit_now(code)
raise SystemExit(code)
