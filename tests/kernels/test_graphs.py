"""fastaf.kernels.launch_graphs: an eager call's launches replayed from a CUDA graph.

On the CPU (interpreter): the graphed forward and backward compose the outputs the ungraphed
path returns, every buffer allocated outside the graph, and ``LaunchGraphs`` captures at a key's
third sighting and replays after (a stand-in graph). On the GPU: real graphs over repeated
calls on the same addresses with new values, against the ungraphed path, and no graph on a
user's stream.
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

from fastaf.kernels import launch_graphs
from fastaf.kernels import lora_linear as ll
from fastaf.kernels.lora_linear_plan import clear_memos
from tests._tolerances import assert_close
from tests.kernels.test_lora_linear import HAS_CUDA, make, reference

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="the CPU checks run the kernels in Triton's interpreter")


@pytest.fixture
def fresh_plans():
    """Plans built from this test's configs only, and none of them left for later tests."""
    clear_memos()
    yield
    clear_memos()


class _Recorder:
    """A stand-in for ``GRAPHS``: runs every call's launches, and keeps the keys."""

    def __init__(self) -> None:
        self.keys: list = []

    def run(self, key, device, launch) -> None:
        self.keys.append(key)
        launch()

    def clear(self) -> None:  # clear_memos clears the graphs too
        self.keys.clear()


def _both(monkeypatch, factor_dtype: torch.dtype, partials: bool, needs_dx: bool = True, p: float = 0.0,
          bias: bool = True):
    """(ungraphed, graphed) forward + backward of one call; the graphed one through ``_Recorder``."""
    recorder = _Recorder()
    monkeypatch.setattr(launch_graphs, "usable", lambda x: True)
    monkeypatch.setattr(launch_graphs, "GRAPHS", recorder)
    x, weight, bias_t, a, b, dy, seed = make(64, 32, 48, 4, torch.float32, "cpu", bias=bias, p=p)
    a, b = a.to(factor_dtype), b.to(factor_dtype)
    conf = dict(ll.INTERPRET["bwd_dy"], DB_PARTIAL=int(partials))
    monkeypatch.setitem(ll.INTERPRET, "bwd_dy", conf)
    out = []
    for graphed in (False, True):
        y, h = ll.lora_linear_fwd_unchecked(x, weight, bias_t, a, b, 0.5, p, seed, "triton", graphed=graphed)
        grads = ll.lora_linear_bwd_unchecked(dy, x, weight, a, b, h, 0.5, p, seed, needs_dx, "triton",
                                             shared_grads=True, graphed=graphed)
        out.append((y, h, *grads))
    return out, recorder.keys, (x, weight, bias_t, a, b, dy)


@needs_interpreter
@pytest.mark.parametrize("factor_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partials", [True, False], ids=["db-partials", "db-atomic"])
def test_graphed_calls_return_what_launches_return(monkeypatch, fresh_plans, factor_dtype, partials):
    (plain, graphed), keys, (x, weight, bias, a, b, dy) = _both(monkeypatch, factor_dtype, partials)
    assert ["fwd" in k for k in keys] == [True, False] and "bwd" in keys[1]  # both phases took the graphed path
    for name, p, g in zip(("y", "h", "dx", "da", "db"), plain, graphed):
        assert g.dtype == p.dtype and g.shape == p.shape, name
        torch.testing.assert_close(g, p, msg=name)
    want = reference(x, weight, bias, a.float(), b.float(), 0.5, 0.0, None, dy)
    for name, g, w in zip(("y", "h", "dx", "da", "db"), graphed, want):
        assert_close(g, w, factor_dtype if name in ("da", "db") else torch.float32, name)


@needs_interpreter
def test_graphed_backward_without_dx(monkeypatch, fresh_plans):
    (plain, graphed), _, _ = _both(monkeypatch, torch.float32, False, needs_dx=False)
    assert plain[2] is None and graphed[2] is None
    for p, g in zip(plain[3:], graphed[3:]):
        torch.testing.assert_close(g, p)


@needs_interpreter
def test_graphed_calls_with_dropout_and_without_bias(monkeypatch, fresh_plans):
    (plain, graphed), keys, _ = _both(monkeypatch, torch.float32, False, p=0.25, bias=False)
    assert len(keys) == 2
    for name, p, g in zip(("y", "h", "dx", "da", "db"), plain, graphed):
        torch.testing.assert_close(g, p, msg=name)


def test_call_key_tells_apart_what_a_launch_could_tell_apart():
    base = torch.zeros(8, 6)
    keys = [launch_graphs.call_key((base, None), 0.5),
            launch_graphs.call_key((base[:, :4], None), 0.5),  # same address, other shape
            launch_graphs.call_key((base.T, None), 0.5),  # same address, other strides
            launch_graphs.call_key((base.view(torch.int32), None), 0.5),  # same address, other dtype
            launch_graphs.call_key((base[1:], None), 0.5),  # other address
            launch_graphs.call_key((base, base), 0.5),  # an optional tensor present
            launch_graphs.call_key((base, None), 0.25)]  # another float
    assert len(set(keys)) == len(keys)
    assert launch_graphs.call_key((base, None), 0.5) == keys[0]  # and equal calls meet


@needs_interpreter
def test_graphed_keys_hold_every_tensor_of_the_call(monkeypatch, fresh_plans):
    seen = []
    shipped = launch_graphs.call_key
    monkeypatch.setattr(launch_graphs, "call_key", lambda tensors, *values: seen.append(tensors) or shipped(tensors, *values))
    (_, (y, h, dx, da, db)), _, (x, weight, bias, a, b, dy) = _both(monkeypatch, torch.float32, True)
    fwd, bwd = ({id(t) for t in ts if t is not None} for ts in seen)
    assert {id(t) for t in (x, weight, bias, a, b, y, h)} <= fwd
    assert {id(t) for t in (dy, x, weight, a, b, h, dx, db)} <= bwd  # db: its own buffer where partials sum it
    assert any(t is not None and t.data_ptr() == da.data_ptr() for t in seen[1])  # da: a view of the work buffer


class _FakeGraph:
    def __init__(self, launch) -> None:
        self.launch, self.replayed = launch, 0

    def replay(self) -> None:
        self.replayed += 1
        self.launch()


class _FakePool:
    id = (0, 1)


@pytest.fixture
def pooled(monkeypatch):
    """The graphs' MemPool faked for the CPU: ``pooled[0]`` says whether a pool is active now."""
    active = [False]

    @contextlib.contextmanager
    def use_mem_pool(pool, device):
        assert isinstance(pool, _FakePool) and not active[0]
        active[0] = True
        try:
            yield
        finally:
            active[0] = False

    monkeypatch.setattr(launch_graphs.torch.cuda, "MemPool", _FakePool)
    monkeypatch.setattr(launch_graphs.torch.cuda, "use_mem_pool", use_mem_pool)
    return active


def test_capture_at_third_sighting_then_replay(monkeypatch, pooled):
    graphs = launch_graphs.LaunchGraphs()
    monkeypatch.setattr(graphs, "capture", lambda device, launch: _FakeGraph(launch))
    runs = []
    for _ in range(5):
        graphs.run(("k",), 0, lambda: runs.append("pooled" if pooled[0] else "launch"))
    # the two launches before the capture take their temporaries from the graphs' pool (the
    # allocator sees the same allocations as on a replay); the fake graph's replays launch too
    assert runs == ["pooled"] * 2 + ["launch"] * 3
    assert graphs.replays == 3 and graphs.captures == 1 and list(graphs.graphs) == [("k",)]
    for _ in range(2):  # a key seen twice: launched, not captured
        graphs.run(("other",), 0, lambda: runs.append("other"))
    assert ("other",) not in graphs.graphs and runs[-2:] == ["other", "other"]


def _capacity_2(monkeypatch) -> launch_graphs.LaunchGraphs:
    """Graphs with a stand-in capture and a capacity of 2."""
    graphs = launch_graphs.LaunchGraphs()
    monkeypatch.setattr(graphs, "capture", lambda device, launch: _FakeGraph(launch))
    monkeypatch.setattr(launch_graphs, "CAPACITY", 2)
    return graphs


def test_capacity_bounds_the_graphs_kept(monkeypatch, pooled):
    """Graphs replayed once after their capture (below ``EARNED``) fill the capacity for good:
    later keys launch, as a loop whose addresses drift would."""
    graphs = _capacity_2(monkeypatch)
    for i in range(4):
        for _ in range(4):
            graphs.run(("k", i), 0, lambda: None)
    assert len(graphs.graphs) == 2 and graphs.captures == 2


def test_a_step_of_more_keys_than_a_generation_still_captures(monkeypatch, pooled):
    """A loop of 5 keys a step with generations of 4 new keys: each key recurs within 4 other
    keys, so all are captured on their third sighting (one dict cleared at 4 forgot them all)."""
    monkeypatch.setattr(launch_graphs, "GENERATION", 4)
    graphs = launch_graphs.LaunchGraphs()
    monkeypatch.setattr(graphs, "capture", lambda device, launch: _FakeGraph(launch))
    for step in range(4):
        for i in range(5):
            graphs.run(("loop", i), 0, lambda: None)
        assert graphs.captures == (5 if step >= 2 else 0)
    assert graphs.replays == 10 and not graphs.seen and not graphs.older


def test_keys_that_never_recur_are_forgotten(monkeypatch, pooled):
    """Addresses that drift: the sightings kept stay within two generations."""
    monkeypatch.setattr(launch_graphs, "GENERATION", 3)
    graphs = launch_graphs.LaunchGraphs()
    for i in range(50):
        graphs.run(("drift", i), 0, lambda: None)
        assert len(graphs.seen) + len(graphs.older) <= 6
    assert graphs.captures == 0


def _filled(monkeypatch) -> launch_graphs.LaunchGraphs:
    """Graphs at a capacity of 2, filled by a loop whose two keys were captured, then replayed twice."""
    graphs = _capacity_2(monkeypatch)
    for i in range(2):
        for _ in range(5):
            graphs.run(("first", i), 0, lambda: None)
    assert graphs.captures == 2 and graphs.replays == 6
    return graphs


def test_at_capacity_graphs_of_an_ended_loop_make_way(monkeypatch, pooled):
    """A process's next loop gets graphs once the first one's, which paid off, stop replaying: when
    a key's capture is refused a second time with no replay between, they are dropped and the key
    captured."""
    graphs = _filled(monkeypatch)
    runs = []
    for _ in range(5):  # each step of the next loop, two keys: launched 3 times (the third refused)
        for i in range(2):
            graphs.run(("next", i), 0, lambda: runs.append(1))
    assert set(graphs.graphs) == {("next", 0), ("next", 1)} and graphs.captures == 4
    assert len(runs) == 10 and not graphs.seen


def test_at_capacity_graphs_still_replaying_are_kept(monkeypatch, pooled):
    """Graphs a training loop replays are kept when the keys refused at capacity are an eval
    loop's, called back to back between training steps; the eval calls launch."""
    graphs = _filled(monkeypatch)
    for _ in range(4):
        for i in range(3):  # eval: three keys in a row, refused once their sightings are up
            graphs.run(("eval", i), 0, lambda: None)
        for i in range(2):  # a training step: the kept graphs replay
            graphs.run(("first", i), 0, lambda: None)
    assert set(graphs.graphs) == {("first", 0), ("first", 1)} and graphs.captures == 2


def test_a_failed_capture_launches_and_turns_graphs_off(monkeypatch, pooled):
    graphs = launch_graphs.LaunchGraphs()
    monkeypatch.setattr(launch_graphs.torch.cuda, "CUDAGraph", lambda: (_ for _ in ()).throw(RuntimeError("no graphs")))
    monkeypatch.setattr(launch_graphs.torch.cuda, "Stream", lambda device: None)
    ended = []
    monkeypatch.setattr(launch_graphs.torch._C, "_cuda_endAllocateToPool", lambda device, pool: ended.append(pool),
                        raising=False)
    runs = []
    for i in range(2):
        graphs.run(("k",), 0, lambda: runs.append(i))
    with pytest.warns(RuntimeWarning, match="CUDA graphs of eager launches disabled"):
        graphs.run(("k",), 0, lambda: runs.append(2))
    assert runs == [0, 1, 2] and not graphs.enabled and not graphs.graphs
    assert ended == [(0, 1)]  # the allocator no longer routes to the failed capture's pool


def test_not_usable_on_the_cpu():
    assert not launch_graphs.usable(torch.empty(2))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("factor_dtype", [torch.float32, torch.bfloat16])
def test_gpu_replays_follow_new_values_at_the_same_addresses(factor_dtype):
    """Steps of one layer, its inputs refilled in place: the graphed calls replay and equal the
    ungraphed path on every step's values."""
    if not launch_graphs.usable(torch.empty(1, device="cuda")):
        pytest.skip("graphs not usable here (fast launch off, or FASTAF_LAUNCH_GRAPHS=0)")
    # the allocator hands the same blocks to the same allocations once its free blocks settle: from
    # an empty cache (earlier tests' leftovers moved them for more than 5 steps, H100) in a few steps
    torch.cuda.empty_cache()
    x, weight, bias, a, b, dy, _ = make(1024, 512, 768, 16, torch.bfloat16, "cuda")
    a, b = a.to(factor_dtype), b.to(factor_dtype)
    before = launch_graphs.GRAPHS.replays
    for step in range(8):
        for t in (x, a, b, dy):
            t.copy_(torch.randn_like(t, dtype=torch.float32) / 8)
        y, h = ll.lora_linear_fwd_unchecked(x, weight, bias, a, b, 0.5, 0.0, None, "triton", graphed=True)
        got = ll.lora_linear_bwd_unchecked(dy, x, weight, a, b, h, 0.5, 0.0, None, True, "triton",
                                           shared_grads=True, graphed=True)
        # against fp64 at bf16's tolerance, x's (the atomics' order makes launch and replay differ
        # in the last bits; fp32 factors meet bf16 activations in the kernels' dots)
        want = reference(x, weight, bias, a, b, 0.5, 0.0, None, dy)
        for name, g, w in zip(("y", "h", "dx", "da", "db"), (y, h, *got), want):
            assert g.dtype == (factor_dtype if name in ("da", "db") else torch.bfloat16), name
            assert_close(g, w, torch.bfloat16, f"step {step}: {name}")
        del y, h, got, want
    assert launch_graphs.GRAPHS.replays > before, "no call replayed its graph"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_no_graph_on_a_user_stream():
    x = torch.empty(8, device="cuda")
    with torch.cuda.stream(torch.cuda.Stream()):
        assert not launch_graphs.usable(x)



@needs_interpreter
def test_graphed_gradients_do_not_keep_dh_alive(monkeypatch, fresh_plans):
    """dA and dB are views of one buffer that holds them alone: as A.grad and B.grad they would
    otherwise keep the backward's (M, R) dh alive until zero_grad."""
    (_, graphed), _, (x, weight, bias, a, b, dy) = _both(monkeypatch, torch.float32, False)
    (R, K), N = a.shape, b.shape[0]
    for g in graphed[3:]:
        assert g.untyped_storage().nbytes() == (R * K + N * R) * 4
