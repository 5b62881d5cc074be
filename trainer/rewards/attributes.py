"""Attributes the verifiable rewards ignore, and simulated annotators who care about them.

Used to rehearse a voting campaign and to test that the preference model learns what people
want: `size` (how chunky the requested colour looks: the colour mass near each of its pixels,
averaged over them, and nothing once the canvas is flooded; larger is preferred by the
"larger" annotator), `upper` (how high the colour sits: 1 at the top row, 0 at the bottom;
preferred by the "upper" annotator), `left` (the same across: the "left" annotator) and
`centre` (how close to the canvas centre: the "centred" annotator), `tidiness` (how little
is drawn besides the requested colour: the "tidy" annotator) and `spread` (how far apart the
objects stand: the "apart" annotator); the last two are neither positional nor a size.
Neither the shapes rewards nor the preference model know these exist.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from trainer.rewards.outcomes import Outcome
from trainer.rewards.registry import register_builtin_reward
from trainer.rewards.shapes import (
    COLOR_TOLERANCE,
    color_distance,
    color_mask,
    components,
    foreground_mask,
)
from trainer.shapes.world import IMAGE_SIZE, parse_prompt


def colour_weight(image: np.ndarray, color: str) -> np.ndarray:
    """(H, W) soft membership in the colour: 1 at the exact colour, 0 from COLOR_TOLERANCE on.

    Perceptual rather than thresholded: a person judging "higher" or "bigger" sees faint
    pixels a little, not all-or-nothing, so the simulated annotator does too.
    """
    return np.clip(1.0 - color_distance(image, color) / COLOR_TOLERANCE, 0.0, 1.0)


@functools.lru_cache(maxsize=8)
def _blur_band(size: int, sigma: float) -> np.ndarray:
    """(size, size) band matrix whose row i holds the Gaussian kernel centred on pixel i."""
    radius = int(3 * sigma)
    offsets = np.arange(size)[None, :] - np.arange(size)[:, None]
    band = np.exp(-offsets.astype(np.float64) ** 2 / (2 * sigma**2)) * (np.abs(offsets) <= radius)
    band /= np.exp(-np.arange(-radius, radius + 1) ** 2 / (2 * sigma**2)).sum()
    band.flags.writeable = False  # shared by every call
    return band


def _gaussian_blur(image: np.ndarray, sigma: float) -> np.ndarray:
    """(H, W) blurred with a Gaussian, zeros beyond the edges: B @ image @ B.T (separable, no
    Python loop)."""
    band = _blur_band(image.shape[0], sigma)
    return band @ image @ band.T


# Share of the canvas that is not background from which objects stop reading as objects, and
# the share at which nothing does: the shipped base model's samples cover at most 28%.
FLOOD_START, FLOOD_END = 0.5, 0.75


def object_size(image: np.ndarray, prompt: str) -> float:
    """Colour mass within about 2 px of each pixel of the requested colour, averaged over them,
    scaled down to 0 as the canvas floods (from FLOOD_START to FLOOD_END of it not background).

    Grows with the size of the blobs the colour forms (a speck scores low, a filled 9x9 square
    high) and changes smoothly with the pixels, the way a person sees "bigger": counting
    objects as connected components instead would let one faint bridge pixel halve the size.
    The flood term is there because someone who asked for larger circles does not prefer a
    canvas painted edge to edge: without it that canvas scores highest, and a policy trained on
    this very function (not a model of it) paints it (docs/benchmarks.md).
    """
    weight = colour_weight(image, parse_prompt(prompt).color)
    total = weight.sum()
    if total < 1e-6:
        return 0.0
    coverage = float(foreground_mask(image).mean())
    not_flooded = float(np.clip((FLOOD_END - coverage) / (FLOOD_END - FLOOD_START), 0.0, 1.0))
    return float((weight * _gaussian_blur(weight, 2.0)).sum() / total) * not_flooded


def upperness(image: np.ndarray, prompt: str) -> float:
    """1 when the requested colour sits on the top row, 0 on the bottom (colour-mass weighted)."""
    weight = colour_weight(image, parse_prompt(prompt).color)
    total = weight.sum()
    if total < 1e-6:
        return 0.0
    mean_row = float((weight.sum(1) * np.arange(image.shape[0])).sum() / total)
    return 1.0 - mean_row / (IMAGE_SIZE - 1)


def leftness(image: np.ndarray, prompt: str) -> float:
    """1 when the requested colour sits on the left column, 0 on the right (colour-mass weighted)."""
    return upperness(np.swapaxes(image, 0, 1), prompt)


@functools.lru_cache(maxsize=4)
def _centre_distance(height: int, width: int) -> np.ndarray:
    """(height, width) distance of every pixel from the canvas centre."""
    rows, cols = np.mgrid[0:height, 0:width]
    distance = np.hypot(rows - (height - 1) / 2, cols - (width - 1) / 2)
    distance.flags.writeable = False  # shared by every call
    return distance


def centredness(image: np.ndarray, prompt: str) -> float:
    """1 when all of the requested colour sits at the canvas centre, 0 when it is all in the
    corners: 1 minus its colour-mass weighted mean distance from the centre, over the corner's.

    The mean of the distances, not the distance of the mean position, so that objects in
    opposite corners do not count as centred.
    """
    weight = colour_weight(image, parse_prompt(prompt).color)
    total = weight.sum()
    if total < 1e-6:
        return 0.0
    distance = _centre_distance(*image.shape[:2])
    return 1.0 - float((weight * distance).sum() / total) / float(distance.max())


def tidiness(image: np.ndarray, prompt: str) -> float:
    """Minus the stray ink: what is drawn that is not the requested colour (specks, smears,
    blends of other colours), per unit of the requested colour's mass. 0 when nothing else is
    drawn, more negative the more else is; neither positional nor a size (a small clean square
    is as tidy as a big one). A ratio rather than a share of the canvas's ink, so that the
    annotator's relative tie band leaves most pairs decisive (a share sits near 0.9 for every
    sample and 81% of within-group pairs would be ties; this leaves 14%)."""
    weight = colour_weight(image, parse_prompt(prompt).color).sum()
    stray = max(float(foreground_mask(image).sum()) - float(weight), 0.0)
    return -stray / max(float(weight), 1.0)


def spread(image: np.ndarray, prompt: str) -> float:
    """How far apart the requested colour's objects stand: the mean distance between the
    centres of its objects (the count reward's connected components), over the canvas
    diagonal; 0 with fewer than two objects. Neither positional (moving the whole scene leaves
    it unchanged) nor a size (two small squares far apart spread more than two big ones side
    by side): a person who wants the objects set apart rather than bunched up."""
    objects = components(color_mask(image, parse_prompt(prompt).color))
    if len(objects) < 2:
        return 0.0
    centres = [pixels.mean(axis=0) for pixels in objects]
    gaps = [np.linalg.norm(a - b) for a, b in itertools.combinations(centres, 2)]
    height, width = image.shape[:2]
    return float(np.mean(gaps)) / float(np.hypot(height - 1, width - 1))


ATTRIBUTES: dict[str, Callable[[np.ndarray, str], float]] = {
    "size": object_size,
    "upper": upperness,
    "left": leftness,
    "centre": centredness,
    "tidiness": tidiness,
    "spread": spread,
}
# preference name -> the attribute it prefers larger values of
PREFERENCES = {"larger": "size", "upper": "upper", "left": "left", "centred": "centre",
               "tidy": "tidiness", "apart": "spread"}


def attribute_values(name: str, images: np.ndarray, prompts: list[str]) -> np.ndarray:
    fn = ATTRIBUTES[name]
    return np.array([fn(image, prompt) for image, prompt in zip(images, prompts, strict=True)])


for _name in ATTRIBUTES:  # measurable by name, e.g. in evaluation: attr_size, attr_upper
    register_builtin_reward(f"attr_{_name}", lambda images, prompts, _n=_name: attribute_values(_n, images, prompts),
                    shapes_only=True)


@dataclass
class SimulatedAnnotator:
    """Votes by a preference function with a flip probability and a tie band.

    `preference` is a name from PREFERENCES or a callable `(image, prompt) -> float` (higher is
    preferred). A pair whose values differ by less than `tie_band` (relative to the larger
    magnitude) is a tie; otherwise the preferred side wins, flipped with probability `flip`.
    """

    preference: str | Callable[[np.ndarray, str], float]
    flip: float = 0.1
    tie_band: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.preference, str):
            if self.preference not in PREFERENCES:
                raise ValueError(f"unknown preference {self.preference!r}; known: {sorted(PREFERENCES)}")
            self._score = ATTRIBUTES[PREFERENCES[self.preference]]
        else:
            self._score = self.preference
        if not 0.0 <= self.flip <= 1.0:
            raise ValueError(f"flip must be in [0, 1], got {self.flip}")
        self._rng = np.random.default_rng(self.seed)

    def vote(self, image_a: np.ndarray, image_b: np.ndarray, prompt: str) -> Outcome:
        a, b = self._score(image_a, prompt), self._score(image_b, prompt)
        scale = max(abs(a), abs(b), 1e-9)
        if abs(a - b) <= self.tie_band * scale:
            return Outcome.TIE
        winner = Outcome.A if a > b else Outcome.B
        if self._rng.random() < self.flip:
            winner = Outcome.B if winner == Outcome.A else Outcome.A
        return winner
