"""Which attention tilings fit which GPU: each tiling's shared memory as Triton compiles it, no GPU.

Triton refuses to launch a kernel that asks for more shared memory a block than the GPU offers
(`OutOfResources`); the engine then falls back to a smaller tiling (`triton_dispatch.launch_fitting`),
so a tiling that does not fit costs speed, not a crash. This script compiles the split attention's
forward and backward kernels for PI0.5's head size (256, bf16) with every tiling the rules can choose,
for each GPU target, and prints the bytes against that GPU's limit. It runs on a CPU (Triton's
compiler and ptxas only). The numbers are this Triton version's: another version can differ (on the
H200 with Triton 3.6 a 64 x 64 x 3-stage backward tiling asked for 262144 bytes; Triton 3.9 compiles
it to 139776).

    python benchmarks/kernel_shared_memory.py                 # sm_87 (Orin), sm_89 (RTX 40), sm_90 (H100 / H200)
    python benchmarks/kernel_shared_memory.py --archs 87,120
    python benchmarks/kernel_shared_memory.py --mma --archs 90   # which MMA instructions, and their waits

`--mma` prints, per tiling and target, how many of the kernel's matrix products compile to Hopper's
asynchronous warpgroup MMA (wgmma) and how many to the older synchronous mma.sync, and for the
wgmma ones how many outstanding products each wait leaves in flight ("pendings"): 0 everywhere means
every product is waited for right after it is issued, so the tensor cores idle while the softmax and
the other elementwise work between products run.
"""

from __future__ import annotations

import argparse
import inspect
import re
from dataclasses import replace
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from phyai_edge.layers import triton_attention as ta
from phyai_edge.layers import triton_grad as tg
from phyai_edge.layers.triton_dispatch import NO_SPLIT

# opt-in shared memory a block (bytes), from NVIDIA's compute-capability tables
LIMITS = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
NAMES = {80: "A100", 86: "RTX 30", 87: "Orin", 89: "RTX 40 / Ada", 90: "H100 / H200", 100: "B200", 120: "RTX 50"}


def _signature(fn: Any, pointers: dict[str, str], floats: set[str]) -> dict[str, str]:
    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in pointers:
            sig[name] = pointers[name]
        elif name in floats:
            sig[name] = "fp32"
        elif name.isupper():
            sig[name] = "constexpr"
        else:
            sig[name] = "i32"
    return sig


def forward(cfg: ta.SplitConfig, arch: int, trace: bool = False) -> tuple[Any, dict[str, str], dict[str, Any]]:
    """The split kernel as a launch on `arch` compiles it: a TMA tiling takes tensor descriptors from
    sm_90 on and pointer loads before (as `_kv_descriptors` decides at run time)."""
    tma = cfg.tma and arch >= 90
    desc = f"tensordesc<bf16[1,1,{cfg.block_n},256]>" if tma else "*bf16"
    ptrs = {**dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "k2_ptr", "v2_ptr", "out_ptr"), "*bf16"), "m_ptr": "*u8",
            **dict.fromkeys(("o_ptr", "lse_ptr", "lse_out_ptr"), "*fp32"), "ticket_ptr": "*i32", "trace_ptr": "*i64",
            **dict.fromkeys(("k_desc", "v_desc", "k2_desc", "v2_desc"), desc)}
    const = dict(HKV=1, D=256, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, FINAL=cfg.min_keys >= NO_SPLIT,
                 MERGE=cfg.inline_merge, UPCAST=False, IEEE=False, PDL=False, WS=False, LSE_OUT=True, TRACE=trace,
                 SPLITS=1 if cfg.min_keys >= NO_SPLIT else 5, TMA=tma, KEYS_AS_ROWS=cfg.keys_as_rows)
    return ta._split_attn_kernel, _signature(ta._split_attn_kernel, ptrs, {"scale_log2"}), const


def backward(cfg: tg.GradConfig, arch: int) -> tuple[Any, dict[str, str], dict[str, Any]]:
    ptrs = {**dict.fromkeys(("q_ptr", "do_ptr", "o_ptr", "k_ptr", "v_ptr", "k2_ptr", "v2_ptr", "dq_ptr", "dk_ptr",
                             "dv_ptr"), "*bf16"), "m_ptr": "*u8",
            **dict.fromkeys(("lse_ptr", "pq_ptr", "pkv_ptr"), "*fp32"), "ticket_ptr": "*i32"}
    const = dict(HKV=1, D=256, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, KV_BLOCK_M=cfg.kv_block_m,
                 KV_BLOCK_N=cfg.kv_block_n, UPCAST=False, IEEE=False, PDL=False)
    return tg._attn_bwd_kernel, _signature(tg._attn_bwd_kernel, ptrs, {"scale_log2", "scale"}), const


def mma_report(kernel: Any) -> str:
    """'wgmma W (waits leaving 0/1/.. in flight: ...), mma.sync M' from a compiled kernel's TTGIR."""
    ttgir = kernel.asm.get("ttgir", "")
    issued = len(re.findall(r"= ttng\.warp_group_dot ", ttgir))
    pendings = sorted({int(x) for x in re.findall(r"ttng\.warp_group_dot_wait[^\n]*pendings = (\d+)", ttgir)})
    synced = len(re.findall(r"= tt\.dot ", ttgir))
    return f"wgmma {issued} (waits leave {pendings} in flight), other dots {synced}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", default="87,89,90", help="compute capabilities, e.g. 87,89,90,120")
    p.add_argument("--mma", action="store_true", help="the matrix-product instructions and their waits instead")
    args = p.parse_args()
    archs = [int(a) for a in args.archs.split(",")]
    tilings = [(f"forward {n}", forward, getattr(ta, n)) for n in
               ("FEW_BLOCKS", "FEW_BLOCKS_COMPACT", "MANY_BLOCKS", "MID_BLOCKS", "MID_BLOCKS_COMPACT", "BIG_BLOCKS",
                "SMALL_BLOCKS")]
    tilings += [("forward FEW keys as rows", forward, replace(ta.FEW_BLOCKS, keys_as_rows=True))]
    tilings += [("backward GradConfig()", backward, tg.GradConfig()), ("backward LARGE_GRAD", backward, tg.LARGE_GRAD),
                ("backward SMALL_GRAD", backward, tg.SMALL_GRAD)]
    heads = [" ".join((f"sm_{a}", NAMES.get(a, ""))) for a in archs]
    if args.mma:
        print(f"triton {triton.__version__}; matrix products as compiled (TTGIR)")
    else:
        print(f"triton {triton.__version__}; shared memory a block, bytes (* = over the GPU's limit)")
        print(f"  {'tiling':26s}" + "".join(f"{h:>22s}" for h in heads))
    for label, build, cfg in tilings:
        cells = []
        for arch in archs:
            fn, sig, const = build(cfg, arch)
            try:
                k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", arch, 32),
                                   options={"num_warps": cfg.warps, "num_stages": cfg.stages})
                if args.mma:
                    print(f"  {label:26s} sm_{arch}: {mma_report(k)}", flush=True)
                    continue
                over = "*" if k.metadata.shared > LIMITS.get(arch, 1 << 62) else " "
                cells.append(f"{k.metadata.shared:>21d}{over}")
            except Exception as exc:  # a target this Triton cannot compile for
                cells.append(f"{type(exc).__name__[:21]:>21s} ")
        if not args.mma:
            print(f"  {label:26s}" + "".join(cells), flush=True)
    if not args.mma:
        print("limits: " + ", ".join(f"sm_{a} {LIMITS[a]}" for a in archs if a in LIMITS))


if __name__ == "__main__":
    main()
