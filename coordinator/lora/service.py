"""Hot-loading MoE LoRA adapters on a running coordinator (what ``Admin.LoadLoRA`` /
``UnloadLoRA`` / ``ListLoRA`` do), free of gRPC: typed errors the servicer maps to codes.

Load: the path must lie under a ``--lora-dir`` root (:class:`LoRAPermissionError`); the adapter
is read and validated against the model (:class:`AdapterError`); each expert server is sent the
LoRA of the experts its placement gives it (two phases through the cluster: every push first,
a failed one unloads it from the servers already pushed to and raises
:class:`LoRAPushError` naming the server); then, between two scheduler steps, the coordinator
installs it and only from then on can requests use it.

Unload: the name stops being usable at once (new requests naming it are refused), the call
waits for the running requests that use it to finish (``unload_timeout_s``), then removes it
from the coordinator (between steps) and from every server.

Placement changes and returning servers: the cluster calls :meth:`LoRAService.on_prepare` after
each server's PREPARE, which pushes every loaded adapter for the experts of the new slot table
and of the live one (both generations stay covered until the commit).

Expert servers shared by several coordinators (``--placement-lease``): the servers hold each
adapter's expert part under one slot number for all of them, so a load takes a slot no server
uses for another name (the servers refuse a slot holding another name), and sends the path it
read. Every coordinator learns from the servers' lease answers which adapters they hold
(:meth:`LoRAService.sync_pool`, on the cluster's maintenance thread): one it lacks is read from
that path (under its own ``--lora-dir``: the adapters live on a volume every coordinator mounts,
like the checkpoint) and installed under the same slot, so its non-expert parts exist here too;
one gone from every server (unloaded through another coordinator) is dropped here.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from coordinator.lora.adapter import LoRAAdapter, load_adapter
from coordinator.lora.config import AdapterError
from coordinator.lora.manager import LoRAManager
from expertmesh.lora.store import LayerAdapter
from expertmesh.lora.wire import encode_adapter
from expertmesh.paths import PathNotAllowed, confine, resolve_roots

BetweenSteps = Callable[[Callable[[], object]], Future]
log = logging.getLogger("expertmesh.lora")


class LoRAPermissionError(PathNotAllowed):
    pass


class LoRANotFound(KeyError):
    pass


class LoRAPushError(RuntimeError):
    pass


class AdapterNameError(AdapterError):
    """The name is the problem (empty, or already loaded), not the adapter at the path."""


class AdapterSlotsFull(AdapterError):
    """Every adapter slot is taken (--max-loras): neither the name nor the path is wrong."""


class LoRAService:
    def __init__(
        self,
        manager: LoRAManager,
        lora_dirs: tuple[str, ...],
        between_steps: BetweenSteps,
        in_use: Callable[[str], int],
        cluster=None,  # coordinator.experts.cluster.ExpertCluster | None (None: experts in process)
        timeout_s: float = 60.0,
        unload_timeout_s: float = 300.0,
    ) -> None:
        self.manager, self.between_steps, self.in_use, self.cluster = manager, between_steps, in_use, cluster
        self.roots = resolve_roots(lora_dirs)
        self.timeout_s, self.unload_timeout_s = timeout_s, unload_timeout_s
        self.usable: set[str] = set()  # names requests may use (all servers acknowledged)
        # told each "load", "load_failed" and "unload" (the coordinator's metrics count them)
        self.on_event: Callable[[str], None] = lambda event: None
        self._lock = threading.Lock()  # one load/unload at a time
        self.sources: dict[str, str] = {}  # name -> the path it was read from
        # shared servers: name -> the pool round after which the servers must report it
        self._pooled: dict[str, int] = {}
        self._not_loadable: dict[str, str] = {}  # name -> why this coordinator cannot load it
        if cluster is not None:
            cluster.prepare_hooks.append(self.on_prepare)
            if getattr(cluster, "pool", None) is not None:
                cluster.round_hooks.append(self.sync_pool)

    # ---------------------------------------------------------------- load

    def check_path(self, path: str) -> Path:
        """The adapter directory, and the two files read from it (either could be a symlink out
        of the roots), must lie under a --lora-dir root (expertmesh/paths.py)."""
        try:
            p = confine(path, self.roots, "adapter path", "--lora-dir")
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                confine(p / name, self.roots, "adapter file", "--lora-dir")
        except PathNotAllowed as e:
            raise LoRAPermissionError(*e.args) from None
        return p

    def load(self, name: str, path: str) -> LoRAAdapter:
        try:
            adapter = self._load(name, path)
        except BaseException:
            self.on_event("load_failed")
            raise
        self.on_event("load")
        return adapter

    def _load(self, name: str, path: str) -> LoRAAdapter:
        if not name or "/" in name:
            raise AdapterNameError(f"adapter name {name!r}: give a non-empty name without '/'")
        p = self.check_path(path)
        with self._lock:
            if name in self.manager.adapters:
                raise AdapterNameError(f"adapter {name!r} is already loaded (unload it first)")
            used = set(self.manager.slot_of.values())
            pooled = self._pool_slots()  # name -> slot on shared servers
            used |= {s for n, s in pooled.items() if n != name}
            free = [s for s in range(self.manager.max_loras) if s not in used]
            if name in pooled:  # loaded through another coordinator already: the same slot here
                free = [pooled[name]] if pooled[name] in free else []
            if not free:
                raise AdapterSlotsFull(f"all {self.manager.max_loras} adapter slots are in use (--max-loras)")
            adapter = load_adapter(name, p, self.manager.model_cfg, self.manager.table)
            slot = free[0]
            self.sources[name] = str(p)
            try:
                skipped = self._push(adapter, slot) if self.cluster is not None else []
            except LoRAPushError:
                self.sources.pop(name, None)
                raise
            self.between_steps(lambda: self.manager.install(adapter, slot)).result()
            self.usable.add(name)
            self._catch_up(adapter, slot, skipped)
            pool = getattr(self.cluster, "pool", None)
            if pool is not None:
                self._pooled[name] = pool.rounds + 1
            return adapter

    def _pool_slots(self) -> dict[str, int]:
        """The adapters the shared servers hold now (name -> slot); {} when not shared."""
        pool = getattr(self.cluster, "pool", None)
        if pool is None:
            return {}
        return {a.name: a.slot for a in pool.observe_adapters().values()}

    def sync_pool(self) -> None:
        """Shared servers: installs the adapters they hold that this coordinator lacks (read
        from the path the loading coordinator sent) and drops those gone from every server."""
        pool = getattr(self.cluster, "pool", None)
        if pool is None or not pool.rounds:
            return
        if not pool.answered:  # NOTE: no server reached: nothing is known to be gone
            return
        seen, rounds = dict(pool.adapters), pool.rounds
        # NOTE: a load or unload running here holds the lock for its pushes: the maintenance
        # thread does not wait for it (the next round syncs)
        if not self._lock.acquire(blocking=False):
            return
        try:
            self._sync(seen, rounds)
        finally:
            self._lock.release()

    def _sync(self, seen: dict, rounds: int) -> None:
        for name, ad in sorted(seen.items()):
            if name not in self.manager.adapters and name not in self._not_loadable:
                self._install_pooled(name, ad.slot, ad.source, rounds)
        for name in sorted(self.manager.adapters):
            due = self._pooled.get(name)
            if due is not None and name not in seen and rounds > due:
                log.info("adapter %r left every expert server: unloading it here too", name)
                self.usable.discard(name)
                self.between_steps(functools.partial(self.manager.unload, name)).result()
                del self._pooled[name]
                self.sources.pop(name, None)
        for name in [n for n in self._not_loadable if n not in seen]:
            del self._not_loadable[name]  # unloaded: a later load by that name is tried again

    def _install_pooled(self, name: str, slot: int, source: str, rounds: int) -> None:
        why = ""
        if slot in self.manager.slot_of.values() or not 0 <= slot < self.manager.max_loras:
            why = f"its slot {slot} is taken here or outside --max-loras {self.manager.max_loras}"
        elif not source:
            why = "the servers do not say where it was read from"
        adapter = None
        if not why:
            try:
                adapter = load_adapter(
                    name, self.check_path(source), self.manager.model_cfg, self.manager.table
                )
            except (LoRAPermissionError, AdapterError, OSError) as e:
                why = str(e)
        if adapter is None:
            self._not_loadable[name] = why
            log.warning("adapter %r (loaded through another coordinator) is not usable here: %s", name, why)
            return
        self.between_steps(lambda: self.manager.install(adapter, slot)).result()
        self.usable.add(name)
        self.sources[name] = source
        self._pooled[name] = rounds
        log.info("adapter %r loaded through another coordinator: usable here too (slot %d)", name, slot)

    def on_prepare(self, server: int, table: dict[int, list[int]], timeout: float) -> None:
        """A placement PREPARE (or a returning server): push every loaded adapter's LoRA of the
        experts in ``table`` and in the live table (ExpertServerError propagates: the PREPARE fails)."""
        adapters = {n: (a, self.manager.slot_of[n]) for n, a in list(self.manager.adapters.items())}
        conn = self.cluster.conns[server]  # type: ignore[union-attr]
        for name, (adapter, slot) in adapters.items():
            payload = self._payload(adapter, server, table)
            conn.load_adapter(slot, name, payload, timeout, self.sources.get(name, ""))

    def _payload(self, adapter: LoRAAdapter, server: int, extra: dict[int, list[int]] | None = None) -> dict:
        assert self.cluster is not None
        table = self.cluster.tables.slots[server]  # layer -> logical expert per local slot
        layers = {}
        for layer, lora in adapter.experts.items():
            held = sorted((set(table.get(layer, ())) | set((extra or {}).get(layer, ()))) - {-1})
            if held:
                layers[layer] = LayerAdapter(tuple(held), lora.select(held))
        return encode_adapter(layers, self.manager.dtype)

    def _push(self, adapter: LoRAAdapter, slot: int) -> list[int]:
        """Loads the adapter on every live server (all or nothing); returns the servers that
        are down now: each gets it when it rejoins (:meth:`on_prepare`)."""
        cluster = self.cluster
        assert cluster is not None
        from coordinator.experts.expert_conn import ExpertServerError

        down = cluster.down()
        live = [i for i in range(len(cluster.members)) if i not in down]
        payloads = {i: self._payload(adapter, i) for i in live}
        try:
            cluster.two_phase(
                prepare=lambda i: cluster.conns[i].load_adapter(
                    slot, adapter.name, payloads[i], self.timeout_s, self.sources.get(adapter.name, "")
                ),
                commit=lambda i: None,
                abort=lambda i: cluster.conns[i].unload_adapter(adapter.name, self.timeout_s),
                members=live,
            )
        except ExpertServerError as e:
            raise LoRAPushError(f"adapter {adapter.name!r} was not loaded: {e}") from e
        return sorted(down)

    def _catch_up(self, adapter: LoRAAdapter, slot: int, skipped: list[int]) -> None:
        """A server down at the push that rejoined before the adapter was installed here got
        the adapters it found installed, not this one: push it now; if that fails, mark it down
        so that its next rejoin pushes everything (never a server serving without it)."""
        cluster = self.cluster
        if cluster is None:
            return
        from coordinator.experts.expert_conn import ExpertServerError

        down = cluster.down()
        for i in skipped:
            if i in down:
                continue  # it rejoins later and gets the adapter then
            try:
                payload = self._payload(adapter, i)
                cluster.conns[i].load_adapter(
                    slot, adapter.name, payload, self.timeout_s, self.sources.get(adapter.name, "")
                )
            except ExpertServerError as e:
                cluster.mark_down(i, e)

    # ---------------------------------------------------------------- unload / list

    def unload(self, name: str) -> None:
        with self._lock:
            if name not in self.manager.adapters:
                raise LoRANotFound(f"no adapter named {name!r} is loaded")
            self.usable.discard(name)  # new requests naming it are refused from now on
            deadline = time.monotonic() + self.unload_timeout_s
            while self.in_use(name):
                if time.monotonic() > deadline:
                    self.usable.add(name)
                    raise TimeoutError(
                        f"adapter {name!r}: requests still use it after {self.unload_timeout_s:.0f} s; not unloaded"
                    )
                time.sleep(0.05)
            self.between_steps(lambda: self.manager.unload(name)).result()
            self._pooled.pop(name, None)
            self.sources.pop(name, None)
            if self.cluster is not None:
                from coordinator.experts.expert_conn import ExpertServerError

                for conn in self.cluster.conns:
                    # NOTE: a server that is down now has nothing to unload we could reach
                    with contextlib.suppress(ExpertServerError):
                        conn.unload_adapter(name, self.timeout_s)
        self.on_event("unload")

    def list(self) -> list[LoRAAdapter]:
        return [a for n, a in sorted(self.manager.adapters.items()) if n in self.usable]
