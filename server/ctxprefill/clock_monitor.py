"""The GPU's SM clock, power draw and clock-event reasons, sampled while work runs.

Why: on the H200 (2026-12-01, ``ctxprefill bench`` at 128 heads) the same attention and
kv_b_proj kernels ran 7 % and 11 % slower in the fused path than in the generic path of
the same process. The fused path leaves out the generic path's long memory-bound pack,
so its compute kernels run back to back: a power-capped clock would explain it, and
would put part of the FLOP floor (counted at the matrix rate of a lone GEMM) out of
reach. This samples what NVML reports during a pass of requests so that a bench row
says which it is.

NVML through ``pynvml`` (the ``nvidia-ml-py`` wheel; torch's ``torch.cuda.clock_rate``
uses the same). NVML averages the clock and the power over a sample period of 1/6 s to
1 s, so a pass should run for a second or more; the clock-event reasons are read as
they stand at each sample.
"""

from __future__ import annotations

import statistics
import threading
import time

# NVML clock-event reason bits (nvml.h, nvmlClocksEventReason*)
REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
}


class ClockMonitor:
    """``available`` is False (``why_not`` says why) off CUDA or without pynvml."""

    def __init__(self, device, interval_s: float = 0.02, nvml=None, handle=None):
        self.interval_s = interval_s
        self.available, self.why_not = False, None
        self._nvml, self._handle = nvml, handle
        if nvml is not None and handle is not None:  # given (tests)
            self._bind()
            return
        import torch

        device = torch.device(device)
        if device.type != "cuda":
            self.why_not = f"device {device} is not a CUDA device"
            return
        try:
            import pynvml

            self._handle = torch.cuda._get_pynvml_handler(device)
            self._nvml = pynvml
            self._bind()
        except Exception as e:  # noqa: BLE001 - no NVML: the bench goes on without clocks
            self.why_not = f"{type(e).__name__}: {e}"

    def _bind(self) -> None:
        # the reasons call was renamed (ClocksThrottleReasons -> ClocksEventReasons): looked up once
        self._reasons = next((f for f in (getattr(self._nvml, "nvmlDeviceGetCurrentClocksEventReasons", None),
                                          getattr(self._nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None))
                              if f is not None), lambda handle: 0)
        self.available = True

    def _sample(self) -> tuple[float, float, int]:
        n, h = self._nvml, self._handle
        return (float(n.nvmlDeviceGetClockInfo(h, 1)),  # NVML_CLOCK_SM
                n.nvmlDeviceGetPowerUsage(h) / 1000.0, int(self._reasons(h)))

    def sample_during(self, fn, skip_s: float = 0.2) -> dict | None:
        """Run ``fn()`` while a thread samples every ``interval_s``; a summary of the samples
        taken after the first ``skip_s`` (NVML's averages still hold what ran before), or
        None when unavailable or when no sample could be read."""
        if not self.available:
            return None
        samples: list[tuple[float, float, float, int]] = []
        errors: list[str] = []
        stop = threading.Event()

        def run():
            while not stop.is_set():
                try:
                    samples.append((time.perf_counter(), *self._sample()))
                except Exception as e:  # noqa: BLE001 - a failing NVML ends the sampling, not the work
                    errors.append(f"{type(e).__name__}: {e}")
                    return
                stop.wait(self.interval_s)

        t = threading.Thread(target=run, name="clock-monitor", daemon=True)
        t0 = time.perf_counter()
        t.start()
        try:
            fn()
        finally:
            stop.set()
            t.join()
        if not samples:
            return None
        kept = [s for s in samples if s[0] - t0 >= skip_s] or samples
        return {**summarize([s[1:] for s in kept], time.perf_counter() - t0),
                **({"error": errors[0]} if errors else {})}


def summarize(samples: list[tuple[float, float, int]], seconds: float) -> dict:
    """Median / min SM clock (MHz), median / max power (W), and the share of samples with
    each clock-event reason set."""
    mhz = [s[0] for s in samples]
    watts = [s[1] for s in samples]
    shares = {name: sum(1 for s in samples if s[2] & bit) / len(samples) for bit, name in REASONS.items()}
    return {"samples": len(samples), "seconds": round(seconds, 3),
            "sm_mhz_median": statistics.median(mhz), "sm_mhz_min": min(mhz),
            "power_w_median": round(statistics.median(watts), 1), "power_w_max": round(max(watts), 1),
            "reasons": {k: round(v, 3) for k, v in shares.items() if v > 0}}
