"""Triton kernels of the MoE alignment plan (see :mod:`hopperkern.moe.align` for the layout they produce).

Slots are the flattened ``topk_ids`` positions ``s = t * top_k + j``. The slots are cut into chunks of
``CHUNK`` (a power of two); a slot's *bin* is its expert, or ``E`` when it is dropped (id -1, an id outside
``[0, E)``, or the chunk tail past the last slot). ``E_P`` (power of two, > E, >= 32) is the histogram width.

Two launch shapes share the same helpers:

- small (all slots in one chunk, CHUNK >= num_slots; up to 2048 slots, see ``align._one_launch``): ONE launch.
  Every program histograms the whole chunk (at most CHUNK ids) for the expert segments, then scatters its own
  sub-blocks of SUB slots and fills its own block tiles, so no program walks the chunk serially (decode: one
  launch, a few microseconds);
- large: count (grid = chunks) -> scan (one program) -> place (grid = the larger of the scatter's sub-blocks and
  the block tiles: each program scatters its sub-blocks and fills its block tile).

Ordering is deterministic: inside an expert, slots appear in increasing slot order (per-(chunk, expert)
bases from an exclusive scan over chunks; a sub-block's base inside its chunk from a histogram of the chunk's
earlier slots; ranks inside a sub-block from a [SUB, SUB] comparison tile). No sort: tl.sort is a bitonic
network that is slow on the GPU at 4096 elements and unusably slow in the interpreter.
"""

import triton
import triton.language as tl

from ..tma.jit import chain_start


@triton.jit
def _slot_bins(ids_ptr, chunk, num_slots, E, CHUNK: tl.constexpr):
    """Bin of each slot of ``chunk``: its expert, or E for a dropped / out-of-range id or the chunk tail."""
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1)
    # Range check in the loaded dtype, then narrow: an int64 id of 2**32 + 1 must not become expert 1.
    return tl.where((e >= 0) & (e < E), e, E).to(tl.int32)


@triton.jit
def _expert_layout(tot, BLOCK_M: tl.constexpr):
    """Padded segment of every expert from its slot count ``tot`` [E_P] (zero for bins >= E).

    Returns (starts, ends): expert e owns sorted rows [starts[e], ends[e]), a multiple of BLOCK_M long."""
    padded = (tot + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    return ends - padded, ends


@triton.jit
def _write_header(starts, ends, tot, offsets_ptr, counts_ptr, num_blocks_ptr, E, BLOCK_M: tl.constexpr,
                  E_P: tl.constexpr):
    """expert_offsets[0..E] (starts[E] is the padded total, since bins >= E are empty), counts, block count."""
    ex = tl.arange(0, E_P)
    tl.store(offsets_ptr + ex, starts, mask=ex <= E)
    tl.store(counts_ptr + ex, tot, mask=ex < E)
    tl.store(num_blocks_ptr, tl.max(ends, 0) // BLOCK_M)


@triton.jit
def _scatter_sub(ids_ptr, bins, chunk, sub, num_slots, base, sorted_ptr, E, CHUNK: tl.constexpr,
                 SUB: tl.constexpr, E_P: tl.constexpr, SUBS: tl.constexpr = 1):
    """Write the slot ids of sub-blocks ``sub .. sub + SUBS - 1`` (SUB slots each) of ``chunk`` to their sorted
    rows.

    ``bins`` [CHUNK] = the chunk's bins (:func:`_slot_bins`); ``base`` [E_P] = first sorted row of the chunk's
    expert-e slots. The first sub-block's own base adds a histogram of the chunk's slots before it; each
    further one adds the previous sub-block's counts. A slot's rank among its sub-block's earlier slots of its
    expert comes from a [SUB, SUB] comparison, and a one-hot [SUB, E_P] row-sum gathers the base (no
    data-dependent register index, no scan: tl.cumsum runs a Python combine per step in the interpreter)."""
    ex = tl.arange(0, E_P)
    i = tl.arange(0, SUB)
    earlier = tl.where(tl.arange(0, CHUNK) < sub * SUB, bins, E)  # bin E (dropped) is not counted below
    nxt = base + tl.where(ex < E, tl.histogram(earlier, E_P), 0)
    for s in range(0, SUBS):
        offs = chunk * CHUNK + (sub + s) * SUB + i
        e = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1)
        e = tl.where((e >= 0) & (e < E), e, E).to(tl.int32)  # check before narrowing int64 ids
        hot = (e[:, None] == ex[None, :]).to(tl.int32)
        rank = tl.sum(((e[None, :] == e[:, None]) & (i[None, :] < i[:, None])).to(tl.int32), axis=1)
        dest = tl.sum(hot * nxt[None, :], axis=1) + rank
        tl.store(sorted_ptr + dest, offs, mask=e < E)
        nxt += tl.sum(hot, axis=0)


@triton.jit
def _fill_blocks(tile, starts, ends, tot, block_expert_ptr, sorted_ptr, max_blocks, num_slots, E,
                 BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr, E_P: tl.constexpr):
    """Blocks tile*BLOCK_B.. : their expert (-1 past the last block) and the sentinel ``num_slots`` in the
    padding rows at the end of each expert's segment. Real rows are left to the scatter (disjoint writes)."""
    blocks = tile * BLOCK_B + tl.arange(0, BLOCK_B)
    ex = tl.arange(0, E_P)
    row0 = blocks * BLOCK_M
    # The block's expert = number of experts whose segment ends at or before the block's first row (empty
    # experts have ends == starts, so they are skipped correctly).
    before = (ends[None, :] <= row0[:, None]) & (ex[None, :] < E)
    e_blk = tl.sum(before.to(tl.int32), axis=1)
    live = (e_blk < E) & (blocks < max_blocks)
    tl.store(block_expert_ptr + blocks, tl.where(e_blk < E, e_blk, -1), mask=blocks < max_blocks)
    fill_from = tl.sum(tl.where(ex[None, :] == e_blk[:, None], (starts + tot)[None, :], 0), axis=1)
    rows = row0[:, None] + tl.arange(0, BLOCK_M)[None, :]
    pad = live[:, None] & (rows >= fill_from[:, None])
    tl.store(sorted_ptr + rows, tl.full((BLOCK_B, BLOCK_M), 0, tl.int32) + num_slots, mask=pad)


@triton.jit(do_not_specialize=["num_slots", "E", "max_blocks"])
def _align_small_kernel(
    ids_ptr,          # [num_slots] int32/int64, flattened topk_ids
    sorted_ptr,       # [max_blocks * BLOCK_M] int32 out: slot per sorted row, sentinel num_slots in padding
    block_expert_ptr, # [max_blocks] int32 out: expert of each block, -1 past the last one
    offsets_ptr,      # [E + 1] int32 out: first sorted row of each expert; offsets[E] = padded total
    counts_ptr,       # [E] int32 out: real slots per expert
    num_blocks_ptr,   # [1] int32 out: number of live blocks
    num_slots, E, max_blocks,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, E_P: tl.constexpr, BLOCK_B: tl.constexpr,
    PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False,
):
    """Whole plan in one launch when all slots fit in one chunk. Any grid: program p scatters sub-blocks p,
    p + grid, ... and fills block tiles p, p + grid, ...; program 0 writes the header."""
    chain_start(PDL_WAIT, PDL_TRIGGER)
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    ex = tl.arange(0, E_P)
    bins = _slot_bins(ids_ptr, 0, num_slots, E, CHUNK)
    tot = tl.where(ex < E, tl.histogram(bins, E_P), 0)
    starts, ends = _expert_layout(tot, BLOCK_M)
    if pid == 0:
        _write_header(starts, ends, tot, offsets_ptr, counts_ptr, num_blocks_ptr, E, BLOCK_M, E_P)
    for sub in range(pid, tl.cdiv(num_slots, SUB), step):
        _scatter_sub(ids_ptr, bins, 0, sub, num_slots, starts, sorted_ptr, E, CHUNK, SUB, E_P)
    for tile in range(pid, tl.cdiv(max_blocks, BLOCK_B), step):
        _fill_blocks(tile, starts, ends, tot, block_expert_ptr, sorted_ptr, max_blocks, num_slots, E,
                     BLOCK_M, BLOCK_B, E_P)


@triton.jit(do_not_specialize=["num_slots", "E"])
def _align_count_kernel(
    ids_ptr,          # [num_slots] int32/int64
    chunk_counts_ptr, # [num_chunks, E_P] int32 out: histogram of bins per chunk
    num_slots, E,
    CHUNK: tl.constexpr, E_P: tl.constexpr,
    PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False,
):
    """Grid (num_chunks,); one program = the bin histogram of one chunk."""
    chain_start(PDL_WAIT, PDL_TRIGGER)
    c = tl.program_id(0)
    bins = _slot_bins(ids_ptr, c, num_slots, E, CHUNK)
    tl.store(chunk_counts_ptr + c * E_P + tl.arange(0, E_P), tl.histogram(bins, E_P))


@triton.jit(do_not_specialize=["num_chunks", "E"])
def _align_scan_kernel(
    chunk_counts_ptr, # [num_chunks, E_P] int32
    base_ptr,         # [num_chunks, E_P] int32 out: first sorted row of chunk c's expert-e slots
    offsets_ptr,      # [E + 1] int32 out
    counts_ptr,       # [E] int32 out
    num_blocks_ptr,   # [1] int32 out
    num_chunks, E,
    BLOCK_M: tl.constexpr, E_P: tl.constexpr, BLOCK_C: tl.constexpr,
    PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False,
):
    """Grid (1,): expert totals, padded segments, then an exclusive scan over chunks (BLOCK_C rows at a time)."""
    chain_start(PDL_WAIT, PDL_TRIGGER)
    ex = tl.arange(0, E_P)
    cs = tl.arange(0, BLOCK_C)
    tot = tl.zeros((E_P,), dtype=tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        m = ((c0 + cs)[:, None] < num_chunks) & (ex[None, :] < E)
        tot += tl.sum(tl.load(chunk_counts_ptr + (c0 + cs)[:, None] * E_P + ex[None, :], mask=m, other=0), axis=0)
    starts, ends = _expert_layout(tot, BLOCK_M)
    _write_header(starts, ends, tot, offsets_ptr, counts_ptr, num_blocks_ptr, E, BLOCK_M, E_P)
    running = starts
    for c0 in range(0, num_chunks, BLOCK_C):
        m = ((c0 + cs)[:, None] < num_chunks) & (ex[None, :] < E)
        rows = tl.load(chunk_counts_ptr + (c0 + cs)[:, None] * E_P + ex[None, :], mask=m, other=0)
        tl.store(base_ptr + (c0 + cs)[:, None] * E_P + ex[None, :],
                 running[None, :] + tl.cumsum(rows, 0) - rows, mask=m)
        running += tl.sum(rows, axis=0)


@triton.jit(do_not_specialize=["num_slots", "E", "max_blocks", "num_scatter"])
def _align_place_kernel(
    ids_ptr,          # [num_slots] int32/int64
    base_ptr,         # [num_chunks, E_P] int32
    offsets_ptr,      # [E + 1] int32
    counts_ptr,       # [E] int32
    sorted_ptr,       # [max_blocks * BLOCK_M] int32 out
    block_expert_ptr, # [max_blocks] int32 out
    num_slots, E, max_blocks, num_scatter,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, E_P: tl.constexpr, SUBS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False,
):
    """Grid (max(num_scatter, cdiv(max_blocks, BLOCK_B)),), after the scan. Program p < num_scatter (=
    num_chunks * CHUNK // (SUB * SUBS)) writes the sorted rows of SUBS consecutive sub-blocks of SUB slots; program
    p < cdiv(max_blocks, BLOCK_B) fills the expert ids and padding sentinels of blocks p*BLOCK_B.. . The two write
    disjoint rows (real ones, padding ones), so one launch does both."""
    chain_start(PDL_WAIT, PDL_TRIGGER)
    per_chunk: tl.constexpr = CHUNK // (SUB * SUBS)
    p = tl.program_id(0)
    ex = tl.arange(0, E_P)
    c = p // per_chunk
    sub = (p % per_chunk) * SUBS
    if (p < num_scatter) & (c * CHUNK + sub * SUB < num_slots):  # the last chunk's tail sub-blocks hold no slot
        base = tl.load(base_ptr + c * E_P + ex, mask=ex < E, other=0)
        bins = _slot_bins(ids_ptr, c, num_slots, E, CHUNK)
        _scatter_sub(ids_ptr, bins, c, sub, num_slots, base, sorted_ptr, E, CHUNK, SUB, E_P, SUBS)
    if p < tl.cdiv(max_blocks, BLOCK_B):
        starts = tl.load(offsets_ptr + ex, mask=ex < E, other=0)
        tot = tl.load(counts_ptr + ex, mask=ex < E, other=0)
        ends = tl.load(offsets_ptr + ex + 1, mask=ex < E, other=0)
        _fill_blocks(p, starts, ends, tot, block_expert_ptr, sorted_ptr, max_blocks, num_slots, E, BLOCK_M, BLOCK_B,
                     E_P)
