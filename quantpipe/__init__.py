"""quantpipe: calibrate on production traffic, quantize, verify, gate and publish LLMs.

Stages live in their own subpackages; the runtime that serves and evaluates models is
`quantpipe.runtime` (source folder `runtime/`), kernels are `quantpipe.kernels`
(`kernels/`), eval suites and gates `quantpipe.evals` (`evals/`).
"""

import importlib
import importlib.util
import os
import sys

__version__ = "0.2.0"


def _bind_installed_kernels() -> None:
    """Make `import kernels` mean Hugging Face's package, not this repository's `kernels/` folder.

    transformers (>= 5.25, which depends on it) imports HF's `kernels` from modeling_utils.
    Run from a checkout with the repository root on sys.path (`python -m ...`, `python -c`,
    `python -m pytest`), the top-level name would resolve to our folder (installed as
    `quantpipe.kernels`) and every transformers model import would fail. Importing the real one
    once, with the root left out of the search, binds the name for the whole process.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if "kernels" in sys.modules:
        return
    try:
        spec = importlib.util.find_spec("kernels")
    except (ImportError, ValueError):
        return
    if spec is None or not (spec.origin or "").startswith(os.path.join(root, "kernels") + os.sep):
        return  # not installed, or found as itself: nothing shadows it
    saved = sys.path[:]
    sys.path[:] = [p for p in saved if os.path.abspath(p or os.curdir) != root]
    try:
        importlib.import_module("kernels")
    except ImportError:
        pass  # not installed: nothing to shadow, and transformers will not look for it
    finally:
        sys.path[:] = saved

_bind_installed_kernels()
