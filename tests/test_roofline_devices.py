"""Device table sanity and the per-stage roofline prediction."""

from __future__ import annotations

import pytest

from phyai_edge.roofline.costs import StageCost
from phyai_edge.roofline.devices import DEVICES, Device, Peak, find_device
from phyai_edge.roofline.predict import Efficiency, calibrate, predict_stage, predict_stages

REQUIRED = {
    "jetson-agx-orin-64gb",
    "jetson-orin-nx-16gb",
    "jetson-thor",
    "rtx-4090",
    "rtx-5090",
    "rtx-pro-6000",
    "l40s",
    "a100-80gb-sxm",
    "h100-sxm",
    "h200-sxm",
}
# Tensor-core rate relative to bf16 on every architecture in the table (fp4 = 4x, fp8/int8 = 2x).
# Ampere has no fp8 and runs int8 at 2x; Thor / RTX Blackwell headlines are fp4.
RATE = {"bf16": 1, "fp16": 1, "fp8": 2, "int8": 2, "fp4": 4}


def test_every_required_device_with_sources() -> None:
    assert set(DEVICES) >= REQUIRED
    for d in DEVICES.values():
        assert any(w in d.source.lower() for w in ("datasheet", "whitepaper", "product page")), d.key
        assert set(d.peaks) == {"bf16", "fp16", "fp8", "int8"}, d.key
        assert d.supports("bf16") and d.supports("int8")
        assert 50 < d.bandwidth_gbs < 10_000 and 8 <= d.memory_gb <= 200


def test_dense_is_at_most_the_quoted_figure_and_sparse_is_halved() -> None:
    for d in DEVICES.values():
        for prec, peak in d.peaks.items():
            if peak is None:
                continue
            assert 0 < peak.dense <= peak.quoted, (d.key, prec)
            if peak.derived:
                continue
            # quoted = dense x (2 if sparse) x (rate of the quoted precision / rate of this one)
            expect = peak.dense * (2 if peak.quoted_sparse else 1) * RATE[peak.quoted_precision] / RATE[prec]
            assert peak.quoted == pytest.approx(expect, rel=0.02), (d.key, prec)


def test_known_figures_and_units() -> None:
    h200, h100 = find_device("h200"), find_device("h100")
    assert h200.peak_flops("bf16") == pytest.approx(989.5e12)  # 1979 sparse / 2
    assert h200.bandwidth == pytest.approx(4.8e12)  # bytes per second
    assert h200.peak_flops("bf16") == h100.peak_flops("bf16") and h200.bandwidth > h100.bandwidth
    assert h200.ridge("bf16") == pytest.approx(989.5e12 / 4.8e12)
    orin = find_device("jetson-agx-orin-64gb")
    assert orin.peak_flops("int8") == pytest.approx(2 * orin.peak_flops("bf16"))
    assert orin.peaks["int8"].quoted == 170  # GPU share of the 275 TOPS module figure
    with pytest.raises(ValueError, match="no fp8"):
        orin.peak_flops("fp8")
    assert not find_device("a100").supports("fp8")


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("NVIDIA H200", "h200-sxm"),
        ("h200-sxm", "h200-sxm"),
        ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "rtx-pro-6000"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("orin", "jetson-agx-orin-64gb"),
        ("Orin NX", "jetson-orin-nx-16gb"),
        ("thor", "jetson-thor"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb-sxm"),
    ],
)
def test_find_device(name: str, key: str) -> None:
    assert find_device(name).key == key


@pytest.mark.parametrize("name", ["NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA A100-SXM4-40GB",
                                  "NVIDIA A100 80GB PCIe", "NVIDIA GeForce RTX 4090 Laptop GPU"])
def test_a_variant_of_a_listed_part_is_not_taken_for_it(name: str) -> None:
    """Matched by family alone, an H100 PCIe got the SXM's 3.35 TB/s and a laptop RTX 4090 the
    desktop's peaks: bench's floors and the roofline's calibration were another part's."""
    with pytest.raises(ValueError, match=r"is a (pcie|nvl|40gb|laptop) part; the table has .* only"):
        find_device(name)


def test_vendor_strings_of_listed_parts_still_resolve() -> None:
    assert find_device("NVIDIA H100 80GB HBM3").key == "h100-sxm"  # what torch names the SXM part
    assert find_device("NVIDIA GeForce RTX 5090").key == "rtx-5090"


def test_find_unknown_device() -> None:
    with pytest.raises(ValueError, match="unknown device"):
        find_device("tpu-v5e")


TOY = Device(
    key="toy",
    name="toy",
    bandwidth_gbs=1000.0,
    memory_gb=16,
    peaks={
        p: Peak(100.0 * (2 if p in ("fp8", "int8") else 1), 0.0, False, p)
        for p in ("bf16", "fp16", "fp8", "int8")
    },
)


def test_predict_stage_by_hand() -> None:
    eff = Efficiency(0.5, 0.5)
    # 1 TFLOP at 100 TFLOPS x 0.5 = 20 ms; 1 GB at 1000 GB/s x 0.5 = 2 ms -> compute-bound.
    p = predict_stage("x", StageCost(flops=1e12, bytes=1e9, gemm_flops=1e12), TOY, "bf16", eff)
    assert p.compute_s == pytest.approx(0.02) and p.memory_s == pytest.approx(0.002)
    assert p.time_s == pytest.approx(0.02) and p.bound == "compute"
    # fp8 doubles the GEMM rate but attention (non-GEMM FLOPs) stays at the 16-bit rate:
    # 0.5 TFLOP GEMM at 200 x 0.5 = 5 ms + 0.5 TFLOP attention at 100 x 0.5 = 10 ms.
    p = predict_stage("x", StageCost(flops=1e12, bytes=1e9, gemm_flops=5e11), TOY, "fp8", eff)
    assert p.compute_s == pytest.approx(0.015)
    # Memory-bound: 10 GFLOP, 1 GB.
    p = predict_stage("x", StageCost(flops=1e10, bytes=1e9, gemm_flops=1e10), TOY, "bf16", eff)
    assert p.bound == "memory" and p.time_s == pytest.approx(0.002)


def test_calibration_recovers_efficiency_and_reproduces_measurement() -> None:
    costs = {
        "embed_images": StageCost(flops=2e12, bytes=1e9, gemm_flops=2e12),  # compute: 20 ms at peak
        "encode_prefix": StageCost(flops=3e12, bytes=1e9, gemm_flops=3e12),  # compute: 30 ms at peak
        "denoise_step": StageCost(flops=1e9, bytes=2e9, gemm_flops=1e9),  # memory: 2 ms at peak
    }
    measured = {"embed_images": 0.050, "encode_prefix": 0.075, "denoise_step": 0.004}
    cal = calibrate(costs, TOY, "bf16", measured)
    assert cal.efficiency.compute == pytest.approx(0.4)  # (20 + 30) / (50 + 75)
    assert cal.efficiency.bandwidth == pytest.approx(0.5)
    assert cal.per_stage["denoise_step"]["bound"] == "memory"
    again = predict_stages(costs, TOY, "bf16", cal.efficiency)
    for stage, t in measured.items():
        assert again[stage].time_s == pytest.approx(t)
    # A class with nothing measured keeps the fallback.
    partial = calibrate(costs, TOY, "bf16", {"denoise_step": 0.004}, fallback=Efficiency(0.3, 0.9))
    assert partial.efficiency.compute == 0.3 and partial.efficiency.bandwidth == pytest.approx(0.5)


def test_efficiency_bounds() -> None:
    with pytest.raises(ValueError):
        Efficiency(0.0, 0.5)
    with pytest.raises(ValueError):
        Efficiency(0.5, 2.0)
