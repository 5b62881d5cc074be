from __future__ import annotations

import gradio as gr

from app.services.jobs import Enqueuer


def build_leaderboard(user: gr.State, enqueuer: Enqueuer | None = None) -> gr.Blocks:
    with gr.Blocks() as page:
        gr.Markdown("TODO")
    return page
