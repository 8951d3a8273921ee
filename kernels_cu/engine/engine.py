"""The GPU engine: a decoder of PyCUDA kernels for fp16, INT8 W8A8 and AWQ int4 checkpoints.

Each layer runs layer.py's sequence; around the layers, the embedding lookup, the final norm and the lm_head
(head.py). Decode steps of a batch-size bucket are captured once as a CUDA graph and replayed: token ids, positions
and lengths live in device buffers, so one graph serves every step. Prefill runs eagerly, or replays a graph for a
short shape that comes again (graphs.py). The engine is a Backend of the same generation loop as the CPU reference
(model_zoo.generation).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from kernels_cu import build
from kernels_cu.attention_decode import (attention_decode, attention_decode_quant, attention_decode_rope,
                                         attention_decode_rope_parts, attention_decode_rope_quant)
from kernels_cu.attention_prefill import attention_prefill
from kernels_cu.embedding import embedding, embedding_fold
import kernels_cu.engine.head as head
from kernels_cu.engine.cache import GpuCache, alloc_cache, kv_position_bytes
from kernels_cu.engine.config import EngineConfig, bucket_of
from kernels_cu.engine.graphs import PrefillGraphs, api, record
from kernels_cu.engine.layer import GpuLayer, run_layer
from kernels_cu.engine.pipe import EnginePipe
from kernels_cu.engine.plan import PREFILL, StepPlan, plan_step
from kernels_cu.engine.sampler import GpuRowSampler, bucket_sampler
from kernels_cu.int8_gemm import DeferredQuant
from kernels_cu.kv_codes import require_kind
from kernels_cu.rope_kv import rope_kv, rope_positions, rope_table
from kernels_cu.sampling import GpuSampler, StepState
from kernels_cu.tuning import DEFAULT, Tuning
from model_zoo.backend import check_token_ids
from model_zoo.config import LlamaConfig
from model_zoo.errors import DeviceError, PromptError
from model_zoo.sampling import SamplingConfig
from model_zoo.weights import ModelWeights


class Engine:
    """fp16 / int8 / awq checkpoint on the GPU; forward(tokens, cache, rows) -> fp32 logits like the reference."""

    name = "engine"

    def __init__(self, weights: ModelWeights, cfg: EngineConfig = EngineConfig(), tuning: Tuning = DEFAULT):
        build.require_cuda()
        self.cfg, self.tuning = cfg, tuning
        self.config: LlamaConfig = weights.config
        self._device = torch.device("cuda", torch.cuda.current_device())
        require_kind(cfg.kv, self._device.index)  # before the weights move: --kv-fp8 on a GPU without e4m3
        self.scheme = weights.meta.get("scheme", "fp16")
        dev = self._device
        with build.on_stream():
            self.embed = weights.embed.to(dev, torch.float16).contiguous()  # [V, H]
            self.lm_head = self.embed if self.config.tie_embeddings else weights.lm_head.to(dev, torch.float16).contiguous()
            self.lm_head_q: tuple[torch.Tensor, torch.Tensor] | None = None  # (codes int8 [V, H], scales fp32 [V])
            if cfg.lm_head_int8:
                self._lm_head_int8()
                if self.lm_head is not self.embed:
                    self.lm_head = None  # the fp16 head is not kept (a tied one is the embedding table)
            self.norm = weights.norm.to(dev, torch.float16).contiguous()
            self.layers = [GpuLayer.upload(l, dev) for l in weights.layers]
            self.max_len = min(cfg.max_len, self.config.max_positions)
            c = self.config
            self.cos_sin = rope_table(c.head_dim, c.rope_theta, c.max_positions + 1, dev, c.rope_scaling)
        self._fresh_state()
        build.synchronize()
        self._check_kv_fits()

    def _check_kv_fits(self) -> None:
        """One sequence of max_len positions must fit in what the weights leave free (--max-context)."""
        free, need = torch.cuda.mem_get_info(self._device)[0], self.kv_bytes(1, self.max_len)
        if need > free:
            fits = max(free // self.kv_position_bytes() - 1, 0)
            raise DeviceError(f"a context of {self.max_len:,} positions needs {need / 2**30:.1f} GiB of KV cache per "
                              f"sequence but {free / 2**30:.1f} GiB are free after the weights: at most {fits:,} "
                              "positions fit (lower --max-context, or --kv-int8 / --kv-fp8)")

    def _fresh_state(self) -> None:
        self._caches: dict[tuple[int, bool], GpuCache] = {}
        self._samplers: dict[int, GpuSampler] = {}
        self._prefill_graphs = PrefillGraphs(self.tuning.prefill_graph_tokens, self.tuning.prefill_graphs)

    @classmethod
    def from_loaded(cls, loaded: Any, cfg: EngineConfig = EngineConfig(), tuning: Tuning = DEFAULT) -> "Engine":
        from model_zoo.quant.checkpoint import build_weights

        return cls(build_weights(loaded, torch.float16, "cpu"), cfg, tuning)

    @classmethod
    def from_checkpoint(cls, path: str, cfg: EngineConfig = EngineConfig(), tuning: Tuning = DEFAULT) -> "Engine":
        from model_zoo.load import load_model

        return cls.from_loaded(load_model(path, dtype=torch.float16), cfg, tuning)

    def variant(self, **changes: Any) -> "Engine":
        """The same weights on the GPU under other EngineConfig and/or Tuning fields, with caches and graphs of its
        own (A/B runs). An int8 head that this engine lacks is made from its fp16 head on first use."""
        cfg_fields = {f.name for f in dataclasses.fields(EngineConfig)}
        other = copy.copy(self)
        other.cfg = dataclasses.replace(self.cfg, **{k: v for k, v in changes.items() if k in cfg_fields})
        other.tuning = dataclasses.replace(self.tuning, **{k: v for k, v in changes.items() if k not in cfg_fields})
        other.max_len = min(other.cfg.max_len, self.config.max_positions)
        other._fresh_state()
        return other

    @property
    def device(self) -> torch.device:
        return self._device

    # -- bytes ------------------------------------------------------------------------------------------
    def weight_bytes(self) -> int:
        """Bytes of the weights held on the GPU."""
        n = self.embed.numel() * 2 + self._body_bytes()
        if self.lm_head is not None and self.lm_head is not self.embed:
            n += self.lm_head.numel() * 2
        if self.lm_head_q is not None:
            n += sum(t.numel() * t.element_size() for t in self.lm_head_q)
        return n

    def step_weight_bytes(self, batch: int) -> int:
        """Bytes of weights one decode step of `batch` rows reads: the layers, the final norm, the lm_head as it runs
        (fp16, or its int8 codes and scales) and the embedding rows looked up."""
        c = self.config
        return (self._body_bytes() + head.head_bytes(c.vocab_size, c.hidden_size, self.cfg.lm_head_int8)
                + c.hidden_size * 2 * batch)

    def _body_bytes(self) -> int:
        return self.norm.numel() * 2 + sum(l.nbytes() for l in self.layers)

    def kv_position_bytes(self) -> int:
        """Bytes of one position of one row's K and V over all layers and KV heads."""
        return kv_position_bytes(self.config, self.cfg.kv)

    def kv_bytes(self, batch: int, max_len: int) -> int:
        return batch * (max_len + 1) * self.kv_position_bytes()

    def memory_report(self) -> dict:
        caches = {f"{b}{'-scratch' if s else ''}": self.kv_bytes(b, c.capacity) for (b, s), c in self._caches.items()}
        return {"weights_bytes": self.weight_bytes(), "kv_cache_bytes": caches,
                "allocated_bytes": torch.cuda.memory_allocated(self._device),
                "peak_bytes": torch.cuda.max_memory_allocated(self._device)}

    # -- the lm_head ---------------------------------------------------------------------------------------
    def _lm_head_fp16(self) -> torch.Tensor:
        if self.lm_head is None:
            raise DeviceError("this engine holds the lm_head as int8 only (it was built with lm_head_int8)")
        return self.lm_head

    def _lm_head_int8(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes int8 [V, H], scales fp32 [V]) of the fp16 lm_head, made on first use."""
        if self.lm_head_q is None:
            self.lm_head_q = head.quantize_head(self._lm_head_fp16())
        return self.lm_head_q

    def _logits(self, h: torch.Tensor, fold: Any = None) -> torch.Tensor:
        w = self._lm_head_int8() if self.cfg.lm_head_int8 else self._lm_head_fp16()
        return head.logits(h, self.norm, self.config.norm_eps, fold, w)  # [T, V] fp16

    # -- cache and plan ------------------------------------------------------------------------------------
    @api
    def new_cache(self, batch: int, max_len: int, scratch: bool = False) -> GpuCache:
        """The bucket's cache, emptied (its decode graph is kept: same buffers, same pointers).

        One cache per bucket: a new_cache of the same bucket empties the previous one. `scratch` caches
        (forward without a cache, as eval does) are separate, so they never clobber a conversation."""
        bucket = bucket_of(batch)
        if max_len > self.config.max_positions:
            raise PromptError(f"{max_len} positions exceed the model's context of {self.config.max_positions}")
        exact = rope_positions(self.config)
        if max_len > exact:
            raise PromptError(f"{max_len} positions: the GPU engine runs dynamic NTK RoPE within the model's "
                              f"max_position_embeddings ({exact}) only; use --device cpu beyond it")
        key = (bucket, scratch)
        cache = self._caches.get(key)
        if cache is None or cache.capacity < max_len:
            self._caches.pop(key, None)  # free the old storage (and its graph) first
            cap = max(max_len, min(self.max_len, self.config.max_positions))
            if cap > max_len and self.kv_bytes(bucket, cap) > torch.cuda.mem_get_info(self._device)[0]:
                cap = max_len  # a long --max-context: preallocate only what this batch asks for
            cache = self._caches[key] = alloc_cache(self.config, self.cfg.kv, bucket, cap, self._device)
        cache.lengths.zero_()
        cache.max_len, cache.batch = max_len, batch
        return cache

    @api
    def plan(self, rows: int) -> StepPlan:
        """Which kernels a decode step of `rows` rows runs (plan.py)."""
        return self._plan(rows)

    def _plan(self, rows: int) -> StepPlan:
        return plan_step(self.layers, self.scheme, self.config.hidden_size, self.cfg, self.tuning, rows)

    def _run_layers(self, h: torch.Tensor, cache: GpuCache, attend, plan: StepPlan, fold: Any = None) -> tuple:
        for i in range(self.config.n_layers):
            h, fold = run_layer(self.layers, self.norm, i, h, cache, attend, plan, fold, self.config.norm_eps,
                                self.tuning)
        return h, fold

    def _rope(self, i: int, qkv: torch.Tensor, pos: torch.Tensor, row: torch.Tensor, cache: GpuCache) -> torch.Tensor:
        """RoPE on q and k of qkv, k and v written to layer i's cache at (row, pos): the rotated q [T, nh, d]."""
        c = self.config
        ks, vs = cache.scales(i)
        return rope_kv(qkv, self.cos_sin, pos, row, cache.k[i], cache.v[i], c.n_heads, c.n_kv_heads, k_scale=ks,
                       v_scale=vs)

    # -- forward -----------------------------------------------------------------------------------------
    @api
    def forward(self, tokens: torch.Tensor, cache: GpuCache | None = None,
                rows: torch.Tensor | None = None, *, prefill_graph: bool = True, last: bool = False) -> torch.Tensor:
        """tokens [B, S] -> fp32 logits [B, S, V]; with a cache each row continues at its own length.
        prefill_graph=False: a prefill runs eagerly even when its shape has a graph (benchmarks: a new prompt's
        time to first token). last: only each row's last position, [B, 1, V] (the final norm and the lm_head on
        B rows, not B x S)."""
        B, S = tokens.shape
        check_token_ids(tokens, self.config.vocab_size)  # an id outside the table would read another row's memory
        if cache is None:
            cache = self.new_cache(B, S, scratch=True)
        rows_l = list(range(B)) if rows is None else [int(r) for r in rows]
        if S == 1:  # decode kernels (graph replay, or the same kernels eagerly with use_graphs off)
            return self._decode(tokens[:, 0], cache, rows_l)[:, None]
        return self._prefill(tokens, cache, rows_l, prefill_graph, last)

    def _prefill(self, tokens: torch.Tensor, cache: GpuCache, rows: list[int], graph_ok: bool = True,
                 last: bool = False) -> torch.Tensor:
        """Eager, or the replay of a graph captured the second time the same prefill shape comes (graphs.py)."""
        S = tokens.shape[1]
        with build.on_stream():
            idx = torch.tensor(rows, device=self._device)  # [B]
        starts = cache.lengths[idx].tolist()
        if max(starts) + S > cache.capacity:
            raise PromptError(f"the KV cache holds {cache.capacity} positions; {max(starts) + S} are needed")

        def eager() -> torch.Tensor:
            return self._prefill_body(*self._prefill_inputs(tokens, starts, rows), idx, cache, rows, starts, last)

        if not (graph_ok and self.cfg.use_graphs and self.cfg.prefill_graphs):
            return eager()
        key = (tuple(rows), S, tuple(starts), last)
        return self._prefill_graphs.run(cache, key, tokens, eager,
                                        lambda: self._capture_prefill(tokens, cache, rows, starts, idx, last))

    def _prefill_inputs(self, tokens: torch.Tensor, starts: list[int],
                        rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids, positions and cache rows of a prefill, flattened [T] int32 on the GPU."""
        S = tokens.shape[1]
        dev = self._device
        with build.on_stream():
            ids = tokens.to(dev, torch.int32).reshape(-1).contiguous()  # [T]
            pos = torch.cat([torch.arange(s, s + S, dtype=torch.int32) for s in starts]).to(dev)  # [T]
            row = torch.tensor(rows, dtype=torch.int32).repeat_interleave(S).to(dev)  # [T]
        return ids, pos, row

    def _prefill_body(self, ids: torch.Tensor, pos: torch.Tensor, row: torch.Tensor, idx: torch.Tensor,
                      cache: GpuCache, rows: list[int], starts: list[int], last: bool = False) -> torch.Tensor:
        """The prefill's kernels, from device inputs only (so a graph can capture them): fp32 logits [B, S, V]
        (last: [B, 1, V])."""
        B, S = len(rows), ids.shape[0] // len(rows)
        c = self.config
        with build.on_stream():
            h = embedding(self.embed, ids)  # [T, H]

            def attend(i: int, qkv: torch.Tensor) -> torch.Tensor:  # qkv [T, (nh + 2 nkv) d]
                q = self._rope(i, qkv, pos, row, cache)  # [T, nh, d]
                outs = [attention_prefill(q[b * S:(b + 1) * S], cache.k[i], cache.v[i], r, starts[b], *cache.scales(i))
                        for b, r in enumerate(rows)]  # each [S, nh, d]
                return (outs[0] if B == 1 else torch.cat(outs)).reshape(B * S, c.q_size)  # no copy for one row

            h, _ = self._run_layers(h, cache, attend, PREFILL)
            if last:
                h = h.view(B, S, -1)[:, -1].contiguous()  # [B, H]
            logits = self._logits(h).float().reshape(B, 1 if last else S, -1)  # [B, S or 1, V]
            cache.lengths[idx] += S
        return logits

    def _capture_prefill(self, tokens: torch.Tensor, cache: GpuCache, rows: list[int], starts: list[int],
                         idx: torch.Tensor, last: bool = False) -> tuple[torch.cuda.CUDAGraph, torch.Tensor,
                                                                          torch.Tensor, tuple]:
        """(graph, its ids input [T], its logits [B, S, V], the other inputs it reads) of this prefill shape: the
        graph holds their addresses, so the entry keeps them alive. Capturing runs nothing, so the cache and
        lengths are untouched until the replay; the eager run of the shape's first occurrence built the kernels
        and warmed cuBLAS and SDPA up."""
        ids, pos, row = self._prefill_inputs(tokens, starts, rows)
        graph, out = record(lambda: self._prefill_body(ids, pos, row, idx, cache, rows, starts, last))
        return graph, ids, out, (pos, row, idx)

    # -- decode --------------------------------------------------------------------------------------------
    def _decode(self, tokens: torch.Tensor, cache: GpuCache, rows: list[int],
                sampler: GpuRowSampler | None = None) -> torch.Tensor:
        """One token for each of `rows`: logits [len(rows), V], or with a sampler the sampled ids [len(rows)].

        Replays the bucket's graph (captured on first use, with or without sampling), or runs the same
        kernels eagerly when graphs are off."""
        with build.on_stream():
            idx = torch.tensor(rows, device=self._device)
            if int(cache.lengths[idx].max()) + 1 > cache.capacity:
                raise PromptError(f"the KV cache holds {cache.capacity} positions; a row is full")
            st = cache.step_buffers()
            st["tokens"][idx] = tokens.to(self._device, torch.int32)
            st["active"].zero_()
            st["active"][idx] = 1
        gpu = sampler.gpu if sampler is not None else None
        if not self.cfg.use_graphs:
            with build.on_stream():
                out = self._step_body(cache, gpu)
        else:
            key = "sampled" if sampler is not None else "logits"
            if cache.graphs.get(key) is None:
                cache.graphs[key] = self._capture(cache, gpu)
            graph, out = cache.graphs[key]
            with build.on_stream():
                graph.replay()
        with build.on_stream():
            return out[idx].long() if sampler is not None else out[idx].float()

    @api
    def decode_sampled(self, tokens: torch.Tensor, cache: GpuCache, rows: list[int],
                       sampler: GpuRowSampler) -> torch.Tensor:
        """Decode and sample on the GPU in one graph replay: the next token of each row [len(rows)]."""
        return self._decode(tokens, cache, rows, sampler)

    def _step_body(self, cache: GpuCache, sampler: GpuSampler | None) -> torch.Tensor:
        st = cache.static
        logits = self._decode_body(cache, advance=sampler is None)  # [Bb, V] fp16
        if sampler is None:
            return logits
        # the sampler also feeds the next replay its input ids (benchmarks replay without the host) and advances
        # the rows that decoded
        return sampler.sample(logits, StepState(st["tokens"], cache.lengths, st["active"]))  # [Bb] int32

    def _decode_body(self, cache: GpuCache, advance: bool) -> torch.Tensor:
        """The step's logits; `advance`: the lengths of the rows that decoded grow by one here (else the sampler
        does it)."""
        st = cache.static
        lens = st["lens"]  # [Bb] attention covers the new token: lengths + 1, written by the embedding kernel
        step_lens = (cache.lengths, lens)
        plan = self._plan(cache.bucket)
        fold = None
        if plan.folds_any:  # RMSNorms deferred into the GEMVs (norm_fold.py)
            h, fold = embedding_fold(self.embed, st["tokens"], self.layers[0].attn_norm, step_lens=step_lens,
                                     int8=plan.int8_fold)  # [Bb, H]
        else:
            h = embedding(self.embed, st["tokens"], step_lens=step_lens)  # [Bb, H]
        h, fold = self._run_layers(h, cache, self._decode_attend(cache, plan), plan, fold)
        logits = self._logits(h, fold)  # [Bb, V] fp16
        if advance:
            cache.lengths.add_(st["active"])  # only rows that decoded this step advance
        return logits

    def _decode_attend(self, cache: GpuCache, plan: StepPlan):
        """attend(i, qkv) of a decode step: RoPE, the K/V write and attention, in one kernel with fuse_rope."""
        c, st = self.config, cache.static
        lens = st["lens"]

        def attend(i: int, qkv: torch.Tensor):
            o_op = self.layers[i].o
            k, v, (ks, vs) = cache.k[i], cache.v[i], cache.scales(i)
            if self.cfg.fuse_rope:  # row b is cache row b (st["row"] is the identity) at position lens - 1
                if plan.defer_o:  # o_proj quantizes attention's output itself, from each unit's max |out|
                    return DeferredQuant(*attention_decode_rope_parts(qkv, self.cos_sin, k, v, lens, c.n_heads, ks, vs))
                if o_op.int8:  # one kernel: RoPE, the K/V write, attention and the o_proj input's quantization
                    return attention_decode_rope_quant(qkv, self.cos_sin, k, v, lens, c.n_heads, o_op.amax, ks, vs)
                return attention_decode_rope(qkv, self.cos_sin, k, v, lens, c.n_heads, ks, vs).reshape(-1, c.q_size)
            q = self._rope(i, qkv, cache.lengths, st["row"], cache)  # [Bb, nh, d] at position lengths
            if o_op.int8:
                return attention_decode_quant(q, k, v, lens, o_op.amax, ks, vs)
            return attention_decode(q, k, v, lens, ks, vs).reshape(-1, c.q_size)

        return attend

    def _capture(self, cache: GpuCache, sampler: GpuSampler | None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        with build.on_stream():
            # warm-up (builds kernels, allocates) must leave no trace: it writes K/V only where this step will
            # write them again, and everything else it changes is put back
            state = [cache.lengths, cache.static["tokens"]]
            if sampler is not None:
                state += [sampler.seen, sampler.rng, sampler.finished]
            saved = [t.clone() for t in state]
            self._step_body(cache, sampler)
            for t, v in zip(state, saved):
                t.copy_(v)
        return record(lambda: self._step_body(cache, sampler))

    @api
    def replay_steps(self, cache: GpuCache, steps: int, sampled: bool = True) -> None:
        """Replay the captured decode step `steps` times with no host work in between (benchmarks)."""
        graph, _ = cache.graphs["sampled" if sampled else "logits"]
        with build.on_stream():
            for _ in range(steps):
                graph.replay()

    def decode_pipe(self, cache: GpuCache, sampler: GpuRowSampler) -> EnginePipe:
        """Decode steps of `cache` queued ahead of the host (model_zoo.decode_pipe)."""
        return EnginePipe(self._capture, self.tuning, self.cfg.pipe_depth, cache, sampler)

    @api
    def make_sampler(self, cfg: SamplingConfig, batch: int) -> GpuRowSampler:
        """The bucket's sampler, reconfigured: its buffers persist so the sampled decode graph stays valid."""
        gpu = bucket_sampler(self._samplers, cfg, bucket_of(batch), self.config.vocab_size, self._device)
        return GpuRowSampler(gpu, self.tuning)
