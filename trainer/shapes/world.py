"""The shapes world: 48 prompts "<count> <color> <shape>", a renderer, and its vocabulary.

Values here are fixed: outside checks render and score images with the same colours, sizes
and canvas, so do not change them.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import numpy as np

IMAGE_SIZE = 32
BACKGROUND = (250, 250, 250)
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 70, 220),
    "yellow": (230, 200, 40),
}
SHAPES = ("circle", "square", "triangle")
COUNT_WORDS = ("one", "two", "three", "four")
MIN_OBJECT_SIZE, MAX_OBJECT_SIZE = 6, 9

# Prompt tokens: count word, colour word, shape word. Plurals map to the same shape token.
VOCAB = ("<pad>",) + COUNT_WORDS + tuple(COLORS) + SHAPES
TOKEN_ID = {word: i for i, word in enumerate(VOCAB)}
PROMPT_LENGTH = 3

_PROMPT_RE = re.compile(r"^\s*(one|two|three|four)\s+(red|green|blue|yellow)\s+"
                        r"(circle|square|triangle)s?\s*$")


@dataclass(frozen=True)
class ShapesPrompt:
    count: int
    color: str
    shape: str

    @property
    def text(self) -> str:
        plural = "s" if self.count > 1 else ""
        return f"{COUNT_WORDS[self.count - 1]} {self.color} {self.shape}{plural}"


def parse_prompt(text: str) -> ShapesPrompt:
    """'three blue squares' -> ShapesPrompt(3, 'blue', 'square'). ValueError if not a shapes prompt."""
    match = _PROMPT_RE.match(text.lower())
    if not match:
        raise ValueError(f"not a shapes prompt: {text!r} (expected '<one..four> "
                         f"<{'|'.join(COLORS)}> <{'|'.join(SHAPES)}>[s]')")
    count_word, color, shape = match.groups()
    return ShapesPrompt(COUNT_WORDS.index(count_word) + 1, color, shape)


def not_shapes_prompts(texts: list[str]) -> list[str]:
    """Those of `texts` the shapes world cannot draw (parse_prompt refuses them)."""
    return [t for t in texts if not isinstance(t, str) or not _PROMPT_RE.match(t.lower())]


def shapes_prompt_problem(texts: list[str]) -> str | None:
    """Why the shapes model cannot train on or draw `texts` (None when it can): the first
    few it cannot draw, and how many there are."""
    bad = not_shapes_prompts(texts)
    if not bad:
        return None
    shown = ", ".join(repr(t[:60]) for t in bad[:3])
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    return (f"model 'shapes' draws only shapes prompts ('<one..four> <{'|'.join(COLORS)}> "
            f"<{'|'.join(SHAPES)}>[s]'); {len(bad)} of {len(texts)} are not: {shown}{more}")


def all_prompts() -> list[str]:
    """The 48 prompts, in a fixed order (count, colour, shape)."""
    return [ShapesPrompt(n, c, s).text
            for n, c, s in itertools.product(range(1, 5), COLORS, SHAPES)]


def tokenize(texts: list[str]) -> np.ndarray:
    """(N, 3) int64 token ids: count, colour, shape."""
    ids = []
    for text in texts:
        p = parse_prompt(text)
        ids.append([TOKEN_ID[COUNT_WORDS[p.count - 1]], TOKEN_ID[p.color], TOKEN_ID[p.shape]])
    return np.asarray(ids, dtype=np.int64)


# ---------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------
def shape_mask(shape: str, size: int) -> np.ndarray:
    """(size, size) bool mask of one object."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64) + 0.5
    if shape == "square":
        return np.ones((size, size), dtype=bool)
    if shape == "circle":
        r = size / 2
        return (yy - r) ** 2 + (xx - r) ** 2 <= r * r
    if shape == "triangle":
        # Apex at the top centre, base along the bottom row.
        half_width = xx - size / 2
        return np.abs(half_width) <= (yy / size) * (size / 2)
    raise ValueError(f"unknown shape {shape!r}")


def render(prompt: ShapesPrompt | str, rng: np.random.Generator, *,
           max_tries: int = 200) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """Draw the prompt: (32, 32, 3) uint8 and the (row, col, size) of each object.

    Objects are 6-9 px and never overlap or touch (a 1 px gap), so counting connected
    components of the colour recovers the count exactly.
    """
    if isinstance(prompt, str):
        prompt = parse_prompt(prompt)
    for _ in range(max_tries):
        image = np.empty((IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
        image[:] = BACKGROUND
        occupied = np.zeros((IMAGE_SIZE, IMAGE_SIZE), dtype=bool)
        boxes: list[tuple[int, int, int]] = []
        for _ in range(prompt.count):
            for _ in range(max_tries):
                size = int(rng.integers(MIN_OBJECT_SIZE, MAX_OBJECT_SIZE + 1))
                row = int(rng.integers(0, IMAGE_SIZE - size + 1))
                col = int(rng.integers(0, IMAGE_SIZE - size + 1))
                r0, c0 = max(row - 1, 0), max(col - 1, 0)
                if not occupied[r0:row + size + 1, c0:col + size + 1].any():
                    break
            else:
                break
            mask = shape_mask(prompt.shape, size)
            image[row:row + size, col:col + size][mask] = COLORS[prompt.color]
            occupied[row:row + size, col:col + size] = True
            boxes.append((row, col, size))
        if len(boxes) == prompt.count:
            return image, boxes
    raise RuntimeError(f"could not place {prompt.count} objects")


def render_batch(texts: list[str], rng: np.random.Generator) -> np.ndarray:
    """(N, 32, 32, 3) uint8."""
    return np.stack([render(t, rng)[0] for t in texts])
