"""Device table: peak dense tensor throughput per precision and DRAM bandwidth.

Every number is the dense peak we use, next to the figure the vendor quotes and whether that
figure is for 2:4 structured sparsity (NVIDIA quotes sparse numbers for most parts; dense is
half). Where the vendor quotes only one headline number (e.g. "AI TOPS" in FP4, or module TOPS
that include the DLAs), the others are derived from it with the per-precision ratios of that
architecture, and the `note` says so. Our engines accumulate bf16/fp16 GEMMs in fp32, so for
GeForce parts (which run fp32-accumulate at half the fp16-accumulate rate) we use the
fp32-accumulate figure.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Peak:
    dense: float  # TFLOPS (TOPS for int8) we compute with
    quoted: float  # the vendor's figure this is taken or derived from
    quoted_sparse: bool  # True when `quoted` assumes 2:4 structured sparsity
    quoted_precision: str  # the precision `quoted` is stated in (e.g. a "fp4" headline)
    derived: bool = False  # True when dense is not quoted / sparsity / precision-ratio alone
    note: str = ""


@dataclass(frozen=True)
class Device:
    key: str
    name: str
    bandwidth_gbs: float  # DRAM bandwidth, GB/s (1e9 bytes)
    memory_gb: float
    peaks: dict[str, Peak | None] = field(default_factory=dict)  # precision -> peak; None: unsupported
    source: str = ""

    def peak_flops(self, precision: str) -> float:
        """Dense peak in FLOP/s for `precision`; ValueError if the device has no such tensor path."""
        peak = self.peaks.get(precision)
        if peak is None:
            raise ValueError(
                f"{self.name} has no {precision} tensor-core path; choose one of {self.precisions()}"
            )
        return peak.dense * 1e12

    def precisions(self) -> list[str]:
        return [p for p, v in self.peaks.items() if v is not None]

    def supports(self, precision: str) -> bool:
        return self.peaks.get(precision) is not None

    @property
    def bandwidth(self) -> float:
        return self.bandwidth_gbs * 1e9

    def ridge(self, precision: str = "bf16") -> float:
        """FLOPs per byte above which a stage is compute-bound on this device."""
        return self.peak_flops(precision) / self.bandwidth


def _p(
    dense: float, quoted: float, sparse: bool, in_precision: str, note: str = "", derived: bool = False
) -> Peak:
    return Peak(dense, quoted, sparse, in_precision, derived, note)


DEVICES: dict[str, Device] = {}


def _add(d: Device) -> None:
    DEVICES[d.key] = d


_add(
    Device(
        key="jetson-agx-orin-64gb",
        name="Jetson AGX Orin 64GB",
        bandwidth_gbs=204.8,
        memory_gb=64,
        peaks={
            # Module: 275 sparse INT8 TOPS = GPU 170 + 2 DLAs 105. Only the GPU runs our engines.
            "int8": _p(85.0, 170.0, True, "int8", "GPU only (module 275 TOPS includes DLAs)"),
            # Ampere tensor cores run fp16/bf16 at half the int8 rate: 64 TC x 512 FLOP/clk x 1.3 GHz.
            "bf16": _p(42.5, 170.0, True, "int8", "half the GPU int8 rate"),
            "fp16": _p(42.5, 170.0, True, "int8", "half the GPU int8 rate"),
            "fp8": None,  # Ampere has no fp8 tensor cores
        },
        source="NVIDIA Jetson AGX Orin Series Technical Brief v1.2 / Jetson AGX Orin 64GB module "
        "datasheet: 275 TOPS (INT8, sparse, GPU 170 + DLA 105), 2048-core Ampere GPU with 64 "
        "Tensor Cores at 1.3 GHz, 204.8 GB/s LPDDR5",
    )
)
_add(
    Device(
        key="jetson-orin-nx-16gb",
        name="Jetson Orin NX 16GB",
        bandwidth_gbs=102.4,
        memory_gb=16,
        peaks={
            # Module: 100 sparse INT8 TOPS including two DLAs (2 x 20). GPU: 32 TC x 1024 int8 ops x 0.918 GHz.
            "int8": _p(30.0, 100.0, True, "int8", "GPU share of a module figure that includes DLAs", True),
            "bf16": _p(15.0, 100.0, True, "int8", "half the GPU int8 rate", True),
            "fp16": _p(15.0, 100.0, True, "int8", "half the GPU int8 rate", True),
            "fp8": None,
        },
        source="NVIDIA Jetson Orin NX Series datasheet: 100 TOPS (INT8, sparse, GPU + 2 DLA), "
        "1024-core Ampere GPU with 32 Tensor Cores at 918 MHz, 102.4 GB/s LPDDR5",
    )
)
_add(
    Device(
        key="jetson-thor",
        name="Jetson AGX Thor (T5000)",
        bandwidth_gbs=273.0,
        memory_gb=128,
        peaks={
            # Headline: 2070 TFLOPS FP4 sparse. Blackwell: fp8 = fp4 / 2, bf16 = fp8 / 2, sparse = 2 x dense.
            "fp8": _p(517.5, 2070.0, True, "fp4", "FP4-sparse headline / 4"),
            "bf16": _p(258.75, 2070.0, True, "fp4", "FP4-sparse headline / 8"),
            "fp16": _p(258.75, 2070.0, True, "fp4", "FP4-sparse headline / 8"),
            "int8": _p(517.5, 2070.0, True, "fp4", "assumed equal to fp8 (datasheet quotes FP4 only)", True),
        },
        source="NVIDIA Jetson AGX Thor developer kit / Jetson T5000 module datasheet: 2070 TFLOPS "
        "(FP4, sparse), 2560-core Blackwell GPU with 96 fifth-gen Tensor Cores, 128 GB LPDDR5X, 273 GB/s",
    )
)
_add(
    Device(
        key="rtx-4090",
        name="GeForce RTX 4090",
        bandwidth_gbs=1008.0,
        memory_gb=24,
        peaks={
            "bf16": _p(165.2, 330.4, True, "bf16", "fp32 accumulate (fp16 accumulate: 330.3 dense)"),
            "fp16": _p(165.2, 330.4, True, "fp16", "fp32 accumulate (fp16 accumulate: 330.3 dense)"),
            "fp8": _p(330.3, 660.6, True, "fp8", "fp32 accumulate"),
            "int8": _p(660.6, 1321.2, True, "int8"),
        },
        source="NVIDIA Ada Lovelace GPU Architecture whitepaper (RTX 4090 column): peak tensor "
        "TFLOPS dense/sparse; 1008 GB/s GDDR6X",
    )
)
_add(
    Device(
        key="rtx-5090",
        name="GeForce RTX 5090",
        bandwidth_gbs=1792.0,
        memory_gb=32,
        peaks={
            # Product page: 3352 AI TOPS (FP4 sparse); 838 TFLOPS fp16 sparse with fp16 accumulate.
            "bf16": _p(209.5, 419.0, True, "bf16", "fp32 accumulate (fp16 accumulate: 838 sparse)"),
            "fp16": _p(209.5, 419.0, True, "fp16", "fp32 accumulate (fp16 accumulate: 838 sparse)"),
            "fp8": _p(419.0, 838.0, True, "fp8", "fp32 accumulate"),
            "int8": _p(838.0, 3352.0, True, "fp4", "FP4-sparse headline 3352 / 4"),
        },
        source="NVIDIA GeForce RTX 5090 product page (3352 AI TOPS, FP4 sparse) and RTX Blackwell "
        "GPU architecture whitepaper; 1792 GB/s GDDR7",
    )
)
_add(
    Device(
        key="rtx-pro-6000",
        name="RTX PRO 6000 Blackwell",
        bandwidth_gbs=1792.0,
        memory_gb=96,
        peaks={
            # 188 SM x 1024 fp16 FLOP/clk x 2.617 GHz = 503.8 dense; pro parts run fp32 accumulate at full rate.
            "bf16": _p(503.8, 4000.0, True, "fp4", "FP4-sparse headline / 8 (4000 is 4030 rounded)"),
            "fp16": _p(503.8, 4000.0, True, "fp4", "FP4-sparse headline / 8 (4000 is 4030 rounded)"),
            "fp8": _p(1007.6, 4000.0, True, "fp4", "FP4-sparse headline / 4 (4000 is 4030 rounded)"),
            "int8": _p(1007.6, 4000.0, True, "fp4", "FP4-sparse headline / 4 (4000 is 4030 rounded)"),
        },
        source="NVIDIA RTX PRO 6000 Blackwell Workstation Edition datasheet: 4000 AI TOPS (FP4, "
        "sparse), 125 TFLOPS FP32, 24064 CUDA cores, 752 Tensor Cores, 96 GB GDDR7, 1792 GB/s",
    )
)
_add(
    Device(
        key="l40s",
        name="L40S",
        bandwidth_gbs=864.0,
        memory_gb=48,
        peaks={
            "bf16": _p(362.05, 733.0, True, "bf16", "datasheet dense 362.05 (sparse 733 is rounded up)"),
            "fp16": _p(362.05, 733.0, True, "fp16", "datasheet dense 362.05 (sparse 733 is rounded up)"),
            "fp8": _p(733.0, 1466.0, True, "fp8"),
            "int8": _p(733.0, 1466.0, True, "int8"),
        },
        source="NVIDIA L40S datasheet: BF16/FP16 362.05 | 733* TFLOPS, FP8 733 | 1466*, "
        "INT8 733 | 1466* TOPS (* with sparsity); 48 GB GDDR6, 864 GB/s",
    )
)
_add(
    Device(
        key="a100-80gb-sxm",
        name="A100 80GB SXM",
        bandwidth_gbs=2039.0,
        memory_gb=80,
        peaks={
            "bf16": _p(312.0, 624.0, True, "bf16"),
            "fp16": _p(312.0, 624.0, True, "fp16"),
            "fp8": None,
            "int8": _p(624.0, 1248.0, True, "int8"),
        },
        source="NVIDIA A100 Tensor Core GPU datasheet: BF16/FP16 312 | 624* TFLOPS, INT8 624 | "
        "1248* TOPS (* with sparsity); 80 GB HBM2e, 2039 GB/s",
    )
)
_add(
    Device(
        key="h100-sxm",
        name="H100 SXM",
        bandwidth_gbs=3350.0,
        memory_gb=80,
        peaks={
            "bf16": _p(989.5, 1979.0, True, "bf16"),
            "fp16": _p(989.5, 1979.0, True, "fp16"),
            "fp8": _p(1979.0, 3958.0, True, "fp8"),
            "int8": _p(1979.0, 3958.0, True, "int8"),
        },
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM): BF16/FP16 1979*, FP8 3958*, INT8 3958* "
        "(* with sparsity); 80 GB HBM3, 3.35 TB/s",
    )
)
_add(
    Device(
        key="h200-sxm",
        name="H200 SXM",
        bandwidth_gbs=4800.0,
        memory_gb=141,
        peaks={
            "bf16": _p(989.5, 1979.0, True, "bf16"),
            "fp16": _p(989.5, 1979.0, True, "fp16"),
            "fp8": _p(1979.0, 3958.0, True, "fp8"),
            "int8": _p(1979.0, 3958.0, True, "int8"),
        },
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16/FP16 1979*, FP8 3958*, INT8 3958* "
        "(* with sparsity); 141 GB HBM3e, 4.8 TB/s",
    )
)

# Loose names people type (and that `torch.cuda.get_device_name` / bench JSON report).
_ALIASES: dict[str, str] = {
    "orin": "jetson-agx-orin-64gb",
    "agx-orin": "jetson-agx-orin-64gb",
    "jetson-agx-orin": "jetson-agx-orin-64gb",
    "orin-nx": "jetson-orin-nx-16gb",
    "thor": "jetson-thor",
    "jetson-agx-thor": "jetson-thor",
    "t5000": "jetson-thor",
    "4090": "rtx-4090",
    "geforce-rtx-4090": "rtx-4090",
    "5090": "rtx-5090",
    "geforce-rtx-5090": "rtx-5090",
    "rtx-pro-6000-blackwell": "rtx-pro-6000",
    "pro-6000": "rtx-pro-6000",
    "a100": "a100-80gb-sxm",
    "h100": "h100-sxm",
    "h200": "h200-sxm",
}


def measured_device(name: str, tflops_16bit: float, bandwidth_gbs: float) -> Device:
    """A device whose bf16 / fp16 peak and bandwidth are ceilings measured on it (a large matmul, a
    large copy) rather than datasheet figures: floors against what the part actually reaches."""
    peak = Peak(tflops_16bit, tflops_16bit, False, "bf16", note="measured")
    return Device(key="measured", name=name, bandwidth_gbs=bandwidth_gbs, memory_gb=0.0,
                  peaks={"bf16": peak, "fp16": peak}, source="measured")


def _norm(name: str) -> str:
    n = name.strip().lower().replace("_", "-").replace(" ", "-")
    for junk in ("nvidia-", "-workstation-edition", "-server-edition", "-max-q", "-tensor-core-gpu"):
        n = n.replace(junk, "")
    return n


# Words in a vendor string that name another part of a family the table has one part of, with
# other peaks or bandwidth (an H100 PCIe has 60% of the SXM's bandwidth, a laptop RTX 4090 a
# third of the desktop's): matched by family alone, its floors and calibration were the other part's.
_VARIANT_WORDS = ("pcie", "nvl", "laptop", "mobile", "40gb")


def find_device(name: str) -> Device:
    """Resolve a key, alias or vendor string ("NVIDIA H200", "NVIDIA RTX PRO 6000 Blackwell ...").
    A vendor string naming a variant of a listed part (`_VARIANT_WORDS`) is a ValueError, not
    that part."""
    n = _norm(name)
    if n in DEVICES:
        return DEVICES[n]
    if n in _ALIASES:
        return DEVICES[_ALIASES[n]]
    # Vendor strings carry extra words ("H100 80GB HBM3", "A100-SXM4-80GB"): match the longest
    # known key or alias contained in the name.
    hits = [k for k in (*DEVICES, *_ALIASES) if k in n]
    if hits:
        best = max(hits, key=len)
        device = DEVICES.get(best) or DEVICES[_ALIASES[best]]
        listed = f"{device.key} {_norm(device.name)}"
        variant = next((w for w in _VARIANT_WORDS if w in n.split("-") and w not in listed), None)
        if variant is not None:
            raise ValueError(f"device {name!r} is a {variant} part; the table has {device.name} only, whose peaks "
                             "and bandwidth it does not share (measure its ceilings, or name a listed part)")
        return device
    raise ValueError(f"unknown device {name!r}; known: {', '.join(DEVICES)}")
