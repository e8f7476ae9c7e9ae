import os
import sys

# One OpenMP thread per test process: the suite runs several processes at once (gloo worlds, torchrun), and
# oversubscribed OpenMP threads spin at barriers (a 100x128x64 matmul + backward measured 30 ms instead of
# 0.3 ms on the 2-core CI machine under load). Set before torch is imported; subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The Triton kernel tests run on CPU tensors in Triton's interpreter. Triton picks interpreter or compiler per
# @triton.jit function when it is first imported (torch may import it early), so set this before anything.
os.environ["TRITON_INTERPRET"] = "1"

import torch

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
sys.path.insert(0, os.path.dirname(__file__))
