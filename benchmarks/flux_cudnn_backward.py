"""Issue 20's `CUBLAS_STATUS_EXECUTION_FAILED` in FLUX's backward pass, reproduced and traced
to its cause: one forward + backward of FLUX.1-dev's transformer (full size, random bf16
weights, batch 4, 1,024 image + 512 text tokens, every parameter trained) with PyTorch's cuDNN
attention backend on or off. On or off is the first argument; `ckpt` as the second turns
gradient checkpointing on. A CUDA error poisons the process, so run each case in its own:

    python benchmarks/flux_cudnn_backward.py off
    python benchmarks/flux_cudnn_backward.py on
    CUDA_LAUNCH_BLOCKING=1 python benchmarks/flux_cudnn_backward.py on   # the real culprit
    python benchmarks/flux_cudnn_backward.py on ckpt

The adapters (trainer/models/diffusers_flow.py) turn cuDNN attention off on CUDA for this.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_models import FLUX_DEV  # noqa: E402  (this folder is not a package)


def main(argv: list[str]) -> int:
    from diffusers import FluxTransformer2DModel

    cudnn, checkpointing = argv[0] == "on", argv[1:] == ["ckpt"]
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = FluxTransformer2DModel(**FLUX_DEV).to(torch.bfloat16)
    if checkpointing:
        model.enable_gradient_checkpointing()
    batch, image_tokens, text_tokens = 4, 1024, 512

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    inputs = dict(hidden_states=randn(batch, image_tokens, 64),
                  encoder_hidden_states=randn(batch, text_tokens, 4096),
                  pooled_projections=randn(batch, 768),
                  timestep=torch.full((batch,), 0.5, device="cuda"),
                  guidance=torch.full((batch,), 3.5, device="cuda"),
                  img_ids=torch.zeros(image_tokens, 3, device="cuda"),
                  txt_ids=torch.zeros(text_tokens, 3, device="cuda"))
    label = f"cudnn attention {argv[0]}, checkpointing {'on' if checkpointing else 'off'}"
    try:
        start = time.perf_counter()
        out = model(**inputs, return_dict=False)[0]
        out.float().square().mean().backward()
        torch.cuda.synchronize()
    except RuntimeError as exc:
        print(f"{label}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        traceback.print_exc(limit=3)
        return 1
    print(f"{label}: forward + backward OK in {time.perf_counter() - start:.1f} s, peak "
          f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:] or ["off"]))
