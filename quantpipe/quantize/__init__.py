"""Stage 2: weights onto INT8 / INT4 grids, written as compressed-tensors artifacts.

    from quantpipe.quantize import QuantConfig, quantize
    art = quantize(None, QuantConfig(scheme="W4A16", group_size=64, method="gptq"), "calib_sets/sample-set",
                   "artifacts/smollm2-w4a16-g64")

Files: config.py (QuantConfig), rtn.py (grids, round-to-nearest), gptq.py, awq.py, kv.py
(static KV scales), mixed.py (per-layer precision), stage.py (the run), cli.py. The
artifact's files are written, read and hashed by `quantpipe.formats.artifact`; the runtime
loads artifacts through it (runtime/model/loader.py, runtime/model/quantized.py).
"""

from quantpipe.quantize.config import QuantConfig
from quantpipe.quantize.stage import Artifact, quantize

__all__ = ["Artifact", "QuantConfig", "quantize"]
