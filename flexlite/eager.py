"""Attention in torch ops, a chunk of query rows at a time: the first calls of a mod whose kernels compile beside them.

A new score_mod (or the first mask_mod of a kind of input) needs its kernels compiled: 1.8-5 s on a GPU host
(benchmarks/NOTES.md 50, 67, 69). :mod:`flexlite.first_calls` runs such calls here instead while a worker thread
compiles the kernels (NOTES 78). The semantics are the kernels' and the fp64 reference's (flexlite.reference): the
mods are evaluated through vmap over each chunk's positions, a position is kept if its block is full, or partial and
the mask_mod keeps it, and a query row with nothing kept gives out 0 and LSE -inf. The arithmetic is float32: scores,
softmax and the matmuls' sums. bfloat16 and float16 operands are multiplied in their own dtype, P (and the
backward's dS) rounded to it first, as the kernels' tensor cores take them (:func:`native`; on a GPU half the time of
float32 operands, NOTES 105). Outputs agree with the kernels' to their tolerances, not bit for bit. Each chunk walks
only the keys its query blocks' block lists reach.

float64 inputs, which no kernel takes, run here in float64 on every device, as torch's flex_attention runs them on
its math path (gradcheck, tests), with score_mod's captured tensors' gradients too.

Memory: copies of key and value in the compute dtype (none for contiguous half-precision inputs), and a few
temporaries of :data:`CHUNK_SCORES` scores. Calls that walk more than :data:`MAX_SCORES` scores raise
:class:`TooLarge` (first_calls then waits for the kernels).
"""

from __future__ import annotations

import functools
from typing import Callable, Iterator, Optional

import torch

from ._vmap import index_vectors, vmap_bhqkv, vmap_positions

# scores per chunk (batch x heads x query rows x keys walked): 2**26 float32 = 256 MB a temporary
CHUNK_SCORES = 2 ** 26
# scores a call walks at most (its chunks' rows x keys x batch x heads): beyond, the torch ops would take longer than
# a compile (1.8-5 s; the harness's D64 shape, 2**34 scores, takes 0.29 s a forward and 0.86 s a backward on the
# H200 since NOTES 105, 0.61 and 1.09 s before)
MAX_SCORES = 2 ** 35


class TooLarge(RuntimeError):
    """A call that walks more than :data:`MAX_SCORES` scores: its kernels are the faster way."""


def fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether a call can run here: a chunk of one query row within :data:`CHUNK_SCORES` scores."""
    return query.shape[0] * query.shape[1] * key.shape[2] <= CHUNK_SCORES


class _Chunks:
    """The chunks of a call: query rows [q0, q1), the keys [k0, k1) their block lists reach, and which of those
    positions are kept (:meth:`keep`)."""

    def __init__(self, block_mask, B: int, H: int, Lq: int, Lkv: int, device: torch.device):
        self.block_mask, self.B, self.H, self.device = block_mask, B, H, device
        self.rows = max(1, CHUNK_SCORES // (B * H * Lkv))
        self.Lq, self.Lkv = Lq, Lkv
        if block_mask is None:
            return
        self.partial = block_mask.dense_blocks(full=False).to(device)
        self.full = block_mask.dense_blocks(full=True).to(device)
        # q block -> (first, last + 1) kv block any batch or head reaches (one copy to the host)
        reached = (self.partial | self.full).any(dim=1).any(dim=0)  # [nQ, nKV]
        cols = torch.arange(reached.shape[1], device=device)
        first = torch.where(reached, cols, reached.shape[1]).amin(dim=1)
        last = torch.where(reached, cols + 1, 0).amax(dim=1)
        self.reach = torch.stack([first, last], dim=1).tolist()

    def __iter__(self) -> Iterator[tuple]:
        for q0 in range(0, self.Lq, self.rows):
            q1 = min(self.Lq, q0 + self.rows)
            if self.block_mask is None:
                yield q0, q1, 0, self.Lkv
                continue
            bq, bkv = self.block_mask.BLOCK_SIZE
            spans = self.reach[q0 // bq:(q1 - 1) // bq + 1]
            first, last = min(s[0] for s in spans), max(s[1] for s in spans)
            if first < last:  # (no block reached: the rows stay out 0, LSE -inf)
                yield q0, q1, first * bkv, min(self.Lkv, last * bkv)

    def check_size(self) -> None:
        """:class:`TooLarge` where the chunks walk more than :data:`MAX_SCORES` scores."""
        walked = self.B * self.H * sum((q1 - q0) * (k1 - k0) for q0, q1, k0, k1 in self)
        if walked > MAX_SCORES:
            raise TooLarge(f"{walked} scores to walk, more than eager.MAX_SCORES = {MAX_SCORES}")

    def _blocks(self, q0: int, q1: int, k0: int, k1: int) -> tuple:
        """(full, partial): bool [B or 1, H or 1, q1 - q0, k1 - k0], whether a position's block is in its query block's
        lists, as full or as partial."""
        bq, bkv = self.block_mask.BLOCK_SIZE
        qb = torch.arange(q0, q1, device=self.device) // bq
        kb = torch.arange(k0, k1, device=self.device) // bkv
        return self.full[:, :, qb][:, :, :, kb], self.partial[:, :, qb][:, :, :, kb]

    def reached(self, q0: int, q1: int, k0: int, k1: int) -> Optional[torch.Tensor]:
        """bool [B or 1, H or 1, q1 - q0, k1 - k0]: the positions whose block the kernels read for the row, masked
        or not (None: all)."""
        if self.block_mask is None:
            return None
        full, partial = self._blocks(q0, q1, k0, k1)
        return full | partial

    def keep(self, q0: int, q1: int, k0: int, k1: int) -> Optional[torch.Tensor]:
        """bool [B or 1, H or 1, q1 - q0, k1 - k0]: the positions kept (None: all)."""
        if self.block_mask is None:
            return None
        full, partial = self._blocks(q0, q1, k0, k1)
        mask_mod = self.block_mask.mask_mod
        if mask_mod is not None:
            # the kernels call mask_mod with the real (b, h) even where the block structure broadcasts
            mask = vmap_bhqkv(mask_mod)(*index_vectors(self.B, self.H, q1 - q0, k1 - k0, self.device,
                                                        q_start=q0, kv_start=k0))
            partial = partial & mask.to(torch.bool)
        return full | partial


def _grouped(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv * groups, R, X] -> [B, Hkv, groups * R, X]: query rows next to their kv head's (no copy of key and
    value per query head)."""
    B, H, R, X = t.shape
    return t.reshape(B, H // groups, groups * R, X)


def _ungrouped(t: torch.Tensor, groups: int) -> torch.Tensor:
    B, Hkv, GR, X = t.shape
    return t.reshape(B, Hkv * groups, GR // groups, X)


def _by_kv_head(x: torch.Tensor, t: torch.Tensor, groups: int) -> torch.Tensor:
    """x [B, H, R, X] (query heads) @ t [B, Hkv, X, N] (each kv head's for the query heads it serves) -> [B, H, R, N]
    (:func:`_matmul`). A key or value shared by the batch (a stride-0 batch: flex_attention hands one of batch 1 on
    so) is multiplied once for the whole batch, not copied to it."""
    g = _grouped(x, groups)  # [B, Hkv, G * R, X]
    B, Hkv, M, X = g.shape
    if B > 1 and t.stride(0) == 0:
        folded = _matmul(g.transpose(0, 1).reshape(1, Hkv, B * M, X), t[:1])
        return _ungrouped(folded.reshape(Hkv, B, M, -1).transpose(0, 1), groups)
    return _ungrouped(_matmul(g, t), groups)


HALF = (torch.bfloat16, torch.float16)


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, X] @ b [..., X, N] (the same leading dims); bfloat16 and float16 operands (:func:`native`) give
    float32: multiplied in their dtype with float32 sums where torch's ``bmm`` takes an ``out_dtype`` on their
    device (CUDA), else cast to float32 first (the same products: a half-precision value is exact in float32)."""
    if a.dtype not in HALF:
        return a @ b
    if not _half_products(a.device):
        return a.float() @ b.float()
    out = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), out_dtype=torch.float32)
    return out.reshape(*a.shape[:-2], *out.shape[-2:])


@functools.lru_cache(maxsize=None)
def _half_products(device: torch.device) -> bool:
    a = torch.ones(1, 1, 1, dtype=torch.bfloat16, device=device)
    try:
        return torch.bmm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):  # (a torch without the overload, or not for this device)
        return False


def native(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether both passes keep key and value in their dtype and multiply in it (:func:`_matmul`), P and dS rounded
    to it first as the kernels round them: bfloat16 or float16 inputs of one dtype."""
    return query.dtype in HALF and key.dtype == value.dtype == query.dtype


def scores(q: torch.Tensor, k: torch.Tensor, groups: int, scale: float, score_mod: Optional[Callable],
            q0: int, k0: int) -> tuple:
    """(the scaled scores q @ k^T [B, H, R, K] as they enter score_mod, what score_mod makes of them), in q's
    compute dtype (float32 for half-precision q: :func:`_matmul`). Under grad mode score_mod gets a copy of the
    scores, so that one changing them in place (``score *= 2``) leaves autograd the scores its derivative is taken
    at."""
    B, H, R, _ = q.shape
    raw = _by_kv_head(q, k.transpose(-1, -2), groups) * scale
    if score_mod is None:
        return raw, raw
    given = raw
    if torch.is_grad_enabled():
        raw.requires_grad_(True)
        given = raw.clone()
    modded = vmap_bhqkv(score_mod, prefix=(0,))(given, *index_vectors(B, H, R, k.shape[2], q.device, q_start=q0,
                                                                       kv_start=k0))
    return raw, modded.to(raw.dtype)


def _any_nonfinite(chunks: _Chunks, v: torch.Tensor) -> bool:
    """Whether some of the values ``v`` are NaN or inf and a block mask decides which rows read them (else every row
    reads every key, and the plain products are the kernels'). One pass over v and one host read per call."""
    return chunks.block_mask is not None and not bool(torch.isfinite(v).all())


def _nonfinite(v: torch.Tensor, any_nonfinite: bool) -> Optional[torch.Tensor]:
    """Where a chunk's values ``v`` are NaN or inf (None: nowhere, or no call's value is)."""
    if not any_nonfinite:
        return None
    bad = ~torch.isfinite(v)
    return bad if bool(bad.any()) else None


def _read_values(p: torch.Tensor, v: torch.Tensor, bad: torch.Tensor, reached: torch.Tensor,
                 groups: int) -> torch.Tensor:
    """P @ V where some of V is NaN or inf, as the kernels compute it: a row reads the values of the blocks its
    query block's lists hold (0 * NaN is NaN there) and never those of the others (where P @ V would give 0 * NaN
    too). The finite values by a matmul; per output element, NaN where a read value is NaN, an inf times a weight of
    0, or infs of both signs, else the read infs' sign."""
    B, H, R, K = p.shape
    reached = reached.expand(B, H, R, K)
    out = _by_kv_head(p, v.masked_fill(bad, 0.0), groups)

    def any_read(rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return _by_kv_head(rows.to(p.dtype), values.to(p.dtype), groups) > 0
    nan = any_read(reached, v.isnan()) | any_read(reached & (p == 0), v.isinf())
    pos, neg = (any_read(reached & (p > 0), v == sign * float("inf")) for sign in (1, -1))
    out = torch.where(pos, float("inf"), torch.where(neg, float("-inf"), out))
    return out.masked_fill(nan | (pos & neg), float("nan"))


def _weights_lse(s: torch.Tensor) -> tuple:
    """(P, LSE, the row maxima m) of a forward chunk's scores: P by torch's fused softmax, each row normalized by its
    own sum as in :func:`_weights`, 0 in a row with nothing kept; LSE = m - log(max P) (max P is 1 / the row's sum of
    exp(s - m)), m itself where m is -inf (nothing kept) or +inf (as logsumexp). 0.66 ms a chunk at the D64 harness
    shape, where logsumexp and :func:`_weights` took 1.51 (NOTES 105)."""
    m = s.amax(dim=-1, keepdim=True)
    p = torch.softmax(s, dim=-1).masked_fill_(torch.isneginf(m), 0.0)
    lse = torch.where(torch.isinf(m), m, m - p.amax(dim=-1, keepdim=True).log())
    return p, lse.squeeze(-1), m.squeeze(-1)


def _weights(s: torch.Tensor) -> torch.Tensor:
    """P = softmax(s) along the keys (a chunk holds whole rows), each row normalized by its own sum, as the kernels'
    running max and sum do (exp(s - LSE) is not: where a row's scores are all one value far from 0, -1e20 say, LSE
    rounds back to it and the log of the count is lost, every weight 1). 0 in a row with nothing kept; NaN in one
    with a +inf or NaN score."""
    m = s.amax(dim=-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isneginf(m), torch.zeros_like(m), m))
    total = e.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, e / total, e)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the passes compute in for inputs of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_listed(block_mask, B: int, H: int) -> None:
    """:class:`TooLarge` where the scores of the blocks ``block_mask`` lists pass :data:`MAX_SCORES` (at most what
    the chunks walk)."""
    listed = sum(int(t.sum(dtype=torch.int64)) for t in (block_mask.kv_num_blocks, block_mask.full_kv_num_blocks)
                 if t is not None)
    Bm, Hm = block_mask.kv_num_blocks.shape[:2]
    scores = listed * block_mask.BLOCK_SIZE[0] * block_mask.BLOCK_SIZE[1] * (B // Bm) * (H // Hm)
    if scores > MAX_SCORES:
        raise TooLarge(f"{scores} scores in the listed blocks, more than eager.MAX_SCORES = {MAX_SCORES}")


def _start(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask, limit: bool,
           in_dtype: bool = False) -> tuple:
    """A pass's chunks (``limit``: :class:`TooLarge` where they walk too many scores), query heads per kv head, and
    key and value in the compute dtype (``in_dtype``: in their own, :func:`native`)."""
    B, H, Lq, _ = query.shape
    if limit and block_mask is not None and B * H * Lq * key.shape[2] > MAX_SCORES:
        _check_listed(block_mask, B, H)  # (before the chunks' dense block flags, which are large where this fails)
    chunks = _Chunks(block_mask, B, H, Lq, key.shape[2], query.device)
    if limit:
        chunks.check_size()
    dtype = query.dtype if in_dtype else compute_dtype(query.dtype)
    # detached: the backward takes score_mod's derivative by autograd from the scores it recomputes, and a key already
    # in the compute dtype (float32's, float64's: no copy) would tie them to the key, so that a score_mod capturing
    # the key itself got the attention's dK a second time through them
    return chunks, H // key.shape[1], _cast(key.detach(), dtype), _cast(value.detach(), dtype)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``, contiguous (each chunk's matmul then takes a view of it); one shared by the batch (stride
    0) cast once and expanded again, not copied per batch."""
    if t.shape[0] > 1 and t.stride(0) == 0:
        return t[:1].to(dtype).contiguous().expand(t.shape)
    return t.to(dtype).contiguous()


def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: Optional[Callable], block_mask,
            scale: float, max_scores: bool = False, limit: bool = True) -> tuple:
    """(out in the input dtype, LSE in natural log and row maxima or None, both in the compute dtype), as
    flex_attention's kernels return them. ``limit``: refuse calls past :data:`MAX_SCORES`."""
    chunks, groups, k, v = _start(query, key, value, block_mask, limit, native(query, key, value))
    B, H, Lq, _ = query.shape
    dtype = compute_dtype(query.dtype)
    out = torch.zeros((B, H, Lq, value.shape[-1]), dtype=dtype, device=query.device)
    lse = torch.full((B, H, Lq), float("-inf"), dtype=dtype, device=query.device)
    row_max = lse.clone() if max_scores else None
    any_nonfinite = _any_nonfinite(chunks, v)
    with torch.no_grad():
        for q0, q1, k0, k1 in chunks:
            _, s = scores(query[:, :, q0:q1].to(k.dtype), k[:, :, k0:k1], groups, scale, score_mod, q0, k0)
            keep = chunks.keep(q0, q1, k0, k1)
            if keep is not None:
                s = s.masked_fill(~keep, float("-inf"))
            p, lse[:, :, q0:q1], m = _weights_lse(s)
            bad = _nonfinite(v[:, :, k0:k1], any_nonfinite)
            out[:, :, q0:q1] = (_by_kv_head(p.to(v.dtype), v[:, :, k0:k1], groups) if bad is None else
                                _read_values(p, v[:, :, k0:k1].to(dtype), bad, chunks.reached(q0, q1, k0, k1), groups))
            if max_scores:
                row_max[:, :, q0:q1] = m
    return out.to(query.dtype), lse, row_max


def backward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
             grad_out: Optional[torch.Tensor], grad_lse: Optional[torch.Tensor], score_mod: Optional[Callable],
             block_mask, scale: float, captured: tuple = (), limit: bool = True) -> tuple:
    """(dq, dk, dv, [the gradients of ``captured``, tensors score_mod reads]) in the inputs' dtypes from the
    forward's out: each chunk's scores recomputed, dS from the weights (P as the forward's, :func:`_weights`), and
    score_mod's derivative by autograd over its vmapped ops (no LSE: the weights are normalized by their own sums).
    Half-precision inputs multiply in their dtype with float32 sums, dS and P rounded to it, as the forward's
    (:func:`native`). ``limit``: as :func:`forward`'s."""
    chunks, groups, k, v = _start(query, key, value, block_mask, limit, native(query, key, value))
    dtype = compute_dtype(query.dtype)
    dq = torch.zeros(query.shape, dtype=dtype, device=query.device)
    dk, dv = (torch.zeros(t.shape, dtype=dtype, device=t.device) for t in (k, v))  # (full batch: autograd sums)
    dcaptured = [torch.zeros(t.shape, dtype=dtype, device=t.device) for t in captured]
    do = grad_out.to(k.dtype) if grad_out is not None else torch.zeros_like(out, dtype=k.dtype)
    delta = (do.to(dtype) * out.to(dtype)).sum(-1)  # [B, H, Lq]: rowsum(dO * O)
    any_nonfinite = _any_nonfinite(chunks, v)
    for q0, q1, k0, k1 in chunks:
        q = query[:, :, q0:q1].detach().to(k.dtype)  # (as key and value: _start)
        with torch.enable_grad():
            raw, s = scores(q, k[:, :, k0:k1], groups, scale, score_mod, q0, k0)
        keep = chunks.keep(q0, q1, k0, k1)
        with torch.no_grad():
            p = _weights(s if keep is None else s.masked_fill(~keep, float("-inf")))
            bad = _nonfinite(v[:, :, k0:k1], any_nonfinite)
            if bad is None:
                dp = _by_kv_head(do[:, :, q0:q1], v[:, :, k0:k1].transpose(-1, -2), groups)
            else:  # (as the forward's: dP NaN where a row reads a NaN or inf value, 0 * it never where it does not)
                dp = _by_kv_head(do[:, :, q0:q1], v[:, :, k0:k1].masked_fill(bad, 0.0).transpose(-1, -2), groups)
                bad_key = bad.any(-1).repeat_interleave(groups, dim=1).unsqueeze(2)  # [B, H, 1, K]
                dp = dp.masked_fill(chunks.reached(q0, q1, k0, k1) & bad_key, float("nan"))
            ds = p * (dp - delta[:, :, q0:q1].unsqueeze(-1))
            if grad_lse is not None:
                ds = ds + p * grad_lse[:, :, q0:q1].to(dtype).unsqueeze(-1)
        if score_mod is not None:  # dS through score_mod's ops to the raw scores and the captured tensors
            ds, grads = through_score_mod(raw, s, ds, captured, score_mod, q0, k0)
            dcaptured = [total + g.to(total.dtype) for total, g in zip(dcaptured, grads)]
            if keep is not None:  # (a masked position's derivative may be NaN, its dS is 0)
                ds = ds.masked_fill(~keep, 0.0)
        with torch.no_grad():  # (dS and P in k's dtype: rounded to a half-precision input's, as the kernels round them)
            ds, p = (ds * scale).to(k.dtype), p.to(k.dtype)
            dq[:, :, q0:q1] = _by_kv_head(ds, k[:, :, k0:k1], groups)
            dk[:, :, k0:k1] += _matmul(_grouped(ds, groups).transpose(-1, -2), _grouped(q, groups))
            dv[:, :, k0:k1] += _matmul(_grouped(p, groups).transpose(-1, -2), _grouped(do[:, :, q0:q1], groups))
    return (dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype),
            [g.to(t.dtype) for g, t in zip(dcaptured, captured)])


# positions per step where captured tensors' gradients are summed over a list of positions (_grads_at_positions)
POSITIONS_PER_STEP = 2 ** 20


def through_score_mod(raw: torch.Tensor, modded: torch.Tensor, ds: torch.Tensor, captured: tuple,
                      score_mod: Optional[Callable] = None, q0: int = 0, k0: int = 0) -> tuple:
    """(dS at score_mod's input, the gradients of ``captured``) from dS at its output ``modded``: autograd of
    sum(modded * dS) (not grad_outputs=dS: autograd.grad imports sympy for grad_outputs, 2 s on a GPU host the first
    time: NOTES 78); zeros for what score_mod does not depend on. Where a captured tensor's gradient is not finite and
    ``score_mod`` is given (the chunk's rows from ``q0``, keys from ``k0``), it is summed again over the positions dS
    reaches (nonzero; a masked position's dS is 0), as the kernels sum it: a position left out whose derivative is
    not finite (score_mod's sqrt(q_idx - kv_idx) above a causal mask's diagonal) gave 0 * inf = NaN there."""
    inputs = (raw, *captured)
    grads = [None] * len(inputs)
    if modded.requires_grad:
        with torch.enable_grad():  # (a backward runs with grad mode off)
            grads = torch.autograd.grad((modded * ds).sum(), inputs, allow_unused=True)
    finite = [torch.isfinite(g).all() for g in grads[1:] if g is not None]
    if score_mod is not None and finite and not bool(torch.stack(finite).all()):  # (one host read per chunk)
        grads = _grads_at_positions(score_mod, raw, ds, captured, q0, k0)
    return (torch.zeros_like(raw) if grads[0] is None else grads[0],
            [torch.zeros_like(t) if g is None else g for g, t in zip(grads[1:], captured)])


def _grads_at_positions(score_mod: Callable, raw: torch.Tensor, ds: torch.Tensor, captured: tuple, q0: int,
                        k0: int) -> list:
    """:func:`through_score_mod`'s gradients from score_mod evaluated at the positions where ``ds`` is nonzero (NaN
    included) alone, :data:`POSITIONS_PER_STEP` at a time."""
    positions = (ds != 0).nonzero()
    totals = [torch.zeros_like(raw)] + [torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in captured]
    for start in range(0, positions.shape[0], POSITIONS_PER_STEP):
        b, h, r, c = positions[start:start + POSITIONS_PER_STEP].unbind(1)
        with torch.enable_grad():
            score = raw.detach()[b, h, r, c].requires_grad_(True)
            modded = vmap_positions(score_mod)(score.clone(), *(i.to(torch.int32) for i in (b, h, r + q0, c + k0)))
            if not modded.requires_grad:
                continue
            grads = torch.autograd.grad((modded.to(ds.dtype) * ds[b, h, r, c]).sum(), (score, *captured),
                                        allow_unused=True)
        if grads[0] is not None:
            totals[0][b, h, r, c] = grads[0]
        for total, g in zip(totals[1:], grads[1:]):
            if g is not None:
                total += g
    return totals
