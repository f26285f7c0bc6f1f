import os

import pytest
import torch

# Two cores on CI: keep torch from oversubscribing them when tests run beside servers.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def _idle_job(module):
    """The module's IDLE_JOB (tests/idle_jobs.py), or None."""
    return getattr(module, "IDLE_JOB", None)


def pytest_collection_modifyitems(config, items):
    """Modules with an IDLE_JOB run last, so that their jobs get the whole session's idle time."""
    items.sort(key=lambda item: _idle_job(getattr(item, "module", None)) is not None)


@pytest.fixture(scope="session", autouse=True)
def idle_jobs(request, tmp_path_factory):
    """The selected modules' IDLE_JOB chains (tests/idle_jobs.py), started at the session's
    first test on CPU time the other tests leave idle, and stopped when the session ends."""
    from tests.idle_jobs import IdleJobs

    jobs = IdleJobs()
    modules = {m.__name__: m for m in (getattr(item, "module", None) for item in request.session.items) if m}
    for name, module in modules.items():  # in the order the session runs them
        if _idle_job(module) is not None:
            jobs.add(name, _idle_job(module), tmp_path_factory.mktemp(name.rsplit(".", 1)[-1]))
    jobs.start()
    yield jobs
    jobs.stop()


@pytest.fixture(scope="session")
def default_model_path():
    from quantpipe.runtime.model.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_default(default_model_path):
    """HF transformers' own reading of the default GGUF, in float32: the numerical reference."""
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run every request to its max_new_tokens
    return model


@pytest.fixture(scope="session")
def default_hf_dir(tmp_path_factory):
    """The default model exported as a plain HF folder (float32 safetensors + tokenizer)."""
    from quantpipe.runtime.model.export import export_hf
    from quantpipe.runtime.model.loader import load_model

    model, _, tokenizer = load_model(None, torch.float32)
    return export_hf(model, tokenizer, str(tmp_path_factory.mktemp("smollm2-hf")))


@pytest.fixture(scope="session")
def corpus_prompts():
    """Real English text of varied length, cut from Python's own documentation."""
    from pydoc_data.topics import topics

    texts = [topics[k] for k in sorted(topics)]
    return [t for t in texts if len(t) > 200]


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: list[int]) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt. Prompts of one length run as one
    batch, without padding, for as many tokens as the longest request of the batch, each row
    then cut to its own count: every row is what it would be alone (greedy tokens do not
    depend on how many follow; float32 rows differ at most in summation order), and a model
    that reads all its weights per decode step does so once per batch, not once per prompt."""
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(prompts):
        by_length.setdefault(len(ids), []).append(i)
    out: list[list[int]] = [[] for _ in prompts]
    with torch.no_grad():
        for n, rows in by_length.items():
            batch = torch.tensor([prompts[i] for i in rows])
            gen = model.generate(batch, max_new_tokens=max(max_new_tokens[i] for i in rows), do_sample=False,
                                 pad_token_id=0, attention_mask=torch.ones_like(batch))
            for i, row in zip(rows, gen):
                out[i] = row[n:n + max_new_tokens[i]].tolist()
    return out


@pytest.fixture(scope="session")
def sample_set(tmp_path_factory):
    """The calibration set of the shipped sample log (calib_sets/recipes/sample.yaml)."""
    from quantpipe.calibrate import CalibConfig, calibrate

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path_factory.mktemp("calib") / "sample-set"
    cwd = os.getcwd()
    os.chdir(root)  # the recipe names its log relative to the project
    try:
        calibrate(CalibConfig.from_recipe(os.path.join("calib_sets", "recipes", "sample.yaml"), out=str(out)))
    finally:
        os.chdir(cwd)
    return str(out)


@pytest.fixture(scope="session")
def w8a16_artifact(tmp_path_factory):
    """The default model as a W8A16 (RTN, per channel) artifact; tests copy it before changing it."""
    from quantpipe.quantize import QuantConfig, quantize

    return str(quantize(None, QuantConfig(scheme="W8A16"), None, str(tmp_path_factory.mktemp("w8") / "w8a16")).path)


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory):
    """quantpipe built as a (non-editable) wheel and installed on its own into a folder:
    (wheel path, install folder, the build's output)."""
    import shutil
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tmp = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools builds in the source tree (build/), and a build/ left
    # there by an earlier layout would put stale modules into the wheel.
    src = tmp / "src"
    shutil.copytree(root, src, ignore=shutil.ignore_patterns(
        ".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis",
        "artifacts", "reports", "bench-results", ".quantpipe", "results", "*-set"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp), str(src)],
                          check=True, capture_output=True, text=True)
    (wheel,) = tmp.glob("*.whl")
    site = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    return wheel, site, proc.stdout + proc.stderr


@pytest.fixture(scope="session")
def quantized_rungs(tmp_path_factory, sample_set):
    """The pipeline's quantize step run here on a plain candidate, the 5- and 6-bit mixed
    rungs and a rung with another probe (tests/test_pipeline.py::quantize_step): the
    mixed-rung test reads it, and the Ray test compares its own run with it."""
    from tests.test_pipeline import PROBE, RUNGS, quantize_step

    return quantize_step(tmp_path_factory.mktemp("rungs") / "local", sample_set,
                         RUNGS + [dict(PROBE, bits_budget=6.0, sensitivity_tokens=8, name="other-probe")])
