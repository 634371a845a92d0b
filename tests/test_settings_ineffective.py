"""settings.ineffective_settings: a setting changed from its default that tunes a feature
this configuration has off is named, as the flag was given, with what it needs; defaults,
and settings whose feature is on, are not."""

from ctxprefill.settings import ServeSettings, ineffective_settings


def test_defaults_and_settings_in_use_are_not_named():
    assert ineffective_settings(ServeSettings()) == []
    on = ServeSettings(shared_memory="all", shared_memory_max_regions=4, shared_memory_pin=False, request_ring=True,
                       request_ring_max=2, request_ring_overlap=False, request_ring_stream_order=True,
                       request_ring_stream_order_timeout_s=5.0, weights="w.safetensors", weights_prefix="x.",
                       cache_dtype="fp8", k_scale=2.0)
    assert ineffective_settings(on) == []
    assert ineffective_settings(ServeSettings(seed=7, kv_b_proj_dtype="fp8")) == []  # random weights
    assert ineffective_settings(ServeSettings(kv_b_proj_gemm="paged")) == []
    assert ineffective_settings(ServeSettings(kv_b_proj_gemm="gluon", cache_dtype="fp8")) == []


def test_settings_whose_feature_is_off_are_named_with_what_they_need():
    off = ServeSettings(shared_memory_max_bytes=1 << 20, shared_memory_pin=False, request_ring_spin_us=0,
                        request_ring_overlap=False, request_ring_stream_order=True, weights_prefix="x.",
                        cache_dtype="fp8_ds_mla", k_scale=2.0)
    assert ineffective_settings(off) == [
        "--shared-memory-max-bytes (needs --shared-memory)",
        "--no-shared-memory-pin (needs --shared-memory)",
        "--request-ring-spin-us (needs --request-ring)",
        "--no-request-ring-overlap (needs --request-ring)",
        "--request-ring-stream-order (needs --request-ring)",
        "--weights-prefix (needs --weights)",
        "--k-scale (needs --cache-dtype fp8: fp8_ds_mla keeps a scale per tile)",
    ]
    # the ring on, stream order off: its timeout does nothing
    ring = ServeSettings(shared_memory="system", request_ring=True, request_ring_stream_order_timeout_s=5.0)
    assert ineffective_settings(ring) == ["--request-ring-stream-order-timeout-s (needs --request-ring-stream-order)"]
    # a weights file or a model decides the weights: the random ones' seed and dtype do nothing
    for source in ({"weights": "w.safetensors"}, {"model": "/m"}):
        got = ineffective_settings(ServeSettings(seed=3, kv_b_proj_dtype="fp8", **source))
        assert got == ["--seed (needs random weights: no --weights or --model)",
                       "--kv-b-proj-dtype (needs random weights: no --weights or --model)"]


def test_a_gemm_kernel_that_cannot_run_is_named():
    assert ineffective_settings(ServeSettings(kv_b_proj_gemm="gluon", device="cpu")) == [
        "--kv-b-proj-gemm (needs a Hopper GPU: on the CPU torch multiplies)"]
    assert ineffective_settings(ServeSettings(kv_b_proj_gemm="paged", cache_dtype="fp8")) == [
        "--kv-b-proj-gemm (needs --cache-dtype auto to read the cache: other caches are gathered and go through "
        "cuBLAS)"]
    wide = "--kv-b-proj-gemm (needs fewer than 64 heads a worker to read the cache: wider weights go through cuBLAS)"
    assert ineffective_settings(ServeSettings(kv_b_proj_gemm="paged", heads=128)) == [wide]
    assert ineffective_settings(ServeSettings(kv_b_proj_gemm="paged", heads=128, num_shards=8)) == []  # 16 a worker
    assert ineffective_settings(ServeSettings(kv_b_proj_gemm="paged", heads=128, model="/m")) == []  # its config
