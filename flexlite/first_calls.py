"""A new mask_mod's first calls while its own kernels compile.

flex_attention compiles kernels for each new pair of mods and each new shape: 1.8-5 s on an H100's host, most of it
ptxas (benchmarks/NOTES.md 67, 69). A mask_mod need not make its first calls wait for that. Its block mask is
evaluated once in torch into bits, one per position (:func:`bits_mask`: the mask_mod vmapped over each partial block,
as the fp64 reference evaluates it; full blocks all ones, empty ones all zeros), and a mask_mod that reads those bits
(:func:`bits_mask_mod`) has one source for every mask: its kernels, once compiled for a score_mod and shape, serve
every later mask_mod. While they run the first calls, a worker thread compiles the mod's own kernels
(``launch.compile_only``: Triton's warmup, nothing launched) from traces made on the calling thread; later calls take
those (benchmarks/NOTES.md 72).

The bits' kernels are the mod's own but for how the mask is read: the same templates, tiles and walk (the tiles chosen
for the original mask_mod: :attr:`BitsMask.gathers`), so outputs and gradients are those of the mod's own kernels.

Where it applies (:func:`applies`): CUDA (``ENABLED``; the interpreter compiles nothing), no kernel_options (nor
FLEXLITE_AUTOTUNE), no CUDA graph being captured; the bits need a block mask with a mask_mod, while any new forward
whose inputs require grad has its backward compiled beside it (a new score_mod's too). A kernel set is known compiled
once a call has run it or the worker has compiled it (:func:`signature`: per kind of input, not per length): the first
mask_mod of a kind compiles its own kernels in the call (as without this) and the worker then compiles the bits'
kernels, so that the next mask_mod's first call does not wait. The bits' kernels are marked for later processes
(:func:`mark_ready`'s ``persist``), whose first mask_mod of that kind takes them from Triton's disk cache.
:func:`wait` waits for the worker (before timing, or capturing a CUDA graph).

Where no bits serve a call whose kernels are not compiled yet (a new score_mod, the first mask_mod of a kind of input, no
block mask), the call runs in torch ops (:mod:`flexlite.eager`, :data:`EAGER`) while the worker compiles its kernels
(and the bits' for the next mask_mod); so do later calls, forward and backward, until they are compiled. Those calls'
results agree with the kernels' to their tolerances, not bit for bit (float32 throughout: NOTES 78).

The worker (:data:`COMPILE_THREADS` threads) has Triton's compiles run in compile servers, processes of their own
(:data:`COMPILE_PROCESSES`, runtime/compile_processes.py), so that they do not hold this process's GIL while the calls
go on (NOTES 79).

create_block_mask takes the same way on CUDA (:func:`block_flags_in_torch`): a new mask_mod's block mask is evaluated
in torch (vmapped over chunks, as on CPU) while the worker compiles its block-mask kernel for the next one.
"""

from __future__ import annotations

import concurrent.futures
import copy
import hashlib
import os
import threading
from pathlib import Path
from typing import Callable, Optional

import torch

from .block_mask import BlockMask, kept_on, tensors_key
from .codegen.trace import MASK_MOD_ARGS, arguments_read, trace_mod, tracing_refused
from .runtime import compile_processes, launch
from .runtime.autotune import autotune_enabled
from .runtime.compile import cache_dir, source_hash

# whether a new mask_mod's first calls run the bits' kernels while its own compile beside them: False never, True
# on CUDA, "always" on every device too (the interpreter compiles nothing: for tests)
ENABLED: "bool | str" = True
# whether calls whose kernels are not compiled and that no bits serve run in torch ops (flexlite.eager) while the
# kernels compile beside (where ENABLED applies): False compiles them in the call
EAGER = True
# bits kept per block mask at most (bytes): beyond, the mod's own kernels compile in the call
MAX_BITS_BYTES = 256 << 20
# a new mask_mod's block mask is evaluated in torch (vmapped, as on CPU) while its kernel compiles beside, up to this
# many positions (B x H x Q_LEN x KV_LEN); beyond, create_block_mask compiles the kernel in the call
MAX_TORCH_POSITIONS = 2 ** 26
# what a marker file promises, in its name: 2 since the bits' backward compiles both grids of the warp-specialized
# backward (benchmarks/NOTES.md 73), where 1's compiled the first mask_mod's
_MARKER_VERSION = 2
# the worker's Triton compiles run in up to this many processes of their own (runtime/compile_processes.py), a kernel
# set's kernels at once: in the worker thread Triton's C++ passes held the GIL 0.4-1 s at a time, and the
# calls beside waited (benchmarks/NOTES.md 79); 0: in the worker thread
COMPILE_PROCESSES = min(4, max(1, (os.cpu_count() or 2) // 2))
# worker threads: kernel sets compiling at once (their Python passes take turns; one running beside a call slows it,
# the GIL's). On the H200 machine 2 took the worker's time after a first step from 17-18 s to ~10 s, 4 no further,
# with the next steps' backwards 0.05-0.1 s slower (NOTES 79)
COMPILE_THREADS = 2
_CHUNK_BLOCKS = 256  # partial blocks evaluated at a time (4M positions at 128 x 128: ~100 MB of temporaries)

_lock = threading.Lock()
_ready: set = set()  # kernel keys (pass, sources, signature) compiled in this process
_pending: dict = {}  # kernel key -> Future of the worker compiling it
_failed: set = set()  # kernel keys whose compile in the worker raised: compiled in the call from then on
_worker: Optional[concurrent.futures.ThreadPoolExecutor] = None
_bits_calls = [0]
_eager_calls = [0]


def applies(query: torch.Tensor, block_mask, options: dict) -> bool:
    """Whether this call takes part: its kernels known compiled or new (a new forward's backward then compiles beside
    it), and with a block mask that has a mask_mod, the bits' kernels for its first calls. See the module's
    docstring."""
    if not ENABLED or options or autotune_enabled({}):
        return False
    if query.is_cuda:
        return not torch.cuda.is_current_stream_capturing()
    return ENABLED == "always"


def signature(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask, *extra) -> tuple:
    """What besides the sources decides whether a call needs kernels compiled: device, dtype, head dims, heads per kv
    head, whether the inputs are contiguous, whether the lengths are multiples of 128 (the Gluon kernels' host
    descriptors) and the queries few enough to decode, the block mask's block size and whether it has full blocks,
    and ``extra``; and what Triton specializes the kernels' integer arguments on (:func:`int_classes`) for the head
    counts and the inputs' strides, so that kernels compiled at 2 heads are not taken as compiled at 16
    (benchmarks/NOTES.md 83). Not the lengths themselves, which the kernels do not specialize on: a new length (a
    decoding step) is no new first call."""
    Lq, Lkv = query.shape[2], key.shape[2]
    blocks = (None, None) if block_mask is None else (tuple(block_mask.BLOCK_SIZE),
                                                      block_mask.full_kv_num_blocks is None)
    ints = int_classes(query.shape[1], key.shape[1], *query.stride(), *key.stride(), *value.stride())
    return (query.device, query.dtype, query.shape[-1], value.shape[-1], query.shape[1] // key.shape[1],
            query.is_contiguous(), key.is_contiguous(), value.is_contiguous(), Lq % 128 == 0, Lkv % 128 == 0,
            Lq <= 64, *blocks, ints) + extra


def int_classes(*ns: int) -> tuple:
    """What Triton compiles integer kernel arguments for (one kernel per class), for each: 1, a multiple of 16 (16),
    or neither (0)."""
    return tuple(1 if n == 1 else 16 if n % 16 == 0 else 0 for n in ns)


def block_mask_key(source: str, H: int, Q_LEN: int, KV_LEN: int, device: torch.device, block_size: tuple) -> tuple:
    """The key of create_block_mask's kernel: its source and what else Triton compiles it for (the device, the block
    sizes, whether the lengths are whole blocks, and its integer arguments H, Q_LEN and KV_LEN each as 1, a multiple of
    16 or neither)."""
    return ("mask", (source,), (device, tuple(block_size), Q_LEN % block_size[0] == 0, KV_LEN % block_size[1] == 0,
                                *int_classes(H, Q_LEN, KV_LEN)))


def block_flags_in_torch(key: tuple, compile_: Callable[[], None], positions: int) -> bool:
    """Whether create_block_mask evaluates a block mask in torch (mask_mod vmapped over chunks, as on CPU) instead of
    by the mask_mod's kernel (``key``, :func:`block_mask_key`): where this process has not compiled that kernel and
    the mask has at most :data:`MAX_TORCH_POSITIONS` positions; the worker then compiles it (``compile_``, the launch
    inside launch.compile_only) for the next block mask, so that a new mask_mod's block mask waits for no compile
    either (NOTES 74). Not where ENABLED is False, a CUDA graph is being captured or the worker failed to compile the
    kernel: the call compiles it."""
    if not ENABLED or key in _ready or key in _failed or positions > MAX_TORCH_POSITIONS:
        return False
    device = key[2][0]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    return compile_beside(key, compile_)


def ready(key: tuple, on_disk: bool = False) -> bool:
    """Whether this process has compiled the kernels of ``key``, or with ``on_disk`` an earlier process on this
    machine has (:func:`mark_ready`'s marker: Triton's disk cache then loads them in a fraction of a second)."""
    if key in _ready:
        return True
    marker = _marker(key) if on_disk else None
    if marker is not None and marker.exists():
        _ready.add(key)
        return True
    return False


def mark_ready(key: tuple, persist: bool = False) -> None:
    """``key``'s kernels are compiled; ``persist``: say so to later processes too (a marker file under flexlite's
    cache directory, for CUDA keys: the bits' kernels, which serve every later mask_mod). In a compile server's
    capture pass, where nothing is compiled yet, kept for later (compile_processes.defer)."""
    if compile_processes.defer(lambda: mark_ready(key, persist)):
        return
    _ready.add(key)
    marker = _marker(key) if persist else None
    if marker is not None and not marker.exists():
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        except OSError:  # a read-only cache: later processes compile in the call, as without the marker
            pass


def _markers_dir() -> Path:
    return cache_dir() / "first_calls"


def _gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def _marker(key: tuple) -> Optional[Path]:
    """The marker file of a CUDA ``key`` (pass, sources, signature), named by a hash of what makes the compiled
    kernels the same in another process: the sources (with Triton's version, as flexlite's kernel files are named),
    the signature, the GPU's name, torch's version and what the marker promises (:data:`_MARKER_VERSION`). None for
    other devices."""
    kind, sources, sig = key
    device = sig[0]
    if not isinstance(device, torch.device) or device.type != "cuda":
        return None
    text = repr((kind, [source and source_hash(source) for source in sources], [str(x) for x in sig[1:]],
                 _gpu_name(device), torch.__version__, _MARKER_VERSION))
    return _markers_dir() / hashlib.sha256(text.encode()).hexdigest()[:24]


def compile_beside(key: tuple, compile_: Callable[[], None], persist: bool = False) -> bool:
    """Run ``compile_`` (launches that compile only) in the worker thread unless ``key`` is compiled, being compiled
    or failed; ``key`` is ready once it returns (``persist``: :func:`mark_ready`'s). False where its compile failed
    before: the call compiles its own. In a compile server's capture pass, kept for later (compile_processes.defer)."""
    global _worker
    if compile_processes.defer(lambda: compile_beside(key, compile_, persist)):
        return True
    with _lock:
        if key in _failed:
            return False
        if key in _ready or key in _pending:
            return True
        if _worker is None:
            _worker = concurrent.futures.ThreadPoolExecutor(max(1, COMPILE_THREADS),
                                                            thread_name_prefix="flexlite-compile")
        _pending[key] = _worker.submit(_compile, key, compile_, torch.cuda.current_device()
                                       if torch.cuda.is_available() and torch.cuda.is_initialized() else None,
                                       persist)
    return True


def _compile(key: tuple, compile_: Callable[[], None], device: Optional[int], persist: bool) -> None:
    try:
        if device is not None:
            torch.cuda.set_device(device)
        with launch.compile_only(), tracing_refused():  # (the calls' traces are made on their thread)
            compile_processes.run(compile_, COMPILE_PROCESSES)
        mark_ready(key, persist)
    except Exception:  # noqa: BLE001 - the call that needs these kernels compiles them itself and raises there
        _failed.add(key)
    finally:
        with _lock:
            _pending.pop(key, None)


def wait_for(key: tuple) -> None:
    """Wait until the worker has compiled ``key`` if it is compiling it (or has it queued)."""
    future = _pending.get(key)
    if future is not None:
        future.result()


def ran_bits() -> int:
    """How many calls in this process ran the bits' kernels (forward and backward each count)."""
    return _bits_calls[0]


def count_bits_call() -> None:
    _bits_calls[0] += 1


def ran_eager() -> int:
    """How many calls in this process ran in torch ops while their kernels compiled (forward and backward each
    count)."""
    return _eager_calls[0]


def count_eager_call() -> None:
    _eager_calls[0] += 1


def failed(key: tuple) -> bool:
    """Whether the worker's compile of ``key`` raised (the calls then compile it themselves)."""
    return key in _failed


def pending(key: tuple) -> bool:
    """Whether the worker is compiling ``key`` (or has it queued)."""
    return key in _pending


def wait(timeout: Optional[float] = None) -> None:
    """Wait until the worker has compiled every kernel asked of it so far (``timeout`` seconds at most: a
    TimeoutError after)."""
    with _lock:
        futures = list(_pending.values())
    done, not_done = concurrent.futures.wait(futures, timeout=timeout)
    if not_done:
        raise TimeoutError(f"flexlite.first_calls.wait: {len(not_done)} kernel compiles still running after "
                           f"{timeout} s")


class BitsMask(BlockMask):
    """A block mask with its partial blocks' mask as bits: the same blocks, and a mask_mod reading the bits
    (:func:`bits_mask_mod`). ``original``: the block mask it stands for; ``gathers``: whether the original's
    mask_mod reads captured tensors (the tiles are chosen for it, so that the bits' kernels walk as its own do)."""

    original: BlockMask
    gathers: bool


def bits_mask(block_mask: BlockMask, B: int, H: int, gathers: bool) -> Optional[BitsMask]:
    """``block_mask`` with its partial blocks' mask as bits for a call of batch ``B`` and ``H`` query heads, kept on
    it; None where the bits would pass :data:`MAX_BITS_BYTES` or torch cannot vmap the mask_mod (the mod's own kernels
    then compile in the call, which reports what is wrong with the mod)."""
    ids = tensors_key(getattr(block_mask, name) for name in BlockMask._TENSOR_ATTRS)
    return kept_on(block_mask, "_first_call_bits", (ids, id(block_mask.mask_mod), B, H, block_mask.seq_lengths,
                                                     gathers),
                   lambda: _make_bits_mask(block_mask, B, H, gathers))


def _pad16(n: int) -> int:
    return max(16, -(-n // 16) * 16)


def _uses(mask_mod: Callable) -> tuple:
    """Whether ``mask_mod`` reads b, and h (from its trace, made on the calling thread)."""
    read = arguments_read(trace_mod(mask_mod, "mask_mod"))
    return tuple(name in read for name in MASK_MOD_ARGS[:2])


def _make_bits_mask(block_mask: BlockMask, B: int, H: int, gathers: bool) -> Optional[BitsMask]:
    """The bits of every position a kernel may ask the mask_mod about, as the kernels' semantics have it
    (flexlite.reference.reference_mask): the mask_mod's value in a partial block, True in a full block, False
    elsewhere (a kernel tile may span several blocks of a small BLOCK_SIZE); mask_mod is called with the call's
    (b, h) where it reads them, also where the block mask broadcasts them."""
    partial, full = block_mask.dense_blocks(full=False), block_mask.dense_blocks(full=True)
    Bm, Hm, n_q, n_kv = partial.shape
    try:
        uses_b, uses_h = _uses(block_mask.mask_mod)
    except Exception:  # noqa: BLE001 - an untraceable mod: its own kernels' path reports it
        return None
    Be, He = (B if Bm == 1 and uses_b else Bm), (H if Hm == 1 and uses_h else Hm)
    partial, full = partial.expand(Be, He, n_q, n_kv), full.expand(Be, He, n_q, n_kv)
    bq, bkv = block_mask.BLOCK_SIZE
    words_per_row = -(-bkv // 32)
    coords = partial.nonzero()  # (P, 4): b, h, q block, kv block
    P = coords.shape[0]
    # every size a multiple of 16 and a broadcast batch or head a stride-0 view: what Triton specializes the
    # kernels on is the same for every mask (the bits' kernels compile once per score_mod and shape)
    slot_shape = (_pad16(Be) if Be > 1 else 1, _pad16(He) if He > 1 else 1, _pad16(n_q), _pad16(n_kv))
    if 4 * (_pad16(P + 2) * bq * words_per_row + slot_shape[0] * slot_shape[1] * slot_shape[2] * slot_shape[3]) \
            > MAX_BITS_BYTES:
        return None
    device = partial.device
    # rows P and P + 1 of the words: a full block's (all ones) and an empty block's (all zeros)
    slot = torch.full(slot_shape, P + 1, dtype=torch.int32, device=device)
    slot[:Be, :He, :n_q, :n_kv][full] = P
    slot[coords[:, 0], coords[:, 1], coords[:, 2], coords[:, 3]] = torch.arange(P, dtype=torch.int32, device=device)
    slot = slot.expand(_pad16(B) if Be == 1 else slot_shape[0], _pad16(H) if He == 1 else slot_shape[1],
                       *slot_shape[2:])
    words = torch.zeros((_pad16(P + 2), bq, words_per_row), dtype=torch.int32, device=device)
    words[P] = -1
    for start in range(0, P, _CHUNK_BLOCKS):
        chunk = coords[start:start + _CHUNK_BLOCKS]
        chunk_words = _block_words(block_mask, chunk, words_per_row)
        if chunk_words is None:
            return None
        words[start:start + chunk.shape[0]] = chunk_words
    bits = copy.copy(block_mask)
    bits.__class__ = BitsMask
    bits.mask_mod = bits_mask_mod(slot, words, bq, bkv)
    bits.original, bits.gathers = block_mask, gathers
    return bits


def _block_words(block_mask: BlockMask, coords: torch.Tensor, words_per_row: int) -> Optional[torch.Tensor]:
    """The mask of each partial block at ``coords`` (b, h, q block, kv block) as int32 words [P, bq, words_per_row],
    bit j of word w of row r the position (q block * bq + r, kv block * bkv + 32 w + j); positions past the lengths
    0 (the kernels mask them apart); None where torch cannot vmap the mask_mod."""
    bq, bkv = block_mask.BLOCK_SIZE
    Lq, Lkv = block_mask.seq_lengths
    device = coords.device
    coords = coords.to(torch.int32)
    q = coords[:, 2:3] * bq + torch.arange(bq, dtype=torch.int32, device=device)  # [P, bq]
    kv = coords[:, 3:4] * bkv + torch.arange(bkv, dtype=torch.int32, device=device)  # [P, bkv]
    fn = torch.vmap(block_mask.mask_mod, in_dims=(None, None, None, 0))
    fn = torch.vmap(fn, in_dims=(None, None, 0, None))
    fn = torch.vmap(fn, in_dims=(0, 0, 0, 0))
    try:
        mask = fn(coords[:, 0], coords[:, 1], q.clamp(max=Lq - 1), kv.clamp(max=Lkv - 1))
    except Exception:  # noqa: BLE001 - a mod torch cannot vmap: its own kernels, whose errors say what to change
        return None
    P = coords.shape[0]
    mask = torch.as_tensor(mask, device=device).bool().broadcast_to((P, bq, bkv))
    mask = mask & (q < Lq)[:, :, None] & (kv < Lkv)[:, None, :]
    padded = torch.zeros((P, bq, words_per_row * 32), dtype=torch.int64, device=device)
    padded[..., :bkv] = mask
    words = (padded.view(P, bq, words_per_row, 32) << torch.arange(32, device=device)).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)  # (two's complement)


def bits_mask_mod(slot: torch.Tensor, words: torch.Tensor, bq: int, bkv: int) -> Callable:
    """The mask_mod of the bits: position (q_idx, kv_idx) of batch b and head h, at column c = kv_idx % bkv of its
    block, is bit ``c % 32`` of word ``c // 32`` of row ``q_idx % bq`` of the words numbered
    ``slot[b, h, q block, kv block]``."""
    def first_call_bits(b, h, q_idx, kv_idx):
        column = kv_idx % bkv
        word = words[slot[b, h, q_idx // bq, kv_idx // bkv], q_idx % bq, column // 32]
        return ((word >> (column % 32)) & 1) == 1
    return first_call_bits
