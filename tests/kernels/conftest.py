import os

import torch

# Triton decides when a kernel module is imported whether @triton.jit interprets: without a
# GPU, every kernel test runs in Triton's CPU interpreter.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
