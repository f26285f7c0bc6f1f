"""Mixed precision: measure each Linear's sensitivity, then pick precisions under a bit budget.

A layer's candidates are bf16 and the config's quantized precisions (`QuantConfig.
mixed_candidates`: bit widths by group, 8 bits per channel) whose group size divides its
input. Sensitivity of a layer at a precision is the mean KL divergence of the model's
next-token distribution from the unquantized model's when only that layer is quantized
(RTN) at that precision, on a few calibration sequences. The assignment minimizing the
summed sensitivity with average bits per weight <= budget (scales and zero points counted)
is a multiple-choice knapsack, solved exactly by dynamic programming over the bit cost in
small units.

The table depends on the source model and the probe sequences, not on the budget, so
candidates that differ only in budget (the default recipe's 5- and 6-bit rungs) measure it
once: the manifest records what it was measured on (`measure_key`) and a later run reuses an
earlier artifact's table when that key is equal but for the precisions, and the earlier
run measured every precision the later one takes (a run over fewer precisions reads its
entries out of the larger table).
"""

from __future__ import annotations

import json
import math

import torch

from quantpipe.manifest import sha256_bytes
from quantpipe.quantize.rtn import WeightScheme, dequantize, rtn
from quantpipe.runtime.model.divergence import kl_rows
from quantpipe.runtime.model.forward import SequenceBatch, SequencePass, head_logits, runs

KEEP = None  # "stay in the model dtype"
LOGITS_BYTES = 256 * 2**20  # the most float32 logits `sensitivities` holds at once
# Names how `sensitivities` measures; changed with it, so a table measured otherwise is never reused.
MEASURE = "kl(base || one layer rtn), float32 passes, v2"


def applies(scheme: WeightScheme | None, in_features: int) -> bool:
    """Whether a layer of this input size can take `scheme` (its groups must divide it)."""
    return scheme is None or scheme.group_size is None or in_features % scheme.group_size == 0


def bits_of(scheme: WeightScheme | None, in_features: int) -> float:
    if scheme is None:
        return 16.0
    if scheme.group_size is None:
        return scheme.num_bits + 16.0 / in_features  # one 16-bit scale per output channel
    return scheme.bits_per_weight()


@torch.inference_mode()
def sensitivities(model, names: list[str], schemes: list[WeightScheme], samples: list[list[int]],
                  max_rows: int = 4096):
    """{name: {scheme.describe(): mean KL}} with every other layer unquantized, for each of
    `schemes` that applies to the layer.

    The unquantized model's hidden state entering every decoder layer is kept per sample,
    so measuring a Linear of layer i reruns layers i.. only: half a forward pass on
    average instead of a whole one, with the same numbers. Only layer i itself needs the
    quantized weights; the layers after it are the unquantized model's, so they run once
    for all of the layer's precisions and samples together (`SequenceBatch`, up to
    `max_rows` tokens per call): each weight is read once per call rather than once per
    precision and sample, and every row is what its own sequence's pass computes (each
    sequence is a causal span of its own, and the passes are float32, whose row results do
    not depend on the other rows). KL is taken in float32 passes over the vocabulary
    (`divergence.kl_rows`), not a float64 log-softmax: on Gemma 3's 262,144 entries that
    pass had cost as much as the lm_head matmul itself.
    """
    passes = [SequencePass(model, ids) for ids in samples]
    entering, ref = [], []  # entering[s][i]: sample s's hidden state before layer i (the last: after all)
    for p in passes:
        x, states = p.embed(), []
        for i in range(len(model.layers)):
            states.append(x)
            x = p.layer(i, x)
        states.append(x)
        entering.append(states)
        ref.append(p.logits(x))
    out: dict[str, dict[str, float]] = {}
    for name in names:
        start = len(model.layers) if name == "lm_head" else int(name.split(".")[1])
        mod = model.get_submodule(name)
        original = mod.weight.detach().clone()
        measured = [s for s in schemes if applies(s, original.shape[1])]
        kl = dict.fromkeys((s.describe() for s in measured), 0.0)
        after = []  # (precision, sample, hidden state after layer `start`)
        for sch in measured:
            q, scale, zero = rtn(original, sch)
            mod.weight.copy_(dequantize(q, scale, zero, sch).to(original.dtype))
            for s, (p, states) in enumerate(zip(passes, entering)):
                if start == len(model.layers):  # lm_head: the logits themselves
                    kl[sch.describe()] += float(kl_rows(ref[s], p.logits(states[start])).mean())
                else:
                    after.append((sch.describe(), s, p.layer(start, states[start])))
        mod.weight.copy_(original)
        for run in runs([h.shape[0] for _, _, h in after], max_rows):
            chunk = after[run]
            for (d, s, _), logits in zip(chunk, _rest_logits(model, start + 1, samples, chunk)):
                kl[d] += float(kl_rows(ref[s], logits).mean())
        out[name] = {d: v / len(samples) for d, v in kl.items()}
    return out


def _rest_logits(model, first: int, samples: list[list[int]], chunk: list[tuple]):
    """Each row's logits after layers first.. of the unquantized model, in order: one call per
    layer for the whole chunk, and lm_head over as many whole sequences as fit in
    `LOGITS_BYTES` (one sequence at least)."""
    batch = SequenceBatch(model, [samples[s] for _, s, _ in chunk])
    x = batch.layers(torch.cat([x for _, _, x in chunk]), first)
    lengths = batch.lengths
    parts = x.split(lengths)
    fit = max(1, LOGITS_BYTES // (4 * model.lm_head.weight.shape[0]))  # rows of float32 logits
    for run in runs(lengths, fit):
        yield from head_logits(model, torch.cat(parts[run])).split(lengths[run])


def measure_key(source_sha256: str, probe: list[list[int]], schemes: list[WeightScheme]) -> dict:
    """What a sensitivity table was measured on: keys equal but for `schemes` give equal
    entries for the precisions both measured."""
    return {"measure": MEASURE, "source_sha256": source_sha256,
            "probe_sha256": sha256_bytes(json.dumps(probe).encode()),
            "schemes": [s.describe() for s in schemes]}


def reusable(recorded: object, key: dict, in_features: dict[str, int],
             schemes: list[WeightScheme]) -> tuple[dict | None, str]:
    """An earlier manifest's `mixed_precision` entry -> (its table for these layers ({name:
    input size}) and precisions, "") when it was measured as `key` says on exactly these
    layers and on these precisions among others, else (None, the reason)."""
    if not isinstance(recorded, dict) or not isinstance(recorded.get("table"), dict):
        return None, "it has no mixed-precision sensitivity table"
    old = recorded.get("measured_on") if isinstance(recorded.get("measured_on"), dict) else {}
    diff = [k for k in key if k != "schemes" and old.get(k) != key[k]]
    if diff:
        return None, f"it was measured differently ({', '.join(diff)} differ)"
    missing = [s for s in key["schemes"] if s not in (old.get("schemes") or [])]
    if missing:
        return None, f"it did not measure {', '.join(missing)}"
    table = recorded["table"]
    want = {n: [s.describe() for s in schemes if applies(s, k)] for n, k in in_features.items()}
    if set(table) != set(want) or any(not isinstance(table[n], dict) or not set(want[n]) <= set(table[n]) or
                                      not all(isinstance(v, float) for v in table[n].values()) for n in want):
        return None, "its table does not cover exactly this model's layers and their precisions"
    return {n: {d: table[n][d] for d in want[n]} for n in want}, ""


def cheapest(in_features: dict[str, int], schemes: list[WeightScheme | None]) -> dict[str, WeightScheme | None]:
    """Each layer's cheapest precision among `schemes` that applies to it: the least budget's assignment."""
    return {n: min((s for s in schemes if applies(s, k)), key=lambda s: bits_of(s, k)) for n, k in in_features.items()}


def average_bits(params: dict[str, int], in_features: dict[str, int], chosen: dict[str, WeightScheme | None]) -> float:
    """Average bits per weight of an assignment, scales and zero points counted."""
    return sum(bits_of(chosen[n], in_features[n]) * p for n, p in params.items()) / sum(params.values())


def assign(params: dict[str, int], in_features: dict[str, int], sens: dict[str, dict[str, float]],
           schemes: list[WeightScheme | None], budget: float, resolution: int = 20000) -> dict[str, WeightScheme | None]:
    """The precision per layer minimizing summed sensitivity with average bits <= budget, each
    layer choosing among the `schemes` that apply to it (KEEP, bf16, always does).

    Every layer starts at its cheapest precision (exact), and the bits left over are spent in
    `resolution` units: each layer's upgrades cost their extra bits rounded up to whole units,
    so the result never exceeds the budget and leaves at most one unit per layer unspent
    (210 layers: 1% of what was left over). Solved exactly over those units by dynamic
    programming, one vector pass per layer and precision.
    """
    bad = [f"{n} {d}" for n, row in sens.items() for d, v in row.items() if not math.isfinite(v)]
    if bad:
        raise ValueError(f"the sensitivity table holds NaN or infinite entries ({', '.join(bad[:3])})")
    names = list(params)
    total = sum(params.values())
    usable = [[k for k, s in enumerate(schemes) if applies(s, in_features[n])] for n in names]
    floor = cheapest(in_features, schemes)
    base = [bits_of(floor[n], in_features[n]) * params[n] for n in names]
    spare = budget * total - sum(base)
    if spare < -1e-6 * total:
        raise ValueError(f"no assignment fits {budget} bits per weight (the cheapest takes "
                         f"{average_bits(params, in_features, floor):.4g})")
    unit = max(spare, 1e-9) / resolution
    inf = float("inf")
    best = torch.full((resolution + 1,), inf, dtype=torch.float64)
    best[0] = 0.0  # best[c]: the least summed sensitivity with exactly c units spent
    picks, costs_of = [], []
    for n, ks, b in zip(names, usable, base):
        costs = [math.ceil((bits_of(schemes[k], in_features[n]) * params[n] - b) / unit - 1e-6) for k in ks]
        new = torch.full_like(best, inf)
        pick = torch.zeros(resolution + 1, dtype=torch.int16)
        for k, cost in zip(ks, costs):
            if cost > resolution:
                continue
            gain = 0.0 if schemes[k] is None else sens[n][schemes[k].describe()]
            moved = torch.cat([torch.full((cost,), inf, dtype=torch.float64), best[: resolution + 1 - cost] + gain])
            better = moved < new
            new = torch.where(better, moved, new)
            pick = torch.where(better, torch.tensor(k, dtype=torch.int16), pick)
        best = new
        picks.append(pick)
        costs_of.append(dict(zip(ks, costs)))
    end = int(torch.argmin(best))  # the first of equal sums: the fewest units
    out: dict[str, WeightScheme | None] = {}
    for n, pick, costs in zip(reversed(names), reversed(picks), reversed(costs_of)):
        k = int(pick[end])
        out[n] = schemes[k]
        end -= costs[k]
    return {n: out[n] for n in names}
