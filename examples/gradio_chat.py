"""A Gradio chat app on a running open-lmi server: the same playground as the built-in page at `/`,
for those who want Gradio's (seed 000's app, built by hand before the page existed).

Optional, not installed by default: `pip install 'open-lmi[gradio]'` (or `pip install gradio openai`),
then `python examples/gradio_chat.py --url http://localhost:8080` and open the address it prints.
It streams through `/v1/chat/completions` with the openai client; the system prompt, temperature,
max tokens and stop sequences are the extra inputs under the chat box.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import gradio as gr
import openai


def _text(content: object) -> str:
    """A history message's text (Gradio may hold it as a string or as a list of content parts)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def build(url: str) -> gr.ChatInterface:
    client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="unused")
    model = client.models.list().data[0].id

    def answer(message: str, history: list[dict], system: str, temperature: float, max_tokens: float,
               stop: str) -> Iterator[str]:
        messages = ([{"role": "system", "content": system}] if system.strip() else [])
        messages += [{"role": m["role"], "content": _text(m["content"])} for m in history]
        messages.append({"role": "user", "content": message})
        stops = [s for s in stop.split("\n") if s] or None
        text = ""
        for chunk in client.chat.completions.create(model=model, messages=messages, stream=True, stop=stops,
                                                    temperature=temperature, max_tokens=int(max_tokens)):
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                yield text

    return gr.ChatInterface(
        answer, title=f"open-lmi: {model}",
        additional_inputs=[gr.Textbox("You are a helpful assistant.", label="System prompt"),
                           gr.Slider(0, 2, value=0.7, step=0.1, label="Temperature"),
                           gr.Slider(1, 4096, value=256, step=1, label="Max tokens"),
                           gr.Textbox("", label="Stop sequences (one per line)")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://localhost:8080", help="the open-lmi server")
    parser.add_argument("--port", type=int, default=7860)
    args = parser.parse_args()
    build(args.url).launch(server_port=args.port)


if __name__ == "__main__":
    main()
