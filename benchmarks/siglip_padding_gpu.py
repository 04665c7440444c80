"""Would SigLIP's awkward widths run faster padded with zeros? One question, one run.

SigLIP so400m (PI0.5's vision tower) has an MLP width of 4304 (not a multiple of 128) and a head
size of 72 (1152 / 16). Zero padding changes nothing in the function: fc1's extra output columns
(zero weight, zero bias) are gelu(0) = 0, and fc2's extra input rows are zero, so the MLP gives the
same numbers; zero query / key columns add nothing to a score and zero value columns are dropped.
Whether the GEMM and attention kernels run faster on the padded shapes is what this measures, at
the vision tower's rows for batch 1, 8 and 32 (3 cameras, 256 patches an image), bf16, inside CUDA
graphs:

- fc1 + bias + GELU (one cuBLASLt call, `torch._addmm_activation`, as `fused_stacks._fc1_gelu`)
  and fc2 + bias, at MLP widths 4304 (as is), 4352 and 4608;
- SDPA over one image's 256 patches, 16 heads, head size 72 (as is), 80, 96 and 128.

Each padded result is checked against the unpadded one first (same function: max abs difference
printed). Prints one table.

    PYTHONPATH=$PWD python3 benchmarks/siglip_padding_gpu.py --json $OUT/siglip_pad.json   # H200
    PYTHONPATH=. python benchmarks/siglip_padding_gpu.py --device cpu --tiny                  # plumbing
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_timing import time_calls  # benchmarks/ is on sys.path when this runs as a script

IMAGES = {1: 3, 8: 24, 32: 96}  # batch -> images (3 cameras)


def pad_rows(w: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([w, w.new_zeros(n - w.shape[0], *w.shape[1:])]) if n > w.shape[0] else w


def mlp_case(rows: int, width: int, mlp: int, padded: int, device: str, dtype: torch.dtype) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(rows, width, generator=g) * 0.5).to(device, dtype)
    w1 = (torch.randn(mlp, width, generator=g) * width ** -0.5).to(device, dtype)
    b1 = (torch.randn(mlp, generator=g) * 0.1).to(device, dtype)
    w2 = (torch.randn(width, mlp, generator=g) * mlp ** -0.5).to(device, dtype)
    b2 = (torch.randn(width, generator=g) * 0.1).to(device, dtype)
    w1p, b1p = pad_rows(w1, padded), pad_rows(b1, padded)
    w2p = pad_rows(w2.t(), padded).t().contiguous()

    def fc1(w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if h.is_cuda:
            return torch._addmm_activation(b, h, w.t(), use_gelu=True)
        return F.gelu(F.linear(h, w, b), approximate="tanh")

    a, ap = fc1(w1, b1), fc1(w1p, b1p)
    y, yp = F.linear(a, w2, b2), F.linear(ap, w2p, b2)
    diff = float((y.float() - yp.float()).abs().max())
    return {"rows": rows, "mlp": padded, "max_abs_diff_vs_unpadded": diff,
            "fc1_us": time_calls([lambda: fc1(w1p, b1p)] * 10, device),
            "fc2_us": time_calls([lambda: F.linear(ap, w2p, b2)] * 10, device)}


def attention_case(images: int, heads: int, tokens: int, d: int, padded: int, device: str,
                   dtype: torch.dtype) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(images, heads, tokens, d, generator=g).to(device, dtype) for _ in range(3))

    def pad(t: torch.Tensor) -> torch.Tensor:
        return F.pad(t, (0, padded - d)) if padded > d else t

    qp, kp, vp = pad(q), pad(k), pad(v)
    scale = d ** -0.5  # the unpadded head's scale: padding must not change it
    out = F.scaled_dot_product_attention(q, k, v, scale=scale)
    outp = F.scaled_dot_product_attention(qp, kp, vp, scale=scale)[..., :d]
    return {"images": images, "head_dim": padded, "max_abs_diff_vs_unpadded": float((out.float() - outp.float()).abs().max()),
            "us": time_calls([lambda: F.scaled_dot_product_attention(qp, kp, vp, scale=scale)] * 10, device)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small shapes: plumbing check")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    width, mlp, heads, tokens, d = (32, 43, 2, 16, 9) if args.tiny else (1152, 4304, 16, 256, 72)
    mlp_pads = (43, 48, 64) if args.tiny else (4304, 4352, 4608)
    head_pads = (9, 16) if args.tiny else (72, 80, 96, 128)
    t0 = time.perf_counter()
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
                           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "mlp": [], "attention": []}
    print(f"{'batch':>5s} {'rows':>6s} {'mlp':>5s} {'fc1 us':>9s} {'fc2 us':>9s} {'max |diff|':>10s}")
    for batch, images in IMAGES.items():
        rows = images * (tokens if args.tiny else 256)
        for n in mlp_pads:
            r = mlp_case(rows, width, mlp, n, args.device, dtype)
            res["mlp"].append({"batch": batch, **r})
            print(f"{batch:5d} {rows:6d} {n:5d} {r['fc1_us']:9.1f} {r['fc2_us']:9.1f} {r['max_abs_diff_vs_unpadded']:10.2e}")
    print(f"\n{'batch':>5s} {'images':>6s} {'head':>5s} {'sdpa us':>9s} {'max |diff|':>10s}")
    for batch, images in IMAGES.items():
        for n in head_pads:
            r = attention_case(images, heads, tokens, d, n, args.device, dtype)
            res["attention"].append({"batch": batch, **r})
            print(f"{batch:5d} {images:6d} {n:5d} {r['us']:9.1f} {r['max_abs_diff_vs_unpadded']:10.2e}")
    print(f"\n{time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
