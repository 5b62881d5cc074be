"""trainer.evaluation.sample_images says how many images are done after each batch (an
evaluate job's progress inside one checkpoint's images, which can take minutes)."""

from __future__ import annotations


def test_sample_images_reports_the_images_done_after_each_batch():
    from trainer.evaluation import sample_images
    from trainer.models import SHAPES_BASE
    from trainer.models.shapes_dit import ShapesDiT
    from trainer.shapes.world import all_prompts

    prompts = all_prompts()[:5]
    done: list[int] = []
    images = sample_images(ShapesDiT.load(SHAPES_BASE, "cpu"), prompts, list(range(5)),
                           steps=2, batch_size=2, on_batch=done.append)
    assert len(images) == 5
    assert done == [2, 4, 5]
