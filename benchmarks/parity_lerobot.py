"""PI0.5 parity against LeRobot 0.6.1's own PI05Policy (code no one here wrote).

Builds LeRobot's PI05Policy at full size with seeded random weights, writes it as a LeRobot
checkpoint folder (`save_pretrained` + normaliser processor files with quantile statistics),
loads that folder through our loader (`load_pi05`), and compares chunks for identical
inputs and noise. Tokens go in directly: LeRobot's PI0.5 processor would download the
PaliGemma tokenizer, so the folder gets LeRobot's default (normaliser-only) processor
pipelines and both sides are fed the same token ids.

Needs Python >= 3.12 with lerobot==0.6.1 importable, and a GPU for the full size:

    python benchmarks/parity_lerobot.py --out runs/parity          # full size, CUDA
    python benchmarks/parity_lerobot.py --tiny --device cpu        # plumbing check, tiny sizes

`--tiny` shrinks LeRobot's Gemma / SigLIP configs (and ours to match) by patching their
size tables at run time; it proves the plumbing (save, load, key mapping, inputs), not the
published sizes. `benchmarks/pi05_gpu.py` runs this first, then the timings.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CAMERAS = ["base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"]
STATE_DIM = ACTION_DIM = 14
T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# -- tiny sizes (plumbing check only) ----------------------------------------------------------
TINY = {"width_2b": 64, "width_300m": 32, "depth": 2, "mlp_2b": 128, "mlp_300m": 64, "heads": 2, "head_dim": 16,
        "vision_width": 32, "vision_depth": 2, "vision_heads": 2, "vision_mlp": 64}


def patch_tiny() -> None:
    """Shrink LeRobot's PI0.5 and ours to the same small structure (test-only)."""
    import lerobot.policies.pi05.modeling_pi05 as lm
    from transformers import CONFIG_MAPPING

    from phyai_edge.adapters.pi05 import config as ours_cfg
    from phyai_edge.adapters.pi05 import loaders

    t = TINY

    def gemma(variant: str) -> Any:
        wide = variant == "gemma_2b"
        return lm.GemmaConfig(width=t["width_2b"] if wide else t["width_300m"], depth=t["depth"],
                              mlp_dim=t["mlp_2b"] if wide else t["mlp_300m"], num_heads=t["heads"],
                              num_kv_heads=1, head_dim=t["head_dim"])

    base_vision = type(CONFIG_MAPPING["paligemma"]().vision_config)

    class TinyVision(base_vision):  # LeRobot writes intermediate_size / projection_dim after building
        @property
        def intermediate_size(self) -> int:
            return t["vision_mlp"]

        @intermediate_size.setter
        def intermediate_size(self, _: int) -> None:
            pass

        @property
        def projection_dim(self) -> int:
            return t["width_2b"]

        @projection_dim.setter
        def projection_dim(self, _: int) -> None:
            pass

    def paligemma(**kw: Any) -> Any:
        cfg = CONFIG_MAPPING["paligemma"](**kw)
        cfg.vision_config = TinyVision(hidden_size=t["vision_width"], num_hidden_layers=t["vision_depth"],
                                       num_attention_heads=t["vision_heads"], patch_size=14, image_size=224,
                                       vision_use_head=False)
        return cfg

    class Mapping(dict):
        def __getitem__(self, key: str) -> Any:
            return paligemma if key == "paligemma" else CONFIG_MAPPING[key]

    import transformers.models.paligemma.modeling_paligemma as pg

    class AutoModelShim:  # build the tower from a plain copy of the tiny vision config
        @staticmethod
        def from_config(cfg: Any = None, **kw: Any) -> Any:
            cfg = kw.pop("config", cfg)
            if isinstance(cfg, TinyVision):
                plain = base_vision(**cfg.to_dict())
                plain.intermediate_size, plain.vision_use_head = t["vision_mlp"], False
                cfg = plain
            return auto_model.from_config(cfg, **kw)

    auto_model = pg.AutoModel
    pg.AutoModel = AutoModelShim
    lm.get_gemma_config = gemma
    lm.CONFIG_MAPPING = Mapping()

    def tiny_full() -> ours_cfg.PI05Config:
        return ours_cfg.PI05Config(
            vision=ours_cfg.SiglipSpec(width=t["vision_width"], depth=t["vision_depth"], num_heads=t["vision_heads"],
                                       mlp_dim=t["vision_mlp"]),
            prefix=ours_cfg.GemmaSpec(width=t["width_2b"], depth=t["depth"], mlp_dim=t["mlp_2b"], num_heads=t["heads"],
                                      head_dim=t["head_dim"]),
            expert=ours_cfg.GemmaSpec(width=t["width_300m"], depth=t["depth"], mlp_dim=t["mlp_300m"],
                                      num_heads=t["heads"], head_dim=t["head_dim"]),
        )

    loaders.full = tiny_full


# -- LeRobot side ------------------------------------------------------------------------------
def build_lerobot(device: str, seed: int) -> Any:
    """LeRobot's PI05Policy in float32 with seeded random weights of a sensible scale.

    LeRobot's own init leaves the adaptive-norm projections at zero (every expert residual
    gated shut), which would make a parity check blind to the expert: every tensor is drawn."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy

    feats = {f"observation.images.{c}": PolicyFeature(FeatureType.VISUAL, (3, 224, 224)) for c in CAMERAS}
    feats["observation.state"] = PolicyFeature(FeatureType.STATE, (STATE_DIM,))
    cfg = PI05Config(device=device, dtype="float32", input_features=feats,
                     output_features={"action": PolicyFeature(FeatureType.ACTION, (ACTION_DIM,))})
    torch.manual_seed(seed)
    with torch.device(device):
        policy = PI05Policy(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            if p.ndim == 1:
                p.copy_(torch.randn(p.shape, generator=gen, device=device) * 0.05)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=device) / p[0].numel() ** 0.5)
        for m in policy.modules():
            if isinstance(m, torch.nn.LayerNorm) and m.weight is not None:
                m.weight.add_(1.0)
    return policy.eval()


def write_lerobot_folder(policy: Any, folder: Path) -> None:
    """save_pretrained + LeRobot's normaliser / unnormaliser processor files (quantile stats)."""
    from lerobot.processor.factory import make_default_pre_post_processors

    policy.save_pretrained(folder)
    g = torch.Generator().manual_seed(11)
    stats = {}
    for key, dim in (("observation.state", STATE_DIM), ("action", ACTION_DIM)):
        lo = -1.0 - torch.rand(dim, generator=g)
        hi = 1.0 + torch.rand(dim, generator=g)
        stats[key] = {"q01": lo, "q99": hi, "q10": lo * 0.8, "q90": hi * 0.8, "mean": (lo + hi) / 2,
                      "std": (hi - lo) / 4, "min": lo * 1.2, "max": hi * 1.2}
    cfg = copy.copy(policy.config)
    cfg.device = "cpu"
    pre, post = make_default_pre_post_processors(cfg, dataset_stats=stats)
    pre.save_pretrained(folder)
    post.save_pretrained(folder)


def lerobot_chunk(policy: Any, inputs: dict[str, torch.Tensor], noise: torch.Tensor) -> torch.Tensor:
    images = [inputs["images"][:, i] for i in range(inputs["images"].shape[1])]
    img_masks = [inputs["image_mask"][:, i] for i in range(inputs["image_mask"].shape[1])]
    with torch.no_grad():
        return policy.model.sample_actions(images, img_masks, inputs["tokens"], inputs["token_mask"],
                                           noise=noise.clone()).float()


# -- shared inputs -----------------------------------------------------------------------------
def make_inputs(batch: int, views: int, valid: list[int], device: str, seed: int = 0, max_len: int = 200,
                vocab: int = 257152, masked_last_view: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(batch, views, 3, 224, 224, generator=g) * 2 - 1
    image_mask = torch.ones(batch, views, dtype=torch.bool)
    if masked_last_view and views > 1:
        images[-1, -1] = -1.0
        image_mask[-1, -1] = False
    token_mask = torch.arange(max_len)[None, :] < torch.tensor(valid)[:, None]
    tokens = torch.randint(1, vocab, (batch, max_len), generator=g) * token_mask
    return {k: v.to(device) for k, v in
            {"images": images, "image_mask": image_mask, "tokens": tokens, "token_mask": token_mask}.items()}


def model_inputs(inputs: dict[str, torch.Tensor]) -> Any:
    from phyai_edge.adapters.base import ModelInputs

    return ModelInputs(dict(inputs), inputs["images"].shape[0])


def err(a: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    a, ref = a.double(), ref.double()
    scale = float(ref.abs().max())
    return {"max_abs": float((a - ref).abs().max()), "scale": scale,
            "max_abs_over_scale": float((a - ref).abs().max()) / scale,
            "rel_l2": float((a - ref).norm() / ref.norm())}


# -- the run -----------------------------------------------------------------------------------
def run_parity(device: str, folder: Path, seed: int = 0, tiny: bool = False) -> dict[str, Any]:
    """Returns {'lerobot': policy (float32), 'adapter': our fp32 adapter, 'report': {...}}."""
    from phyai_edge.adapters.pi05 import load_pi05
    from phyai_edge.adapters.pi05.builtin import tiny_tokenizer_path
    from phyai_edge.engines.cudagraph import CudaGraphEngine
    from phyai_edge.engines.eager import EagerEngine

    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity means fp32 arithmetic
        torch.backends.cudnn.allow_tf32 = False
    say("building LeRobot PI05Policy (float32, seeded random weights)")
    policy = build_lerobot(device, seed)
    n_params = sum(p.numel() for p in policy.parameters())
    say(f"LeRobot policy: {n_params / 1e9:.3f} B parameters; writing the LeRobot folder to {folder}")
    write_lerobot_folder(policy, folder)
    files = sorted(p.name for p in folder.iterdir())
    say(f"folder: {files}")
    adapter = load_pi05(folder, device=device, tokenizer=tiny_tokenizer_path(),
                        camera_names=list(CAMERAS))
    say("loaded through load_pi05")
    vocab = adapter.cfg.vocab_size
    inputs = make_inputs(2, 3, [48, 30], device, seed=1, vocab=vocab, masked_last_view=True,
                         max_len=adapter.cfg.max_token_len)
    noise = torch.randn(2, adapter.chunk_size, adapter.model_action_dim,
                        generator=torch.Generator().manual_seed(2)).to(device)
    ref = lerobot_chunk(policy, inputs, noise)
    say("LeRobot fp32 chunk done")
    eager32 = EagerEngine(adapter, device=device, dtype="float32")
    ours32 = eager32.run(model_inputs(inputs), noise=noise)
    fast32 = CudaGraphEngine(copy.deepcopy(adapter), device=device, dtype="float32", triton_ops=False)
    ours_fast32 = fast32.run(model_inputs(inputs), noise=noise)
    del fast32
    report: dict[str, Any] = {
        "lerobot_params": n_params,
        "checkpoint_files": files,
        "inputs": "batch 2, 3 views (sample 2: third camera masked), 48 and 30 valid prompt tokens of "
                  f"{adapter.cfg.max_token_len}, 10 steps, identical noise",
        "fp32_eager_vs_lerobot_fp32": err(ours32, ref),
        "fp32_cudagraph_vs_lerobot_fp32": err(ours_fast32, ref),
    }
    say(f"fp32: eager {report['fp32_eager_vs_lerobot_fp32']}")
    say(f"fp32: cudagraph {report['fp32_cudagraph_vs_lerobot_fp32']}")
    report["fp32_pass"] = report["fp32_eager_vs_lerobot_fp32"]["max_abs_over_scale"] <= 1e-4
    return {"lerobot": policy, "adapter": adapter, "report": report, "inputs": inputs, "noise": noise,
            "lerobot_fp32_chunk": ref, "ours_fp32_chunk": ours32}


def bf16_parity(state: dict[str, Any], device: str) -> dict[str, Any]:
    """LeRobot in its own bf16 configuration against ours in bf16 (eager and cudagraph)."""
    from phyai_edge.engines.cudagraph import CudaGraphEngine
    from phyai_edge.engines.eager import EagerEngine

    policy, inputs, noise = state["lerobot"], state["inputs"], state["noise"]
    policy.model.paligemma_with_expert.to_bfloat16_for_selected_params("bfloat16")
    lr16 = lerobot_chunk(policy, inputs, noise)
    ad16 = copy.deepcopy(state["adapter"])
    eager16 = EagerEngine(ad16, device=device, dtype="bfloat16").run(model_inputs(inputs), noise=noise)
    del ad16
    fast = CudaGraphEngine(copy.deepcopy(state["adapter"]), device=device, dtype="bfloat16", triton_ops=False)
    fast16 = fast.run(model_inputs(inputs), noise=noise)
    ref32, ours32 = state["lerobot_fp32_chunk"], state["ours_fp32_chunk"]
    return {
        "lerobot_bf16_vs_lerobot_fp32": err(lr16, ref32),
        "ours_eager_bf16_vs_ours_fp32": err(eager16, ours32),
        "ours_cudagraph_bf16_vs_ours_fp32": err(fast16, ours32),
        "ours_cudagraph_bf16_vs_lerobot_bf16": err(fast16, lr16),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small sizes: plumbing check (CPU is fine)")
    ap.add_argument("--out", type=Path, default=None, help="folder for parity.json")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.tiny:
        patch_tiny()
    with tempfile.TemporaryDirectory() as tmp:
        state = run_parity(args.device, Path(tmp) / "lerobot_pi05", args.seed, args.tiny)
        report = state["report"]
        report["bf16"] = bf16_parity(state, args.device)
    print(json.dumps(report, indent=1), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "parity.json").write_text(json.dumps(report, indent=1))
    return 0 if report["fp32_pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
