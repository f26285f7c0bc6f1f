"""Executes one scheduled step: builds the flat batch, runs the model, returns logits.

It owns the KV cache tensors and the mapping from block ids to cache slots; it makes
no scheduling decisions.
"""

from __future__ import annotations

import logging

import torch

from quantpipe.runtime.engine.scheduler import ScheduledChunk
from quantpipe.runtime.model.attention import AttentionMetadata, DecodeGroup, PrefillSpan
from quantpipe.runtime.model.blocked_linear import block_wide_linears
from quantpipe.runtime.model.cpu_kernels import ALL_ON, CpuKernels
from quantpipe.runtime.model.fused_elementwise import fuse_elementwise
from quantpipe.runtime.model.kv_cache import QuantizedKVCache, bytes_per_token, layer_cache
from quantpipe.runtime.model.llama import LlamaForCausalLM
from quantpipe.runtime.model.prepacked_linear import prepack_linears

log = logging.getLogger("quantpipe.runtime")


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, device: torch.device, dtype,
                 cpu_kernels: CpuKernels = ALL_ON, cuda_decode_kernel=None):
        """`cuda_decode_kernel`: the paged decode the engine chose for CUDA (quantpipe.kernels'),
        or None for the gather + GEMMs path; on CPU the runtime's own kernel is used."""
        cfg = model.config
        self.model = model
        self.device = device
        self.block_size = block_size
        self.kv_caches = [layer_cache(model, i, num_blocks * block_size, device) for i in range(cfg.num_layers)]
        self.decode_kernel = cuda_decode_kernel if device.type == "cuda" else \
            _cpu_decode_kernel(model) if cpu_kernels.enabled("attention") else None
        blocked = block_wide_linears(model, device) if cpu_kernels.enabled("blocked-gemm") else []
        if blocked:
            log.info("float32 GEMMs in row blocks at few rows: %d wide Linear layers", len(blocked))
        packed = prepack_linears(model, device) if cpu_kernels.enabled("prepack") else []
        if packed:
            log.info("bf16 weights prepacked for oneDNN: %d Linear layers", len(packed))
        fused = fuse_elementwise(model, device) if cpu_kernels.enabled("fused-elementwise") else 0
        if cpu_kernels.disabled:
            log.info("CPU kernels turned off: %s", ", ".join(sorted(cpu_kernels.disabled)))
        if fused:
            log.info("bf16 RMSNorm and SiLU-mul fused: %d modules", fused)

    @staticmethod
    def kv_bytes_per_block(model_config, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                           static: bool = False) -> int:
        c = model_config
        return block_size * bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, dtype, kv_cache_dtype, static)

    def _slots(self, block_ids: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(start, end)]

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], extra_rows: list[tuple[ScheduledChunk, int, int]] = ()
                ) -> tuple[list[ScheduledChunk], torch.Tensor]:
        """Run the chunks; returns the chunks that sample and their logits [R, V] (float32).

        `extra_rows` asks for more logits: (chunk, a, b) adds the rows of token positions
        a..b-1 of that chunk (prompt logprobs), after the R sampled rows and in order."""
        # Decodes (single-token chunks) first, by context length, so they batch into a few calls.
        decodes = sorted((c for c in chunks if c.num_tokens == 1 and c.start > 0), key=lambda c: c.end)
        prefills = [c for c in chunks if not (c.num_tokens == 1 and c.start > 0)]
        ordered = decodes + prefills
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        for c in ordered:
            input_ids.extend(c.request.token_ids[c.start:c.end])
            positions.extend(range(c.start, c.end))
            slot_mapping.extend(self._slots(c.request.block_ids, c.start, c.end))
        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.tensor(slot_mapping, device=dev), block_size=self.block_size,
                                 decode_kernel=self.decode_kernel)
        row = 0
        # A kernel reads each sequence's own blocks: one call for all decodes, nothing padded.
        for group in _group_by_length(decodes) if self.decode_kernel is None else [decodes] if decodes else []:
            table, mask, lens = self._decode_tables(group)
            meta.decodes.append(DecodeGroup(row, len(group), table, mask, lens))
            row += len(group)
        for c in prefills:
            span = PrefillSpan(row, c.num_tokens, c.end, None)
            if c.start > 0:  # earlier tokens are in the cache: read them, mask causally from `start`
                num_blocks = -(-c.end // self.block_size)
                span.block_table = torch.tensor(c.request.block_ids[:num_blocks], device=dev)
                q_pos = torch.arange(c.start, c.end, device=dev).unsqueeze(1)
                span.mask = torch.arange(num_blocks * self.block_size, device=dev).unsqueeze(0) <= q_pos
            meta.prefills.append(span)
            row += c.num_tokens
        sampled, logit_rows, first_row, row = [], [], {}, 0
        for c in ordered:
            first_row[id(c)] = row
            row += c.num_tokens
            if c.sample:
                sampled.append(c)
                logit_rows.append(row - 1)
        for c, a, b in extra_rows:
            assert c.start <= a <= b <= c.end, (c, a, b)
            logit_rows.extend(range(first_row[id(c)] + a - c.start, first_row[id(c)] + b - c.start))
        logits = self.model(
            torch.tensor(input_ids, device=dev),
            torch.tensor(positions, device=dev),
            self.kv_caches,
            meta,
            torch.tensor(logit_rows, device=dev, dtype=torch.long),
        )
        return sampled, logits

    def _decode_tables(self, decodes: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        bs = self.block_size
        ctx = [c.end for c in decodes]
        max_blocks = -(-max(ctx) // bs)
        # Padding entries point at block 0; the mask hides whatever it holds.
        table = torch.tensor(
            [c.request.block_ids[:max_blocks] + [0] * (max_blocks - len(c.request.block_ids)) for c in decodes],
            device=self.device,
        )
        lens = torch.tensor(ctx, device=self.device)
        if self.decode_kernel is not None:  # it reads the lengths; the mask is the torch path's
            return table, None, lens
        mask = torch.arange(max_blocks * bs, device=self.device).unsqueeze(0) < lens.unsqueeze(1)
        return table, mask[:, None, None, :], lens


def _cpu_decode_kernel(model: LlamaForCausalLM):
    """The CPU paged decode kernel for a cache in the model dtype or in dynamic INT8, or None
    (FP8 or static scales, no compiler)."""
    if model.kv_cache_dtype not in ("auto", "int8") or model.embed_tokens.weight.dtype not in (torch.bfloat16,
                                                                                              torch.float32):
        return None
    if model.kv_cache_dtype == "int8" and any(layer.self_attn.kv_scales is not None for layer in model.layers):
        return None
    from quantpipe.runtime.model.cpu_attention import extension

    ext = extension()
    if ext is None:
        return None

    def decode(q, cache, block_table, context_lens, block_size):
        if isinstance(cache, QuantizedKVCache):  # in the cache's rotated basis: attention turns q and the output
            return ext.paged_decode_int8(q, cache.q[0], cache.q[1], cache.scale[0], cache.scale[1], block_table,
                                         context_lens, block_size)
        return ext.paged_decode(q, cache.k, cache.v, block_table, context_lens, block_size)

    return decode


def _group_by_length(decodes: list[ScheduledChunk], min_group: int = 8, max_ratio: float = 1.5) -> list[list[ScheduledChunk]]:
    """Split length-sorted decodes where padding to the group's longest would waste a lot.

    Each extra group costs one attention call per layer, so small groups are merged.
    """
    groups: list[list[ScheduledChunk]] = []
    for c in decodes:
        if groups and (len(groups[-1]) < min_group or c.end <= max_ratio * groups[-1][0].end):
            groups[-1].append(c)
        else:
            groups.append([c])
    return groups
