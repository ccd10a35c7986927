import sys

from .cli.main import main

code = main()
if "dflash_graph.exec.distributed" in sys.modules:   # a rank under torchrun ends by os._exit (exec/distributed.py)
    sys.modules["dflash_graph.exec.distributed"].end_rank(code)
raise SystemExit(code)
