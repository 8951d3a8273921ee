"""A decode layer's AWQ GEMVs in one persistent kernel (awq_chain.cu): o_proj (+ residual), gate|up (SwiGLU),
down_proj (+ residual) and, when there is a next layer, its q|k|v, separated by grid barriers instead of
kernel boundaries. Each output is bit for bit what awq_gemv.cu's 8-warp entries compute for the same call (the
same panel body, awq_gemv.cuh, the same order of sums); awq_linear picks those where a grid has few panels, the
4-warp ones elsewhere (LLaMA-2-7B's gate|up), whose sums differ by rounding only.

Where it runs (`takes`): up to 8 tokens with the deferred RMSNorms (norm_fold.py: the chain has no room for a
norm kernel between its GEMVs), every weight in groups of 128 k; the engine with EngineConfig(chain_gemvs=True).
Measured slower than the separate kernels (H200, LLaMA-2-7B awq decode: -6.7 / -7.7 / -12.0% at batch 1 / 2 /
4): the four GEMVs take 43.2 us as a chain, 43.1 as separate 8-warp kernels, 40.3 as the engine launches them
(4-warp gate|up), so the kernel boundaries it removes cost next to nothing under PDL.

    o_in [M, nh d] -- o_proj + h --> h1 [M, H] (+ ffn xg, part) -- gate|up --> a [M, F]
       -- down_proj + h1 --> h2 [M, H] (+ next xg, part) -- next q|k|v --> qkv [M, (nh + 2 nkv) d]

Residency, which a grid barrier needs: the grid is at most what the SMs hold at once (the occupancy query times
the SMs; not a cooperative launch, which stream capture refuses), and nothing else on the GPU waits on the
chain: the kernel before it has finished once the chain's blocks pass their PDL wait (they issue weight loads
only before it), and the kernel after it is let in only once every block has passed the last barrier. A GPU
shared with other processes (MPS with an SM limit) could hold fewer blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels_cu import build, norm_fold
from kernels_cu.awq_gemv import AwqPacked, folds
from kernels_cu.checks import check_tensor
from kernels_cu.gemm_shapes import sm_count
from kernels_cu.norm_fold import FoldOut

MAX_M = 8  # one token tile (the _mt1 body)
GROUP_RUN = 128  # the _g1 body: terms per 128 k
WARPS = 8
THREADS = 32 * WARPS
BLOCKS_PER_SM = 2  # __launch_bounds__(256, 2)
# awq_chain.cu's Phase: y, x, packed, terms, residual, N, K, tiles, fold_w, fold_xg, fold_part, fold_in
PHASE_SIGNATURE = "PPPPPiiiPPPP"
SIGNATURE = PHASE_SIGNATURE * 4 + "iifP"
ENTRY = "awq_chain_mt1_g1"

_BARRIERS: dict[int, torch.Tensor] = {}  # device index -> the grid barrier's word (int32 [1])


@dataclass(frozen=True)
class ChainOut:
    """What a chain writes: the residual stream after o_proj and after down_proj, the SwiGLU activations, and the
    next layer's q|k|v (None for the last layer)."""

    h1: torch.Tensor  # [M, H]
    a: torch.Tensor  # [M, F]
    h2: torch.Tensor  # [M, H]
    qkv: torch.Tensor | None  # [M, (nh + 2 nkv) d]


def takes(m: int, ops: list[AwqPacked]) -> bool:
    """Whether the chain runs these GEMVs for m tokens: one token tile with the deferred norm, groups of 128."""
    if not 1 <= m <= MAX_M:
        return False
    return all(p.gs == GROUP_RUN and folds(p, m) for p in ops)


def awq_chain(o_in: torch.Tensor, h: torch.Tensor, o: AwqPacked, gate_up: AwqPacked, down: AwqPacked,
              ffn: FoldOut, nxt: FoldOut, eps: float, qkv: AwqPacked | None = None,
              blocks: int | None = None) -> ChainOut:
    """One layer's o_proj .. down_proj (and the next layer's q|k|v) for M = o_in.shape[0] tokens.

    h: the layer's residual stream [M, H]; ffn: the deferred ffn_norm (o_proj produces it, gate|up consumes it);
    nxt: the norm after the layer (down_proj produces it, the next q|k|v consumes it, or the engine's lm_head).
    blocks: the grid (tests: few blocks, many panels each); by default every block the GPU holds at once."""
    M, H = h.shape
    _check(o_in, h, o, gate_up, down, ffn, nxt, qkv)
    fn = build.get_function("awq_chain.cu", ENTRY, SIGNATURE)
    with build.on_stream():
        dev = h.device
        h1 = torch.empty((M, H), dtype=torch.float16, device=dev)  # [M, H]
        a = torch.empty((M, gate_up.out_features), dtype=torch.float16, device=dev)  # [M, F]
        h2 = torch.empty((M, H), dtype=torch.float16, device=dev)  # [M, H]
        q = torch.empty((M, qkv.n), dtype=torch.float16, device=dev) if qkv is not None else None
        phases = [
            _phase(h1, o_in, o, h, fold_out=ffn),
            _phase(a, ffn.xg, gate_up, None, fold_in=ffn),
            _phase(h2, a, down, h1, fold_out=nxt),
            _phase(q, nxt.xg, qkv, None, fold_in=nxt) if qkv is not None else _phase(None, None, None, None),
        ]
        resident = min(BLOCKS_PER_SM, fn.max_active_blocks(THREADS)) * sm_count(dev.index)
        if blocks is None:
            blocks = resident
        elif not 1 <= blocks <= resident:  # a grid barrier would wait forever for blocks that never become resident
            raise ValueError(f"the AWQ chain's grid must be 1-{resident} blocks (all resident at once), got {blocks}")
        fn((blocks,), (THREADS,), *[v for p in phases for v in p], 4 if qkv is not None else 3, M, float(eps),
           _barrier(dev))
    return ChainOut(h1, a, h2, q)


def _phase(y, x, p: AwqPacked | None, residual, fold_out: FoldOut | None = None,
           fold_in: FoldOut | None = None) -> tuple:
    """One Phase's arguments, in PHASE_SIGNATURE's order (awq_gemv.cu's, less M and eps)."""
    if p is None:
        return (None,) * 5 + (0, 0, 0) + (None,) * 4
    return (y, x, p.packed, p.terms, residual, p.n, p.k, p.tiles, *norm_fold.out_args(fold_out),
            fold_in.part if fold_in is not None else None)


def _barrier(device: torch.device) -> torch.Tensor:
    """The device's barrier word. Its value does not matter (each barrier adds 2^31 and passes on the top bit's
    flip), so one word serves every chain: fllama's kernels run on one stream, and a chain lets the next kernel
    in only after its last barrier. Allocated outside any capture, as counters.py's."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    word = _BARRIERS.get(index)
    if word is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the AWQ chain's barrier must exist before graph capture: run the same call once first")
        word = _BARRIERS[index] = torch.zeros(1, dtype=torch.int32, device=device)  # [1]
    return word


def _check(o_in: torch.Tensor, h: torch.Tensor, o: AwqPacked, gate_up: AwqPacked, down: AwqPacked,
           ffn: FoldOut, nxt: FoldOut, qkv: AwqPacked | None) -> None:
    if h.dim() != 2:
        raise ValueError(f"h must be [M, H], got {tuple(h.shape)}")
    M, H = h.shape
    check_tensor(h, "h", torch.float16)
    check_tensor(o_in, "o_in", torch.float16, (M, o.k))
    ops = [o, gate_up, down] + ([qkv] if qkv is not None else [])
    if not takes(M, ops):
        raise ValueError(f"the AWQ chain runs 1-{MAX_M} tokens with groups of {GROUP_RUN} k, got M = {M}, "
                         f"group runs {[p.gs for p in ops]}")
    if o.swiglu or down.swiglu or not gate_up.swiglu or (qkv is not None and qkv.swiglu):
        raise ValueError("the chain is o_proj, a SwiGLU gate|up, down_proj and a plain q|k|v")
    if o.n != H or gate_up.k != H or down.k != gate_up.out_features or down.n != H or (qkv is not None and qkv.k != H):
        raise ValueError(f"chain shapes do not meet: H = {H}, o {o.k}->{o.n}, gate|up {gate_up.k}->"
                         f"{gate_up.out_features}, down {down.k}->{down.n}" + (f", q|k|v {qkv.k}" if qkv else ""))
    norm_fold.check_out(ffn, M, H)
    norm_fold.check_out(nxt, M, H)
