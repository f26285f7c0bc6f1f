"""`quantpipe publish | promote | rollback | registry serve`."""

from __future__ import annotations

import os
import subprocess
import sys

import click

from quantpipe.manifest import StageError

registry_option = click.option("--registry-uri", default=None, show_default="sqlite:///.quantpipe/registry.db",
                               help="sqlite:///PATH or http://host:port [env: MLFLOW_TRACKING_URI]")


def _uri(given: str | None) -> str:
    from quantpipe.registry import resolve_registry_uri

    return resolve_registry_uri(given)


def _run(what: str, fn) -> int:
    try:
        fn()
    except StageError as e:
        click.echo(f"quantpipe {what}: {e}", err=True)
        return 2
    return 0


@click.command("publish", help="Register an artifact that passed its gate (alias candidate) in the MLflow registry.")
@click.argument("artifact")
@click.option("--verdict", "verdict", required=True, help="verdict.json from `quantpipe gate`")
@click.option("--name", required=True, help="registered model name")
@click.option("--policy", default=None, help="the project's gate policy [default: evals/gates/default.yaml]")
@click.option("--allow-partial", is_flag=True, help="publish a quality-only or latency-only verdict (tagged)")
@registry_option
def publish_command(artifact, verdict, name, policy, allow_partial, registry_uri) -> int:
    from quantpipe.registry import publish

    def go():
        r = publish(artifact, verdict, name, _uri(registry_uri), policy, allow_partial)
        click.echo(f"published {r['uri']} (alias candidate, run {r['run_id']}) in {r['registry_uri']}")

    return _run("publish", go)


@click.command("promote", help="Move alias champion to a version that passed its gate (the old one becomes previous).")
@click.argument("name")
@click.option("--version", required=True)
@click.option("--reason", default="")
@registry_option
def promote_command(name, version, reason, registry_uri) -> int:
    from quantpipe.registry import promote

    def go():
        r = promote(name, version, _uri(registry_uri), reason)
        click.echo(f"{name}: champion is version {r['champion']} (previous: {r['previous']})")

    return _run("promote", go)


@click.command("rollback", help="Move alias champion back to the previous champion, in one step.")
@click.argument("name")
@click.option("--reason", default="")
@registry_option
def rollback_command(name, reason, registry_uri) -> int:
    from quantpipe.registry import rollback

    def go():
        r = rollback(name, _uri(registry_uri), reason)
        click.echo(f"{name}: champion is version {r['champion']} again (rolled back {r['rolled_back']})")

    return _run("rollback", go)


EXIT_INCONCLUSIVE = 3  # distinct from 2, which click and every quantpipe command use for bad input


@click.command("canary", help="Serve @champion and @candidate behind one endpoint; roll back on a breach, "
                              "promote when the window passes. Exit 0 promoted, 1 rolled back, 2 bad input or "
                              "registry error (nothing served), 3 inconclusive (nothing changed).")
@click.argument("name")
@click.option("--fraction", type=float, default=0.1, show_default=True, help="share of conversations to the candidate")
@click.option("--duration", default="10m", show_default=True, help="the window: 90s, 10m, 1h")
@click.option("--until-samples", type=int, default=None,
              help="end the window early once every rule's metric has this many observations (at least the "
                   "policy's min_samples)  [default: the whole --duration]")
@click.option("--policy", default=None, help="canary policy  [default: evals/gates/canary.yaml]")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--mirror-fraction", type=float, default=0.25, show_default=True,
              help="share of requests mirrored, greedy, to both sides for the agreement check")
@click.option("--mirror-tokens", type=int, default=8, show_default=True)
@click.option("--request-timeout", type=float, default=60.0, show_default=True, help="seconds per upstream request")
@click.option("--server-arg", "server_args", multiple=True,
              help="passed to both `quantpipe serve` processes, e.g. --server-arg=--max-num-seqs=8")
@registry_option
def canary_command(name, fraction, duration, until_samples, policy, host, port, mirror_fraction, mirror_tokens,
                   request_timeout, server_args, registry_uri) -> int:
    import json

    from quantpipe.registry.canary import parse_duration, run_canary

    try:
        r = run_canary(name, _uri(registry_uri), fraction, parse_duration(duration), policy, host, port,
                       mirror_fraction, mirror_tokens, request_timeout, list(server_args), until_samples)
    except StageError as e:
        click.echo(f"quantpipe canary: {e}", err=True)
        return 2
    click.echo(json.dumps({k: r.get(k) for k in ("decision", "reason", "metrics", "after_s")}, default=str))
    click.echo(f"{name}: {r['decision']} version {r['candidate_version']} ({r['reason']}); champion is version "
               f"{r['candidate_version'] if r['decision'] == 'promoted' else r['champion_version']}")
    return {"promoted": 0, "rolled_back": 1}.get(r["decision"], EXIT_INCONCLUSIVE)


@click.group("registry", help="A team's MLflow registry server.")
def registry_group() -> None:
    pass


@registry_group.command("serve", help="Run `mlflow server` with a sqlite store and local artifacts on 127.0.0.1.")
@click.option("--port", type=int, default=5000, show_default=True)
@click.option("--dir", "folder", default=".quantpipe/server", show_default=True, help="store and artifacts")
def registry_serve(port, folder) -> int:
    os.makedirs(folder, exist_ok=True)
    db = os.path.abspath(os.path.join(folder, "registry.db"))
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
           "--backend-store-uri", f"sqlite:///{db}", "--artifacts-destination",
           os.path.abspath(os.path.join(folder, "artifacts")), "--workers", "1"]
    click.echo(f"mlflow server on http://127.0.0.1:{port} (store {db}); Ctrl-C stops it")
    proc = subprocess.Popen(cmd)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        return proc.wait(30)
