"""`quantpipe canary`: @champion and @candidate behind one endpoint, driven by the official
`openai` client. A healthy candidate is promoted; a candidate whose weights were broken
on purpose is rolled back automatically while traffic runs, and both decisions are in
the registry."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from quantpipe.gate import Rule
from quantpipe.manifest import StageError
from quantpipe.registry import promote, publish
from quantpipe.registry.canary import Canary, CanaryPolicy, load_canary_policy, parse_duration
from tests.registry.test_registry import verdict_for
from tests.server.test_process import alive, proc_stat

mlflow = pytest.importorskip("mlflow")
openai = pytest.importorskip("openai")
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["What is the capital of France?", "Name three primary colors.", "Say hello in Spanish.",
           "What is 2 plus 2?", "Write a haiku about rain.", "What does a CPU do?", "Define the word 'river'.",
           "Give me a synonym for happy.", "What is the boiling point of water?", "Who wrote Hamlet?"]


def _servers_of(pid: int) -> list[int]:
    """Pids of the runtime servers whose parent is `pid` (from /proc)."""
    out = []
    for entry in Path("/proc").glob("[0-9]*"):
        fields = proc_stat(entry.name)
        if fields is None or int(fields[1]) != pid:
            continue
        try:
            if b"quantpipe.runtime.server" in (entry / "cmdline").read_bytes():
                out.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _broken_copy(artifact: str, dst: Path) -> str:
    """The artifact with every weight scale scrambled: it loads and serves, and says nonsense."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(artifact, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        g = torch.Generator().manual_seed(0)
        for k, v in tensors.items():
            if k.endswith("weight_scale"):
                tensors[k] = (v.float() * torch.rand(v.shape, generator=g) * 4).to(v.dtype)
        save_file(tensors, f, metadata={"format": "pt"})
    return str(dst)


class Traffic:
    """Chat conversations through the official client until stopped; remembers which side served each.

    Each client pauses `PAUSE_S` after every answer, as users between turns do: the servers
    are busy part of the time rather than all of it, so the canary's one-at-a-time mirrored
    pairs are not queued behind a saturated side, and the rest of the suite gets the CPU
    time a closed loop of back-to-back requests would take."""

    PAUSE_S = 0.5

    def __init__(self, url: str):
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        self.sides: list[tuple[float, str, str]] = []  # (time the request was sent, conversation, side)
        self.errors: list[tuple[float, str]] = []  # (time sent, error) of requests that failed
        self.log: list[list[str]] = [[], []]  # per thread, in order: "ok", "connection" or "status: ..."
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(2)]

    def _run(self, k: int) -> None:
        i = k
        while not self.stop.is_set():
            conv = f"conversation-{i % 40}"
            sent = time.monotonic()
            try:
                raw = self.client.chat.completions.with_raw_response.create(
                    model="smol", messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                    max_tokens=8, temperature=0.7, stream=True, user=conv)
                for _ in raw.parse():
                    pass
                self.sides.append((sent, conv, raw.headers.get("x-canary-side")))
                self.log[k].append("ok")
                self.stop.wait(self.PAUSE_S)
            except (openai.APIError, httpx.HTTPError) as e:
                self.errors.append((sent, repr(e)))
                refused = (isinstance(e, openai.APIConnectionError) and not isinstance(e, openai.APITimeoutError)) or (
                    isinstance(e, httpx.TransportError) and not isinstance(e, httpx.TimeoutException))
                self.log[k].append("connection" if refused else f"status: {e!r}"[:300])
                if self.stop.is_set():
                    return
                time.sleep(0.2)
            i += 2

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(90)

    def assert_served_until_shutdown(self) -> None:
        """Every request answered while the router was up: no error of any kind but a refused
        connection, and those only as each client's last requests (the router had exited)."""
        for k, log in enumerate(self.log):
            assert not [e for e in log if e.startswith("status")], (k, [e for e in log if e.startswith("status")][:3])
            tail = len(log)
            while tail and log[tail - 1] == "connection":
                tail -= 1
            assert "connection" not in log[:tail], (k, log)


def _canary(registry: str, name: str, port: int, policy: Path, duration: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "quantpipe", "canary", name, "--registry-uri", registry, "--fraction", "0.5",
         "--duration", duration, "--policy", str(policy), "--port", str(port), "--mirror-fraction", "1.0", *extra,
         # float32 on every CPU: dtype auto serves bf16 where the CPU has AVX-512 BF16, and
         # bf16 greedy output depends on batch composition, so identical weights on the two
         # sides would not give identical mirrored completions there.
         "--server-arg=--max-num-seqs=4", "--server-arg=--dtype=float32"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))


def _wait_ready(url: str, proc: subprocess.Popen) -> None:
    end = time.monotonic() + 300
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read()[-3000:])
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("the canary did not come up")


@pytest.fixture(scope="module")
def registry(tmp_path_factory, w8a16_artifact):
    """A registry where v1 (W8A16) is champion; each test publishes its candidate."""
    folder = tmp_path_factory.mktemp("canary")
    uri = f"sqlite:///{folder / 'registry.db'}"
    publish(w8a16_artifact, verdict_for(w8a16_artifact, folder / "r1"), "smol", uri)
    promote("smol", 1, uri)
    return uri, folder


# The healthy canary's window: it ends once every rule has this many observations (24
# mirrored pairs: two flipped near-ties still leave the agreement above 0.9).
UNTIL = 24


def _policy(tmp_path: Path) -> Path:
    # The default canary policy's rules, judged after fewer samples (a short test window).
    doc = load_canary_policy()
    p = tmp_path / "canary.yaml"
    p.write_text(json.dumps({"name": "test", "min_samples": 4,
                             "rules": [{"metric": r.metric, "op": r.op, "threshold": r.threshold} for r in doc.rules
                                       if not r.metric.endswith("_ratio")]}))
    return p


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_healthy_candidate_is_promoted(registry, w8a16_artifact, tmp_path):
    uri, folder = registry
    healthy = shutil.copytree(w8a16_artifact, tmp_path / "w8-again")
    v = publish(str(healthy), verdict_for(str(healthy), tmp_path / "r"), "smol", uri)["version"]
    port = _free_port()
    # The window ends once every rule stands on UNTIL observations, however long the
    # traffic takes to bring them (a fixed 40 s or 60 s window once ended inconclusive on a
    # loaded 2-core machine); the 600 s --duration only bounds a canary that sees none.
    proc = _canary(uri, "smol", port, _policy(tmp_path), "600s", f"--until-samples={UNTIL}")
    _wait_ready(f"http://127.0.0.1:{port}", proc)
    with Traffic(f"http://127.0.0.1:{port}") as traffic:
        out, err = proc.communicate(timeout=700)
    assert proc.returncode == 0, (out[-2000:], err[-2000:])
    assert f"smol: promoted version {v}" in out, out
    assert f"every rule had {UNTIL} observations before the 600 s window ended" in out, out
    traffic.assert_served_until_shutdown()
    print(out)
    sides = {s for _, _, s in traffic.sides}
    assert sides == {"champion", "candidate"}
    # Sticky: a conversation is always served by the same side.
    by_conv: dict[str, set] = {}
    for _, conv, side in traffic.sides:
        by_conv.setdefault(conv, set()).add(side)
    assert all(len(s) == 1 for s in by_conv.values()), by_conv
    client = mlflow.tracking.MlflowClient(tracking_uri=uri, registry_uri=uri)
    assert str(client.get_model_version_by_alias("smol", "champion").version) == str(v)
    assert str(client.get_model_version_by_alias("smol", "previous").version) == "1"
    tags = client.get_model_version("smol", str(v)).tags
    assert tags["quantpipe.canary.decision"] == "promoted"
    metrics = json.loads(tags["quantpipe.canary.metrics"])["metrics"]
    assert metrics["mirrored"] >= UNTIL and metrics["candidate_requests"] >= UNTIL, metrics
    # Identical weights on both sides, float32: mirrored greedy completions agree (a rare
    # near-tie may flip one token when the two sides batch it with different requests).
    assert metrics["greedy_agreement"] >= 0.9 and metrics["error_rate"] == 0.0
    # Put v1 back as champion for the next test.
    promote("smol", 1, uri, "test reset")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_broken_candidate_is_rolled_back_while_traffic_runs(registry, w8a16_artifact, tmp_path):
    uri, folder = registry
    client = mlflow.tracking.MlflowClient(tracking_uri=uri, registry_uri=uri)
    champion = str(client.get_model_version_by_alias("smol", "champion").version)
    broken = _broken_copy(w8a16_artifact, tmp_path / "w8-broken")
    v = publish(broken, verdict_for(broken, tmp_path / "r"), "smol", uri)["version"]
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _canary(uri, "smol", port, _policy(tmp_path), "120s")
    _wait_ready(url, proc)
    with Traffic(url) as traffic:
        end = time.monotonic() + 240
        status = httpx.get(url + "/canary").json()
        while status["breach"] is None and time.monotonic() < end:
            time.sleep(0.25)
            status = httpx.get(url + "/canary").json()
        breach_seen = time.monotonic()
        assert status["breach"] is not None, status
        assert status["breach"]["failed"] == ["greedy_agreement >= 0.5"], status["breach"]
        print(json.dumps({k: status["breach"][k] for k in ("after_s", "metrics")}))
        # Let a few requests be sent after the breach (a fixed pause saw none on a loaded machine).
        wait_until = time.monotonic() + 60
        while sum(t > breach_seen for t, _, _ in traffic.sides) < 4 and time.monotonic() < wait_until:
            time.sleep(0.25)
    # Every request sent after the router reported the breach went to the champion (it
    # stops routing to the candidate before it reports the breach).
    late = [side for t, _, side in traffic.sides if t > breach_seen]
    assert late and set(late) == {"champion"}, (late, traffic.errors[-5:])
    # The candidate's answers are garbage, not errors: the canary still never failed a request.
    traffic.assert_served_until_shutdown()
    assert any(side == "candidate" for t, _, side in traffic.sides if t < breach_seen)
    # The decision is in the registry before the window ends, and the champion never moved.
    tags = client.get_model_version("smol", str(v)).tags
    assert tags["quantpipe.canary.decision"] == "rolled_back"
    assert "greedy_agreement" in tags["quantpipe.canary.reason"]
    assert str(client.get_model_version_by_alias("smol", "champion").version) == champion
    servers = _servers_of(proc.pid)
    assert len(servers) == 2  # champion and candidate
    if len(os.sched_getaffinity(0)) >= 2:  # each side on its own CPUs, one compute thread per CPU
        cpus = [os.sched_getaffinity(pid) for pid in servers]
        assert cpus[0] and cpus[1] and not cpus[0] & cpus[1], cpus
        for pid, own in zip(servers, cpus):
            assert f"OMP_NUM_THREADS={len(own)}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    proc.terminate()
    proc.wait(60)
    # A terminated canary takes its servers with it (uvicorn re-raises the SIGTERM it handled).
    assert not [pid for pid in servers if alive(pid)], "a canary server outlived the canary"


def test_canary_refuses_bad_input(registry):
    uri, _ = registry
    policy = CanaryPolicy([Rule("error_rate", "point", "<=", 0.0)], 1, "t", "t")
    with pytest.raises(StageError, match=r"--fraction must be in \(0, 1\)"):
        Canary({"champion": "http://x", "candidate": "http://y"}, 1.5, policy)
    with pytest.raises(StageError, match="--duration must be a positive time"):
        parse_duration("ten minutes")
    assert parse_duration("10m") == 600 and parse_duration("90s") == 90 and parse_duration("2") == 2
    from quantpipe.registry.canary import run_canary

    with pytest.raises(StageError, match="'nosuch' has no alias 'champion'"):
        run_canary("nosuch", uri, 0.1, 10)
    with pytest.raises(StageError, match=r"--until-samples must be an integer >= the policy's min_samples \(8, "):
        run_canary("smol", uri, 0.1, 10, until_samples=7)  # the default policy's min_samples is 8


def test_observations_per_rule_end_the_window_only_when_every_rule_has_enough():
    rules = [Rule("greedy_agreement", "point", ">=", 0.5), Rule("ttft_p99_ratio", "point", "<=", 1.5)]
    canary = Canary({"champion": "http://x", "candidate": "http://y"}, 0.5, CanaryPolicy(rules, 2, "t", "t"))
    champion, candidate = canary.stats["champion"], canary.stats["candidate"]
    canary.agreement = [1.0, 0.0, 1.0]
    candidate.ttft, champion.ttft = [0.1, 0.2, 0.3], [0.1]
    candidate.requests = 3
    counts = canary.observations()
    assert counts["greedy_agreement"] == 3 and counts["ttft_p99_ratio"] == 1 and counts["error_rate"] == 3
    assert canary.metrics()["ttft_p99_ratio"] is None and canary.metrics()["greedy_agreement"] == pytest.approx(2 / 3)
    assert not canary.observed(2)  # the champion's latency has 1 observation
    champion.ttft.append(0.2)
    assert canary.observed(2) and not canary.observed(3) and canary.metrics()["ttft_p99_ratio"] is not None
