"""`quantpipe gate`: the policy gate (quantpipe.gate) or, with --against, the regression
gate (quantpipe.regression), which is built on the policy gate's rules."""

from __future__ import annotations

import click

from quantpipe.gate import DEFAULT_POLICY, gate
from quantpipe.manifest import StageError
from quantpipe.regression import against

MARK = {"pass": "PASS", "fail": "FAIL", "cannot_judge": "N/A ", "skipped": "skip"}


@click.command("gate", help="Judge an eval report against a gate policy (or, with --against, against committed "
                            "reference results); exit 0 pass, 1 fail, 2 cannot judge.")
@click.argument("report_dir")
@click.option("--policy", default=None, help="gate policy  [default: evals/gates/default.yaml]")
@click.option("--candidate", default=None, help="candidate name in a report with several")
@click.option("--artifact", default=None, help="artifact folder: refuse to judge unless it is the evaluated one")
@click.option("--against", "against_path", default=None,
              help="regression gate: a baseline file (evals/baselines/NAME.yaml); judges every candidate it names")
@click.option("--record", is_flag=True, help="with --against: write this report's values as the new references")
@click.option("--out", default=None, help="verdict file [default: REPORT_DIR/verdict.json, or regression.json]")
def gate_command(report_dir, policy, candidate, artifact, against_path, record, out) -> int:
    try:
        if against_path:
            if policy or candidate or artifact:
                raise StageError("--against judges every candidate against its references; it takes no "
                                 "--policy, --candidate or --artifact")
            code, doc = against(report_dir, against_path, out, write=record)
        elif record:
            raise StageError("--record needs --against (the baseline file to record into)")
        else:
            code, doc = gate(report_dir, policy or str(DEFAULT_POLICY), candidate, artifact, out)
    except StageError as e:
        click.echo(f"quantpipe gate: {e}", err=True)
        return 2
    for r in doc["rules"]:
        value = f"{r['value']:.4g}" if "value" in r else r.get("reason", "")
        who = f"{r['candidate']}: " if "candidate" in r else ""
        click.echo(f"{MARK[r['result']]}  {who}{r['metric']} ({r['compare']}) = {value}  [{r['op']} {r['threshold']:.4g}]")
    for p in doc["problems"]:
        click.echo(f"N/A   {p}")
    if against_path:
        click.echo(f"verdict: {doc['verdict']} (against {against_path})")
    else:
        click.echo(f"verdict: {doc['verdict']} ({doc['candidate']['name']}, policy {doc['policy']['name']}, "
                   f"scope {doc['scope']})")
    return code
