"""What an iteration with new prompts pays for FLUX's text encoders, side by side in one run:
moved to the GPU and back with `.to()` (what the adapter did before), against host-resident
encoders (trainer/models/host_resident.py: pinned host copy, the trip back only re-points the
tensors), against encoders that stay on the GPU (the floor: encoding alone).

T5-XXL's encoder (4.7B parameters) and CLIP-L's text model at full size with random bf16
weights (the published configs; the weights do not change the cost), one batch of prompts of
FLUX's lengths (512 T5 tokens, 77 CLIP tokens) per visit, as encode_prompts runs them.

    python benchmarks/text_encoders.py --out docs/figures/text_encoders_h200.json
    python benchmarks/text_encoders.py --tiny --device cpu   # the same code at toy size (CI)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.models.host_resident import HostResident  # noqa: E402

# transformers configs of FLUX.1-dev's text_encoder_2 (T5-XXL encoder) and text_encoder (CLIP-L)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
              num_heads=64, feed_forward_proj="gated-gelu", is_encoder_decoder=False,
              use_cache=False)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
              num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
              projection_dim=768)
TINY_T5 = dict(T5_XXL, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
TINY_CLIP = dict(CLIP_L, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, projection_dim=32)


def build(tiny: bool, device: torch.device) -> list[torch.nn.Module]:
    """The two encoders, frozen, in bf16, in host memory (initialised on `device`: a 4.7B
    random init is minutes on a CPU)."""
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    with torch.device(device):
        t5 = T5EncoderModel(T5Config(**(TINY_T5 if tiny else T5_XXL))).to(torch.bfloat16)
        clip = CLIPTextModel(CLIPTextConfig(**(TINY_CLIP if tiny else CLIP_L))).to(torch.bfloat16)
    return [m.requires_grad_(False).eval().to("cpu") for m in (t5, clip)]


def encode(encoders: list[torch.nn.Module], batch: int, device: torch.device) -> None:
    t5, clip = encoders
    with torch.no_grad():
        t5(input_ids=torch.randint(0, 32000, (batch, 512), device=device))
        clip(input_ids=torch.randint(0, 49000, (batch, 77), device=device))


def timed(fn: Callable[[], None], device: torch.device, repeats: int) -> dict:
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return {"median_s": statistics.median(seconds), "all_s": [round(s, 4) for s in seconds]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="toy-size encoders (CI)")
    parser.add_argument("--batch", type=int, default=4, help="new prompts per visit")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    encoders = build(args.tiny, device)
    params = sum(p.numel() for m in encoders for p in m.parameters())
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results: dict = {"card": card, "encoder_parameters": params, "batch": args.batch}

    def moved_with_to() -> None:  # the adapter before: a full copy each way
        for m in encoders:
            m.to(device)
        encode(encoders, args.batch, device)
        for m in encoders:
            m.to("cpu")

    results["to_and_back"] = timed(moved_with_to, device, args.repeats)

    start = time.perf_counter()
    residents = [HostResident(m, pin=device.type == "cuda") for m in encoders]
    results["pin_once_s"] = time.perf_counter() - start

    def host_resident() -> None:  # as DiffusersFlowModel.encode_prompts runs them
        with contextlib.ExitStack() as stack:
            for resident in residents:
                stack.enter_context(resident.visit(device))
            encode(encoders, args.batch, device)

    results["host_resident"] = timed(host_resident, device, args.repeats)
    on_device = {r.home[n].data_ptr() for r in residents for n in r.home}
    back_home = {t.data_ptr() for m in encoders for t in m.state_dict().values()}
    results["returned_to_host_copy"] = back_home <= on_device  # no new host memory

    for m in encoders:
        m.to(device)
    results["resident_on_gpu"] = timed(lambda: encode(encoders, args.batch, device), device,
                                       args.repeats)
    if device.type == "cuda":
        results["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    saved = results["to_and_back"]["median_s"] - results["host_resident"]["median_s"]
    results["saved_s_per_visit"] = saved
    print(f"{card}: {params / 1e9:.2f}B encoder parameters, batch {args.batch}")
    for key in ("to_and_back", "host_resident", "resident_on_gpu"):
        print(f"  {key:16s} {results[key]['median_s']:7.3f} s  {results[key]['all_s']}")
    print(f"  pinning once     {results['pin_once_s']:7.3f} s; saved per visit {saved:.3f} s; "
          f"returned to the host copy: {results['returned_to_host_copy']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
