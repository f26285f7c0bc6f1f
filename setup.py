"""Maps the design's top-level folders onto one import namespace.

`runtime/`, `kernels/` and `evals/` install as `quantpipe.runtime`, `quantpipe.kernels` and
`quantpipe.evals`: no generic top-level name (Hugging Face's `kernels` already owns that
one). Metadata lives in pyproject.toml; only the package map needs code.
"""

from setuptools import find_packages, setup

ROOTS = {"quantpipe": "quantpipe", "quantpipe.runtime": "runtime",
         "quantpipe.kernels": "kernels", "quantpipe.evals": "evals"}

packages = []
for name, folder in ROOTS.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=ROOTS)
