"""The slot table of an expert server: which logical expert each local slot holds, per layer,
and the stacked weights the backend computes with.

Placement changes are two-phase and hold every expert once. Each layer's slots are the first S
of an allocation that may hold a few spare slots past them (budget.py says how many), so a
resize within it rewrites only the slots that change. :meth:`SlotTable.prepare` plans each
layer's slot moves (moves.py) beside the live table, touching no live slot: it builds the new
allocation of a layer that outgrows its own (or holds nothing yet, or is trimmed of spare
slots), writes the new slots that land in spare slots (nothing computes them), and reads ahead
the other new experts, within a staging budget (default: one layer of this server's slots).
:meth:`commit` (which the worker core runs under the lock every compute takes, so no forward
sees a half-moved layer) swaps in the layers built by prepare and rewrites the live slots of
the others in place (a host table's layers on parallel threads): moves inside a layer through
one spare slot, staged experts copied in, the others read from the checkpoint straight into
their slot, then the live count set. Its pause follows the live slots that change, not the
layers' sizes (only a layer that outgrows its allocation when the budget cannot hold its new
one is rebuilt in the commit), and what it replaces is freed by :meth:`release`, after it.
A placement equal to the live one touches no weight. :meth:`abort` drops what was
staged; the live slots were never touched. Memory freed by either goes back to the device or
the OS (memory.py): abort does it, and the worker calls :meth:`release` after a commit, once
requests flow again.

Errors are typed: :class:`SlotError` (an InvalidRequest) for a table that cannot be built,
``StaleGeneration`` for a phase naming the wrong generation, ``Unavailable`` for a commit that
failed half-way (the server then refuses requests until a new placement is pushed).

Shapes: S local slots of a layer, H hidden, I expert intermediate size.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from expertmesh.checkpoint import CheckpointReader
from expertmesh.errors import InvalidRequest, StaleGeneration, Unavailable
from expertmesh.placement import MAX_GENERATION
from expertmesh.safetensors_io import read_threads, reader_pool, run_on
from expertmesh.worker import memory
from expertmesh.worker.budget import headroom, plan_change
from expertmesh.worker.moves import TEMP, LayerPlan, move_order
from expertmesh.worker.slot_state import LayerSlots, PreviousSlots, Rows, SlotSet, live_bytes

# a slot's rows -> where its gate [I, H], up [I, H] and down [H, I] go (views, any layout), or
# None when the backend's layout needs the plain weights first (quantised rows)
Views = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]
# reads one expert's gate [I, H], up [I, H] and down [H, I] into these views
ReadExpert = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
# (name, shape, dtype) -> the calling reader thread's buffer of that name, reused expert after
# expert (SlotTable._scratch_buffer)
Scratch = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]
# a backend that quantises as it reads: ``read`` into scratch buffers in the server's dtype
# (the last argument), packed into the slot's w13, w2 rows; False when its layout does not
# take this path
ReadPacked = Callable[[ReadExpert, torch.Tensor, torch.Tensor, Scratch, torch.dtype], bool]
# parallel checkpoint reads while requests are served: page-cache copies release the GIL;
# more threads than this gained nothing measurable on the hosts tried
MAX_READ_THREADS = 8
# start-up reads (nothing computes yet) use every CPU of the process up to this many (page-cache
# copies release the GIL)
MAX_PRELOAD_THREADS = 64
# ... but at most this many for a backend that quantises as it reads (torch's quantiser held the
# GIL between its calls: 32 threads were slower than 8); with the C quantiser, which releases
# it, 8 / 16 / 32 threads loaded 29 GB of bf16 experts as int4 at 8.8 / 9.7 / 9.3 GB/s on a
# 16-core H200 host: no gain past 8
MAX_QUANTISE_THREADS = 8
# a host table's commit rewrites its layers on this many threads at most (each copy on one
# core): nothing computes during a commit, and one thread copying staged experts in at ~10
# GB/s made the commit the slowest step of a rebalance (a copy is memory-bound well before 16)
MAX_COMMIT_THREADS = 16
# a new slot's weights: an expert to read, or rows to copy (a live slot, a staged read)
Source = int | Rows


@dataclass
class _Copy:
    """A staged expert a host commit copies into its slot (one job of the commit's threads)."""

    layer: int
    w13: torch.Tensor  # the slot's rows
    w2: torch.Tensor
    rows: Rows  # the staged rows

    def run(self) -> None:
        self.w13.copy_(self.rows[0])
        self.w2.copy_(self.rows[1])


class SlotError(InvalidRequest, ValueError):
    """A slot table that cannot be built: unknown layers or experts, more slots than capacity."""


@dataclass
class _Staged:
    generation: int
    base: int  # the table's commit count when planned: a commit in between invalidates it
    plans: dict[int, LayerPlan]
    rows: dict[tuple[int, int], Rows] = field(default_factory=dict)  # (layer, dst) read ahead
    built: dict[int, LayerSlots] = field(default_factory=dict)  # new allocations, swapped in
    # (layer, dst) spare slots of the live allocation the prepare already wrote
    direct: set[tuple[int, int]] = field(default_factory=set)

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.rows.values()) + live_bytes(self.built)

    def line(self) -> str:
        """What this prepare did, for its log line (the commit does the rest)."""
        reads = sum(len(p.reads) for p in self.plans.values())
        return (
            f"{reads} experts to read: {len(self.rows)} staged, {len(self.direct)} written into spare "
            f"slots; {len(self.built)} layers built, {self.nbytes() / 2**20:.0f} MiB held until the commit"
        )


def parse_expert_spec(spec: str, num_experts: int) -> list[int]:
    """``all`` | ``none`` | ``0-15,32,40-47`` -> sorted logical expert ids."""
    spec = spec.strip().lower()
    if spec == "all":
        return list(range(num_experts))
    if spec in ("none", ""):
        return []
    ids: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if not 0 <= a <= b < num_experts:
            raise SlotError(f"expert range {part!r} outside [0, {num_experts})")
        ids.update(range(a, b + 1))
    return sorted(ids)


@dataclass
class CommitWork:
    """What one commit did, for its log line: a commit's pause should follow these counts."""

    swapped: int = 0  # layers given the allocation prepare built
    rebuilt: int = 0  # layers built inside the commit (the staging budget could not hold them)
    moved: int = 0  # slots copied from another slot of their layer (spare-slot saves included)
    copied: int = 0  # slots copied in from staged rows
    read: int = 0  # slots read from the checkpoint inside the commit

    def __add__(self, o: CommitWork) -> CommitWork:
        return CommitWork(
            self.swapped + o.swapped,
            self.rebuilt + o.rebuilt,
            self.moved + o.moved,
            self.copied + o.copied,
            self.read + o.read,
        )

    def line(self) -> str:
        return (
            f"{self.swapped} layers swapped, {self.rebuilt} rebuilt, slots: {self.moved} moved, "
            f"{self.copied} copied from staging, {self.read} read"
        )


class SlotTable:
    def __init__(
        self,
        reader: CheckpointReader,
        dtype: torch.dtype,
        device: torch.device,
        capacity: int,
        pack: Callable[[torch.Tensor, torch.Tensor], Rows] | None = None,
        read_expert: Callable[[int, int], Rows] | None = None,
        stack: Callable[[list[torch.Tensor], list[torch.Tensor]], Rows] | None = None,
        staging_bytes: int | None = None,
        views: Views | None = None,
        spare_bytes: int | None = None,
        read_packed: ReadPacked | None = None,
    ) -> None:
        self.reader, self.dtype, self.device, self.capacity = reader, dtype, device, capacity
        # ExpertBackend.pack_weights: applied once per expert as it is read, so moves work on
        # packed rows
        self.pack = pack
        # (layer, expert) -> the backend's own per-slot rows, read as stored (FP8 experts);
        # replaces both the float read and pack. None: float weights, then pack
        self.read_expert = read_expert
        # a layer's slots -> its stacked w13, w2 where a backend places memory itself (NUMA
        # nodes, cpu_expert_server/numa_backend.py). None: one allocation filled slot by slot
        self.stack = stack
        # bytes a prepare may read ahead beyond the live experts (None: one layer of slots)
        self.staging_bytes = staging_bytes
        # where a slot's weights go, to read them from the checkpoint straight into the slot
        # (plain_views for backends that compute on the weights as stored)
        self.views = views
        # spare slots kept between changes, over all layers (None: half the staging budget)
        self.spare_bytes = spare_bytes
        # quantises each expert straight into its slot through a reader thread's plain buffers
        # (the CPU backend's int8/int4); None: read, pack, copy
        self.read_packed = read_packed
        # each reader thread's buffers for read_packed; replaced (so freed) after each
        # load, prepare and commit, so no thread keeps them between placement changes
        self._scratch = threading.local()
        self._pool: ThreadPoolExecutor | None = None
        self._commit_pool: ThreadPoolExecutor | None = None
        self.moe_layers = reader.config.moe_layer_ids
        self.live = SlotSet(0, {layer: self._empty() for layer in self.moe_layers})
        self.previous: PreviousSlots | None = None  # the generation the last commit replaced
        self._staged: _Staged | None = None
        # what the last commit replaced (old allocations, used staged rows), freed by release():
        # unmapping gigabytes of pages inside the commit made it the slowest part of a move
        self._freed: list[object] = []
        self._commits = 0
        self.last_commit = CommitWork()  # what the last commit did
        self.last_prepare = ""  # what the last prepare did (_Staged.line)
        self._slot_bytes = 0  # one slot's w13 + w2 bytes, known once a slot was read
        self.peak_bytes = 0  # the most expert bytes (live + staged + transient) held at once
        self._lock = threading.Lock()  # guards _staged and orders prepare's plan with commit
        # NOTE: one prepare at a time: a prepare writes the spare slots of the live allocation
        self._preparing = threading.Lock()

    # ------------------------------------------------------------ reading

    def _empty(self) -> LayerSlots:
        cfg = self.reader.config
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        dt, dev = self.dtype, self.device
        w13, w2 = torch.empty(0, 2 * i, h, dtype=dt, device=dev), torch.empty(0, h, i, dtype=dt, device=dev)
        return LayerSlots((), *(self.pack(w13, w2) if self.pack is not None else (w13, w2)))

    def _row_layout(self) -> tuple[torch.Size, torch.dtype, torch.Size, torch.dtype] | None:
        """A slot's row shapes and dtypes, when the empty layout says them (not for read_expert)."""
        if self.read_expert is not None:
            return None
        e = self._empty()
        return e.w13.shape[1:], e.w13.dtype, e.w2.shape[1:], e.w2.dtype

    def _read_plain(self, layer: int, e: int) -> Rows:
        """One expert's plain weights [2I, H], [H, I] in the server's dtype, on its device."""
        direct = getattr(self.reader, "expert_into", None)
        if direct is None:
            w = self.reader.expert_weights(layer, e)
            return w.w13.to(self.device, self.dtype), w.w2.to(self.device, self.dtype)
        cfg = self.reader.config
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        w13 = torch.empty(2 * i, h, dtype=self.dtype, device=self.device)
        w2 = torch.empty(h, i, dtype=self.dtype, device=self.device)
        direct(layer, e, w13[:i], w13[i:], w2)
        return w13, w2

    def _read_rows(self, layer: int, e: int) -> Rows:
        """One expert as the backend computes with it: [2I, H], [H, I] or its packed rows."""
        if self.read_expert is not None:
            return self.read_expert(layer, e)
        layout = self._row_layout()
        direct = self.views is not None or self.read_packed is not None
        if direct and layout is not None and getattr(self.reader, "expert_into", None) is not None:
            a = torch.empty(layout[0], dtype=layout[1], device=self.device)
            b = torch.empty(layout[2], dtype=layout[3], device=self.device)
            if self._read_direct(layer, e, a, b):
                return a, b
        w13, w2 = self._read_plain(layer, e)
        if self.pack is None:
            return w13, w2
        p13, p2 = self.pack(w13[None], w2[None])
        return p13[0], p2[0]

    def _read_into(self, layer: int, e: int, out13: torch.Tensor, out2: torch.Tensor) -> None:
        """Reads expert ``e`` of ``layer`` into a slot's rows: straight from the checkpoint when
        the backend's layout allows it, else through its plain weights and pack."""
        if self._read_direct(layer, e, out13, out2):
            return
        a, b = self._read_rows(layer, e)
        out13.copy_(a)
        out2.copy_(b)

    def _read_direct(self, layer: int, e: int, out13: torch.Tensor, out2: torch.Tensor) -> bool:
        """Reads expert ``e`` of ``layer`` into a slot's rows with no per-expert copy: into the
        slot itself (views), or through this thread's plain buffers into the backend's
        quantiser (read_packed); False when neither applies (nothing read)."""
        direct = getattr(self.reader, "expert_into", None)
        if direct is None or self.read_expert is not None:
            return False
        v = self.views(out13, out2) if self.views is not None else None
        if v is not None:
            direct(layer, e, *v)
            return True
        if self.read_packed is None:
            return False

        def read(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
            direct(layer, e, gate, up, down)

        return self.read_packed(read, out13, out2, self._scratch_buffer, self.dtype)

    def _scratch_buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """This thread's buffer ``name`` of ``shape`` and ``dtype`` (read_packed's plain weights
        and quantiser blocks; one per shape, as w13 and w2 alternate)."""
        bufs: dict[tuple, torch.Tensor] | None = getattr(self._scratch, "bufs", None)
        if bufs is None:
            bufs = self._scratch.bufs = {}
        key = (name, shape, dtype)
        got = bufs.get(key)
        if got is None:
            got = bufs[key] = torch.empty(shape, dtype=dtype, device=self.device)
        return got

    def _drop_scratch(self) -> None:
        """Frees every reader thread's scratch buffers (those in use stay alive until their
        reader lets go)."""
        self._scratch = threading.local()

    def _parallel(
        self, jobs: list[Callable[[], object]], pool: ThreadPoolExecutor | None = None
    ) -> list[object]:
        """Runs checkpoint reads on ``pool``, by default the table's reader threads; raises the
        first failure."""
        if pool is None and len(jobs) > 1:
            pool = self._read_pool()
        return run_on(pool, jobs)

    def _read_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = reader_pool(min(MAX_READ_THREADS, len(os.sched_getaffinity(0))), background=True)
        return self._pool

    def _load_pool(self) -> ThreadPoolExecutor:
        """Reader threads for a load (nothing computes yet): every CPU of the process, fewer
        when the backend quantises."""
        w13 = self._empty().w13
        quantises = w13.dtype in (torch.uint8, torch.int8)
        return reader_pool(read_threads(MAX_QUANTISE_THREADS if quantises else MAX_PRELOAD_THREADS))

    def _build(
        self, layer: int, sources: list[Source], pool: ThreadPoolExecutor | None = None, slots: int = 0
    ) -> Rows:
        """A new layer allocation of ``max(slots, S)`` slots whose first S hold ``sources [S]``:
        [A, *row13], [A, *row2] (reads on ``pool``, see :meth:`_parallel`); a backend that
        stacks its own memory gets exactly S."""
        if not sources:
            empty = self._empty()
            return empty.w13, empty.w2
        n = max(slots, len(sources))
        if self.stack is not None:
            got = self._parallel([_rows_job(self, layer, s) for s in sources], pool)
            rows = [r for r in got if isinstance(r, tuple)]
            return self.stack([r[0] for r in rows], [r[1] for r in rows])
        layout = self._row_layout()
        first: Rows | None = None
        if layout is None:  # the first read tells the rows' shape
            first = sources[0] if isinstance(sources[0], tuple) else self._read_rows(layer, sources[0])
            layout = first[0].shape, first[0].dtype, first[1].shape, first[1].dtype
        w13 = torch.empty((n, *layout[0]), dtype=layout[1], device=self.device)
        w2 = torch.empty((n, *layout[2]), dtype=layout[3], device=self.device)
        memory.huge_pages(w13)  # NOTE: before any slot's pages are faulted in (fill)
        memory.huge_pages(w2)

        def fill(s: int, src: Source) -> None:
            if s == 0 and first is not None:
                src = first
            # NOTE: a new allocation: its pages are faulted in by the thread filling the slot
            memory.populate(w13[s])
            memory.populate(w2[s])
            if isinstance(src, tuple):
                w13[s].copy_(src[0])
                w2[s].copy_(src[1])
            else:
                self._read_into(layer, src, w13[s], w2[s])

        self._parallel([_bind(fill, s, src) for s, src in enumerate(sources)], pool)
        self._slot_bytes = self._slot_bytes or w13[0].nbytes + w2[0].nbytes
        return w13, w2

    # ------------------------------------------------------------ memory

    def slot_bytes(self) -> int:
        """Bytes of one slot (w13 + w2 rows), from a resident slot or the empty layout."""
        for ls in self.live.layers.values():
            if ls.experts:
                return ls.w13[0].nbytes + ls.w2[0].nbytes
        if self._slot_bytes:
            return self._slot_bytes
        e = self._empty()
        return sum(t[0:1].element_size() * math.prod(t.shape[1:]) for t in (e.w13, e.w2))

    def layer_bytes(self) -> int:
        """One layer of this server's slots: the default staging budget."""
        return self.capacity * self.slot_bytes()

    def _budget_slots(self) -> tuple[int, int]:
        """(staging budget, spare slots kept between changes), in slots (budget.py)."""
        slot = max(1, self.slot_bytes())
        budget = self.layer_bytes() if self.staging_bytes is None else self.staging_bytes
        spare = budget // 2 if self.spare_bytes is None else self.spare_bytes
        return budget // slot, spare // slot

    def _alloc_slots(self, size: int) -> int:
        """Slots of a new allocation holding ``size`` live ones (budget.headroom)."""
        _, spare = self._budget_slots()
        return headroom(spare, len(self.moe_layers), self.capacity, size, self.stack is not None)

    def resident_bytes(self) -> int:
        """Bytes of the live experts plus what a prepare has staged."""
        staged = self._staged
        return live_bytes(self.live.layers) + (staged.nbytes() if staged is not None else 0)

    def _note(self, extra: int = 0) -> None:
        self.peak_bytes = max(self.peak_bytes, self.resident_bytes() + extra)

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        """Rewrites run on the table's device with the work queued before them finished (a
        graph launched for the last step reads these weights) and finish before returning."""
        if self.device.type != "cuda":
            yield
            return
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)
            yield
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------ phases

    def preload(self, experts: list[int]) -> int:
        """Generation 0: the same experts in every MoE layer (start-up, before any placement)."""
        layers, read = dict(self.live.layers), 0
        with self._load_pool() as pool:
            for layer in self.moe_layers:
                rows = self._build(layer, list(experts), pool, self._alloc_slots(len(experts)))
                layers[layer] = LayerSlots.of(tuple(experts), *rows)
                read += len(experts)
        self.live = SlotSet(0, layers)
        self._note()
        self._drop_scratch()
        memory.release(self.device)  # the reads' temporaries
        return read

    def prepare(self, generation: int, table: dict[int, list[int]]) -> int:
        """Plans ``table`` beside the live placement and reads ahead what the budget allows;
        returns how many experts the change reads from the checkpoint (now or at commit)."""
        if generation > MAX_GENERATION:
            raise SlotError(
                f"placement generation {generation} is above the largest allowed, {MAX_GENERATION}"
            )
        unknown = set(table) - set(self.moe_layers)
        if unknown:
            raise SlotError(f"layers {sorted(unknown)} are not MoE layers (MoE layers: {self.moe_layers})")
        for layer, experts in table.items():
            if len(experts) > self.capacity:
                raise SlotError(
                    f"layer {layer}: {len(experts)} slots exceed this server's capacity {self.capacity}"
                )
        with self._preparing:
            return self._prepare(generation, table)

    def _prepare(self, generation: int, table: dict[int, list[int]]) -> int:
        with self._lock:
            if generation <= self.live.generation:
                raise StaleGeneration(
                    f"generation {generation} is not newer than the live {self.live.generation}"
                )
            self._staged = None  # NOTE: a newer prepare replaces it: never two stagings at once
            live, base = self.live, self._commits
        self.release()
        budget, spare = self._budget_slots()
        lay = plan_change(
            {layer: live.layers[layer].experts for layer in self.moe_layers},
            {layer: live.layers[layer].allocated for layer in self.moe_layers},
            {layer: tuple(table.get(layer, [])) for layer in self.moe_layers},
            self.capacity,
            budget,
            spare,
            exact=self.stack is not None,
        )
        staged = _Staged(generation, base, lay.plans)
        # NOTE: a table holding nothing serves nothing yet: this placement is its load, read on
        # every CPU as a preload is (beside requests, reads keep to the table's few threads)
        loading = not any(live.layers[layer].experts for layer in self.moe_layers)
        with self._load_pool() if loading else contextlib.nullcontext() as pool:
            for layer in self.moe_layers:
                p = lay.plans[layer]
                if layer in lay.built:  # NOTE: copies live slots, which no commit changes meanwhile
                    sources = _sources(layer, p, live.layers[layer], {})
                    rows = self._build(layer, sources, pool, p.rebuild or 0)
                    staged.built[layer] = LayerSlots.of(p.experts, *rows)
                    del sources, rows
                for dst, e in p.reads:
                    if (layer, dst) in lay.staged:
                        staged.rows[layer, dst] = self._read_rows(layer, e)
                self._write_spare(layer, p, live.layers[layer], lay.direct, staged)
                self._note(staged.nbytes())
        self._drop_scratch()
        with self._lock:
            if self._commits != base:  # NOTE: planned against a placement that is gone
                raise StaleGeneration(f"generation {generation}: the live placement changed during prepare")
            self._staged = staged
            self.last_prepare = staged.line()
        return sum(len(p.reads) for p in lay.plans.values())

    def _write_spare(
        self,
        layer: int,
        plan: LayerPlan,
        cur: LayerSlots,
        direct: frozenset[tuple[int, int]],
        staged: _Staged,
    ) -> None:
        """Writes the new slots of ``layer`` that lie past its live ones, inside its allocation:
        no forward reads them, so the commit has nothing left to do for them."""
        w13, w2 = cur.rows
        for dst, src in plan.moves:
            if (layer, dst) in direct:
                w13[dst].copy_(w13[src])
                w2[dst].copy_(w2[src])
                staged.direct.add((layer, dst))
        reads = [(dst, e) for dst, e in plan.reads if (layer, dst) in direct]
        self._parallel([_bind(self._read_into, layer, e, w13[dst], w2[dst]) for dst, e in reads])
        staged.direct.update((layer, dst) for dst, _ in reads)

    def commit(self, generation: int) -> None:
        """Makes the prepared placement live. The caller keeps every forward out meanwhile."""
        with self._lock:
            staged = self._staged
            if staged is None or staged.generation != generation:
                raise StaleGeneration(
                    f"no prepared placement of generation {generation} "
                    f"(prepared: {None if staged is None else staged.generation})"
                )
            if staged.base != self._commits:
                self._staged = None
                raise StaleGeneration(f"generation {generation} was prepared against an earlier placement")
            # NOTE: the previous SlotSet is dropped here, so a rebuilt layer's old allocation
            # goes as soon as its replacement exists
            old_generation = self.live.generation
            layers = dict(self.live.layers)
            before = {layer: ls.experts for layer, ls in layers.items()}
            self.previous = None
            self.live = SlotSet(old_generation, layers, committing=True)
            self._commits += 1
            try:
                with self._on_device():
                    work = self._apply_all(staged, layers)
            except (OSError, ValueError, RuntimeError) as e:
                why = f"the commit of placement generation {generation} failed half-way ({e}); push a new placement"
                self.live = SlotSet(old_generation, layers, why)
                self._staged = None
                raise Unavailable(why) from e
            self.live = SlotSet(generation, layers)
            self.last_commit = work
            self.previous = PreviousSlots.between(old_generation, before, layers)
            self._staged = None
            self._drop_scratch()
            self._freed.append(staged)

    def _apply_all(self, staged: _Staged, layers: dict[int, LayerSlots]) -> CommitWork:
        """Rewrites every layer as planned. A host table's layers are independent allocations,
        so they are rewritten on parallel threads (one core's copies each; a layer's own moves
        keep their order), then the staged experts are copied in, one slot per job over the
        same threads: a capped rebalance changes many slots of few layers, and one thread per
        layer copied them one after another; a GPU table's copies are device work queued from
        this thread."""
        changed = [layer for layer in self.moe_layers if not staged.plans[layer].unchanged]
        # NOTE: a layer rebuilt by the commit allocates a whole new layer: after the in-place
        # layers have used up (so freed) the staged rows, and one at a time, so the extra
        # memory stays one layer
        rebuilt = [n for n in changed if staged.plans[n].rebuild is not None and n not in staged.built]
        in_place = [layer for layer in changed if layer not in rebuilt]
        if self.device.type != "cpu" or not in_place:
            done = [self._apply(layer, staged, layers) for layer in in_place]
        else:
            self._read_pool()  # NOTE: created here, not raced for by the layers' threads
            if self._commit_pool is None:
                self._commit_pool = reader_pool(read_threads(MAX_COMMIT_THREADS))
            # NOTE: a layer's checkpoint reads run on the read pool, never on these threads (no
            # job waits on a pool that its own thread belongs to)
            copies: list[_Copy] = []
            jobs = [_bind(self._apply, layer, staged, layers, copies) for layer in in_place]
            done = [w for w in run_on(self._commit_pool, jobs) if isinstance(w, CommitWork)]
            run_on(self._commit_pool, [_bind(_Copy.run, c) for c in copies])
            for layer in {c.layer for c in copies}:  # every slot written: the layer is whole
                layers[layer] = LayerSlots.of(staged.plans[layer].experts, *layers[layer].rows)
            self._freed += [c.rows for c in copies]
        if rebuilt:
            self._freed.clear()  # NOTE: freed now, so the rebuilds below add one layer at most
        done += [self._apply(layer, staged, layers) for layer in rebuilt]
        return sum(done, CommitWork())

    def _apply(
        self, layer: int, staged: _Staged, layers: dict[int, LayerSlots], copies: list[_Copy] | None = None
    ) -> CommitWork:
        """Rewrites one layer of ``layers`` as planned (dropping what it used from ``staged``);
        with ``copies``, its staged experts are left to the caller (see :meth:`_rewrite`)."""
        plan, cur = staged.plans[layer], layers[layer]
        if plan.unchanged:
            return CommitWork()
        built = staged.built.pop(layer, None)
        if built is not None:
            self._freed.append(cur)  # the old allocation, freed by release()
            layers[layer] = built
            return CommitWork(swapped=1)
        if plan.rebuild is not None:  # outgrew its allocation beyond what prepare could stage
            sources = _sources(layer, plan, cur, staged.rows)
            self._note(plan.rebuild * self.slot_bytes())
            new = LayerSlots.of(plan.experts, *self._build(layer, sources, slots=plan.rebuild))
            read = sum(isinstance(src, int) for src in sources)
            del sources, cur
            layers[layer] = new
            return CommitWork(rebuilt=1, read=read)
        return self._rewrite(layer, plan, cur, staged, layers, copies)

    def _rewrite(
        self,
        layer: int,
        plan: LayerPlan,
        cur: LayerSlots,
        staged: _Staged,
        layers: dict[int, LayerSlots],
        copies: list[_Copy] | None = None,
    ) -> CommitWork:
        """The in-place path: the changed slots of the allocation are written, the live count
        becomes S' (slots past it stay allocated as spare). With ``copies``, the staged experts
        are appended there instead of copied, and the layer is left listing their slots as -1
        (never computed) until the caller has copied them and set its live slots."""
        n = max(len(cur.experts), len(plan.experts))
        # what each slot holds at this point (-1: being written); spare slots it grows into too
        content = list(cur.experts) + [-1] * (n - len(cur.experts))
        w13, w2 = cur.rows
        for dst, e in ((d, plan.experts[d]) for d in range(len(cur.experts), len(plan.experts))):
            if (layer, dst) in staged.direct:  # written by the prepare
                content[dst] = e
        moves = tuple((d, s) for d, s in plan.moves if (layer, d) not in staged.direct)
        spare: Rows | None = None
        spare_expert = -1
        work = CommitWork()
        deferred = False
        try:
            for op, dst, src in move_order(moves):
                work.moved += 1
                if op == "save":
                    if spare is None:
                        spare = (torch.empty_like(w13[dst]), torch.empty_like(w2[dst]))
                        self._note(spare[0].nbytes + spare[1].nbytes)
                    spare[0].copy_(w13[dst])
                    spare[1].copy_(w2[dst])
                    spare_expert = content[dst]
                    continue
                a, b = spare if src == TEMP and spare is not None else (w13[src], w2[src])
                content[dst] = -1
                w13[dst].copy_(a)
                w2[dst].copy_(b)
                content[dst] = spare_expert if src == TEMP else content[src]
            unread = []
            for dst, e in plan.reads:
                if (layer, dst) in staged.direct:
                    continue
                content[dst] = -1
                rows = staged.rows.pop((layer, dst), None)
                if rows is None:
                    unread.append((dst, e))
                    continue
                work.copied += 1
                if copies is not None:
                    copies.append(_Copy(layer, w13[dst], w2[dst], rows))
                    deferred = True
                    continue
                w13[dst].copy_(rows[0])
                w2[dst].copy_(rows[1])
                self._freed.append(rows)
                content[dst] = e
            self._parallel([_bind(self._read_into, layer, e, w13[dst], w2[dst]) for dst, e in unread])
            for dst, e in unread:
                content[dst] = e
            work.read += len(unread)
        finally:
            # NOTE: on a failure the slots being written stay listed as -1 (never computed)
            layers[layer] = LayerSlots.of(tuple(content), w13, w2)
        if deferred:
            return work  # NOTE: listed -1 where the caller copies (list appends are thread-safe)
        assert tuple(content[: len(plan.experts)]) == plan.experts, f"{layer=} {content=} {plan.experts=}"
        layers[layer] = LayerSlots.of(plan.experts, w13, w2)
        return work

    def release(self) -> int:
        """Frees what the last commit replaced and hands it back to the device or the OS
        (memory.py); the worker calls it once requests flow again (unmapping pages and walking
        the allocator's free lists take time). Host pages go back a chunk at a time before the
        free (:func:`memory.drop_pages`); returns their bytes."""
        with self._lock:
            freed, self._freed = self._freed, []
        dropped = memory.drop_pages(_host_tensors(freed)) if self.device.type == "cpu" else 0
        del freed
        memory.release(self.device)
        return dropped

    def abort(self, generation: int) -> None:
        with self._lock:
            if self._staged is None or self._staged.generation != generation:
                return
            self._staged = None
        memory.release(self.device)


def _host_tensors(freed: list[object]) -> list[torch.Tensor]:
    """Every tensor held by what commits freed (layers, staged rows, a prepare's leftovers)."""
    out: list[torch.Tensor] = []
    stack = list(freed)
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, (tuple, list)):
            stack.extend(o)
        elif isinstance(o, LayerSlots):
            stack += [o.w13, o.w2, *(o.alloc or ())]
        elif isinstance(o, _Staged):
            stack += [*o.rows.values(), *o.built.values()]
    return out


def _sources(layer: int, plan: LayerPlan, cur: LayerSlots, rows: dict[tuple[int, int], Rows]) -> list[Source]:
    """What each slot of ``plan``'s new allocation is filled from: a live slot of ``cur``, rows
    read ahead (taken from ``rows``), or the expert to read."""
    sources: list[Source] = list(plan.experts)
    for dst, src in plan.moves:
        sources[dst] = (cur.w13[src], cur.w2[src])
    for dst, _ in plan.reads:
        got = rows.pop((layer, dst), None)
        if got is not None:
            sources[dst] = got
    return sources


def plain_views(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A slot of a backend that computes on the weights as stored: gate rows, then up rows."""
    i = w13.shape[0] // 2
    return w13[:i], w13[i:], w2


def _bind(fn: Callable[..., object], *args: object) -> Callable[[], object]:
    return lambda: fn(*args)


def _rows_job(table: SlotTable, layer: int, src: Source) -> Callable[[], object]:
    return (lambda: src) if isinstance(src, tuple) else (lambda: table._read_rows(layer, src))
