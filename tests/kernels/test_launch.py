"""fastaf.kernels.launch_sites: the fallbacks and hook detection (CPU; the fast path itself
is exercised on the GPU by test_lora_linear.test_gpu_fast_launch_repeats)."""
from __future__ import annotations

import os

import pytest
import torch

from fastaf.kernels import launch_sites


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="checks the interpreter's normal path")
def test_interpreter_takes_normal_launch():
    from fastaf.kernels import lora_linear as ll

    assert not any(site.fast for site in ll.SITES.values())


def test_bad_kernel_disables_fast_path(monkeypatch):
    class Param:
        def __init__(self, name, const):
            self.name, self.is_constexpr = name, const

    class Kernel:  # a constexpr before a runtime parameter: the site must refuse the fast path
        params = [Param("A", True), Param("x", False)]

    monkeypatch.setattr(launch_sites, "fast_launch_enabled", lambda: True)
    with pytest.warns(RuntimeWarning, match="fast Triton launch disabled"):
        site = launch_sites.LaunchSite(Kernel(), 1, 0)
    assert not site.fast


def test_hook_activity():
    class Chain:
        def __init__(self, calls):
            self.calls = calls

    assert not launch_sites.hook_active(None)
    assert not launch_sites.hook_active(Chain([]))  # triton 3.6+'s default: an empty chain
    assert launch_sites.hook_active(Chain([print]))
    assert launch_sites.hook_active(print)  # older triton: a plain callable


def test_layout_check_refuses_unkeyed_arguments(monkeypatch):
    class Param:
        def __init__(self, name, const):
            self.name, self.is_constexpr = name, const

    class Kernel:
        params = [Param("x", False), Param("n", False), Param("s", False), Param("B", True)]

    monkeypatch.setattr(launch_sites, "fast_launch_enabled", lambda: True)
    site = launch_sites.LaunchSite(Kernel(), 1, 1)
    assert site.layout_ok((torch.empty(1), 3, 0.5))
    with pytest.warns(RuntimeWarning):
        assert not site.layout_ok((torch.empty(1), 0.5, 3))  # a float where the key expects an int
    assert not site.fast


class _FakeSite:
    """Stands in for a LaunchSite: records which path launched, ``again`` succeeds while ``ok``."""

    def __init__(self):
        self.log, self.ok = [], True

    def __call__(self, grid, args, meta, meta_key):
        self.log.append("site")
        return ("entry", len(self.log))

    def again(self, entry, grid, args):
        if self.ok:
            self.log.append(("again", entry))
        return self.ok


def test_a_plan_keeps_the_kernel_it_launched_for_alike_calls():
    """``launch_planned``: the first call goes through the site and keeps its kernel in the plan;
    alike calls relaunch it; a call whose outputs the plan does not describe (alike=False) takes
    the site and leaves the kept kernel; a failed relaunch goes through the site and keeps anew."""
    from fastaf.kernels.lora_linear import launch_planned

    site, plan = _FakeSite(), ["grid", None]
    launch_planned(site, plan, 1, (1,), (), {}, ())
    assert site.log == ["site"] and plan[1] == ("entry", 1)
    launch_planned(site, plan, 1, (1,), (), {}, ())
    assert site.log[-1] == ("again", ("entry", 1))
    launch_planned(site, plan, 1, (1,), (), {}, (), alike=False)
    assert site.log[-1] == "site" and plan[1] == ("entry", 1)
    site.ok = False
    launch_planned(site, plan, 1, (1,), (), {}, ())
    assert site.log[-1] == "site" and plan[1] == ("entry", len(site.log))


def test_clear_memos_forgets_the_call_plans():
    from fastaf.kernels import lora_linear_plan as plan

    plan.call_memo[("probe",)] = [None]
    plan.clear_memos()
    assert ("probe",) not in plan.call_memo


def test_aligned_checks_every_given_pointer():
    from fastaf.kernels.lora_linear_plan import aligned

    t = torch.zeros(64)
    assert aligned(t, None, t[4:])
    assert not aligned(t, t[1:])
