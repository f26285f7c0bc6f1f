"""The first pass over the logs: every record reduced to the few numbers sampling needs.

Per record it keeps where it is, its stratum and conversation (indexes into their
distinct values), its token count, a hash of its text (exact duplicates) and a MinHash
signature (near duplicates), in flat arrays: a log of millions fits in memory while its
text does not. The sampled records' text and source id are read again in the second pass.

Line-based logs are cut into chunks that worker processes parse, render, scrub, count
and hash; the main process reads the lines and merges the results in log order, so the
result does not depend on the number of workers. Everything that depends on order
(which of two duplicates is kept) happens in the merge.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import pickle
from array import array
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from quantpipe.calibrate import clean, strata
from quantpipe.calibrate.sources import (
    LINE_FORMATS,
    TABLE_FORMATS,
    ReadStats,
    Record,
    block_lines,
    input_size,
    is_uri,
    open_blocks,
    open_table_blocks,
    parse_line,
    table_records,
)
from quantpipe.calibrate.token_count import TokenCounter

_CHUNK = 1024  # records featurized together (token counts and MinHash are batched)
_BLOCK_BYTES = 1 << 20  # sent to a worker at once: about 700 request-log lines
_PARALLEL_BYTES = 32 << 20  # smaller logs are read in-process: starting workers costs more than it saves


@dataclass
class Scan:
    """What the first pass found: counts for the manifest and one row per record that survived."""

    stats: ReadStats = field(default_factory=ReadStats)
    keys_seen: set[str] = field(default_factory=set)
    label_keys: Counter = field(default_factory=Counter)
    endpoints: Counter = field(default_factory=Counter)
    dropped: Counter = field(default_factory=Counter)
    pii: dict[str, int] = field(default_factory=lambda: {t: 0 for t in clean.PII_TYPES})
    # One entry per kept record, in log order.
    file: array = field(default_factory=lambda: array("i"))
    line: array = field(default_factory=lambda: array("q"))
    stratum: array = field(default_factory=lambda: array("i"))  # index into `values`
    conv: array = field(default_factory=lambda: array("i"))  # index into `conversations`
    tokens: array = field(default_factory=lambda: array("i"))
    sig_chunks: list = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # only when clustering
    values: list[tuple[str, ...]] = field(default_factory=list)  # distinct stratum values (except cluster)
    conversations: list[str] = field(default_factory=list)  # distinct conversation keys

    def __len__(self) -> int:
        return len(self.tokens)

    def signatures(self) -> np.ndarray:
        return np.concatenate(self.sig_chunks) if self.sig_chunks else np.zeros((0, clean.NUM_PERM), np.uint32)


def conversation_key(rec: Record) -> str:
    """metadata.conversation_id when present, else the hash of the first user message."""
    cid = rec.labels.get("conversation_id")
    if cid:
        return "id:" + cid
    if rec.messages:
        first = next((m["content"] for m in rec.messages if m["role"] == "user"), rec.messages[0]["content"])
    else:
        first = rec.prompt if rec.prompt is not None else (rec.text or "")
    return "h:" + hashlib.blake2b(first.encode("utf-8"), digest_size=8).hexdigest()


def render(rec: Record, tokenizer) -> str:
    """The text as the model sees it: prompt and reply, both pass through the quantized layers."""
    if rec.text is not None:
        return rec.text
    if rec.messages is not None:
        msgs = rec.messages + ([{"role": "assistant", "content": rec.reply}] if rec.reply else [])
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=False)
    return (rec.prompt or "") + rec.reply


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


class _Featurizer:
    """Record -> (stratum values, conversation hash, token count, text hash, signature), in chunks."""

    def __init__(self, cfg, tokenizer, plain_keys: list[str], clustering: bool):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.counter = TokenCounter(tokenizer.backend)
        self.plain_keys, self.clustering = plain_keys, clustering

    def chunk(self, records: list[Record]) -> dict:
        """Features of a chunk of records, plus what it saw and dropped (merged by the caller)."""
        out = {"label_keys": Counter(), "endpoints": Counter(), "dropped": Counter(), "pii": {}, "kept": []}
        texts, kept = [], []
        for rec in records:
            out["label_keys"].update(rec.labels)
            out["endpoints"][rec.endpoint or strata.MISSING] += 1
            if rec.status not in self.cfg.include_status:
                out["dropped"][f"status_{rec.status}"] += 1
                continue
            try:
                text = render(rec, self.tokenizer)
            except ValueError:
                out["dropped"]["chat_template_failed"] += 1
                continue
            text = clean.scrub(text, out["pii"])
            labels = {k: clean.scrub(v, out["pii"]) for k, v in rec.labels.items()}
            texts.append(text)
            kept.append((rec, labels))
        if not kept:
            return out
        tokens = self.counter.count(texts)
        sigs = clean.minhash_batch([clean.normalize(t) for t in texts])
        for (rec, labels), text, n in zip(kept, texts, tokens):
            values = []
            for k in self.plain_keys:
                if k == "length":
                    values.append(strata.length_bucket(n, self.cfg.length_edges))
                elif k == "endpoint":
                    values.append(rec.endpoint or strata.MISSING)
                elif k == "model":
                    values.append(rec.model or strata.MISSING)
                elif k == "label":
                    values.append(labels.get("label", strata.MISSING))
                else:
                    values.append(labels.get(k.removeprefix("metadata."), strata.MISSING))
            out["kept"].append((rec.file, rec.line, tuple(values), conversation_key(rec), n,
                                _hash64(text), clean.scrub(strata.cluster_text(rec), {}) if self.clustering else None))
        out["sigs"] = sigs
        return out


def first_pass(files: list[str], formats: list[str], cfg, tokenizer, plain_keys: list[str], clustering: bool,
               records, progress=None, ray=None) -> Scan:
    """Read every input once.

    `records(which, stats, keys_seen)` yields the Records of the files `which` that are
    read in-process; `progress(lines)` is told how many lines were read so far. With `ray`
    (a connected Ray module) the line-based and table files are read and featurized on its
    cluster through Ray Data; the merge, and so the result, is the same. Either way files
    are merged in their order, Batch API files (joined across files) last.
    """
    scan = Scan()
    feat = _Featurizer(cfg, tokenizer, plain_keys, clustering)
    seen_text: set[int] = set()
    stratum_of: dict[tuple[str, ...], int] = {}
    conv_of: dict[str, int] = {}

    def merge(out: dict) -> None:
        scan.label_keys.update(out["label_keys"])
        scan.endpoints.update(out["endpoints"])
        scan.dropped.update(out["dropped"])
        for t, n in out["pii"].items():
            scan.pii[t] += n
        if not out["kept"]:
            return
        keep_rows = []
        for row, (file, line, values, conv, n, text_hash, text) in enumerate(out["kept"]):
            # Exact duplicates are judged in log order, so the earliest copy is the one kept.
            if text_hash in seen_text:
                scan.dropped["exact_duplicate"] += 1
                continue
            seen_text.add(text_hash)
            if n < cfg.min_tokens:
                scan.dropped["too_short"] += 1
                continue
            scan.file.append(file)
            scan.line.append(line)
            scan.stratum.append(stratum_of.setdefault(values, len(stratum_of)))
            scan.conv.append(conv_of.setdefault(conv, len(conv_of)))
            scan.tokens.append(n)
            if text is not None:
                scan.texts.append(text)
            keep_rows.append(row)
        if keep_rows:
            scan.sig_chunks.append(out["sigs"][keep_rows])

    parallel = [i for i, fmt in enumerate(formats) if fmt in LINE_FORMATS + TABLE_FORMATS]
    workers = _workers(cfg, sum(input_size(files[i]) for i in parallel))
    outputs = None
    if ray is not None and parallel:
        outputs = _ray_outputs(ray, files, parallel, (feat, cfg, formats))
    elif workers > 1 and parallel:
        outputs = _pool_outputs(files, parallel, workers, (feat, cfg, formats))
    if outputs is not None:
        for out in outputs:
            scan.stats.lines += out["lines"]
            scan.stats.torn_tail += out["torn_tail"]
            scan.stats.bad += out["bad"]
            scan.keys_seen |= out["keys_seen"]
            merge(out)
            if progress:
                progress(scan.stats.lines)
        rest = [i for i in range(len(files)) if i not in parallel]
    else:
        rest = list(range(len(files)))
    if rest:
        chunk: list[Record] = []
        for rec in records(rest, scan.stats, scan.keys_seen):
            chunk.append(rec)
            if len(chunk) >= _CHUNK:
                merge(feat.chunk(chunk))
                chunk = []
                if progress:
                    progress(scan.stats.lines)
        if chunk:
            merge(feat.chunk(chunk))
    scan.values = list(stratum_of)
    scan.conversations = list(conv_of)
    return scan


def _workers(cfg, line_bytes: int) -> int:
    if cfg.workers is not None:
        return cfg.workers
    if line_bytes < _PARALLEL_BYTES or "fork" not in multiprocessing.get_all_start_methods():
        return 1
    return min(os.cpu_count() or 1, 8)


def _blocks(path: str, fmt: str) -> Iterator[tuple[int, bytes]]:
    """(first line or row number, block) of one file as the workers take them: a line file's
    bytes, split into lines by the worker (the reading process only decompresses), or a
    table's rows, pickled."""
    if fmt in TABLE_FORMATS:
        for first, rows in open_table_blocks(path, fmt):
            yield first, pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL)
    else:
        yield from open_blocks(path, _BLOCK_BYTES)


def _file_blocks(files: list[str], formats: list[str], which: list[int]) -> Iterator[tuple[int, int, bytes]]:
    for i in which:
        for first, block in _blocks(files[i], formats[i]):
            yield i, first, block


def _pool_outputs(files: list[str], which: list[int], workers: int, worker) -> Iterator[dict]:
    """Blocks read here, featurized by forked processes, outputs in log order. `worker` is
    (featurizer, cfg, formats)."""
    global _WORKER
    ctx = multiprocessing.get_context("fork")
    _WORKER = worker
    try:
        with ctx.Pool(workers, initializer=_quiet_tokenizers) as pool:
            yield from pool.imap(_work, _file_blocks(files, worker[2], which), chunksize=1)
    finally:
        _WORKER = None


def _ray_outputs(ray, files: list[str], which: list[int], worker) -> Iterator[dict]:
    """The same blocks through Ray Data: one read task per file cuts it into blocks of whole
    lines or of table rows (any pyarrow filesystem path), a pool of actors across the cluster
    featurizes them, and the outputs come back in log order (preserve_order), as the merge
    needs."""
    from ray import data as rd

    from quantpipe.distributed import cluster_cpus

    ctx = rd.DataContext.get_current()
    saved = ctx.execution_options.preserve_order
    ctx.execution_options.preserve_order = True
    try:
        # Paths as this process sees them (workers run elsewhere): URIs as they are, files made absolute.
        paths = [f if is_uri(f) else os.path.abspath(f) for f in files]
        ds = rd.from_items([{"file": i, "path": paths[i], "format": worker[2][i]} for i in which],
                           override_num_blocks=len(which))
        # Reading is decompression and line cuts, light beside featurizing: it takes no whole CPU,
        # so every CPU can hold a featurizing actor and the reads still get scheduled.
        ds = ds.flat_map(_read_blocks, num_cpus=0.25)
        ds = ds.map_batches(_Featurize, fn_constructor_args=(pickle.dumps(worker),), batch_size=1,
                            concurrency=(1, cluster_cpus(ray)), num_cpus=1)
        for row in ds.iter_rows():
            yield pickle.loads(row["out"])
    finally:
        ctx.execution_options.preserve_order = saved


def _read_blocks(row: dict) -> list[dict]:
    return [{"file": row["file"], "first": first, "block": block} for first, block in _blocks(row["path"], row["format"])]


class _Featurize:
    """A Ray Data actor: the featurizer (with its tokenizer) unpickled once, then block after block."""

    def __init__(self, worker: bytes):
        _quiet_tokenizers()
        self.worker = pickle.loads(worker)

    def __call__(self, batch: dict) -> dict:
        outs = [featurize_block(self.worker, int(f), int(first), bytes(block))
                for f, first, block in zip(batch["file"], batch["first"], batch["block"])]
        return {"out": [pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL) for o in outs]}


_WORKER = None  # (featurizer, cfg, formats): set before the pool forks, inherited by the workers


def _quiet_tokenizers() -> None:
    # Each worker is one process on one core: the tokenizer's own thread pool would only contend.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def featurize_block(worker, file: int, first: int, block: bytes) -> dict:
    """One block (`_blocks`) parsed and featurized, with what reading it saw (merged by the caller)."""
    feat, cfg, formats = worker
    stats, keys_seen = ReadStats(), set()
    if formats[file] in TABLE_FORMATS:
        records = list(table_records(pickle.loads(block), first, file, cfg, stats, keys_seen))
    else:
        records = [r for r in (parse_line(line, file, n, complete, formats[file], cfg, stats, keys_seen)
                               for n, line, complete in block_lines(first, block)) if r is not None]
    out = feat.chunk(records)
    out.update(lines=stats.lines, torn_tail=stats.torn_tail, bad=stats.bad, keys_seen=keys_seen)
    return out


def _work(job) -> dict:
    return featurize_block(_WORKER, *job)
