"""The plan: which layers stay resident for a strategy and a budget, and the peak device memory that
costs (an estimate, computed from the model's shape, labelled as such wherever it is shown).

Peak device memory of a plan for a batch of n_seqs sequences (1 for a request alone) =
    resident layers' weights and every sequence's KV cache (the store's device tier)
  + working slots x the largest streamed layer's weights and every sequence's KV cache
  (where the device holds allocations in whole pages, the tier's entries and each slot counted in pages)
  + fixed tensors (output norm and output matrix)
  + the workspace of one prefill chunk of num_batch tokens, or of a decode step over the batch
  + the backend's fixed overhead (the CUDA context and allocator on the GPU; 0 on host and stub)
  + on the GPU, the decoder's scratch for a step of the batch (store.decoder_scratch: memory of its own, there
    beside CuPy's pool, which keeps what a prefill chunk took)
  + where device memory is measured, the measurement's granularity (margin_bytes: NVML counts a
    process's memory in whole 2 MiB pages, and allocations in different pages each round up; on the
    H200 a peak stood up to 1.5 pages over the byte count, so two pages are allowed)
  + with experts as pebbles (runtime.experts): the decoder's expert slots, a cache of C experts per layer
    of experts and its staging slots; the layers' weights above are then their dense part only, and C the
    most the budget leaves room for (at most what the request asks; 0 under minimal)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from fractions import Fraction

from ..errors import OptionsError
from ..model import WEIGHT_FORMS, ModelConfig, check_weight_form
from ..store.abi import DECODER_SPLIT_ROWS, paged
from ..store.strategy import ADAPTIVE, NONE, Strategy, resident_layers
from .experts import ExpertMemory, parse_expert_options


MEASURED_MARGIN_BYTES = 2 * (2 << 20)  # two of the 2 MiB pages NVML counts a process's GPU memory in


@dataclass(frozen=True)
class MemoryModel:
    """What one model costs in device memory, in bytes, for one num_ctx, num_batch, dtype and batch size."""

    layer_weight_bytes: tuple[int, ...]  # per layer, as held on the device
    layer_kv_bytes: int | tuple[int, ...]  # K and V of one layer at num_ctx, for one sequence (per layer: a
                                           # sliding layer's cache holds its window only)
    kv_bytes_per_token: int              # K and V rows of one layer for one token (the model's own head shape)
    fixed_bytes: int                     # output norm and output matrix
    workspace_bytes: int                 # activations of one prefill chunk or batched decode step
    overhead_bytes: int = 0              # the backend's own fixed cost
    kv_windows: tuple[int, ...] = ()     # per layer, the most positions its cache holds (0: all of them)
    n_seqs: int = 1                      # sequences decoding together, each with KV entries of its own
    n_ctx: int = 0                       # the num_ctx each sequence's KV entries hold
    request: str = "any request"         # what the workspace was sized for, as messages name it
    experts: ExpertMemory | None = None  # experts as pebbles: layer_weight_bytes is then the dense part
    margin_bytes: int = 0                # what a measured peak may stand over the bytes (0: accounted)
    # Where the device holds an allocation in whole pages (cuda: PEBBLE_DEVICE_PAGE_BYTES), what the pages
    # add per layer to its weights' entries and to one sequence's K and V entries (the store's device tier
    # counts them so), and the page size (0: bytes are what is held)
    weight_page_bytes: tuple[int, ...] = ()
    kv_page_bytes: tuple[int, ...] = ()
    page_bytes: int = 0
    decoder_bytes: int = 0               # the native decoder's scratch where it is device memory of its own
    layer_kv_token_bytes: tuple[int, ...] = ()  # per layer, K and V of one token in its own caches (Gemma 4: its
                                         # head shape, 0 where it reads another's); (): kv_bytes_per_token each
    pinned: tuple[int, ...] = ()         # layers resident under every strategy: those whose caches later layers
                                         # read (Gemma 4), which must be in place when those layers compute

    @property
    def n_layers(self) -> int:
        return len(self.layer_weight_bytes)

    def kv_bytes(self, i: int) -> int:
        kv = self.layer_kv_bytes
        return kv if isinstance(kv, int) else kv[i]

    def layer_bytes(self, i: int, in_pages: bool = True) -> int:
        """Layer i's weights and every sequence's KV entries, as the device tier holds them (`in_pages`), or in
        bytes (a slot holds them in one buffer)."""
        if not in_pages or not self.weight_page_bytes:
            return self.layer_weight_bytes[i] + self.n_seqs * self.kv_bytes(i)
        return (self.layer_weight_bytes[i] + self.weight_page_bytes[i]
                + self.n_seqs * (self.kv_bytes(i) + self.kv_page_bytes[i]))

    def footprint(self, nbytes: int) -> int:
        """One allocation of `nbytes` as the device holds it (pebble.h, PEBBLE_DEVICE_PAGE_BYTES)."""
        return paged(nbytes, self.page_bytes)

    def kv_bytes_at(self, i: int, context_tokens: int) -> int:
        """Layer i's K and V bytes with `context_tokens` in one sequence's cache (at most its window's)."""
        token = self.layer_kv_token_bytes[i] if self.layer_kv_token_bytes else self.kv_bytes_per_token
        return self.kv_rows(i, context_tokens) * token

    def kv_cache_bytes(self, context_tokens: int) -> int:
        """Every layer's K and V bytes with `context_tokens` in one sequence's cache."""
        return sum(self.kv_bytes_at(i, context_tokens) for i in range(self.n_layers))

    def kv_rows(self, i: int, context_tokens: int) -> int:
        """KV rows layer i holds with `context_tokens` in the cache: at most its window."""
        window = self.kv_windows[i] if i < len(self.kv_windows) else 0
        return min(context_tokens, window) if window else context_tokens


@dataclass(frozen=True)
class Plan:
    strategy: Strategy          # adaptive carries the resident count it settled on as its arg
    resident: tuple[int, ...]   # layer indices kept on the device
    n_slots: int                # device working slots for streamed layers
    slot_bytes: int             # size of one slot
    store_limit: int            # the store's device tier: resident layers' weights and KV
    estimated_peak_bytes: int
    budget_bytes: int | None
    memory: MemoryModel = field(repr=False)
    expert_cache: int | None = None  # experts as pebbles: experts cached per layer of experts (None: off)
    expert_bytes: int = 0            # ... and the decoder's expert slots, in the estimated peak

    @property
    def streamed(self) -> tuple[int, ...]:
        resident = set(self.resident)
        return tuple(i for i in range(self.memory.n_layers) if i not in resident)

    def expert_restored_bytes_per_token(self) -> int:
        """The routed experts a token restores that the plan's expert cache misses (an estimate under uniform
        routing: ExpertMemory.restored_bytes_per_token); 0 without experts as pebbles."""
        e = self.memory.experts
        return e.restored_bytes_per_token(self.expert_cache) if e and self.expert_cache is not None else 0

    def weight_placement(self) -> tuple[int, int]:
        """(bytes, bytes) of the weights a decode step reads that the plan keeps in device memory (the resident
        layers', and the output norm and matrix) and that stay in the host tier (the streamed layers'): an
        estimate from the memory model, not a measurement. On a backend whose arrays are not in device
        memory (host, stub) all of it is host memory whatever this says."""
        m = self.memory
        device = sum(m.layer_weight_bytes[i] for i in self.resident) + m.fixed_bytes
        return device, sum(m.layer_weight_bytes) + m.fixed_bytes - device

    def restored_bytes_per_token(self, context_tokens: int) -> int:
        """Bytes a decode step restores per token generated with `context_tokens` already in each
        sequence's cache (an estimate): a full batch shares each streamed layer's weights, while every
        sequence reads its own KV rows."""
        m = self.memory
        return sum(m.layer_weight_bytes[i] // m.n_seqs + m.kv_bytes_at(i, context_tokens) for i in self.streamed)


def workspace_bytes(cfg: ModelConfig, n_tokens: int, n_ctx: int, itemsize: int) -> int:
    """Activations of one chunk of n_tokens attending over up to n_ctx positions (an estimate of the
    forward pass's live temporaries: the attention scores, or the MLP, whichever is larger, on top of
    the residual stream and the float32 logits)."""
    T, E, F = n_tokens, cfg.n_embd, cfg.n_ff
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    stream = 4 * T * E * 4                                       # x, normed x and float32 norm temporaries
    attention = 2 * T * (q + 2 * kv) * itemsize + cfg.n_head * T * n_ctx * (8 + itemsize)
    if T == 1:  # a decode step's weighted sums of V, in parts of DECODER_SPLIT_ROWS rows, and each part's
        attention += 4 * (q + 2 * cfg.n_head) * -(-n_ctx // DECODER_SPLIT_ROWS)  # softmax (native/cuda/attention.cu)
    mlp = 5 * T * F * itemsize                                   # gate, up, silu temporaries, product
    return stream + max(attention, mlp) + 2 * cfg.n_vocab * 4


def peak_for(memory: MemoryModel, resident: list[int] | tuple[int, ...], cache: int = 0) -> tuple[int, int, int, int]:
    """(estimated peak, store limit, slots, slot bytes) when exactly `resident` stay on the device (and, with
    experts as pebbles, `cache` experts per layer of experts)."""
    keep = set(resident) | set(memory.pinned)
    streamed = [i for i in range(memory.n_layers) if i not in keep]
    store_limit = sum(memory.layer_bytes(i) for i in keep)
    n_slots = min(2, len(streamed))  # double buffering: one computes while the next is restored
    slot_bytes = max((memory.layer_bytes(i, in_pages=False) for i in streamed), default=0)
    peak = (store_limit + n_slots * memory.footprint(slot_bytes) + memory.fixed_bytes + memory.workspace_bytes
            + memory.overhead_bytes + memory.margin_bytes + memory.decoder_bytes
            + (memory.experts.device_bytes(cache) if memory.experts else 0))
    return peak, store_limit, n_slots, slot_bytes


def smallest_footprint(memory: MemoryModel) -> int:
    """The smallest budget that works for what `memory` describes (its `request`): minimal's peak. The
    one answer `estimate`, `run` and the server give, each from the memory model of its request."""
    return peak_for(memory, [])[0]


def make_plan(memory: MemoryModel, strategy: Strategy | str, budget: int | None = None) -> Plan:
    """Decides residency. `budget` None means unbounded, except that `adaptive` then needs one."""
    if isinstance(strategy, str):
        strategy = Strategy.parse(strategy)
    n = memory.n_layers
    floor = smallest_footprint(memory)
    if budget is not None and budget < floor:
        raise OptionsError(
            f"a memory limit of {format_bytes(budget)} is below this model's smallest footprint for "
            f"{memory.request}: {format_bytes(floor)} ({floor} bytes, strategy minimal) is the least that "
            "works")

    if strategy.code == ADAPTIVE:
        k = n if budget is None else _most_resident_within(memory, budget)
        strategy = Strategy("adaptive", ADAPTIVE, k)
    resident = sorted(set(resident_layers(strategy.code, strategy.arg, n)) | set(memory.pinned))
    peak, store_limit, n_slots, slot_bytes = peak_for(memory, resident)
    if budget is not None and peak > budget:
        raise OptionsError(
            f"strategy {strategy} needs about {format_bytes(peak)} of device memory (estimate), more than "
            f"the limit of {format_bytes(budget)}; use adaptive, a larger limit, or minimal, whose "
            f"smallest footprint is {format_bytes(floor)}")
    e = memory.experts
    if e is None:
        return Plan(strategy, tuple(resident), n_slots, slot_bytes, store_limit, peak, budget, memory)
    # The dense part placed by the strategy; the cache takes the rest of the budget (minimal: no cache).
    cache = 0 if strategy.name == "minimal" else min(e.most, e.n_expert) if budget is None else \
        e.most_within(budget - peak + e.device_bytes(0))
    peak = peak_for(memory, resident, cache)[0]
    return Plan(strategy, tuple(resident), n_slots, slot_bytes, store_limit, peak, budget, memory, cache,
                e.device_bytes(cache))


def _most_resident_within(memory: MemoryModel, budget: int) -> int:
    """The largest k whose evenly spaced residency fits `budget` (peak grows with k)."""
    best = 0
    for k in range(memory.n_layers + 1):
        if peak_for(memory, resident_layers(ADAPTIVE, k, memory.n_layers))[0] <= budget:
            best = k
    return best


def full_residency_peak(memory: MemoryModel) -> int:
    return peak_for(memory, resident_layers(NONE, 0, memory.n_layers))[0]


# ---------------------------------------------------------------------------------------------------
# sizes

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
SIZE_HELP = "bytes as an integer, or a size such as \"512MiB\", \"6GiB\" or \"8GB\""
MAX_SIZE = 2**64 - 1  # what the store's device limit can hold
_SIZE = re.compile(r"([0-9]{1,20}(?:\.[0-9]{1,20})?)([a-z]*)")  # ASCII digits only, bounded


def parse_size(value, what: str = "pebbling_memory_limit") -> int:
    """Bytes from an int or a string such as '6GiB'; a clear OptionsError otherwise, never an overflow."""
    if isinstance(value, bool) or value is None:
        raise OptionsError(f"{what} must be {SIZE_HELP}, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise OptionsError(f"{what} must be a finite number of bytes, got {value!r}")
        size = int(value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        if text.startswith("-"):
            raise OptionsError(f"{what} must not be negative, got {value!r}")
        match = _SIZE.fullmatch(text) if len(text) <= 64 else None
        if not match:
            raise OptionsError(f"{what} must be {SIZE_HELP}, got {value!r}"[:300])
        if match.group(2) not in _UNITS:
            raise OptionsError(f"{what}: unknown unit {match.group(2)!r} in {value!r}; "
                               "use B, KB, MB, GB, KiB, MiB, GiB")
        size = int(Fraction(match.group(1)) * _UNITS[match.group(2)])
    else:
        raise OptionsError(f"{what} must be {SIZE_HELP}, got {type(value).__name__}")
    if size < 0:
        raise OptionsError(f"{what} must not be negative, got {value!r}")
    if size > MAX_SIZE:
        raise OptionsError(f"{what} is larger than any device: at most {MAX_SIZE} bytes, got {str(value)[:40]}")
    return size


def format_bytes(n: int | float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


# ---------------------------------------------------------------------------------------------------
# the options a request adds to Ollama's


@dataclass(frozen=True)
class PebblingOptions:
    """pebbling_strategy, pebbling_enabled, pebbling_memory_limit, pebbling_weights; None means "not
    given". pebbling_cache_prompt (default true) lets a request start from the KV the last request left
    where its prompt begins with the same tokens; false prefills the whole prompt, for results that do not
    depend on what ran before (reusing a cache changes how the prompt is split into chunks, and so the
    rounding, as llama.cpp's cache_prompt says of itself)."""

    strategy: Strategy | None = None
    enabled: bool | None = None
    memory_limit: int | None = None  # bytes
    weights: str | None = None       # one of WEIGHT_FORMS
    cache_prompt: bool = True
    # experts as pebbles (runtime.experts): the most experts of each layer cached on the device (None: off),
    # whether each layer's experts are guessed and restored early, and which cached expert gives way
    expert_cache: int | None = None
    expert_prefetch: bool = False
    expert_policy: str = "lru"

    @classmethod
    def from_options(cls, options) -> "PebblingOptions":
        options = options or {}
        strategy = options.get("pebbling_strategy")
        enabled = options.get("pebbling_enabled")
        limit = options.get("pebbling_memory_limit")
        weights = options.get("pebbling_weights")
        cache_prompt = options.get("pebbling_cache_prompt")
        for name, value in (("pebbling_enabled", enabled), ("pebbling_cache_prompt", cache_prompt)):
            if value is not None and not isinstance(value, bool):
                raise OptionsError(f"option {name!r}: got {str(value)[:40]!r} ({type(value).__name__}); "
                                   "accepted: true or false")
        if weights is not None:
            check_weight_form(weights, "option 'pebbling_weights'")
        return cls(None if strategy is None else Strategy.parse(strategy), enabled,
                   None if limit is None else parse_size(limit), weights, cache_prompt is not False,
                   *parse_expert_options(options))

    @property
    def effective_strategy(self) -> Strategy:
        """What runs: the strategy asked for, `none` when pebbling is disabled, else `adaptive`."""
        if self.enabled is False:
            return Strategy.parse("none")
        return self.strategy or Strategy.parse("adaptive")

    @property
    def effective_weights(self) -> str:
        """The form the weights are held in: the one asked for, else quantized (the file's own)."""
        return self.weights or WEIGHT_FORMS[0]


def adaptive_budget(free: int | None, used, others: int, reserve: float = 0.05) -> int | None:
    """Device bytes an adaptive plan may fill: free memory plus this process's own (`used`, a
    DeviceUse; NVML's whole-device figure when it cannot tell this process's, which then counts for
    nothing), less `others`, what this process's other loaded models hold, less a reserve for
    fragmentation and other users. None when NVML cannot say."""
    if free is None or used is None:
        return None
    mine = used.bytes if used.this_process else 0
    return max(0, int((free + max(0, mine - others)) * (1 - reserve)))
