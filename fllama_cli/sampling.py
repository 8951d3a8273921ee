"""The sampling options of generate and chat, defined once; options that greedy decoding ignores are named."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from fllama_cli.errors import warn
from model_zoo.sampling import SamplingConfig

TemperatureOpt = Annotated[float, typer.Option("--temperature", help="0 = greedy (the most likely token each step).")]
TopKOpt = Annotated[Optional[int], typer.Option("--top-k", help="Keep the k most likely tokens (0 = off). \\[default: 40]",
                                                show_default=False)]
TopPOpt = Annotated[Optional[float], typer.Option("--top-p", help="Nucleus sampling mass (1 = off). \\[default: 0.95]",
                                                  show_default=False)]
RepetitionOpt = Annotated[float, typer.Option("--repetition-penalty", help="> 1 discourages tokens already in the text "
                                                                           "(the prompt too); 1 = off.")]


def sampling_config(temperature: float, top_k: int | None, top_p: float | None, repetition_penalty: float,
                    seed: int | None) -> SamplingConfig:
    """The SamplingConfig of the options; --top-k / --top-p given with --temperature 0 are said to do nothing."""
    cfg = SamplingConfig(temperature=temperature, top_k=40 if top_k is None else top_k,
                         top_p=0.95 if top_p is None else top_p, repetition_penalty=repetition_penalty, seed=seed)
    unused = [name for name, value in (("--top-k", top_k), ("--top-p", top_p)) if value is not None]
    if temperature == 0 and unused:
        warn(f"{' and '.join(unused)} {'do' if len(unused) > 1 else 'does'} nothing with --temperature 0 "
             "(greedy decoding takes the most likely token)")
    return cfg
