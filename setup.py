"""Maps the design's top-level folders onto one import namespace.

`runtime/`, `kernels/src/` and `evals/` install as `quantpipe.runtime`, `quantpipe.kernels`
and `quantpipe.evals`: no generic top-level name. `kernels/` itself is not a package, so
Python started in the repository root still finds Hugging Face's `kernels` package
(transformers imports it) rather than this folder. Metadata lives in pyproject.toml; only
the package map needs code.

Folders that hold only data (gate policies, suites, recipes, task files, the CPU kernels'
C++ sources) are listed as packages too, so their files reach the wheel by declaration
(package-data in pyproject.toml), not by setuptools' deprecated fallback.
"""

from setuptools import find_namespace_packages, setup

ROOTS = {"quantpipe": "quantpipe", "quantpipe.runtime": "runtime",
         "quantpipe.kernels": "kernels/src", "quantpipe.evals": "evals"}

packages = []
for name, folder in ROOTS.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_namespace_packages(folder, exclude=["*__pycache__*"])]

setup(packages=packages, package_dir=ROOTS)
