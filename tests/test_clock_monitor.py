"""clock_monitor.py: samples taken while work runs, summarized (a fake NVML on the CPU);
no samples off CUDA; ``ctxprefill bench --clocks-s`` records why there are none."""

import threading
import time

import torch

from ctxprefill.clock_monitor import ClockMonitor, summarize


class FakeNvml:
    """SM clock 1980 MHz and 500 W while idle, 1755 MHz, 700 W and the software power cap
    (bit 0x4) while ``busy`` is set."""

    def __init__(self):
        self.busy = threading.Event()
        self.calls = 0

    def nvmlDeviceGetClockInfo(self, handle, kind):
        assert handle == "h" and kind == 1
        self.calls += 1
        return 1755 if self.busy.is_set() else 1980

    def nvmlDeviceGetPowerUsage(self, handle):
        return 700_000 if self.busy.is_set() else 500_000

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return 0x4 if self.busy.is_set() else 0x1


def test_samples_while_the_work_runs_summarized():
    nv = FakeNvml()
    mon = ClockMonitor("cpu", interval_s=0.002, nvml=nv, handle="h")

    def work():
        nv.busy.set()
        time.sleep(0.15)

    r = mon.sample_during(work, skip_s=0.02)
    assert r["samples"] >= 10 and r["seconds"] >= 0.15
    assert r["sm_mhz_median"] == 1755 and r["power_w_median"] == 700.0
    assert r["reasons"]["sw_power_cap"] > 0.9
    assert "error" not in r


def test_a_failing_nvml_ends_the_sampling_not_the_work():
    class Broken(FakeNvml):
        def nvmlDeviceGetPowerUsage(self, handle):
            raise RuntimeError("NVML gone")

    done = []
    mon = ClockMonitor("cpu", interval_s=0.002, nvml=Broken(), handle="h")
    assert mon.sample_during(lambda: done.append(1)) is None and done == [1]


def test_summary_of_mixed_samples():
    r = summarize([(1980.0, 400.0, 0), (1800.0, 650.0, 0x4), (1700.0, 700.0, 0x4 | 0x20)], 1.0)
    assert r["sm_mhz_median"] == 1800.0 and r["sm_mhz_min"] == 1700.0
    assert r["power_w_median"] == 650.0 and r["power_w_max"] == 700.0
    assert r["reasons"] == {"sw_power_cap": round(2 / 3, 3), "sw_thermal_slowdown": round(1 / 3, 3)}


def test_off_cuda_there_is_nothing_to_sample():
    mon = ClockMonitor(torch.device("cpu"))
    assert not mon.available and "not a CUDA device" in mon.why_not
    assert mon.sample_during(lambda: None) is None


def test_bench_records_why_there_are_no_clocks(tmp_path):
    from engine_helpers import cpu_bench

    d = cpu_bench(tmp_path, "--heads", "2", "--new", "4", "--context", "200", "--cache-dtype", "auto",
                  "--prefill-dtype", "bf16", "--workspace-tokens", "128", "--iters", "1", "--clocks-s", "0.1")
    assert d["meta"]["clocks"]["available"] is False and "CUDA" in d["meta"]["clocks"]["why_not"]
    (r,) = d["rows"]
    assert r["generic_clocks"] is None and r["fused_clocks"] is None and r["bit_identical"]


def test_bench_clock_pass_runs_enough_requests():
    """--clocks-s: the pass runs at least that long (requests of the timed median's length)
    under the monitor, and says how many it ran."""
    from ctxprefill_bench import engine_bench as bench

    calls = []

    class Engine:
        def prefill_context(self, q, seqs, fused):
            calls.append(fused)

    nv = FakeNvml()
    mon = ClockMonitor("cpu", interval_s=0.001, nvml=nv, handle="h")
    r = bench._clocks(mon, Engine(), None, [], True, torch.device("cpu"), t_request=0.01, seconds=0.05)
    assert r["requests"] == 5 and calls == [True] * 5 and r["samples"] >= 1
    assert bench._clocks(mon, Engine(), None, [], True, torch.device("cpu"), 0.01, 0.0) is None
    assert bench._clocks(None, Engine(), None, [], True, torch.device("cpu"), 0.01, 1.0) is None


def test_older_nvml_names_and_none_at_all():
    """The reasons call under its older name (ClocksThrottleReasons), and a NVML with
    neither: no reasons, the clock and power still read."""

    class Old(FakeNvml):
        nvmlDeviceGetCurrentClocksEventReasons = None

        def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
            return 0x4

    class Neither(FakeNvml):
        nvmlDeviceGetCurrentClocksEventReasons = None

    for nv, reasons in ((Old(), {"sw_power_cap": 1.0}), (Neither(), {})):
        r = ClockMonitor("cpu", interval_s=0.002, nvml=nv, handle="h").sample_during(lambda: time.sleep(0.02),
                                                                                      skip_s=0.0)
        assert r["sm_mhz_median"] == 1980 and r["reasons"] == reasons, (type(nv).__name__, r)
