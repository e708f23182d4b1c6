"""An eager call's launches replayed from a CUDA graph: one host call where the call made 2-4.

An eager LoRA step on a fast base (a Liger-Kernel-patched model) is host-bound: an adapted
layer's forward makes two Triton launches and its backward a memset and three, each ~9-13 us in
Triton's launcher plus fastaf's planning around it. In a training loop
a layer runs step after step on buffers at the same addresses (the caching allocator hands out
the same blocks for the same sequence of allocations), so one call's launches are the same
kernels with the same arguments each step. ``LaunchGraphs.run`` captures them into a CUDA graph
at the third sighting of a call's key and replays the graph from then on.

The caller's key (``call_key``) names everything the launches read or write: every tensor's
address, shape, strides and dtype, every float. Every buffer a caller keeps (outputs, gradients)
is allocated by the caller before, outside the graph; inside, the launches may allocate only
temporaries (Triton's TMA scratch, a factor cast, db's partial sums), which come from one private
memory pool shared by the graphs of a device, so two graphs may share a temporary's block: safe
because every replay runs on the device's default stream, in order. The launches of a call not
(yet) captured take their temporaries from that pool too (``torch.cuda.use_mem_pool``): the
caching allocator then makes the same allocations whether a step launches or replays, and the
blocks it holds for the model's tensors do not split around them. Measured (H100, the Liger step
run after PEFT's steps in one process, two alternating rounds): 100.8 / 100.0 ms with it, 105.5 /
102.6 ms without, 224 graphs captured either way. A key seen once or
twice (addresses that never repeat) costs a dict entry, kept for two generations of
``GENERATION`` new keys: a key that recurs within that many other keys is recognised, one that
never recurs is forgotten. A capture that fails turns graphs off for the process, warned once,
and the call launches normally. At ``CAPACITY`` graphs, those kept are dropped and capturing
starts over if they paid off and a key's capture was refused twice with no replay in between,
else new keys launch.

``usable`` says where replays are safe: a CUDA tensor on the current device, the current stream
the legacy default one (no user stream, no stream capture of the user's under way: theirs would
record our launches), no Triton launch hook (a profiler's), not while compiling, and
``FASTAF_LAUNCH_GRAPHS`` not "0".
"""
from __future__ import annotations

import threading
import warnings
from typing import Any, Callable, Hashable

import torch

from fastaf import _config
from fastaf.kernels import launch_sites

# graphs kept per process. At it, a key whose capture is refused launches; refused once more with
# no graph replayed in between (a whole iteration of a new loop ran without the old graphs), the
# graphs kept are all dropped and capturing starts over, if they paid off (replayed EARNED times
# each on average): a process's next training loop (a notebook's next model, a test suite's next
# test) gets graphs too. Graphs still replaying (a training loop beside an eval loop whose keys
# came last) are kept; graphs that never paid off (a loop whose addresses drift) stop the
# captures: that bounds what captures never replayed cost (~0.1-1 ms each, once).
CAPACITY = 4096
EARNED = 3  # replays per graph kept, its capture's own included
SIGHTINGS = 2  # launches of a key before its capture: a key that recurs only once is not captured
# new keys per generation of sightings. Two generations are kept, so a key is recognised when it
# recurs within GENERATION other keys: a step of more graphed calls than CAPACITY (an 80-layer
# model under gradient accumulation) still captures its first CAPACITY keys, where one dict cleared
# at a cap would forget a step of more keys than the cap before any of them recurred.
GENERATION = 2 * CAPACITY


class LaunchGraphs:
    """CUDA graphs of eager calls' launches, by the callers' keys."""

    def __init__(self) -> None:
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.seen: dict[Hashable, int] = {}  # key -> its calls launched so far (this generation)
        self.older: dict[Hashable, int] = {}  # the same, of the generation before
        self.pools: dict[int, Any] = {}  # device -> the MemPool its graphs and launches share
        self.streams: dict[int, torch.cuda.Stream] = {}  # device -> the side stream captures run on
        self.enabled = True  # False after a capture failed; the launch_graphs flag is read per call
        self.replays = self.captures = 0  # tests and diagnostics read them
        self._replays_at_clear = 0
        self._refused: dict[Hashable, int] = {}  # key -> replays when its capture was last refused
        self._lock = threading.Lock()  # one capture at a time (the backward runs on autograd's thread)

    def run(self, key: Hashable, device: int, launch: Callable[[], Any]) -> None:
        """Run ``launch`` (kernel launches into buffers allocated before) or the graph of an
        earlier call with this ``key`` on ``device``, the current device."""
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            self.replays += 1
            return
        launched = self._sightings(key)
        if launched < SIGHTINGS or (len(self.graphs) >= CAPACITY and not self._renewed(key)):
            self._sighted(key, launched + 1)
            self._launch(device, launch)
            return
        self.seen.pop(key, None)  # another thread may have cleared it meanwhile
        self.older.pop(key, None)
        with self._lock:
            graph = self.capture(device, launch)
        if graph is None:
            launch()
            return
        self.graphs[key] = graph
        self.captures += 1
        graph.replay()  # a capture records the launches without running them
        self.replays += 1

    def _sightings(self, key: Hashable) -> int:
        """Launches of ``key`` so far, in either generation."""
        launched = self.seen.get(key)
        return self.older.get(key, 0) if launched is None else launched

    def _sighted(self, key: Hashable, launched: int) -> None:
        """Record ``key``'s launches in this generation; a full one becomes the older (the older
        one's keys, not seen again since, are forgotten: addresses that drift do not grow it)."""
        if key not in self.seen:
            if len(self.seen) >= GENERATION:
                self.older, self.seen = self.seen, {}
            self.older.pop(key, None)
        self.seen[key] = launched

    def _renewed(self, key: Hashable) -> bool:
        """At capacity: whether the graphs kept served a loop that has ended, so that all are
        dropped (``clear``) and ``key`` may be captured; else its capture is refused (``CAPACITY``)."""
        with self._lock:  # not while another thread captures into the pool clear() drops
            if self._refused.get(key) != self.replays:  # first refusal, or graphs replayed since
                if len(self._refused) >= CAPACITY:
                    self._refused.clear()
                self._refused[key] = self.replays
                return False
            if self.replays - self._replays_at_clear < EARNED * len(self.graphs):  # never paid off
                return False
            seen, older = self.seen, self.older  # the new loop's sightings stay: its other
            self.clear()  # keys capture on time
            self.seen, self.older = seen, older
            return True

    def _launch(self, device: int, launch: Callable[[], Any]) -> None:
        """``launch()`` with its temporaries from ``device``'s pool (module docstring)."""
        with torch.cuda.use_mem_pool(self._pool(device), device):
            launch()

    def _pool(self, device: int) -> Any:
        pool = self.pools.get(device)
        if pool is None:
            pool = self.pools[device] = torch.cuda.MemPool()
        return pool

    def capture(self, device: int, launch: Callable[[], Any]) -> torch.cuda.CUDAGraph | None:
        pool = None
        try:
            stream = self.streams.get(device)
            if stream is None:
                stream = self.streams[device] = torch.cuda.Stream(device)
            pool = self._pool(device).id
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                # thread_local: other threads' CUDA calls stay legal while this one captures
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    launch()
                finally:
                    graph.capture_end()
        except Exception as err:  # noqa: BLE001 - any failure: launches as before, for good
            if pool is not None:
                # capture_end raises before it stops routing allocations to the pool: stop it
                # here (torch raises when it had stopped already)
                try:
                    torch._C._cuda_endAllocateToPool(device, pool)
                except Exception:  # noqa: BLE001
                    pass
            self.enabled = False
            self.clear()
            warnings.warn(f"fastaf: CUDA graphs of eager launches disabled ({type(err).__name__}: {err}); "
                          "launching each kernel", RuntimeWarning, stacklevel=4)
            return None
        return graph

    def clear(self) -> None:
        """Drop every graph (their pool goes with the last one), after the GPU ran what was queued:
        a replay in flight must not lose its pool's temporaries (fastaf-tune's clear_memos calls this)."""
        if self.graphs and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self.graphs.clear()
        self.seen, self.older = {}, {}
        self.pools.clear()
        self._refused.clear()
        self._replays_at_clear = self.replays


GRAPHS = LaunchGraphs()
# the fast launch path exists here (triton's knobs, not the interpreter): read once, as the
# launch sites do, not per call
_FAST_LAUNCH = launch_sites.fast_launch_enabled()


def call_key(tensors: tuple, *values: Hashable) -> tuple:
    """A graphed call's key: each of ``tensors`` (every tensor its launches read or write, None
    for an absent one) by address, shape, strides and dtype, then ``values`` (floats, flags)."""
    return (*[None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors], *values)


def usable(x: torch.Tensor) -> bool:
    """Whether a call on ``x`` may replay graphs (module docstring)."""
    if not (GRAPHS.enabled and _FAST_LAUNCH and x.is_cuda and _config.flags().launch_graphs) \
            or torch.compiler.is_compiling():
        return False
    device = x.get_device()
    if device != launch_sites._current_device() or launch_sites._raw_stream(device) != 0:  # a user stream, or
        return False  # a capture of theirs on one; a graph replays on the current device's stream
    return not launch_sites._hooks_active()
