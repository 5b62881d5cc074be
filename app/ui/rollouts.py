from __future__ import annotations

import gradio as gr


def build_rollouts(user: gr.State) -> gr.Blocks:
    with gr.Blocks() as page:
        gr.Markdown("TODO")
    return page
