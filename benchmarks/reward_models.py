"""Images per second of each weight-loaded reward at full size (issue 17's GPU check).

Real weights are not needed for speed, only the architectures: each reward's network is built
at its published size with random weights, written into a REWARD_MODELS_DIR in the layout its
adapter loads (trainer/rewards/models.py), and then scored through the registry exactly as a
training job scores (`compute_rewards`), at batch 48 (4 prompts x G = 12) of 512x512 images.

    python benchmarks/reward_models.py                          # every reward, on CUDA
    python benchmarks/reward_models.py --rewards pickscore      # one
    python benchmarks/reward_models.py --tiny --device cpu      # toy sizes (CI)
    python benchmarks/reward_models.py --server --clients 4     # and through the reward server

With `--server`, the same rewards are then scored through the reward server
(trainer/rewards/serve.py) started in this process on 127.0.0.1 (uvicorn in a thread, same
device, same written weights): one client sending the in-process batch through the job's own
client (trainer/rewards/remote.py: `prepare_scorer` with a `reward_server_url`), then
`--clients` concurrent clients each sending one prompt's group of 12 images, as several
workers would. Each row gains the server's images/s, its ratio to in-process and the largest
absolute difference between served and in-process scores of the same images. Clients and
server share this process's GIL (encoding, JSON and decoding the images hold it), which
separate worker and server processes would not: the served numbers are a lower bound. With
`--server-process` the server is its own process (`python -m trainer.rewards.serve` on a free
loopback port, as a deployment runs it), so only the clients share this one.

A reward whose package does not import here (open_clip for hpsv2 and aesthetic) is skipped
with a note.

Architectures: hpsv2 = open_clip ViT-H-14 (HPS v2.1); aesthetic = open_clip ViT-L-14 with
QuickGELU + the LAION MLP; pickscore = transformers CLIP ViT-H/14 (laion/CLIP-ViT-H-14, which
PickScore fine-tunes); clip_score = transformers CLIP ViT-L/14 (openai/clip-vit-large-patch14);
imagereward = ImageReward v1.0 (BLIP_Pretrain(image_size=224, vit='large'): BLIP's ViT-L/16 at
224 px, BLIP's med_config.json BERT-base text encoder cross-attending to it, the MLP head),
written as ImageReward.pt with BLIP's original key names + med_config.json + vocab.txt.
The tokenizers are character-level stand-ins (no vocabulary can be downloaded); text costs
little beside the 224 px image towers (ImageReward's prompts are padded to 35 tokens anyway).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from imagereward_reference import MED_CONFIG  # noqa: E402  (this folder is not a package)

from trainer.rewards import compute_rewards  # noqa: E402
from trainer.rewards import models as reward_models  # noqa: E402

REWARDS = ("hpsv2", "pickscore", "clip_score", "aesthetic", "imagereward")
# images per request of each concurrent server client: one prompt's group (G = 12)
GROUP = 12
# the server's start (its models load in create_app, before this clock) and its stop
SERVER_START_TIMEOUT_S = 60.0
SERVER_STOP_TIMEOUT_S = 30.0

# transformers CLIPConfig sizes of the published checkpoints (config.json)
HF_CLIP = {
    "pickscore": dict(  # laion/CLIP-ViT-H-14-laion2B-s32B-b79K
        text=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                  num_attention_heads=16),
        vision=dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                    num_attention_heads=16, patch_size=14, image_size=224),
        projection_dim=1024, hidden_act="gelu"),
    "clip_score": dict(  # openai/clip-vit-large-patch14
        text=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                  num_attention_heads=12),
        vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                    num_attention_heads=16, patch_size=14, image_size=224),
        projection_dim=768, hidden_act="quick_gelu"),
}
TINY_HF_CLIP = dict(text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2),
                    vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, patch_size=8, image_size=32),
                    projection_dim=16, hidden_act="gelu")
TINY_OPEN_CLIP = {"embed_dim": 16,
                  "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16,
                                 "patch_size": 8},
                  "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32,
                               "heads": 2, "layers": 1}}

# ImageReward v1.0: BLIP_Pretrain(image_size=224, vit='large') (blip.py create_vit: ViT-L/16,
# 1024 wide, 24 blocks, 16 heads, MLP 4096) and BLIP's med_config.json (BERT-base + cross-attention;
# vocab 30524 = bert-base-uncased's 30522 + [DEC] + [ENC])
IMAGEREWARD_VIT = dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=4096,
                       patch_size=16, image_size=224)
# BLIP's med_config.json, as the image-reward reference check writes it (that script imports
# nothing of the project's, so it runs in the image-reward package's own venv)
IMAGEREWARD_MED_CONFIG = MED_CONFIG
# toy sizes: 2 ViT heads of BLIP's 64, one block, 16 px patches on 32 px; a one-layer BERT 32 wide
TINY_IMAGEREWARD_VIT = dict(hidden_size=128, num_hidden_layers=1, intermediate_size=256,
                            patch_size=16, image_size=32)
TINY_IMAGEREWARD_MED_CONFIG = {**IMAGEREWARD_MED_CONFIG, "hidden_size": 32,
                               "intermediate_size": 64, "max_position_embeddings": 40,
                               "num_attention_heads": 2, "num_hidden_layers": 1}
# BLIP_Pretrain's contrastive projections (in ImageReward.pt, unused by the score): embed_dim 256
BLIP_EMBED_DIM = 256


def _write_hf_clip(directory: Path, sizes: dict, device: torch.device) -> None:
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for char in string.ascii_lowercase + string.digits:
        vocab[char] = len(vocab)
        vocab[char + "</w>"] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = transformers.CLIPTokenizer(str(directory / "vocab.json"),
                                           str(directory / "merges.txt"))
    size = sizes["vision"]["image_size"]
    images = transformers.CLIPImageProcessor(size={"shortest_edge": size},
                                             crop_size={"height": size, "width": size})
    transformers.CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(directory)
    act = {"hidden_act": sizes["hidden_act"]}
    config = transformers.CLIPConfig(
        text_config={**sizes["text"], **act, "vocab_size": len(vocab),
                     "max_position_embeddings": 77, "bos_token_id": 0, "eos_token_id": 1,
                     "pad_token_id": 1},
        vision_config={**sizes["vision"], **act}, projection_dim=sizes["projection_dim"])
    with torch.device(device):  # random init on the card: minutes on a CPU at ViT-H size
        model = transformers.CLIPModel(config)
    model.save_pretrained(directory)


def _write_open_clip(name: str, directory: Path, tiny: bool, device: torch.device) -> None:
    import open_clip
    from open_clip.model import CLIP
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    quick_gelu = name == "aesthetic"
    if tiny:
        cfg = {**TINY_OPEN_CLIP, "quick_gelu": quick_gelu}
        (directory / reward_models.OPEN_CLIP_CONFIG).write_text(json.dumps({"model_cfg": cfg}))
    else:
        cfg = {**open_clip.get_model_config("ViT-H-14" if name == "hpsv2" else "ViT-L-14"),
               "quick_gelu": quick_gelu}
    with torch.device(device):
        model = CLIP(**cfg)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if name == "hpsv2":  # HPS v2.1's layout: a torch checkpoint holding "state_dict"
        torch.save({"state_dict": state}, directory / reward_models.HPS_CHECKPOINT)
    else:
        save_file(state, str(directory / "open_clip_model.safetensors"))
        head = reward_models.AestheticHead(cfg["embed_dim"])
        torch.save(head.state_dict(), directory / reward_models.AESTHETIC_HEAD)


def _bert_vocab() -> list[str]:
    """A character-level BERT WordPiece vocabulary (vocab.txt: a token a line, the id its line):
    BERT's special tokens, then every lower-case letter and digit alone and as a ##suffix, so
    that any benchmark prompt tokenizes without [UNK]."""
    chars = string.ascii_lowercase + string.digits
    return ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *(f"##{c}" for c in chars)]


def imagereward_original_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ImageRewardModel's state dict under ImageReward.pt's own names: the inverse of the
    adapter's reward_models.imagereward_state_dict (BLIP vit.py / med.py / ImageReward.py mlp)."""
    top = {ours: original for original, ours in reward_models._IMAGEREWARD_VIT_TOP.items()}
    block = {ours: original for original, ours in reward_models._IMAGEREWARD_VIT_BLOCK.items()}
    out = {}
    for key, value in state.items():
        if key.startswith("vision."):
            name = key[len("vision."):]
            if name in top:
                out["blip.visual_encoder." + top[name]] = value
                continue
            # encoder.layers.<i>.<module path>.<weight|bias>
            parts = name.split(".")
            module = block[".".join(parts[3:-1])]
            out[f"blip.visual_encoder.blocks.{parts[2]}.{module}.{parts[-1]}"] = value
        elif key.startswith("text."):
            out["blip.text_encoder." + key[len("text."):]] = value
        elif key.startswith("head."):
            out["mlp." + key[len("head."):]] = value
        else:
            raise ValueError(f"ImageRewardModel key {key!r} has no ImageReward.pt name")
    return out


def _write_imagereward(directory: Path, tiny: bool, device: torch.device) -> None:
    """ImageReward's layout (trainer/rewards/models.py load_imagereward_model): ImageReward.pt, a
    torch.save'd state dict with BLIP's original names (the contrastive projections and the
    position_ids buffer included, as the published file has them), med_config.json, vocab.txt."""
    from transformers import BlipVisionConfig

    directory.mkdir(parents=True, exist_ok=True)
    vocab = _bert_vocab()
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    med = TINY_IMAGEREWARD_MED_CONFIG if tiny else IMAGEREWARD_MED_CONFIG
    if tiny:  # the published 30524 rows would dwarf a toy model; + BLIP's [DEC] and [ENC]
        med = {**med, "vocab_size": len(vocab) + 2}
    (directory / reward_models.IMAGEREWARD_MED_CONFIG).write_text(json.dumps(med, indent=2))
    vit = TINY_IMAGEREWARD_VIT if tiny else IMAGEREWARD_VIT
    # as the adapter reads it back from the checkpoint's shapes (_imagereward_vision_config)
    vision_config = BlipVisionConfig(
        **vit, num_attention_heads=vit["hidden_size"] // reward_models.BLIP_VIT_HEAD_DIM,
        hidden_act="gelu", layer_norm_eps=reward_models.BLIP_VIT_LAYER_NORM_EPS)
    text_config = reward_models._imagereward_text_config(
        directory / reward_models.IMAGEREWARD_MED_CONFIG, vit["hidden_size"])
    with torch.device(device):  # random init on the card
        model = reward_models.ImageRewardModel(vision_config, text_config)
    state = imagereward_original_names(
        {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()})
    width, hidden = vit["hidden_size"], med["hidden_size"]
    state.update({
        "blip.vision_proj.weight": torch.randn(BLIP_EMBED_DIM, width) * width ** -0.5,
        "blip.vision_proj.bias": torch.zeros(BLIP_EMBED_DIM),
        "blip.text_proj.weight": torch.randn(BLIP_EMBED_DIM, hidden) * hidden ** -0.5,
        "blip.text_proj.bias": torch.zeros(BLIP_EMBED_DIM),
        "blip.text_encoder.embeddings.position_ids":
            torch.arange(med["max_position_embeddings"]).expand(1, -1)})
    torch.save(state, directory / reward_models.IMAGEREWARD_CHECKPOINT)


def write_reward(name: str, root: Path, tiny: bool, device: torch.device) -> None:
    """The reward's network, random weights, in the layout its adapter loads."""
    if name == "imagereward":
        _write_imagereward(root / name, tiny, device)
    elif name in HF_CLIP:
        _write_hf_clip(root / name, TINY_HF_CLIP if tiny else HF_CLIP[name], device)
    else:
        _write_open_clip(name, root / name, tiny, device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def inputs(batch: int, image_size: int) -> tuple[np.ndarray, list[str]]:
    """The scored batch: random (batch, size, size, 3) uint8 images (seeded: in process and
    served score the same ones) and their prompts."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (batch, image_size, image_size, 3), np.uint8)
    prompts = [f"a photo of {i % 4} red squares on a table" for i in range(batch)]
    return images, prompts


def measure(name: str, root: Path, args: argparse.Namespace) -> tuple[dict, np.ndarray]:
    """Write, load (timed: a job's cold start) and score `--repeats` batches (timed). Returns
    the row and the last batch's scores (the reference the server's are compared with)."""
    device = torch.device(args.device)
    started = time.perf_counter()
    write_reward(name, root, args.tiny, device)
    written = time.perf_counter() - started
    reward_models.configure_reward_models({}, device)
    images, prompts = inputs(args.batch, args.image_size)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    compute_rewards([name], images[:1], prompts[:1])  # loads the model
    _sync(device)
    load_seconds = time.perf_counter() - started
    compute_rewards([name], images, prompts)  # warm-up at the measured batch
    _sync(device)
    started = time.perf_counter()
    for _ in range(args.repeats):
        scores = compute_rewards([name], images, prompts)[name]
    _sync(device)
    seconds = (time.perf_counter() - started) / args.repeats
    row = {"reward": name, "batch": args.batch, "image_size": args.image_size,
           "seconds_per_batch": seconds, "images_per_second": args.batch / seconds,
           "load_seconds": load_seconds, "write_seconds": written,
           "finite": bool(np.isfinite(scores).all())}
    if device.type == "cuda":
        row["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    reward_models.clear_cache()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, scores


@contextmanager
def reward_server(names: list[str], args: argparse.Namespace) -> Iterator[tuple[str, float]]:
    """The reward server serving `names` (from this run's REWARD_MODELS_DIR, on `--device`):
    in a thread of this process (serve.ServerThread), or with `--server-process` as its own
    process (`python -m trainer.rewards.serve`, as a deployment runs it); yields (url, seconds
    until it could score: model loading, and the process's start) and stops it on exit."""
    from trainer.rewards.remote import reward_client

    start = _server_process if args.server_process else _server_thread
    with start(names, args) as (url, load_seconds):
        try:
            yield url, load_seconds
        finally:
            # the job's client of this URL (prepare_scorer's) is cached per process: it goes
            # with its server, so that a later server on the same port gets a fresh one
            reward_client(url).close()
            reward_client.cache_clear()


@contextmanager
def _server_thread(names: list[str], args: argparse.Namespace) -> Iterator[tuple[str, float]]:
    """The server's app in a thread of this process; yields (url, seconds create_app took to
    load the models)."""
    from trainer.rewards.serve import ServerThread, create_app

    started = time.perf_counter()
    app = create_app(names, device=args.device, max_batch=args.server_max_batch,
                     max_wait_ms=args.server_max_wait_ms)
    load_seconds = time.perf_counter() - started
    with ServerThread(app, start_timeout=SERVER_START_TIMEOUT_S,
                      stop_timeout=SERVER_STOP_TIMEOUT_S) as server:
        yield server.url, load_seconds


@contextmanager
def _server_process(names: list[str], args: argparse.Namespace) -> Iterator[tuple[str, float]]:
    """`python -m trainer.rewards.serve` on a free loopback port, in its own process (its own
    GIL, as in a deployment); yields (url, seconds until /health answered) and terminates it."""
    from trainer.rewards.remote import reward_client

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "trainer.rewards.serve", "--rewards", ",".join(names),
               "--host", "127.0.0.1", "--port", str(port), "--device", args.device,
               "--max-batch", str(args.server_max_batch),
               "--max-wait-ms", str(args.server_max_wait_ms), "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    # REWARD_MODELS_DIR (this run's written weights) reaches it through the inherited environment
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    process = subprocess.Popen(command, cwd=root, env=env)
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the reward server exited with {process.returncode}")
            if time.perf_counter() - started > SERVER_START_TIMEOUT_S:
                raise TimeoutError(f"the reward server did not answer /health within "
                                   f"{SERVER_START_TIMEOUT_S} s")
            try:
                reward_client(url).health()
                break
            except Exception:  # not listening yet
                reward_client.cache_clear()
                time.sleep(0.5)
        yield url, time.perf_counter() - started
    finally:
        process.terminate()
        try:
            process.wait(SERVER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def measure_server(name: str, url: str, reference: np.ndarray, in_process: float,
                   args: argparse.Namespace) -> dict:
    """The server's keys of `name`'s row: images/s of one client sending the in-process batch
    and of `--clients` concurrent clients sending GROUP images each, their ratios to
    `in_process` images/s, and the largest |served - in-process score| (`reference`) over
    every timed request."""
    from trainer.rewards.remote import RewardClient, prepare_scorer

    images, prompts = inputs(args.batch, args.image_size)
    # what a training job with reward_server_url does: prepare_scorer checks the server serves
    # the reward and hands back the process's RewardClient, which the job calls per batch
    scorer = prepare_scorer([name], server_url=url)
    scorer([name], images, prompts)  # warm-up
    diffs = []
    started = time.perf_counter()
    for _ in range(args.repeats):
        diffs.append(np.abs(scorer([name], images, prompts)[name] - reference).max())
    one = args.batch * args.repeats / (time.perf_counter() - started)

    # client k sends images k*12 .. k*12+11 (wrapping around a smaller --batch); each has its
    # own RewardClient (connection pool), as separate worker processes would
    groups = [(k * GROUP + np.arange(GROUP)) % args.batch for k in range(args.clients)]
    clients = [RewardClient(url) for _ in groups]

    def send(k: int) -> float:
        rows = groups[k]
        scores = clients[k]([name], images[rows], [prompts[i] for i in rows])[name]
        return float(np.abs(scores - reference[rows]).max())

    def send_repeats(k: int) -> list[float]:
        return [send(k) for _ in range(args.repeats)]

    try:
        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(send, range(args.clients)))  # warm-up: every thread and connection up
            # each client loops on its own (a worker sends its next group when it has one),
            # not in lockstep rounds; the clock stops when the slowest is done
            started = time.perf_counter()
            for client_diffs in pool.map(send_repeats, range(args.clients)):
                diffs += client_diffs
            seconds = time.perf_counter() - started
    finally:
        for client in clients:
            client.close()
    concurrent = args.clients * GROUP * args.repeats / seconds
    return {"server_batch": args.batch, "server_one_client_images_per_second": one,
            "server_one_client_ratio": one / in_process,
            "server_clients": args.clients, "server_client_batch": GROUP,
            "server_concurrent_images_per_second": concurrent,
            "server_concurrent_ratio": concurrent / in_process,
            "server_max_abs_diff": float(max(diffs))}


def _print_row(row: dict) -> None:
    name, card = row["reward"], row["card"]
    if "skipped" in row:
        print(f"| {name} | {card} | skipped: {row['skipped']} |", flush=True)
    elif "error" in row:
        print(f"| {name} | {card} | error: {row['error']} |", flush=True)
    else:
        print(f"| {name} | {card} | {row['batch']} | {row['images_per_second']:.1f} | "
              f"{row['seconds_per_batch']:.3f} | {row['load_seconds']:.1f} | "
              f"{row.get('peak_memory_gb', float('nan')):.1f} |", flush=True)


def _print_server_row(row: dict) -> None:
    name, card = row["reward"], row["card"]
    if "server_error" in row:
        print(f"| {name} | {card} | server error: {row['server_error']} |", flush=True)
    else:
        print(f"| {name} | {card} | {row['images_per_second']:.1f} | "
              f"{row['server_one_client_images_per_second']:.1f} | "
              f"{row['server_one_client_ratio']:.2f} | "
              f"{row['server_concurrent_images_per_second']:.1f} | "
              f"{row['server_concurrent_ratio']:.2f} | {row['server_max_abs_diff']:.2e} |",
              flush=True)


def _measure_served(rows: list[dict], references: dict[str, np.ndarray],
                    args: argparse.Namespace, write: Callable[[], None]) -> dict:
    """Add the server's keys to the rows of the rewards in `references` (those scored in
    process), through one reward server serving them all; returns the run's server facts
    (its settings, model load time, final /health counters, or the error that stopped it)."""
    from trainer.rewards.remote import reward_client

    print(f"\n| reward | card | in-process images/s | server 1 client x {args.batch} "
          f"images/s | server/in-process | server {args.clients} clients x {GROUP} images/s | "
          f"server/in-process | max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    info: dict = {"max_batch": args.server_max_batch, "max_wait_ms": args.server_max_wait_ms}
    pending = [r for r in rows if r["reward"] in references]
    try:
        with reward_server(list(references), args) as (url, load_seconds):
            info["load_seconds"] = load_seconds
            while pending:
                row = pending.pop(0)
                try:
                    row.update(measure_server(row["reward"], url, references[row["reward"]],
                                              row["images_per_second"], args))
                except Exception as error:  # one reward failing must not lose the others
                    row["server_error"] = f"{type(error).__name__}: {error}"
                _print_server_row(row)
                write()
            # how the batcher gathered the requests (batches, largest_batch_requests)
            info["health"] = reward_client(url).health()
    except Exception as error:  # the server did not start: the rows left get no number
        info["error"] = f"{type(error).__name__}: {error}"
        for row in pending:
            row["server_error"] = f"no reward server: {info['error']}"
            _print_server_row(row)
    finally:
        reward_models.clear_cache()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rewards", default=",".join(REWARDS), help=f"any of {', '.join(REWARDS)}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="toy-size networks (CPU smoke run)")
    parser.add_argument("--batch", type=int, default=48, help="images per scored batch")
    parser.add_argument("--image-size", type=int, default=512, help="generated image side")
    parser.add_argument("--repeats", type=int, default=3, help="timed batches, after a warm-up")
    parser.add_argument("--out", help="write the rows as JSON here (after every reward)")
    parser.add_argument("--server", action="store_true",
                        help="also score through the reward server started in this process")
    parser.add_argument("--clients", type=int, default=4,
                        help=f"concurrent server clients, {GROUP} images a request "
                             "(default %(default)s)")
    parser.add_argument("--server-max-batch", type=int, default=None,
                        help="the server's --max-batch (default: the server's own)")
    parser.add_argument("--server-max-wait-ms", type=float, default=None,
                        help="the server's --max-wait-ms (default: the server's own)")
    parser.add_argument("--server-process", action="store_true",
                        help="with --server: run the server as its own process (python -m "
                        "trainer.rewards.serve) instead of a thread of this one")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.rewards.split(",") if n.strip()]
    unknown = sorted(set(names) - set(REWARDS))
    if unknown:
        parser.error(f"--rewards: unknown {unknown}; known: {', '.join(REWARDS)}")
    for flag in ("batch", "repeats", "clients"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1")
    if args.server:
        # imported only here: in-process scoring needs neither the server nor its packages
        from trainer.rewards import serve

        if args.server_max_batch is None:
            args.server_max_batch = serve.DEFAULT_MAX_BATCH
        if args.server_max_wait_ms is None:
            args.server_max_wait_ms = serve.DEFAULT_MAX_WAIT_MS
    card = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    report: dict = {"card": card, "rows": []}
    rows = report["rows"]

    def write() -> None:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=2))

    print("| reward | card | batch | images/s | s/batch | load s | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    references: dict[str, np.ndarray] = {}  # in-process scores, for the server's to match
    with tempfile.TemporaryDirectory() as tmp:
        os.environ[reward_models.ENV_DIR] = tmp  # the adapters find tmp/<reward>/
        for name in names:
            # a missing package is this machine's, not the reward's: a note, not a failure
            if (reason := reward_models.MODEL_REWARDS[name].unavailable()) is not None:
                row = {"reward": name, "skipped": reason}
            else:
                try:
                    row, references[name] = measure(name, Path(tmp), args)
                except Exception as error:  # one reward failing must not lose the others' rows
                    row = {"reward": name, "error": f"{type(error).__name__}: {error}"}
            row["card"] = card
            rows.append(row)
            _print_row(row)
            write()
        if args.server and references:
            # the weights written under tmp stay there for the server to load
            report["server"] = _measure_served(rows, references, args, write)
            write()
    return 0 if all("error" not in r and "server_error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
