"""`quantpipe canary NAME`: @champion and @candidate behind one OpenAI-compatible endpoint.

A router forwards each request to one of two runtime servers: a fixed share of
conversations (sticky: the same conversation always lands on the same side) goes to the
candidate. For every request it records what the client saw (time to first streamed
token, time per output token, errors, timeouts), and for a sample it mirrors the
prompt, greedy and short, to both sides and compares the completions. Twice a second
the canary policy (evals/gates/canary.yaml) is judged on the candidate's numbers
against the champion's: a breach stops routing to the candidate at once (the champion
stays champion: that is the rollback), and the decision with its numbers is written to
the candidate's version tags. If the window ends (at --duration, or once every rule stands
on --until-samples observations) with every rule judged and passed, the candidate is
promoted to champion; too little traffic to judge promotes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import random
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

import quantpipe.evals
from quantpipe.gate import OPS, Rule, parse_rules
from quantpipe.manifest import StageError, read_yaml
from quantpipe.runtime.server.errors import error_body, error_response

log = logging.getLogger("quantpipe.canary")
DEFAULT_CANARY_POLICY = Path(quantpipe.evals.__file__).resolve().parent / "gates" / "canary.yaml"
METRICS = ("ttft_p99_ratio", "tpot_p99_ratio", "error_rate", "timeout_rate", "greedy_agreement")
SIDES = ("champion", "candidate")


@dataclass
class CanaryPolicy:
    rules: list[Rule]  # compare is always "point": the live numbers have no CI
    min_samples: int
    name: str
    path: str


def load_canary_policy(path: str | None = None) -> CanaryPolicy:
    path = str(path or DEFAULT_CANARY_POLICY)
    data = read_yaml(path, "--policy")
    rules = parse_rules(data, path, lambda m: m in METRICS, f"be one of {', '.join(METRICS)}", ("point",))
    n = data.get("min_samples", 8)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise StageError(f"--policy {path}: min_samples must be an integer >= 1; got {n!r}")
    return CanaryPolicy(rules, n, data.get("name", Path(path).stem), path)


@dataclass
class SideStats:
    """What one side's clients saw, request by request."""

    requests: int = 0
    errors: int = 0
    timeouts: int = 0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98] if len(values) > 1 else values[0]


class Canary:
    """The routing state and the live judgement; the HTTP app below drives it."""

    def __init__(self, urls: dict[str, str], fraction: float, policy: CanaryPolicy, mirror_fraction: float = 0.25,
                 mirror_tokens: int = 8, request_timeout_s: float = 60.0, seed: int = 0, served_name: str = "model",
                 model_ids: dict[str, str] | None = None):
        if not 0 < fraction < 1:
            raise StageError(f"--fraction must be in (0, 1); got {fraction}")
        if not 0 <= mirror_fraction <= 1:
            raise StageError(f"--mirror-fraction must be in [0, 1]; got {mirror_fraction}")
        self.urls, self.fraction, self.policy = urls, fraction, policy
        # Clients name one model (the registered name); each side is asked for its own id.
        self.served_name, self.model_ids = served_name, model_ids or {}
        self.mirror_fraction, self.mirror_tokens = mirror_fraction, mirror_tokens
        self.stats = {s: SideStats() for s in SIDES}
        self.agreement: list[float] = []
        self.routing = True  # False once a rule is breached: every request goes to the champion
        self.breach: dict | None = None
        self.started = time.monotonic()
        self._rng = random.Random(seed)
        self._mirrors: set[asyncio.Task] = set()
        self._mirror_slot = asyncio.Semaphore(1)  # one mirrored pair at a time: the sample adds little load
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=5.0))

    # -- routing ---------------------------------------------------------------
    def side_for(self, body: dict, headers) -> str:
        """Sticky per conversation: a hash of its id (header, `user`, or its first message)."""
        if not self.routing:
            return "champion"
        key = headers.get("x-conversation-id") or body.get("user")
        if not key:
            msgs = body.get("messages")
            key = json.dumps(msgs[0], sort_keys=True) if isinstance(msgs, list) and msgs else str(body.get("prompt"))
        bucket = int.from_bytes(hashlib.sha256(str(key).encode()).digest()[:8], "big") / 2**64
        return "candidate" if bucket < self.fraction else "champion"

    # -- live metrics ------------------------------------------------------------
    def observations(self) -> dict[str, int]:
        """How many observations each metric stands on: a latency ratio on the fewer of the
        two sides' requests, the rates on the candidate's requests, the agreement on the
        mirrored pairs."""
        c, b = self.stats["candidate"], self.stats["champion"]
        return {"ttft_p99_ratio": min(len(c.ttft), len(b.ttft)), "tpot_p99_ratio": min(len(c.tpot), len(b.tpot)),
                "error_rate": c.requests, "timeout_rate": c.requests, "greedy_agreement": len(self.agreement)}

    def metrics(self) -> dict:
        """Each metric's value once it has `min_samples` observations, else None."""
        c, b = self.stats["candidate"], self.stats["champion"]
        enough = {k: n >= self.policy.min_samples for k, n in self.observations().items()}
        out: dict = {"candidate_requests": c.requests, "champion_requests": b.requests,
                     "mirrored": len(self.agreement)}
        for key, attr in (("ttft_p99_ratio", "ttft"), ("tpot_p99_ratio", "tpot")):
            cv, bv = getattr(c, attr), getattr(b, attr)
            out[key] = _p99(cv) / _p99(bv) if enough[key] and _p99(bv) > 0 else None
        out["error_rate"] = c.errors / c.requests if enough["error_rate"] else None
        out["timeout_rate"] = c.timeouts / c.requests if enough["timeout_rate"] else None
        out["greedy_agreement"] = sum(self.agreement) / len(self.agreement) if enough["greedy_agreement"] else None
        return out

    def observed(self, samples: int) -> bool:
        """Whether every rule's metric has at least `samples` observations."""
        counts = self.observations()
        return all(counts[r.metric] >= samples for r in self.policy.rules)

    def judge(self) -> tuple[list[dict], dict]:
        m = self.metrics()
        rows = []
        for r in self.policy.rules:
            v = m[r.metric]
            result = "not_yet" if v is None else ("pass" if OPS[r.op](v, r.threshold) else "fail")
            rows.append({"rule": r.describe(), "metric": r.metric, "value": v, "result": result})
        return rows, m

    def check(self) -> dict | None:
        """Stop routing to the candidate on the first breached rule; returns the breach."""
        if not self.routing:
            return self.breach
        rows, m = self.judge()
        failed = [r for r in rows if r["result"] == "fail"]
        if failed:
            self.routing = False
            self.breach = {"rules": rows, "metrics": m, "after_s": round(time.monotonic() - self.started, 2),
                           "failed": [r["rule"] for r in failed]}
            log.warning("canary: %s breached after %.1f s: routing everything to the champion",
                        ", ".join(self.breach["failed"]), self.breach["after_s"])
        return self.breach

    # -- proxying ------------------------------------------------------------------
    async def forward(self, path: str, body: dict, headers) -> Response:
        asked = body.get("model")
        if asked not in (None, self.served_name):
            return error_response(404, f"model {asked!r} is not served here; this endpoint serves "
                                       f"{self.served_name!r}", param="model", code="model_not_found")
        side = self.side_for(body, headers)
        body = {**body, "model": self.model_ids.get(side, asked)}
        url = self.urls[side] + path
        fwd = {k: v for k, v in headers.items() if k.lower() in ("authorization", "content-type")}
        stats = self.stats[side]
        stats.requests += 1
        t0 = time.monotonic()
        try:
            if body.get("stream"):
                return await self._stream(url, body, fwd, stats, t0, side)
            r = await self.client.post(url, json=body, headers=fwd)
        except httpx.TimeoutException:
            stats.timeouts += 1
            stats.errors += 1
            return error_response(504, f"the {side} server timed out", code="upstream_timeout")
        except httpx.HTTPError as e:
            stats.errors += 1
            return error_response(502, f"the {side} server is unreachable: {e}", code="upstream_unreachable")
        if r.status_code >= 500:
            stats.errors += 1
        elif r.status_code == 200:
            done = time.monotonic() - t0
            tokens = (r.json().get("usage") or {}).get("completion_tokens") or 0
            if tokens:
                stats.tpot.append(done / tokens)
        self._maybe_mirror(path, body)
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"),
                        headers={"x-canary-side": side})

    async def _stream(self, url, body, fwd, stats: SideStats, t0: float, side: str) -> Response:
        req = self.client.build_request("POST", url, json=body, headers=fwd)
        resp = await self.client.send(req, stream=True)
        if resp.status_code != 200:
            content = await resp.aread()
            await resp.aclose()
            if resp.status_code >= 500:
                stats.errors += 1
            return Response(content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))

        async def relay():
            first = last = None
            chunks = 0
            try:
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        if '"error"' in line[:20]:
                            stats.errors += 1
                        elif _has_text(line):
                            last = time.monotonic()
                            first = first or last
                            chunks += 1
                    yield line + "\n"
            except httpx.TimeoutException:
                stats.timeouts += 1
                stats.errors += 1
                yield "data: " + json.dumps(error_body(504, f"the {side} server timed out", code="upstream_timeout")) + "\n\n"
            except httpx.HTTPError as e:
                stats.errors += 1
                yield "data: " + json.dumps(error_body(502, f"the {side} server failed: {e}", code="upstream_failed")) + "\n\n"
            finally:
                await resp.aclose()
            if first is not None:
                stats.ttft.append(first - t0)
                if chunks > 1:
                    stats.tpot.append((last - first) / (chunks - 1))
            self._maybe_mirror(url.removeprefix(self.urls[side]), body)

        return StreamingResponse(relay(), media_type="text/event-stream", headers={"x-canary-side": side})

    # -- mirrored greedy agreement ---------------------------------------------------
    def _maybe_mirror(self, path: str, body: dict) -> None:
        if not self.routing or self._rng.random() >= self.mirror_fraction:
            return
        task = asyncio.get_running_loop().create_task(self._mirror(path, body))
        self._mirrors.add(task)
        task.add_done_callback(self._mirrors.discard)

    async def _mirror(self, path: str, body: dict) -> None:
        greedy = {k: v for k, v in body.items() if k in ("prompt", "messages")}
        greedy.update(temperature=0.0, max_tokens=self.mirror_tokens, stream=False)
        async with self._mirror_slot:
            try:
                outs = [await self.client.post(self.urls[s] + path, json={**greedy, "model": self.model_ids.get(s)})
                        for s in SIDES]
            except httpx.HTTPError:
                return  # the request itself already counted any failure
            if all(o.status_code == 200 for o in outs):
                texts = [_completion_text(o.json()) for o in outs]
                self.agreement.append(float(texts[0] == texts[1]))

    async def aclose(self) -> None:
        for t in list(self._mirrors):
            t.cancel()
        await self.client.aclose()


def _has_text(line: str) -> bool:
    try:
        chunk = json.loads(line[6:])
    except ValueError:
        return False
    for c in chunk.get("choices") or []:
        if c.get("text") or (c.get("delta") or {}).get("content"):
            return True
    return False


def _completion_text(doc: dict) -> str:
    c = (doc.get("choices") or [{}])[0]
    return c.get("text") if "text" in c else (c.get("message") or {}).get("content") or ""


def router_app(canary: Canary) -> FastAPI:
    app = FastAPI(title="quantpipe canary")

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def proxy(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object")
        return await canary.forward(request.url.path, body, request.headers)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": canary.served_name, "object": "model", "owned_by": "quantpipe"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "routing_to_candidate": canary.routing}

    @app.get("/canary")
    async def status():
        rows, m = canary.judge()
        return {"routing_to_candidate": canary.routing, "fraction": canary.fraction, "rules": rows, "metrics": m,
                "breach": canary.breach}

    return app


def parse_duration(text: str) -> float:
    """'90', '90s', '10m', '1h' -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    t = str(text).strip().lower()
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        value = -1
    if not value > 0:
        raise StageError(f"--duration must be a positive time such as 90s, 10m or 1h; got {text!r}")
    return value


def _record(client, name: str, version: str, decision: str, reason: str, detail: dict) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for key, value in (("decision", decision), ("at", stamp), ("reason", reason),
                       ("metrics", json.dumps(detail, sort_keys=True, default=str)[:4900])):
        client.set_model_version_tag(name, version, f"quantpipe.canary.{key}", value)


def run_canary(name: str, registry_uri: str, fraction: float, duration_s: float, policy_path: str | None = None,
               host: str = "127.0.0.1", port: int = 8000, mirror_fraction: float = 0.25, mirror_tokens: int = 8,
               request_timeout_s: float = 60.0, server_args: list[str] | None = None,
               until_samples: int | None = None) -> dict:
    """Serve the canary for `duration_s`, or until every rule's metric has `until_samples`
    observations if that comes first; returns the decision (promoted, rolled_back,
    inconclusive)."""
    from quantpipe.registry.publish import _alias_version, _client, resolve_model_uri
    from quantpipe.runtime.server.process import Served, ServerStartError, split_cpus

    policy = load_canary_policy(policy_path)
    if until_samples is not None and (isinstance(until_samples, bool) or not isinstance(until_samples, int)
                                      or until_samples < policy.min_samples):
        raise StageError(f"--until-samples must be an integer >= the policy's min_samples ({policy.min_samples}, "
                         f"{policy.path}); got {until_samples!r}")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request otherwise
    client = _client(registry_uri)
    versions = {s: _alias_version(client, name, s) for s in SIDES}
    for side, v in versions.items():
        if v is None:
            raise StageError(f"model {name!r} has no alias {side!r} in {registry_uri}")
    if versions["champion"] == versions["candidate"]:
        raise StageError(f"model {name!r}: champion and candidate are both version {versions['champion']}")
    folders = {s: resolve_model_uri(f"models:/{name}/{v}", registry_uri) for s, v in versions.items()}
    # uvicorn shuts the router down on SIGTERM and then raises the signal again; as an
    # exception it unwinds the servers' context managers instead of killing the process.
    # Both sides run on this host at once: each gets its own half of the CPUs, or their
    # thread pools fight over every core and each side's latency measures the other's load.
    cpus = dict(zip(SIDES, split_cpus(len(SIDES))))
    try:
        with _sigterm_as_exit(), Served(folders["champion"], extra_args=server_args, cpus=cpus["champion"]) as champ, \
                Served(folders["candidate"], extra_args=server_args, cpus=cpus["candidate"]) as cand:
            urls = {"champion": champ.url, "candidate": cand.url}
            ids = {s: httpx.get(u + "/v1/models", timeout=10).json()["data"][0]["id"] for s, u in urls.items()}
            canary = Canary(urls, fraction, policy, mirror_fraction, mirror_tokens, request_timeout_s,
                            served_name=name, model_ids=ids)
            log.info("canary: %s v%s (champion) and v%s (candidate, %.0f%% of conversations) on http://%s:%d",
                     name, versions["champion"], versions["candidate"], 100 * fraction, host, port)
            if cpus["champion"] is not None:
                log.info("canary: CPUs %s serve the champion, %s the candidate",
                         _cpu_list(cpus["champion"]), _cpu_list(cpus["candidate"]))
            outcome = asyncio.run(_serve(canary, client, name, versions["candidate"], registry_uri, duration_s,
                                         host, port, until_samples))
    except ServerStartError as e:
        raise StageError(str(e)) from None
    if not outcome:
        raise StageError("the canary was stopped before its window ended: no decision, nothing changed")
    return {"name": name, **{f"{s}_version": int(v) for s, v in versions.items()}, **outcome}


def _cpu_list(cpus: frozenset[int]) -> str:
    return ",".join(map(str, sorted(cpus)))


@contextlib.contextmanager
def _sigterm_as_exit():
    if threading.current_thread() is not threading.main_thread():  # only the main thread takes signals
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


async def _serve(canary: Canary, client, name: str, version: str, registry_uri: str, duration_s: float,
                 host: str, port: int, until_samples: int | None = None) -> dict:
    import uvicorn

    from quantpipe.registry.publish import promote

    server = uvicorn.Server(uvicorn.Config(router_app(canary), host=host, port=port, log_level="warning"))
    outcome: dict = {}

    async def record(decision: str, reason: str, detail: dict) -> None:
        await asyncio.to_thread(_record, client, name, version, decision, reason, detail)
        outcome.update(decision=decision, reason=reason, **detail)

    def window_ended() -> bool:
        """At --duration; or, before any breach, once every rule stands on --until-samples
        observations (a breach keeps the champion serving until --duration)."""
        return time.monotonic() - canary.started >= duration_s or (
            until_samples is not None and not outcome and canary.observed(until_samples))

    async def decide() -> None:
        ended = False
        while not server.should_exit:
            breach = canary.check()
            if breach and not outcome:  # the rollback: the champion serves everything from now on
                await record("rolled_back", "breached " + ", ".join(breach["failed"]), breach)
            if ended := window_ended():
                break
            await asyncio.sleep(0.5)
        if not outcome and ended:
            rows, m = canary.judge()
            pending = [r["rule"] for r in rows if r["result"] == "not_yet"]
            if pending:
                await record("inconclusive", "not enough traffic to judge " + ", ".join(pending),
                             {"rules": rows, "metrics": m})
            else:
                elapsed = time.monotonic() - canary.started
                reason = f"canary passed policy {canary.policy.name} over {elapsed:.0f} s"
                if until_samples is not None and elapsed < duration_s:
                    reason += f": every rule had {until_samples} observations before the {duration_s:g} s window ended"
                await asyncio.to_thread(promote, name, version, registry_uri, reason)
                await record("promoted", reason, {"rules": rows, "metrics": m})
        server.should_exit = True

    task = asyncio.get_running_loop().create_task(decide())
    try:
        await server.serve()
    finally:
        if not task.done():
            task.cancel()
        await canary.aclose()
    return outcome
