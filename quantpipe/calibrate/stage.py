"""`calibrate(CalibConfig) -> CalibSet`: production logs in, a stratified calibration set and a
disjoint held-out set out, with a manifest and a coverage report.

Two passes over the inputs keep memory flat for logs larger than RAM: the first
(`scan.first_pass`) keeps only a few numbers per record (where it is, its stratum,
conversation, token count and MinHash signature); the second re-reads just the records
that were sampled.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from quantpipe import distributed
from quantpipe.calibrate import clean, report, strata
from quantpipe.calibrate.config import CalibConfig
from quantpipe.calibrate.scan import conversation_key, first_pass, render
from quantpipe.calibrate.sources import (
    BadLine,
    ReadStats,
    Record,
    detect_format,
    expand_inputs,
    input_sha256,
    input_size,
    read_batch,
    read_file,
)
from quantpipe.formats import calib_set
from quantpipe.formats.calib_set import CalibSet
from quantpipe.manifest import MANIFEST_VERSION, StageError, code_version, sha256_file, staged_output

log = logging.getLogger("quantpipe.calibrate")


def _records(files: list[str], formats: list[str], cfg: CalibConfig, stats: ReadStats,
             keys_seen: set[str], only: dict[int, set[int]] | None = None,
             which: list[int] | None = None) -> Iterator[Record]:
    """Every file's records (of the files `which`); with `only` ({file: line numbers}), just those lines."""
    which = range(len(files)) if which is None else which
    batch = [(i, files[i]) for i in which if formats[i] == "batch"]
    for i in which:
        if formats[i] != "batch" and (only is None or i in only):
            yield from read_file(files[i], i, formats[i], cfg, stats, keys_seen, None if only is None else only[i])
    if batch:
        yield from read_batch(batch, stats, keys_seen)


def _progress(enabled: bool):
    if not enabled:
        return None
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    # Lines, not bytes: a compressed file's position says little about how far its lines are.
    prog = Progress(TextColumn("calibrate: {task.description}"), BarColumn(),
                    TextColumn("{task.completed:,.0f} lines"), TimeElapsedColumn(), transient=True)
    prog.start()
    prog.add_task("reading logs", total=None)
    return prog


def calibrate(cfg: CalibConfig, progress: bool = False) -> CalibSet:
    """Sample `cfg.size` calibration texts and `cfg.heldout_size` held-out texts from `cfg.logs`."""
    from quantpipe.runtime.model.loader import resolve_model_path
    from quantpipe.runtime.model.tokenizer import load_tokenizer

    if not cfg.out:
        raise StageError("out: give the output folder (--out DIR)")
    if Path(cfg.out).exists() and not cfg.overwrite:
        raise StageError(f"--out {cfg.out} already exists (pass --overwrite to replace it)")
    files = expand_inputs(cfg.logs)
    formats = [detect_format(f, cfg.format, cfg.text_field) for f in files]
    try:
        model_path = resolve_model_path(cfg.model)
        tokenizer = load_tokenizer(cfg.model)
    except (ValueError, FileNotFoundError) as e:
        raise StageError(f"model: {e}") from None
    keys = cfg.strata
    plain_keys = [k for k in keys if k != "cluster"]
    clustering = "cluster" in keys

    where = distributed.address(cfg.ray)
    prog = _progress(progress)
    try:
        with distributed.session(where) if where else contextlib.nullcontext() as ray:
            scan = first_pass(files, formats, cfg, tokenizer, plain_keys, clustering,
                              lambda which, st, ks: _records(files, formats, cfg, st, ks, which=which),
                              progress=prog and (lambda lines: prog.update(prog.task_ids[0], completed=lines)),
                              ray=ray)
    finally:
        if prog:
            prog.stop()
    stats, keys_seen, label_keys, dropped = scan.stats, scan.keys_seen, scan.label_keys, scan.dropped

    # -- bad input that is only known after reading ---------------------------------------
    if stats.lines == 0:
        raise StageError(f"--logs {', '.join(files)}: no lines to read")
    if len(stats.bad) > cfg.max_bad_lines * stats.lines:
        where = ", ".join(f"{files[f]}:{n} ({why})" for f, n, why in stats.bad[:5])
        raise StageError(f"{len(stats.bad)} of {stats.lines} lines are malformed, over --max-bad-lines "
                         f"{cfg.max_bad_lines:g} ({cfg.max_bad_lines * stats.lines:.0f} lines); first: {where}")
    for k in plain_keys:
        if k.startswith("metadata."):
            name = k.removeprefix("metadata.")
            if name not in label_keys:
                found = ", ".join(sorted(label_keys)) or "none"
                raise StageError(f"strata: no record has {k}; metadata keys found: {found}")
        if k == "label" and "label" not in label_keys:
            raise StageError(f"strata: label_field {cfg.label_field!r} is in no record; "
                             f"fields found: {', '.join(sorted(keys_seen))}")
    if cfg.text_field and "jsonl" in formats and not len(scan) and not any(
            cfg.text_field.split(".")[0] == k for k in keys_seen):
        raise StageError(f"text_field {cfg.text_field!r} is in no record; fields found: {', '.join(sorted(keys_seen))}")
    if not len(scan):
        raise StageError(f"no text is left after cleaning ({dict(dropped)}); see --include-status and --min-tokens")

    # -- near-duplicates: one per group survives (the earliest) ---------------------------
    groups = clean.near_dup_groups(scan.signatures(), cfg.near_dup_threshold)
    scan.sig_chunks = []
    keep = np.flatnonzero(groups == np.arange(len(groups)))
    dropped["near_duplicate"] = int(len(groups) - len(keep))

    values = [scan.values[scan.stratum[i]] for i in keep]
    cluster_info = None
    if clustering:
        names, cluster_info = strata.cluster_labels([scan.texts[i] for i in keep], tuple(cfg.cluster_k), cfg.seed)
        values = [v + (c,) for v, c in zip(values, names)]
        scan.texts = []
    order_keys = plain_keys + (["cluster"] if clustering else [])
    # Names list the keys in the order the user gave them.
    name_of: dict[tuple[str, ...], str] = {}  # one string per stratum, shared by its records
    names_of = [name_of.get(v) or name_of.setdefault(v, strata.stratum_name(
        {k: v[order_keys.index(k)] for k in keys}, keys)) for v in values]

    sel = _select(cfg, keep, names_of, [scan.conv[i] for i in keep], scan.conversations,
                  [scan.tokens[i] for i in keep])
    calib_idx, heldout_idx, table, under = sel

    # -- second pass: the sampled records' texts ------------------------------------------
    wanted: dict[tuple[int, int], tuple[str, int]] = {}
    for which, idx in (("calib", calib_idx), ("heldout", heldout_idx)):
        for j in idx:
            wanted[scan.file[keep[j]], scan.line[keep[j]]] = (which, j)
    texts: dict[int, str] = {}
    ids: dict[int, tuple[str, str]] = {}  # (source id, conversation)
    only: dict[int, set[int]] = defaultdict(set)
    for f, n in wanted:
        only[f].add(n)
    for rec in _records(files, formats, cfg, ReadStats(), set(), only):
        hit = wanted.get((rec.file, rec.line))
        if hit is None:
            continue
        try:
            texts[hit[1]] = clean.scrub(render(rec, tokenizer), {})
            ids[hit[1]] = rec.source_id, conversation_key(rec)
        except (ValueError, BadLine):  # the file changed between the passes
            raise StageError(f"--logs {files[rec.file]} changed while being read (line {rec.line})") from None
    if len(texts) != len(wanted):
        raise StageError("an input file changed while being read; rerun on files that are not being written")

    def rows(idx: list[int]) -> list[dict]:
        out = []
        for j in sorted(idx, key=lambda j: (names_of[j], scan.file[keep[j]], scan.line[keep[j]])):
            v = {k: values[j][order_keys.index(k)] for k in keys}
            out.append({"text": texts[j], "stratum": names_of[j], "strata": v, "source_id": ids[j][0],
                        "num_tokens": scan.tokens[keep[j]], "conversation": ids[j][1]})
        return out

    calib_rows, heldout_rows = rows(calib_idx), rows(heldout_idx)
    manifest = {
        "stage": "calibrate", "manifest_version": MANIFEST_VERSION, "code_version": code_version(),
        "inputs": [{"path": f, "sha256": input_sha256(f), "format": fmt, "bytes": input_size(f)}
                   for f, fmt in zip(files, formats)],
        "parameters": cfg.to_dict(),
        "lines_read": stats.lines,
        "counts": {"records": sum(scan.endpoints.values()), "cleaned": int(len(keep)),
                   "calib": len(calib_rows), "heldout": len(heldout_rows)},
        "dropped": {"malformed_line": len(stats.bad), "torn_last_line": stats.torn_tail,
                    "batch_unanswered": stats.unanswered, **dict(sorted(dropped.items()))},
        "malformed_lines": [{"file": files[f], "line": n, "reason": why} for f, n, why in stats.bad[:100]],
        "pii_scrubbed": scan.pii,
        "strata": table,
        "under_covered": under,
        "clusters": cluster_info,
        "tokenizer": {"model": os.path.basename(os.path.normpath(model_path)),
                      "model_sha256": sha256_file(model_path) if os.path.isfile(model_path) else None,
                      "chat_template_sha256": hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()},
        "length_histogram": _histograms(cfg.length_edges, [scan.tokens[i] for i in keep],
                                        [r["num_tokens"] for r in calib_rows], [r["num_tokens"] for r in heldout_rows]),
        "seed": cfg.seed,
    }
    with staged_output(cfg.out, overwrite=cfg.overwrite) as tmp:
        calib_set.write(tmp, calib_rows, heldout_rows, manifest)
        (tmp / "coverage.html").write_text(report.coverage_html(manifest), encoding="utf-8")
    for s in under:
        log.warning("stratum %s is under-covered: the cleaned log holds fewer than --min-per-stratum %d",
                    s, cfg.min_per_stratum)
    return CalibSet.open(cfg.out, "--out")


def _select(cfg: CalibConfig, keep: np.ndarray, names: list[str], convs: list[int], conv_keys: list[str],
            tokens: list[int]):
    """Held-out first (whole conversations), then the calibration sample from the rest.

    `convs[j]` indexes `conv_keys`, the conversations' keys.
    """
    n = len(names)
    counts = Counter(names)
    n_strata = len(counts)
    wanted = cfg.size + cfg.heldout_size
    if wanted > n and not cfg.allow_smaller:
        raise StageError(f"size {cfg.size} + heldout_size {cfg.heldout_size} = {wanted} is larger than the {n} "
                         f"texts left after cleaning (pass --allow-smaller to take what there is)")
    if cfg.min_per_stratum * n_strata > cfg.size:
        raise StageError(f"min_per_stratum {cfg.min_per_stratum} x {n_strata} strata = "
                         f"{cfg.min_per_stratum * n_strata} is larger than size {cfg.size}")
    rng = np.random.default_rng(cfg.seed)
    by_conv: dict[int, list[int]] = defaultdict(list)
    for j, c in enumerate(convs):
        by_conv[c].append(j)
    heldout: list[int] = []
    held_convs: set[int] = set()
    if cfg.heldout_size:
        floor = max(1, min(cfg.min_per_stratum, cfg.heldout_size // n_strata))
        size = min(cfg.heldout_size, max(0, n - cfg.size)) if cfg.allow_smaller else cfg.heldout_size
        # The calibration set comes first: a scarce stratum keeps its floor for calibration,
        # and the held-out set takes only what lies beyond it.
        spare = {s: max(0, counts[s] - cfg.min_per_stratum) for s in counts}
        need, _ = strata.allocate(dict(counts), size, floor, available=spare)
        conv_order = sorted(by_conv, key=conv_keys.__getitem__)
        for ci in rng.permutation(len(conv_order)):
            if not any(need.values()):
                break
            members = by_conv[conv_order[ci]]
            if not any(need[names[j]] > 0 for j in members):
                continue
            held_convs.add(conv_order[ci])
            for j in members:
                if need[names[j]] > 0:
                    heldout.append(j)
                    need[names[j]] -= 1
    pool: dict[str, list[int]] = defaultdict(list)
    for j in range(n):
        if convs[j] not in held_convs:
            pool[names[j]].append(j)
    available = {s: len(pool.get(s, [])) for s in counts}
    weights = None
    if cfg.allocation == "neyman":
        lengths: dict[str, list[int]] = defaultdict(list)
        for j in range(n):
            lengths[names[j]].append(tokens[j])
        weights = strata.neyman_weights(lengths)
    alloc, _ = strata.allocate(dict(counts), cfg.size, cfg.min_per_stratum, weights, available)
    calib: list[int] = []
    for s in sorted(alloc):
        members = pool.get(s, [])
        take = min(alloc[s], len(members))
        calib += [members[k] for k in sorted(rng.choice(len(members), size=take, replace=False))] if take else []
    if set(convs[j] for j in calib) & held_convs:
        raise StageError("internal: a held-out conversation reached the calibration set")
    if len(calib) < cfg.size and not cfg.allow_smaller:
        raise StageError(f"size {cfg.size}: only {len(calib)} texts are left for calibration after the held-out "
                         f"set took whole conversations (pass --allow-smaller, or lower --heldout-size)")
    h_counts, c_counts = Counter(names[j] for j in heldout), Counter(names[j] for j in calib)
    under = sorted(s for s in counts if c_counts[s] < cfg.min_per_stratum)
    table = [{"name": s, "log_count": counts[s], "log_share": round(counts[s] / n, 6),
              "calib_count": c_counts[s], "calib_share": round(c_counts[s] / max(1, len(calib)), 6),
              "heldout_count": h_counts[s], "heldout_share": round(h_counts[s] / max(1, len(heldout)), 6),
              "under_covered": s in under} for s in sorted(counts)]
    return calib, heldout, table, under


def _histograms(edges: list[int], log_tokens: list[int], calib: list[int], heldout: list[int]) -> dict:
    bins = [0] + list(edges) + [max(edges[-1] * 2, max(log_tokens, default=0) + 1)]
    return {"bins": bins, "log": np.histogram(log_tokens, bins)[0].tolist(),
            "calib": np.histogram(calib, bins)[0].tolist(), "heldout": np.histogram(heldout, bins)[0].tolist()}
